"""Triton kernels and their thin launchers (imported as ``minference.kernels``).

Importing this package compiles nothing; each kernel compiles on first use. On CPU tensors the
kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` set before triton's first import).
"""

if __name__ != "minference.kernels":  # a bare `import kernels` from the checkout root: see minference/_toplevel.py
    import os
    import runpy

    # run by path: importing the minference package here could import transformers, which imports `kernels`
    runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, "minference", "_toplevel.py"))["hand_over"](
        __name__, __file__)
else:
    from minference.kernels._common import SUPPORTED_HEAD_DIMS, value_guard
    from minference.kernels.ashape import ashape_attention, dense_attention
    from minference.kernels.block_sparse import BLOCK_SIZES, block_sparse_attention
    from minference.kernels.convert import VSIndex, convert_vertical_slash, vs_index_to_dense, vs_physical_tiles
    from minference.kernels.estimate_bs import block_sparse_index, pool_blocks, query_block_scores
    from minference.kernels.estimate_vs import vertical_slash_index
    from minference.kernels.select import block_index_ascending, select_query_blocks
    from minference.kernels.vertical_slash import (
        vertical_slash_attention,
        vertical_slash_attention_physical,
        vertical_slash_block_m,
    )

    # index estimation: estimate_vs.py (vertical-slash), estimate_bs.py (block-sparse), select.py (the
    # one-launch selections); their builders take the host half from minference.builders

    __all__ = [
        "BLOCK_SIZES",
        "block_sparse_attention",
        "block_index_ascending",
        "block_sparse_index",
        "SUPPORTED_HEAD_DIMS",
        "VSIndex",
        "ashape_attention",
        "convert_vertical_slash",
        "dense_attention",
        "pool_blocks",
        "query_block_scores",
        "select_query_blocks",
        "vertical_slash_attention",
        "vertical_slash_attention_physical",
        "vertical_slash_index",
        "value_guard",
        "vertical_slash_block_m",
        "vs_index_to_dense",
        "vs_physical_tiles",
    ]

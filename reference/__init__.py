"""Slow, obviously-correct references: candidate masks, float64 masked attention, naive estimators.

Imported as ``minference.reference``. Each function is the definition a fast path is tested
against and has the same signature as its twin in :mod:`minference.kernels`.
"""

if __name__ != "minference.reference":  # a bare `import reference` from the checkout root: see minference/_toplevel.py
    import os
    import runpy

    # run by path: importing the minference package here could import transformers, which imports `kernels`
    runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, "minference", "_toplevel.py"))["hand_over"](
        __name__, __file__)
else:
    from minference.reference.attention import (
        ashape_attention,
        block_sparse_attention,
        dense_attention,
        dense_attention_probs,
        masked_attention,
        merge_attention,
        query_rows_attention,
        vertical_slash_attention,
    )
    from minference.reference.masks import (
        ashape_mask,
        block_sparse_mask,
        causal_mask,
        length_mask,
        slash_set,
        vertical_slash_mask,
    )

    __all__ = [
        "ashape_attention",
        "ashape_mask",
        "block_sparse_attention",
        "block_sparse_mask",
        "causal_mask",
        "dense_attention",
        "dense_attention_probs",
        "length_mask",
        "masked_attention",
        "merge_attention",
        "query_rows_attention",
        "slash_set",
        "vertical_slash_attention",
        "vertical_slash_mask",
    ]

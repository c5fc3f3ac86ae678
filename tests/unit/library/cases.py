"""Shared plans of the library tests."""

from __future__ import annotations

from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

#: A plan exercising every kind, two vertical-slash groups, two block sizes and per-head budgets
#: (9 heads, 3 kv heads).
MIXED_PLAN = [
    VerticalSlash(vertical=8, slash=12, last_q=16, sink_columns=2, local_diagonals=3),
    AShape(sink=4, window=24),
    BlockSparse(top_k=3, block=16, sink_blocks=1),
    VerticalSlash(vertical=5, slash=20, last_q=16, sink_columns=1, local_diagonals=1),
    Dense(),
    VerticalSlash(vertical=6, slash=9, last_q=40, aggregation="max"),
    AShape(sink=1, window=50),
    BlockSparse(top_k=2, block=32, sink_blocks=0, force_diagonal=True),
    BlockSparse(top_k=4, block=16, sink_blocks=2),
]

"""Reusable verification tools for attention kernels: tolerance rule, NaN poisoning, hypothesis
strategies (:mod:`minference.testing.strategies`), an aten-op recorder
(:mod:`minference.testing.ops`), and a pytest plugin (markers, profiles)."""

from minference.testing.tolerance import (
    ATOL_FACTOR,
    FLOORS,
    STATS_RTOL,
    assert_close_to_reference,
    assert_not_written,
    assert_stats_close,
    poison,
)

__all__ = ["ATOL_FACTOR", "FLOORS", "STATS_RTOL", "assert_close_to_reference", "assert_not_written",
           "assert_stats_close", "poison"]

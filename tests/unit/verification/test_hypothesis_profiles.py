"""The hypothesis profiles of :mod:`minference.testing.plugin`: the CI profile reports a failing
example as soon as it is found (no shrink phase) without drawing fewer examples."""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from minference.testing.plugin import PROFILES


def test_profiles_keep_their_example_counts():
    assert settings.get_profile("ci").max_examples == 25
    assert settings.get_profile("ci-shrink").max_examples == 25
    assert settings.get_profile("gpu").max_examples == 400
    assert Phase.shrink not in settings.get_profile("ci").phases
    assert Phase.shrink in settings.get_profile("ci-shrink").phases
    assert set(PROFILES) == {"ci", "ci-shrink", "gpu"}


def test_ci_profile_reports_a_failure_without_shrinking():
    """After the first failing example hypothesis only replays it to report it (an interpreted
    kernel example takes seconds, so each shrink step would too); with shrinking it would keep
    calling the test to minimise the example."""
    calls = []

    @settings(settings.get_profile("ci"), database=None)
    @given(st.lists(st.integers(0, 1000), min_size=3))
    def prop(xs):
        calls.append(list(xs))
        assert sum(xs) < 100

    with pytest.raises(AssertionError):
        prop()
    first = next(i for i, xs in enumerate(calls) if sum(xs) >= 100)
    assert len(calls) - first <= 2, f"{len(calls) - first} calls after the first failure: shrinking ran"

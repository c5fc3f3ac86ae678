"""The main job end to end on SmolLM2-135M, at a short length to bound CI time (the default
4096-token run is ``minference run``)."""

from __future__ import annotations

import math

import pytest

from minference.app.main_job import format_report, run_main_job

pytestmark = pytest.mark.model

#: Prompt length of the CI run.
CI_TOKENS = 1024


@pytest.fixture(scope="module")
def report(smollm2):
    return run_main_job(n_tokens=CI_TOKENS, progress=False, loaded=smollm2)


def test_main_job_reports_both_runs(report):
    text = format_report(report)
    print(text)
    assert report.dense.text.strip().startswith(report.key), "dense SmolLM2 retrieves the key at 1K"
    assert report.sparse.text.strip().startswith(report.key), text
    assert report.call_counts["sparse"] == len(report.layer_density) == 30
    assert report.dense.prefill_s > 0 and report.sparse.prefill_s > 0
    # coverage is each row's share of its computed mass: at most 1 exactly, 1 for a full layer
    for d, c in zip(report.layer_density, report.layer_coverage):
        assert 0 < d <= 1 and 0 < c <= 1 and not math.isnan(d)
    assert report.density < 1
    for needle in ("dense  answer", "sparse answer", "prefill", "density           :", "coverage", "layer  density"):
        assert needle in text

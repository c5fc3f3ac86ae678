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
    assert report.dense.warmup_s is None and "untimed" not in text  # on a CPU no warm-up by default


def test_warm_up_runs_before_each_timed_prefill_and_is_reported(smollm2, tmp_path):
    """With ``warmup`` (the default on a GPU) each timed prefill follows an untimed one of the same
    prompt: both times are reported; the attention calls, the answers and the quality guard's
    summary and log are the timed run's (the warm-up runs a throwaway guard of the same settings)."""
    from minference.app.guard_options import GuardOptions

    log = tmp_path / "guard.jsonl"
    guard = GuardOptions(settings={"mode": "observe", "sample_rate": 1.0}, jsonl=str(log))
    r = run_main_job(n_tokens=CI_TOKENS, progress=False, loaded=smollm2, coverage=False, warmup=True, guard=guard)
    text = format_report(r)
    assert r.guard["calls"] == r.guard["checked_calls"] == 1, r.guard  # one prefill checked: the timed one
    assert len(log.read_text().splitlines()) == 1
    assert r.dense.warmup_s is not None and r.dense.warmup_s > 0
    assert r.sparse.warmup_s is not None and r.sparse.warmup_s > 0
    assert r.call_counts["sparse"] == 30, r.call_counts  # one prefill's 30 layers: the warm-up is not counted
    assert r.sparse.text.strip().startswith(r.key), text
    assert text.count("after an untimed first prefill of") == 2, text
    assert "Triton compiles" not in text, text  # the compile note is a GPU's (the CPU backend compiles nothing)

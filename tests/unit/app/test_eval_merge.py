"""``minference eval --merge`` and the report file (minference.app.evaluate.merge_reports,
EvalReport.from_dict / load): every ratio against dense from one run, configs compared by what
they run, the differing settings named, CUDA graph counters kept out of the settings, and a
malformed report refused in one line."""

from __future__ import annotations

import json
import re

import pytest

from minference.app import evaluate as E
from minference.app.cli import main

from .test_evaluate import LAYERS, UNIFORM, N, _timed_report


def _named(report: E.EvalReport, old: str, config: E.EvalConfig) -> E.EvalReport:
    """``report`` with its config ``old`` replaced by ``config`` (runs and records renamed)."""
    report.configs = [config if c.name == old else c for c in report.configs]
    for r in report.runs + report.records:
        if r.config == old:
            r.config = config.name
    return report


def test_merge_refuses_a_sparse_config_without_dense_in_its_own_report():
    """A report with a sparse config but no dense run at its length, or dense on other prompts,
    would put a ratio between two runs in the merged table: refused, naming the report and config.
    Where no report has a dense config there is no ratio, and nothing to refuse."""
    a = _timed_report({"dense": {("a", 0): 1.0}, "fast": {("a", 0): 0.5}})
    alone = _named(_timed_report({"fast": {("a", 0): 9.0}}), "fast", E.EvalConfig("other", UNIFORM + " ", "uniform"))
    alone.configs = [c for c in alone.configs if c.name == "other"]
    with pytest.raises(E.EvalError, match=r"^b.json: other at 1024 tokens has no dense run at that length in the "
                                          r"same report; every ratio against dense must come from one run"):
        E.merge_reports([a, alone], names=["a.json", "b.json"])
    with pytest.raises(E.EvalError, match="^report 2: other at 1024"):
        E.merge_reports([a, alone])
    # dense in the same report, but on another prompt than the sparse config's
    shifted = _named(_timed_report({"dense": {("b", 0): 1.0}, "fast": {("a", 1): 0.5}}), "fast",
                     E.EvalConfig("other", UNIFORM + " ", "uniform"))
    with pytest.raises(E.EvalError, match=r"report 2: other at 1024 tokens has no dense run on task a sample 1 in"):
        E.merge_reports([a, shifted])
    no_dense = [E.EvalReport.from_dict(r.to_dict()) for r in (a, alone)]
    no_dense[0] = _named(no_dense[0], "dense", E.EvalConfig("fast2", UNIFORM + "  ", "uniform"))
    merged = E.merge_reports(no_dense)
    assert all(r["speedup_median"] is None for r in merged.ttft_summary())


def test_merge_compares_what_a_config_runs_not_only_its_spec():
    """One file path with other contents in two runs (a config re-searched between calls) is two
    configs under one name: refused; a uniform config made again (another creation time in its
    provenance) is the same config."""
    a = _timed_report({"dense": {("a", 0): 1.0}, "fast": {("a", 0): 0.5}})
    b = _timed_report({"dense": {("b", 0): 1.0}, "fast": {("b", 0): 0.5}})
    for rep, (vertical, slash), created in ((a, (1000, 6096), "2026-01-01"), (b, (100, 500), "2026-01-02")):
        layers = [[{"kind": "vertical_slash", "vertical": vertical, "slash": slash}]]
        rep.configs[1] = E.EvalConfig("fast", "configs/qwen.json", "file",
                                      config={"layers": layers, "provenance": {"created": created}})
    with pytest.raises(E.EvalError, match=r"config 'fast' has two contents under the specs 'configs/qwen.json' "
                                          r"and 'configs/qwen.json' \(report 2 differs"):
        E.merge_reports([a, b])
    b.configs[1].config["layers"] = a.configs[1].config["layers"]
    assert [c.config["provenance"]["created"] for c in E.merge_reports([a, b]).configs[1:]] == ["2026-01-01"]
    b.configs[1].pattern = {"kind": "vertical_slash", "vertical": 1, "slash": 2}
    with pytest.raises(E.EvalError, match="config 'fast' has two contents"):
        E.merge_reports([a, b])


def test_merge_takes_a_report_written_before_a_pattern_field_existed():
    """A report written before ``BlockSparse.score_rows`` existed lacks the field in its patterns;
    one written since holds its default (0): the same config, merged (``--continue`` of an older
    report goes through the same check), and matched by ``show frontier``'s pattern identity. A
    config that sets the field (32 rows) is another config under that name: refused."""
    from minference.app import frontier as F

    old = {"kind": "block_sparse", "top_k": 512, "block": 128, "sink_blocks": 1, "force_diagonal": True,
           "rule": "relative", "threshold": 0.03, "min_blocks": 0, "estimate": "query"}
    a = _timed_report({"dense": {("a", 0): 1.0}, "fast": {("a", 0): 0.5}})
    b = _timed_report({"dense": {("b", 0): 1.0}, "fast": {("b", 0): 0.5}})
    for rep, pattern in ((a, old), (b, dict(old, score_rows=0))):
        rep.configs[1] = E.EvalConfig("fast", "bsr", "uniform", config={"layers": [[pattern]]}, pattern=pattern)
    merged = E.merge_reports([a, b])
    assert [c.name for c in merged.configs] == ["dense", "fast"]
    assert F._identity(a.configs[1]) == F._identity(b.configs[1])
    for field in ("pattern", "config"):
        c = _named(_timed_report({"dense": {("b", 0): 1.0}, "fast": {("b", 0): 0.5}}), "fast",
                   E.EvalConfig("fast", "bsr", "uniform", config={"layers": [[old]]}, pattern=old))
        changed = dict(old, score_rows=32)
        if field == "pattern":
            c.configs[1].pattern = changed
        else:
            c.configs[1].config = {"layers": [[changed]]}
        with pytest.raises(E.EvalError, match="config 'fast' has two contents"):
            E.merge_reports([a, c])
    assert F._identity(a.configs[1]) != F._identity(c.configs[1])  # the layers differ (the identity reads them)


def test_merge_names_the_settings_that_differ():
    a = _timed_report({"dense": {("a", 0): 1.0}})
    b = _timed_report({"dense": {("b", 0): 1.0}})
    b.settings = dict(b.settings, dense_tail=64, dense_threshold=4096)
    del b.settings["backend"]
    with pytest.raises(E.EvalError, match=r"different settings cannot be merged \(x.json vs y.json: dense_threshold: "
                                          r"None vs 4096; backend: 'auto' vs absent; dense_tail: absent vs 64\)$"):
        E.merge_reports([a, b], names=["x.json", "y.json"])


def test_cuda_graph_counters_stay_out_of_the_settings_and_add_up():
    """Two calls with --cuda-graphs split by task captured and replayed different counts: they
    merge (the settings hold no counters), the counters summed per config; a report that kept
    them in its settings (before they had a field) loads with them moved, and merges too."""
    a = _timed_report({"dense": {("a", 0): 1.0}, "fast": {("a", 0): 0.5}})
    b = _timed_report({"dense": {("b", 0): 1.0}, "fast": {("b", 0): 0.5}})
    a.settings["cuda_graphs"] = b.settings["cuda_graphs"] = True
    a.cuda_graph_stats = {"fast": {"captures": 4, "replays": 8, "direct": 0}}
    b.cuda_graph_stats = {"fast": {"captures": 6, "replays": 2, "direct": 1}}
    merged = E.merge_reports([a, b])
    assert merged.cuda_graph_stats == {"fast": {"captures": 10, "replays": 10, "direct": 1}}
    assert "cuda_graph_stats" not in merged.settings and a.cuda_graph_stats["fast"]["captures"] == 4
    back = E.EvalReport.from_dict(json.loads(merged.to_json()))
    assert back.cuda_graph_stats == merged.cuda_graph_stats
    old = a.to_dict()
    old["settings"]["cuda_graph_stats"] = old.pop("cuda_graph_stats")  # a report written before the field
    older = E.EvalReport.from_dict(old)
    assert older.settings == a.settings and older.cuda_graph_stats == a.cuda_graph_stats
    assert E.merge_reports([older, b]).cuda_graph_stats == merged.cuda_graph_stats


def test_a_cuda_graphs_run_keeps_its_counters_out_of_the_settings(smollm2_layers, monkeypatch):
    """On the CPU every sparse call runs directly (no graph), and is counted: in the report's own
    field, so the checkpoints (written before the counters exist) and the final report have the
    same settings. ``run_eval`` refuses graphs off CUDA (test_eval_checks.py): lifted here, so the
    CPU stands in for a GPU run's bookkeeping."""
    monkeypatch.setattr(E, "_check_cuda_graphs", lambda *a: None)
    small = smollm2_layers(LAYERS)
    saved: list = []
    report = E.run_eval("smollm2", configs=["dense", UNIFORM], lengths=[512], tasks=["single_needle"], samples=1,
                        dense_threshold=0, progress=False, loaded=small, coverage=False, cuda_graphs=True,
                        checkpoint=lambda r: saved.append(json.loads(r.to_json())))
    assert "cuda_graph_stats" not in report.settings and report.settings == saved[-1]["settings"]
    (name,) = report.cuda_graph_stats
    assert name == "BS(top4,b64)" and report.cuda_graph_stats[name]["direct"] > 0


@pytest.mark.parametrize("content, message", [
    ("[]", "not an eval report (a JSON list, not an object)"),
    ('{"format": "minference.eval_report"}', "malformed eval report: no 'model', 'machine', 'settings', 'configs', "
                                             "'lengths', 'tasks', 'records', 'runs'"),
    ("{", "Expecting property name"),
])
def test_a_malformed_report_is_one_line_error(content, message, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: "):
        E.EvalReport.load(path)
    assert main(["eval", "--merge", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minference eval: error: {path}: ") and message in err and err.count("\n") == 1
    good = _timed_report({"dense": {("a", 0): 1.0}}).to_dict()
    good["runs"][0] = ["not", "an", "object"]
    with pytest.raises(ValueError, match="^malformed eval report: "):
        E.EvalReport.from_dict(good)


def test_runs_that_differ_only_in_untimed_extras_merge():
    """``--no-profile`` / ``--no-coverage`` only skip an untimed prefill: a RULER length split over
    calls with and without them merges, each (config, length) keeping the split and coverage of
    the first report that measured them (never overwritten by a later one), and the merged
    settings say they were measured. Coverage on different numbers of sample rows is two kinds of
    figure: refused in any order, while a report that measured no coverage may hold another."""
    def report(key, profile, coverage, rows=512, split=None, cover=None):
        r = _timed_report({"dense": {(key, 0): 1.0}, "fast": {(key, 0): 0.5}})
        r.settings.update(profile=profile, coverage=coverage, coverage_rows=rows)
        r.run("fast", N).split, r.run("fast", N).coverage = split, cover
        return r

    one = E.TimeSplit(attention_ms=3.0, index_ms=1.0, other_ms=2.0, total_ms=6.0)
    two = E.TimeSplit(attention_ms=9.0, index_ms=9.0, other_ms=9.0, total_ms=27.0)
    a, b = report("a", False, False, rows=256), report("b", True, True, split=one, cover=0.9)
    merged = E.merge_reports([a, b])
    assert merged.run("fast", N).split == one and merged.run("fast", N).coverage == 0.9
    assert merged.settings["profile"] is True and merged.settings["coverage"] is True
    assert merged.settings["coverage_rows"] == 512  # the rows of the coverage it holds
    assert a.run("fast", N).split is None and a.settings["profile"] is False  # the inputs are not changed
    assert merged.run("fast", N).ttft_s == [0.5, 0.5]
    # the first report's own figures stay; profile-only then coverage-only fills each from its report
    kept = E.merge_reports([b, report("c", True, True, split=two, cover=0.5)])
    assert kept.run("fast", N).split == one and kept.run("fast", N).coverage == 0.9
    crossed = E.merge_reports([report("d", True, False, split=one), report("e", False, True, cover=0.7)])
    assert crossed.run("fast", N).split == one and crossed.run("fast", N).coverage == 0.7
    # coverage of 512 and 1024 rows: refused whichever report comes first, naming the two
    c = report("f", True, True, rows=1024, cover=0.8)
    for order in ([a, b, c], [b, a, c], [c, a, b]):
        with pytest.raises(E.EvalError, match=r"different settings cannot be merged \(report \d vs report \d: "
                                              r"coverage_rows: (512 vs 1024|1024 vs 512)\)"):
            E.merge_reports(order)

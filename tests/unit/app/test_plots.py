"""Pictures (``minference.app.plots``): files are written, numbers agree with the reference metrics,
bad input is refused before drawing, and matplotlib stays optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from minference.reference import metrics as R
from minference.reference.attention import dense_attention_probs
from minference.reference.masks import ashape_mask, causal_mask

from minference.app import cli
from minference.app import plots as P
from minference.app.main_job import DEFAULT_CONFIG
from minference.config import ModelSignature, PatternConfig, Provenance, load_config
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > len(PNG_MAGIC) and path.read_bytes()[:8] == PNG_MAGIC


def small_config(with_densities: bool = True) -> PatternConfig:
    layers = [[Dense(), AShape(sink=4, window=32), VerticalSlash(vertical=8, slash=16), BlockSparse(top_k=3, block=16)],
              [BlockSparse(top_k=2, block=16), Dense(), Dense(), AShape(sink=1, window=8)]]
    prov = Provenance(source="manual", metric="captured_mass", target_density=0.3,
                      densities=[[1.0, 0.2, 0.3, None], [0.25, 1.0, 1.0, 0.1]] if with_densities else None,
                      scores=[[1.0, 0.9, 0.8, None], [0.95, 1.0, 1.0, 0.7]] if with_densities else None)
    return PatternConfig(ModelSignature("tiny-test-model", "llama", 2, 4), layers, prov)


def qk(hq: int = 4, hkv: int = 2, n: int = 96, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)


@pytest.mark.parametrize("with_densities", [True, False])
def test_plot_config_writes_png(tmp_path, with_densities) -> None:
    out = P.plot_config(small_config(with_densities), tmp_path / "cfg.png")
    assert out == tmp_path / "cfg.png"
    assert _is_png(out)


def test_plot_config_bundled_smollm2(tmp_path) -> None:
    out = P.plot_config(load_config(DEFAULT_CONFIG), tmp_path / "smollm2.png", dpi=60)
    assert _is_png(out)


def test_plot_config_refuses_bad_input(tmp_path) -> None:
    with pytest.raises(TypeError, match="config must be a minference.config.PatternConfig"):
        P.plot_config(small_config().to_dict(), tmp_path / "x.png")
    with pytest.raises(ValueError, match="folder"):
        P.plot_config(small_config(), tmp_path / "missing" / "x.png")
    with pytest.raises(ValueError, match="extension"):
        P.plot_config(small_config(), tmp_path / "noext")
    with pytest.raises(TypeError, match="path"):
        P.plot_config(small_config(), 3)
    assert not list(tmp_path.iterdir())


def test_budget_labels() -> None:
    assert P.budget_label(AShape(sink=4, window=32)) == "4+32"
    assert P.budget_label(VerticalSlash(vertical=8, slash=16)) == "8/16"
    assert P.budget_label(BlockSparse(top_k=3)) == "k3"
    assert P.budget_label(Dense()) == ""


@pytest.mark.parametrize("pattern", [Dense(), AShape(sink=2, window=10), VerticalSlash(vertical=6, slash=9, last_q=16),
                                     BlockSparse(top_k=2, block=16, sink_blocks=1)])
def test_plot_head_writes_png_and_reports_reference_metrics(tmp_path, pattern) -> None:
    q, k = qk()
    head = 3  # kv head 1 under GQA group 2
    res = P.plot_head(q, k, pattern, tmp_path / "head.png", head=head, title="synthetic")
    assert _is_png(res.path)
    mask = P.head_mask(q, k, pattern, head=head)
    probs = dense_attention_probs(q[:, head : head + 1], k[:, 1:2])
    assert res.mass == pytest.approx(float(R.captured_mass(probs, mask[None, None])[0, 0]), abs=1e-12)
    assert res.density == pytest.approx(float(R.density(mask[None, None])[0, 0]), abs=1e-12)
    if isinstance(pattern, Dense):
        assert res.mass == pytest.approx(1.0, abs=1e-12) and res.density == 1.0
    else:
        assert 0.0 < res.density < 1.0


def test_plot_head_static_masks_are_the_reference_formulas() -> None:
    q, k = qk()
    n = q.shape[2]
    assert torch.equal(P.head_mask(q, k, AShape(sink=2, window=10), head=1), ashape_mask(n, 2, 10))
    assert torch.equal(P.head_mask(q, k, Dense(), head=0), causal_mask(n))


def test_plot_head_picks_the_head_and_its_kv_head(tmp_path) -> None:
    """An explicit mask keeping only key 0: the captured mass is head 2's attention to key 0,
    which differs between heads of different kv heads."""
    q, k = qk(hq=4, hkv=2)
    n = q.shape[2]
    only_first = torch.zeros(n, n, dtype=torch.bool)
    only_first[:, 0] = True
    masses = [P.plot_head(q, k, only_first, tmp_path / f"h{h}.png", head=h).mass for h in (0, 2)]
    probs = dense_attention_probs(q, k)  # [1, 4, n, n], GQA by the reference
    want = probs[0, :, :, 0].mean(-1)
    assert masses == pytest.approx([float(want[0]), float(want[2])], abs=1e-12)
    assert masses[0] != pytest.approx(masses[1])


def test_plot_head_pools_long_sequences_for_display(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(P, "MAX_DISPLAY_PIXELS", 32)
    q, k = qk(n=100)
    res = P.plot_head(q[0], k[0], AShape(sink=1, window=8), tmp_path / "pooled.png", head=0)  # rank-3 inputs
    assert _is_png(res.path)


def test_plot_head_refuses_bad_input(tmp_path) -> None:
    q, k = qk()
    out = tmp_path / "h.png"
    with pytest.raises(ValueError, match=r"head must be in \[0, 4\)"):
        P.plot_head(q, k, Dense(), out, head=4)
    with pytest.raises(ValueError, match="head must be >= 0"):
        P.plot_head(q, k, Dense(), out, head=-1)
    with pytest.raises(TypeError, match="head must be an int"):
        P.plot_head(q, k, Dense(), out, head=1.0)
    with pytest.raises(TypeError, match="pattern must be a minference pattern"):
        P.plot_head(q, k, "a_shape", out)
    with pytest.raises(ValueError, match="mask pattern must be"):
        P.plot_head(q, k, torch.ones(5, 5, dtype=torch.bool), out)
    with pytest.raises(TypeError, match="pattern must have dtype"):
        P.plot_head(q, k, torch.ones(96, 96), out)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        P.plot_head(q, k[:, :1].expand(1, 3, -1, -1), Dense(), out)
    with pytest.raises(ValueError, match="batch must be 1"):
        P.plot_head(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), Dense(), out)
    with pytest.raises(ValueError, match="to match q"):
        P.plot_head(q, k[:, :, :50], Dense(), out)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        P.plot_head(q.numpy(), k, Dense(), out)
    assert not out.exists()


def test_show_config_cli(tmp_path, capsys) -> None:
    cfg = tmp_path / "cfg.json"
    small_config().save(cfg)
    out = tmp_path / "grid.png"
    assert cli.main(["show", "config", str(cfg), "--out", str(out), "--dpi", "50"]) == 0
    assert _is_png(out)
    assert "tiny-test-model" in capsys.readouterr().out


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        P.plot_config(small_config(), tmp_path / "x.png")
    q, k = qk()
    with pytest.raises(ImportError, match="pip install matplotlib"):
        P.plot_head(q, k, Dense(), tmp_path / "y.png")


def test_import_minference_does_not_import_matplotlib() -> None:
    code = ("import sys, minference, minference.app.plots, minference.app.cli; minference.app.cli.build_parser(); "
            "sys.exit(1 if 'matplotlib' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------
# The frontier pictures.


def _frontier_summary() -> dict:
    from minference.app.frontier import FRONTIER_FORMAT

    point = {"cost": 5.0, "error": 0.02, "worst": 6.0, "prefill": 15.0, "worst_prefill": 16.0, "speedup": 2.0,
             "counts": {"a_shape": 1, "vertical_slash": 2, "block_sparse": 3, "dense": 0}}
    return {"format": FRONTIER_FORMAT, "version": 1, "model": {"model_id": "tiny"}, "n_tokens": 1000, "unit": "ms",
            "cost_source": "t.json", "fixed": 10.0, "worst_ratio": 1.2, "heads": 6, "dense_cost": 20.0,
            "points": [dict(point, budget=0.02, config="a_0.02.json"),
                       dict(point, budget=0.05, error=0.05, cost=3.0, prefill=13.0, config="a_0.05.json")],
            "rules": [dict(point, min_mass=0.9, error=0.03, cost=6.0, prefill=16.0)],
            "curve": {"error": [0.0, 0.02, 0.05, 0.1], "cost": [20.0, 5.0, 3.0, 2.0], "worst": [20.0, 6, 4, 3]}}


def _eval_report():
    from minference.app.evaluate import EvalConfig, EvalReport, RunStats, SampleRecord

    family = {"provenance": {"notes": "frontier point: error budget 0.02 ..."}}
    other = {"provenance": {"notes": "2 prompt(s) ..."}}
    configs = [EvalConfig("dense", "dense", "dense"), EvalConfig("f1", "f1.json", "file", config=family),
               EvalConfig("f2", "f2.json", "file", config=family), EvalConfig("u", "{}", "uniform"),
               EvalConfig("old", "old.json", "file", config=other)]
    ttft = {"dense": [1.0] * 10, "f1": [0.5] * 9 + [0.55], "f2": [0.4] * 9 + [0.7], "u": [0.3] * 10,
            "old": [0.6] * 10}
    correct = {"dense": 8, "f1": 8, "f2": 7, "u": 4, "old": 8}
    nll = {"dense": 2.0, "f1": 2.01, "f2": 2.015, "u": 2.5, "old": 2.005}
    records, runs = [], []
    for name in ttft:
        runs.append(RunStats(name, 1000, ttft_s=ttft[name]))
        records += [SampleRecord(name, "single_needle", 1000, i, 0, None, ["1"], i < correct[name], "", None)
                    for i in range(10)]
        records.append(SampleRecord(name, "perplexity", 1000, 0, 0, None, [], None, None, None, nll=nll[name],
                                    nll_buckets=[nll[name]]))
    return EvalReport(model={"name": "m", "dtype": "bf16", "model_id": "m"}, machine={}, settings={"device": "cuda"},
                      configs=configs, lengths=[1000], tasks=["single_needle", "perplexity"], records=records,
                      runs=runs)


def test_config_groups() -> None:
    report = _eval_report()
    assert [P.config_group(c) for c in report.configs] == ["dense", "family", "family", "uniform", "config"]


def test_plot_search_frontier(tmp_path) -> None:
    assert _is_png(P.plot_search_frontier(_frontier_summary(), tmp_path / "f.png", dpi=50))
    assert _is_png(P.plot_search_frontier({**_frontier_summary(), "proxy": "output"}, tmp_path / "o.png", dpi=50))
    with pytest.raises(ValueError, match="frontier summary"):
        P.plot_search_frontier({"format": "x"}, tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


def test_plot_eval_frontier(tmp_path) -> None:
    report = _eval_report()
    assert _is_png(P.plot_eval_frontier(report, tmp_path / "e.png", ship="f1", dpi=50))
    with pytest.raises(ValueError, match="length 5"):
        P.plot_eval_frontier(report, tmp_path / "x.png", length=5)


def test_an_nll_only_report_draws_the_nll_panel_alone(tmp_path) -> None:
    """A perplexity-only run (the frontier's NLL calls) has no accuracy to draw: one panel, not an
    empty one beside it; with a generation task, two."""
    import struct

    def width(path) -> int:  # the PNG header's IHDR width
        return struct.unpack(">I", path.read_bytes()[16:20])[0]

    report = _eval_report()
    both = P.plot_eval_frontier(report, tmp_path / "both.png", dpi=50)
    report.tasks = ["perplexity"]
    report.records = [r for r in report.records if r.task == "perplexity"]
    alone = P.plot_eval_frontier(report, tmp_path / "nll.png", dpi=50)
    assert (width(both), width(alone)) == (650, 325)
    # decided per length: generation tasks at another length leave this length's panel alone
    from minference.app.evaluate import SampleRecord

    report.tasks = ["single_needle", "perplexity"]
    report.lengths = [500, 1000]
    report.records.append(SampleRecord("dense", "single_needle", 500, 0, 0, None, ["1"], True, "", None))
    assert width(P.plot_eval_frontier(report, tmp_path / "mixed.png", length=1000, dpi=50)) == 325


def test_show_frontier_cli_prints_the_ship_decision(tmp_path, capsys) -> None:
    import json

    rep = tmp_path / "r.json"
    rep.write_text(_eval_report().to_json())
    assert cli.main(["show", "frontier", str(rep), "--out", str(tmp_path / "r.png")]) == 0
    text = capsys.readouterr().out
    # u (fastest) loses 4 samples, f2 has worst 0.7 > 1.2 x 0.4; f1 passes
    assert "ship: f1" in text and "u: 300.0 ms, rejected: single_needle at 1000: 4/10 vs dense 8/10" in text
    assert "f2: 400.0 ms, rejected: TTFT at 1000: worst 700.0 ms > 1.2 x median 400.0 ms" in text
    assert _is_png(tmp_path / "r.png")
    summary = tmp_path / "s.json"
    summary.write_text(json.dumps(_frontier_summary()))
    assert cli.main(["show", "frontier", str(summary), "--out", str(tmp_path / "s.png")]) == 0
    assert _is_png(tmp_path / "s.png")

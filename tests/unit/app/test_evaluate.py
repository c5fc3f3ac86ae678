"""``minference eval`` (minference.app.evaluate): a tiny real SmolLM2 run, the CLI and its errors,
the chunked perplexity, the profiler ranges and the eq. 13 split."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import statistics
import types

import pytest
import torch

from minference import dispatch
from minference.app import evals
from minference.app import evaluate as E
from minference.app.cli import build_parser, main
from minference.app.main_job import DEFAULT_CONFIG
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

from .conftest import SMALL_LAYERS as LAYERS

N = 1024
TASKS = ("single_needle", "multi_key", evals.PERPLEXITY_TASK)
UNIFORM = '{"kind": "block_sparse", "top_k": 4, "block": 64}'



@pytest.fixture(scope="module")
def tiny_run(small):
    """One real run: 1 length, 2 tasks + perplexity, 1 sample, dense + bundled + uniform config,
    with every ``evals.score`` call recorded."""
    calls = []
    real_score = evals.score

    def spy(sample, text):
        result = real_score(sample, text)
        calls.append((sample, text, result))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evals, "score", spy)
        report = E.run_eval("smollm2", configs=["dense", str(DEFAULT_CONFIG), UNIFORM], lengths=[N], tasks=TASKS,
                            samples=1, dense_threshold=0, allow_mismatch=True, progress=False, loaded=small)
    return report, calls


def test_report_structure_and_counts(tiny_run):
    report, _ = tiny_run
    names = [c.name for c in report.configs]
    assert names == ["dense", "smollm2-135m", "BS(top4,b64)"]
    assert [c.kind for c in report.configs] == ["dense", "file", "uniform"]
    assert (report.configs[2].pattern["kind"], report.configs[2].pattern["top_k"]) == ("block_sparse", 4)
    assert report.configs[1].config["layers"][3][0]["kind"] == "vertical_slash"  # the full pattern JSON
    assert report.lengths == [N] and report.tasks == list(TASKS)
    assert len(report.records) == len(names) * len(TASKS)
    acc = report.accuracy()
    assert sorted((a["config"], a["task"]) for a in acc) == sorted((c, t) for c in names for t in TASKS[:2])
    assert all(a["total"] == 1 and a["correct"] in (0, 1) for a in acc)
    assert all(a["found"] == 1.0 if a["correct"] else 0 <= a["found"] < 1 for a in acc)
    assert sum(a["correct"] for a in acc) == sum(bool(r.correct) for r in report.records)
    assert sum(a["total"] for a in acc) == sum(r.correct is not None for r in report.records)
    for r in report.records:
        assert r.n_tokens == N and r.index == 0 and r.seed == 0
        if r.task == evals.PERPLEXITY_TASK:
            assert r.correct is None and r.ttft_s is None and len(r.nll_buckets) == E.NLL_BUCKETS
            assert math.isfinite(r.nll) and r.nll > 0
        else:  # the first task's prompt is the timed one; the tasks decode as one batch
            assert isinstance(r.text, str) and 1 <= r.new_tokens
            assert (r.ttft_s > 0) if r.task == TASKS[0] else (r.ttft_s is None)
    for stats in report.runs:
        assert len(stats.ttft_s) == 1 and stats.ttft_median_s == statistics.median(stats.ttft_s)
        assert stats.warmup_s > 0


def test_warmup_covers_both_divisibility_classes_on_a_gpu():
    # Triton specialises an integer argument on n % 16 == 0: the warm-up compiles both variants
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for n in (130000, 130416, 130417, 4096, 4097, 17):
        lengths = E.warmup_lengths(n, cuda)
        assert lengths[0] == n and len(lengths) == 2 and 0 < lengths[1] < n
        assert {m % 16 == 0 for m in lengths} == {True, False}
    assert E.warmup_lengths(130000, cpu) == [130000] and E.warmup_lengths(16, cuda) == [16]


def test_dense_and_sparse_configs_warm_up_at_every_warmup_length(monkeypatch):
    # dense pays a first use at the other divisibility class too (an H100, 32K: 840 ms against a
    # 385 ms median), so every config's warm-up prefills each of warmup_lengths, untimed
    seen = []
    monkeypatch.setattr(E, "warmup_lengths", lambda n, dev: [n, n - 3])
    monkeypatch.setattr(E, "_prefill", lambda model, ids, chunk=0: seen.append(ids.shape[-1]) or (0.5, None, None))
    model = torch.nn.Linear(1, 1)
    for spec in ("dense", '{"kind": "a_shape", "sink": 4, "window": 16}'):
        seen.clear()
        config = None if spec == "dense" else object()
        monkeypatch.setattr("minference.integration.reset_counts", lambda m: None)
        monkeypatch.setattr("minference.integration.call_counts", lambda m: {})
        monkeypatch.setattr("minference.integration.attention_modules", lambda m: {0: m})
        stats = E.RunStats(spec, 40)
        E._once_per_length(model, None, config, torch.zeros(40, dtype=torch.long), stats, torch.device("cpu"),
                           coverage=False, profile=False, physical=False)
        assert seen == [40, 37], (spec, seen)
        assert stats.warmup_s == 0.5


def test_generation_records_are_scored_with_evals_score(tiny_run, small):
    report, calls = tiny_run
    generated = [r for r in report.records if r.correct is not None]
    # every record's score is a call on its final text (decoding also asks score whether a
    # row has settled, on the text so far)
    final = {(sample.task, text): (sample, result) for sample, text, result in calls}
    for r in generated:
        sample, result = final[(r.task, r.text)]
        assert result is r.correct
        again = evals.make_sample(r.task, small[1], N, r.index, samples=1, seed=r.seed)
        assert torch.equal(again.ids, sample.ids) and list(again.answers) == r.answers
        assert evals.score(again, r.text) is r.correct
        assert r.found == evals.score_fraction(again, r.text)
    dense = [r for r in generated if r.config == "dense"]
    assert {r.task for r in dense} == set(TASKS[:2])


def test_split_density_coverage_on_cpu(tiny_run):
    report, _ = tiny_run
    assert not report.settings["profile"]
    for stats in report.runs:
        assert stats.split is None  # no device timer on the CPU
        assert len(stats.layer_coverage) == len(stats.layer_density) == LAYERS
        assert all(0.0 <= c <= 1.0 for c in stats.layer_coverage)
        assert all(0.0 < d <= 1.0 for d in stats.layer_density)
        assert 0.0 < stats.density <= 1.0 and 0.0 <= stats.coverage <= 1.0
    dense, bundled, uniform = (report.run(c.name, N) for c in report.configs)
    assert dense.density == dense.coverage == 1.0 and dense.calls == {}
    for sparse in (bundled, uniform):
        assert sparse.calls == {"sparse": LAYERS}  # dense_threshold=0: sparse really ran
        assert sparse.physical_density is None  # torch backend: no tiles
        assert sparse.density < 1.0
    assert uniform.coverage < 1.0


def test_json_round_trip(tiny_run, tmp_path):
    report, _ = tiny_run
    path = tmp_path / "eval.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == E.REPORT_FORMAT and data["machine"]["versions"]["torch"] == torch.__version__
    assert data["summary"]["accuracy"] == report.accuracy()
    assert len(data["records"]) == len(report.records)
    assert E.EvalReport.load(path) == report


def test_table_and_plot(tiny_run, tmp_path):
    report, _ = tiny_run
    table = E.format_report(report)
    for c in report.configs:
        assert f"| {N} | {c.name} |" in table
    assert "1/1" in table or "0/1" in table
    assert "n/a | n/a | n/a" in table  # the CPU split
    assert "1.00x" in table  # dense against itself
    pytest.importorskip("matplotlib")
    fig = E.plot_eval(report, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 1000
    # with the perplexity task a second panel: NLL against TTFT, one point per config
    assert report.perplexity() and [ax.get_ylabel()[:4] for ax in fig.axes] == ["accu", "mean"]
    assert len(fig.axes[1].collections) == len(report.configs)
    no_ppl = dataclasses.replace(report, records=[r for r in report.records if r.nll is None])
    assert len(E.plot_eval(no_ppl, tmp_path / "eval2.png").axes) == 1


def test_chunked_nll_equals_full_logits(small):
    model, tokenizer = small
    ids = evals.perplexity_ids(tokenizer, 48, 0)
    got = E.sequence_nll(model, ids, chunk=7)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    want = -torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    assert got.shape == (47,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # NLL ~20 here: fp32 rounding of the sum
    with pytest.raises(ValueError, match="chunk"):
        E.sequence_nll(model, ids, chunk=0)
    # the prompt fed in chunks through the cache (chunked prefill, dense here): the same NLL up to
    # float32 rounding (another SDPA path: a chunk against its cache is a masked call, not is_causal)
    torch.testing.assert_close(E.sequence_nll(model, ids, chunk=7, prefill_chunk=13), want, rtol=1e-5, atol=1e-5)
    # only the last positions: the same values, the LM head run on those rows only (one and several chunks,
    # with and without chunked prefill, a tail that starts inside a prefill chunk)
    # (21 with chunks of 13: the tail starts exactly where a prefill chunk begins, position 26, the third)
    for last, prefill in ((1, 0), (5, 0), (20, 0), (47, 0), (20, 13), (9, 13), (21, 13)):
        tail = E.sequence_nll(model, ids, chunk=7, prefill_chunk=prefill, last=last)
        torch.testing.assert_close(tail, want[-last:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(E.sequence_nll(model, ids, last=torch.tensor(3)), want[-3:], rtol=1e-5, atol=1e-5)
    for bad in (0, 48, True, 2.0):
        with pytest.raises(ValueError, match="last must be"):
            E.sequence_nll(model, ids, last=bad)


def test_chunked_prefill_decodes_as_one_call():
    """``_generate`` / ``_prefill`` with the prompt in chunks through the cache give what one
    call gives (an unpatched model: chunked dense prefill is the same attention)."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (2, 23))
    assert E._generate(model, ids, [8, 8], set(), chunk=5) == E._generate(model, ids, [8, 8], set())
    assert int(E._prefill(model, ids[0], 6)[2]) == int(E._prefill(model, ids[0])[2])


def test_run_eval_prefills_in_chunks(small):
    """``prefill_chunk``: the later chunks of a sparse config run the ``sparse_continue`` path,
    recorded with the setting; the dense config is unpatched."""
    report = E.run_eval("smollm2", configs=["dense", UNIFORM], lengths=[N], tasks=["perplexity"], samples=1,
                        dense_threshold=0, allow_mismatch=True, progress=False, loaded=small, coverage=False,
                        prefill_chunk=N // 3)
    assert report.settings["prefill_chunk"] == N // 3
    calls = report.run("BS(top4,b64)", N).calls
    assert calls["sparse"] == LAYERS and calls["sparse_continue"] == 2 * LAYERS  # chunks 2 and 3 of every layer
    assert "prefill in chunks of" in E.format_report(report)
    with pytest.raises(E.EvalError, match="prefill_chunk"):
        E.run_eval("smollm2", configs=["dense"], lengths=[N], tasks=["perplexity"], prefill_chunk=-1, loaded=small,
                   progress=False)


# ---------------------------------------------------------------------------------------------
# CLI and errors.


def test_cli_parses_every_option():
    args = build_parser().parse_args([
        "eval", "--model", "qwen", "--model-path", "q.gguf", "--config", "dense", "fast=" + UNIFORM,
        "--config", "c.json", "--lengths", "8192", "16384", "--tasks", "single_needle", "perplexity",
        "--samples", "3", "--seed", "7", "--device", "cuda", "--dense-threshold", "0", "--out", "r.json",
        "--plot", "r.png", "--no-coverage", "--no-profile", "--allow-mismatch", "--no-progress", "--dense-tail", "64"])
    assert args.func is E._eval_cmd
    assert (args.model, args.model_path, args.configs) == ("qwen", "q.gguf", ["dense", "fast=" + UNIFORM, "c.json"])
    assert (args.lengths, args.tasks, args.samples, args.seed) == ([8192, 16384], ["single_needle", "perplexity"], 3, 7)
    assert (args.device, args.dense_threshold, args.out, args.plot) == ("cuda", 0, "r.json", "r.png")
    assert args.no_coverage and args.no_profile and args.allow_mismatch and args.no_progress
    default = build_parser().parse_args(["eval"])
    assert default.configs is None and default.dense_threshold is None and default.model == "smollm2"
    assert (args.dense_tail, default.dense_tail) == (64, 0)


def test_configs_are_patched_with_the_dense_tail(monkeypatch):
    """``run_eval(dense_tail=T)`` reaches :func:`minference.patch` for every sparse config."""
    import minference.integration as integ

    seen = []
    monkeypatch.setattr(integ, "is_patched", lambda model: False)
    monkeypatch.setattr(integ, "patch", lambda model, config, **kw: seen.append(kw))
    E._apply(object(), object(), None, "auto", False, 128)
    E._apply(object(), None, None, "auto", False, 128)  # dense: not patched
    assert [kw["dense_tail"] for kw in seen] == [128]


def test_cli_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--model", "llama"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "needle"], "unknown task 'needle'"),
    (["--samples", "0"], "samples must be an int >= 1"),
    (["--lengths", "1"], "length must be an int >= 2"),
    (["--config", "nosuch.json"], "unknown config 'nosuch.json'"),
    (["--config", '{"kind": "vertical_slash", "vertical": 10'], "not valid JSON"),
    (["--config", '{"kind": "diagonal"}'], "not a pattern"),
    (["--config", "dense", "dense"], "config names repeat"),
])
def test_cli_errors_before_loading_anything(argv, message, capsys, monkeypatch):
    import minference.app.models as M

    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for a bad command line"))
    if message == "config names repeat":  # needs the model (and the tokenizer): a stand-in model
        stand_in = torch.nn.Linear(1, 1)
        stand_in.config = types.SimpleNamespace(max_position_embeddings=8192)
        monkeypatch.setattr(M, "load_model", lambda *a, **kw: (stand_in, M.load_smollm2_tokenizer()))
    assert main(["eval", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("configs, noted", [
    (["nosuch.json"], True),
    (["a=nosuch.json", "b=nosuch.json"], True),
    (["dense", "nosuch.json"], False),
    (["base=dense", "nosuch.json"], False),
])
def test_cli_notes_a_run_without_dense(configs, noted, capsys, monkeypatch):
    """A --config list without dense gets a one-line note on stderr before anything runs (its report
    has no baseline); the bad spec then stops the run before any model loads."""
    import minference.app.models as M

    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for a bad command line"))
    assert main(["eval", "--no-progress", "--config", *configs]) == 2
    err = capsys.readouterr().err
    assert ("no 'dense' among --config" in err) is noted
    assert err.index("unknown config") > (err.find("note:") if noted else -1)


def test_model_dependent_errors(small):
    kw = dict(samples=1, progress=False, loaded=small, coverage=False)
    with pytest.raises(E.EvalError, match="does not fit task 'multi_value'.*n_tokens >="):
        E.run_eval("smollm2", configs=["dense"], lengths=[60], tasks=["multi_value"], **kw)
    with pytest.raises(E.EvalError, match="perplexity task"):
        E.run_eval("smollm2", configs=["dense"], lengths=[8], tasks=["perplexity"], **kw)
    with pytest.raises(E.EvalError, match="exceeds smollm2's 8192-token context.*--force-length"):
        E.run_eval("smollm2", configs=["dense"], lengths=[8180], tasks=["single_needle"], **kw)
    # the bundled config has 30 layers, this model 2: one line naming the file (tests/unit/app/test_eval_checks.py)
    with pytest.raises(E.EvalError, match=f"^{DEFAULT_CONFIG} was made for another model: num_layers: config has 30"):
        E.run_eval("smollm2", configs=[str(DEFAULT_CONFIG)], lengths=[256], tasks=["perplexity"], **kw)
    with pytest.raises(E.EvalError, match="unknown model"):
        E.run_eval("llama", configs=["dense"], lengths=[256], tasks=["perplexity"], **kw)


def test_config_specs(small):
    model, _ = small
    named = E.resolve_config("fast=" + UNIFORM, model)
    assert (named.name, named.kind, named.pattern["top_k"]) == ("fast", "uniform", 4)
    cfg = named.pattern_config()
    assert len(cfg.layers) == LAYERS and all(p == BlockSparse(top_k=4, block=64) for row in cfg.layers for p in row)
    assert cfg.provenance.source == "manual" and "uniform" in cfg.provenance.notes
    vs = E.resolve_config('{"kind": "vertical_slash", "vertical": 1000, "slash": 6096}', model)
    assert vs.name == "VS(1000,6096)" and vs.counts() == {"vertical_slash": LAYERS * 9}
    assert E.resolve_config("base=dense", model).name == "base" and E.resolve_config("dense", model).dense


# ---------------------------------------------------------------------------------------------
# Profiler ranges and the split.


def _qkv(n=256, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g),
            torch.randn(1, hkv, n, d, generator=g))


def _names(prof) -> list[str]:
    return [e.name for e in prof.events()]


def test_profiler_ranges_in_a_cpu_trace_of_sparse_prefill():
    from torch.profiler import ProfilerActivity, profile

    assert (dispatch.INDEX_RANGE, dispatch.ATTENTION_RANGE) == ("minference::index", "minference::attention")
    q, k, v = _qkv()
    plan = [VerticalSlash(vertical=16, slash=32, last_q=16), BlockSparse(top_k=2, block=32),
            AShape(sink=4, window=32), Dense()]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = dispatch.sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch")
    assert _names(prof).count(dispatch.INDEX_RANGE) == 2  # one per group with an online index
    ranges = [e for e in prof.events() if e.name == dispatch.INDEX_RANGE]
    assert all(e.cpu_time_total > 0 and e.cpu_children for e in ranges)  # the builders ran inside
    torch.testing.assert_close(out, dispatch.sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dispatch.sparse_prefill(q, k, v, [AShape(sink=4, window=32)] * 4, dense_threshold=0, backend="torch")
    assert dispatch.INDEX_RANGE not in _names(prof)
    assert not isinstance(dispatch.profile_range("x"), torch.profiler.record_function)  # off: a no-op


def test_profiler_ranges_in_a_patched_model_and_the_split(small):
    """Every attention call of a patched model runs inside one attention range (index ranges
    nested in it); the split adds up, on CPU time here (the CUDA split reads device time)."""
    from torch.profiler import ProfilerActivity, profile

    import minference.integration as integ

    model, tokenizer = small
    ids = evals.perplexity_ids(tokenizer, 96, 0)[None]
    cfg = E.resolve_config(UNIFORM.replace('"block": 64', '"block": 16'), model).pattern_config()
    integ.patch(model, cfg, dense_threshold=0, backend="torch")
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
            model(ids, use_cache=False)
    finally:
        integ.unpatch(model)
    events = prof.events()
    attention = [e for e in events if e.name == dispatch.ATTENTION_RANGE]
    index = [e for e in events if e.name == dispatch.INDEX_RANGE]
    assert len(attention) == len(index) == LAYERS
    assert all(e.cpu_parent.name == dispatch.ATTENTION_RANGE for e in index)
    split = E.split_events(events, device=False)
    assert 0 < split.index_ms and 0 < split.attention_ms and 0 < split.other_ms
    assert split.attention_ms + split.index_ms + split.other_ms == pytest.approx(split.total_ms)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(ids, use_cache=False)  # dense baseline: its attention is the SDPA ops
    dense = E.split_events(prof.events(), device=False)
    assert dense.index_ms == 0 and 0 < dense.attention_ms < dense.total_ms
    assert dispatch.ATTENTION_RANGE not in _names(prof)


@pytest.mark.interpret
def test_physical_density_from_the_triton_index():
    """Tiles cover every logical pair, so physical density is at least the logical one; dense heads
    count 1, A-shape heads have no index (None), block-sparse is the chosen blocks' area."""
    from minference.app.search import plan_coverage
    from minference.backend import get_backend
    from minference.index import build_group_index, prepare_plan

    q, k, _ = _qkv(n=256, d=32, seed=3)
    plan = [VerticalSlash(vertical=16, slash=32, last_q=16), BlockSparse(top_k=2, block=32),
            AShape(sink=4, window=32), Dense()]
    phys = E._physical_density(plan, q, k, None, dispatch.FILL_GAPS)
    _, logical = plan_coverage(q[0], k[0], plan)
    assert phys[2] is None and phys[3] == 1.0
    assert logical[0] <= phys[0] <= 1.0
    (bs,) = [dg for dg in prepare_plan(plan, 4, 0, q.device) if dg.group.kind == "block_sparse"]
    blocks = build_group_index(get_backend("triton"), bs, q, k, scale=None, seqlens=None, seqstarts=None, head_offset=0)
    chosen = {(qb, int(b)) for qb in range(blocks.shape[2]) for b in blocks[0, 0, qb] if 0 <= b <= qb}
    assert phys[1] == pytest.approx(len(chosen) * 32 * 32 / (256 * 257 / 2))
    assert logical[1] <= phys[1]


@pytest.mark.gpu
def test_gpu_split_and_physical_density_on_a_random_model():
    """CUDA: the split reads kernel time under the ranges (Triton kernels included), adds up to
    the profiled total, and the dense baseline's attention is its SDPA kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import minference.integration as integ

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=32768)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (16384,), device="cuda")
    dense = E._profiled_split(model, ids)
    assert dense.index_ms == 0 and 0 < dense.attention_ms < dense.total_ms
    config = E.resolve_config('{"kind": "vertical_slash", "vertical": 256, "slash": 1024}', model).pattern_config()
    integ.patch(model, config, dense_threshold=0)
    try:
        E._prefill(model, ids)  # compile
        sparse = E._profiled_split(model, ids)
        stats = E.RunStats("vs", ids.numel())
        E._measure_coverage(model, config, ids, stats, physical=True)
    finally:
        integ.unpatch(model)
    print(dense, sparse, sep="\n")
    assert 0 < sparse.index_ms and 0 < sparse.attention_ms and 0 < sparse.other_ms
    assert sparse.attention_ms + sparse.index_ms + sparse.other_ms == pytest.approx(sparse.total_ms)
    assert sparse.unlinked_ms <= 0.02 * sparse.total_ms and dense.unlinked_ms <= 0.02 * dense.total_ms
    assert sparse.other_ms == pytest.approx(dense.other_ms, rel=0.25)  # the same non-attention kernels
    assert all(0 < d <= p <= 1 for d, p in zip(stats.layer_density, stats.layer_physical))
    for split in (dense, sparse):  # the named kernels are the costliest of each part, in order
        for part, ms in (("attention", split.attention_ms), ("index", split.index_ms), ("other", split.other_ms)):
            named = list(split.top[part].values())
            assert named == sorted(named, reverse=True) and sum(named) <= ms + 1e-3
            assert len(named) <= E.TOP_KERNELS and (named or ms == 0)


@pytest.mark.gpu
def test_gpu_run_eval_end_to_end_on_a_random_model(byte_tokenizer):
    """The whole run on CUDA (Triton backend): warm-up, profiled split, physical density, timed
    prefills, greedy decode and perplexity, for dense and two uniform configs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=32768)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    specs = ["dense", '{"kind": "vertical_slash", "vertical": 128, "slash": 512}', "bs=" + UNIFORM]
    report = E.run_eval("smollm2", configs=specs, lengths=[8192], tasks=["single_needle", "perplexity"], samples=1,
                        device="cuda", dense_threshold=0, progress=False, loaded=(model, byte_tokenizer))
    print(E.format_report(report))
    assert report.machine["gpu"] and report.settings["profile"]
    dense, vs, bs = (report.run(c.name, 8192) for c in report.configs)
    assert dense.split.index_ms == 0 and dense.split.attention_ms > 0 and dense.physical_density == 1.0
    for s in (vs, bs):
        assert s.calls == {"sparse": 2} and s.split.index_ms > 0 and s.split.attention_ms > 0
        assert 0 < s.density <= s.physical_density <= 1 and 0 < s.coverage <= 1
        assert s.ttft_median_s > 0 and len(s.ttft_s) == 1
    assert len(report.records) == 6 and all(math.isfinite(r.nll) for r in report.records if r.nll is not None)


def test_batched_generation_decodes_each_row_as_alone():
    """``_generate`` on a batch of equal-length prompts gives each row what it gives alone: its
    own token limit, its own stop at EOS (not returned), greedy."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (3, 20))
    free = E._generate(model, ids, [12, 12, 12], set())
    eos = {free[1][3]}  # row 1 stops at its 4th token
    limits = [6, 12, 2]
    batch = E._generate(model, ids, limits, eos)
    for b in range(3):
        assert batch[b] == E._generate(model, ids[b : b + 1], [limits[b]], eos)[0]
        want = free[b][: limits[b]]
        cut = next((i for i, t in enumerate(want) if t in eos), None)
        assert batch[b] == (want if cut is None else want[:cut])
    assert len(batch[1]) == 3 and len(batch[2]) == 2


def test_decoding_stops_once_the_score_is_settled(small):
    """A row stops as soon as its answers are whole words followed by a non-word character; the
    stop never changes the score (a longer decode would score the same)."""
    model, tokenizer = small
    sample = evals.make_sample("single_needle", tokenizer, 300, 0, samples=1)
    (answer,) = sample.answers
    good = tokenizer(f" {answer}.", add_special_tokens=False)["input_ids"]
    assert E._settled(sample, good, tokenizer)
    assert not E._settled(sample, good[:-1], tokenizer)  # " 1234567": a digit may still follow
    assert not E._settled(sample, tokenizer(" 0.", add_special_tokens=False)["input_ids"], tokenizer)


def test_merge_reports_of_one_session(tiny_run, tmp_path):
    """Runs split over several device calls merge into one report (configs and lengths in
    first-seen order, records and runs concatenated); a repeated (config, length), a config
    name with two specs or other settings are refused; the CLI merges without loading a model."""
    report, _ = tiny_run
    a = E.EvalReport.from_dict(report.to_dict())
    b = E.EvalReport.from_dict(report.to_dict())
    for r in b.runs:
        r.n_tokens *= 2
    for r in b.records:
        r.n_tokens *= 2
    b.lengths = [N * 2]
    merged = E.merge_reports([a, b])
    assert merged.lengths == [N, 2 * N] and [c.name for c in merged.configs] == [c.name for c in a.configs]
    assert len(merged.records) == 2 * len(a.records) and len(merged.runs) == 2 * len(a.runs)
    assert merged.accuracy() == a.accuracy() + [dict(x, n_tokens=2 * N) for x in a.accuracy()]
    with pytest.raises(E.EvalError, match="in two reports"):
        E.merge_reports([a, a])
    c = E.EvalReport.from_dict(b.to_dict())
    c.settings = dict(c.settings, dense_tail=64)
    with pytest.raises(E.EvalError, match="settings"):
        E.merge_reports([a, c])
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    args = build_parser().parse_args(["eval", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--out", str(tmp_path / "m.json")])
    assert E._eval_cmd(args, out=io.StringIO()) == 0
    assert E.EvalReport.load(tmp_path / "m.json").lengths == [N, 2 * N]


# ---------------------------------------------------------------------------------------------
# The worst case: median and maximum TTFT, each against dense on the same prompts.


def _timed_report(times: dict[str, dict[tuple[str, int], float]]) -> E.EvalReport:
    configs = [E.EvalConfig("dense", "dense", "dense"), E.EvalConfig("fast", UNIFORM, "uniform")]
    report = E.EvalReport(model={"name": "m", "dtype": "bfloat16"}, machine={"gpu": "g"},
                          settings={"device": "cuda", "samples": 3, "seed": 0, "dense_threshold": None,
                                    "backend": "auto"},
                          configs=configs, lengths=[N], tasks=["a", "b"])
    for config, cells in times.items():
        stats = E.RunStats(config, N, ttft_s=list(cells.values()))
        stats.ttft_median_s = statistics.median(stats.ttft_s)
        report.runs.append(stats)
        for (task, index), t in cells.items():
            report.records.append(E.SampleRecord(config, task, N, index, 0, None, ["x"], True, "x", t))
    return report


def test_worst_case_ttft_against_dense():
    """Per (config, task, length) and pooled: the median and the maximum TTFT, dense's on the same
    prompts, both ratios, and the worst single prompt against dense; the table shows the pooled
    ones. The fast config's median is 2x dense's while one prompt takes 2x dense's time."""
    dense = {("a", 0): 1.0, ("a", 1): 2.0, ("a", 2): 3.0, ("b", 0): 1.0}
    fast = {("a", 0): 0.5, ("a", 1): 4.0, ("a", 2): 1.0, ("b", 0): 0.5}
    report = _timed_report({"dense": dense, "fast": fast})
    rows = {(r["config"], r["task"]): r for r in report.ttft_summary()}
    a = rows[("fast", "a")]
    assert (a["prompts"], a["ttft_median_ms"], a["ttft_max_ms"]) == (3, 1000.0, 4000.0)
    assert (a["dense_median_ms"], a["dense_max_ms"]) == (2000.0, 3000.0)
    assert a["speedup_median"] == 2.0 and a["speedup_max"] == 0.75
    assert (a["worst_ratio"], a["worst_task"], a["worst_index"]) == (2.0, "a", 1)
    pooled = rows[("fast", "all")]
    assert (pooled["prompts"], pooled["ttft_median_ms"], pooled["ttft_max_ms"]) == (4, 0.75 * 1000, 4000.0)
    assert pooled["dense_median_ms"] == 1500.0 and pooled["speedup_max"] == 0.75 and pooled["worst_ratio"] == 2.0
    assert rows[("dense", "all")]["worst_ratio"] == 1.0 and rows[("fast", "b")]["speedup_median"] == 2.0
    assert report.to_dict()["summary"]["ttft"] == report.ttft_summary()
    table = E.format_report(report)
    assert "| TTFT ms | vs dense | TTFT max ms | max vs dense | worst / dense |" in table
    fast_row = next(line for line in table.splitlines() if line.startswith(f"| {N} | fast |"))
    assert "| 750.0 | 2.00x | 4000.0 | 0.75x | 2.00 |" in fast_row


def test_worst_case_without_dense_is_left_empty():
    report = _timed_report({"fast": {("a", 0): 0.5, ("a", 1): 4.0}})
    row = next(r for r in report.ttft_summary() if r["task"] == "all")
    assert row["ttft_max_ms"] == 4000.0 and row["dense_max_ms"] is None and row["worst_ratio"] is None


def test_plot_draws_the_worst_case_whisker(tmp_path):
    dense = {("a", 0): 1.0, ("a", 1): 2.0}
    report = _timed_report({"dense": dense, "fast": {("a", 0): 0.5, ("a", 1): 4.0}})
    fig = E.plot_eval(report, tmp_path / "p.png")
    ax = fig.axes[0]
    whiskers = [line.get_xdata() for line in ax.lines if len(line.get_xdata()) == 2]
    assert sorted(tuple(x) for x in whiskers) == [(1500.0, 2000.0), (2250.0, 4000.0)]


def test_a_ruler_cell_with_fewer_samples_than_the_header_says_shows_its_count():
    """A RULER call cut by its time bound leaves a task with fewer samples than the run's setting;
    the table's header says "samples 3", so that cell names its own count and the full ones do not."""
    report = _timed_report({"dense": {("a", 0): 1.0, ("a", 1): 1.0, ("a", 2): 1.0, ("b", 0): 1.0, ("b", 1): 1.0}})
    report.settings.update(suite="ruler", ruler={"seed": 42})
    for r in report.records:
        r.found = 1.0 if r.index == 0 else 0.0
    row = next(line for line in E.format_report(report).splitlines() if line.startswith(f"| {N} | dense |"))
    assert row.split(" | ")[2:5] == ["33.3", "50.0 (n=2)", "-"]  # no average over an incomplete row
    report.records.append(E.SampleRecord("dense", "b", N, 2, 0, None, ["1"], False, "", 1.0, found=0.0))
    row = next(line for line in E.format_report(report).splitlines() if line.startswith(f"| {N} | dense |"))
    assert row.split(" | ")[2:5] == ["33.3", "33.3", "33.3"]


def test_merge_joins_one_length_split_over_calls_by_task():
    """A RULER length too long for one device call runs as two calls with disjoint --tasks: the
    merged (config, length) holds every TTFT (median taken again) and the worst-case summary sees
    every prompt; the same task in both is refused."""
    one = _timed_report({"dense": {("a", 0): 1.0, ("a", 1): 2.0}, "fast": {("a", 0): 0.5, ("a", 1): 4.0}})
    two = _timed_report({"dense": {("b", 0): 3.0}, "fast": {("b", 0): 1.0}})
    merged = E.merge_reports([one, two])
    run = merged.run("fast", N)
    assert run.ttft_s == [0.5, 4.0, 1.0] and run.ttft_median_s == 1.0 and one.run("fast", N).ttft_s == [0.5, 4.0]
    pooled = next(r for r in merged.ttft_summary() if (r["config"], r["task"]) == ("fast", "all"))
    assert pooled["prompts"] == 3 and pooled["dense_max_ms"] == 3000.0 and pooled["worst_ratio"] == 2.0
    with pytest.raises(E.EvalError, match="task a samples 0, 1 in both"):
        E.merge_reports([one, one])
    # one task split by sample (a cut call continued): disjoint samples merge, a shared one does not
    rest = _timed_report({"dense": {("a", 2): 5.0}, "fast": {("a", 2): 6.0}})
    assert [r.index for r in E.merge_reports([one, rest]).records if r.config == "fast"] == [0, 1, 2]
    with pytest.raises(E.EvalError, match=r"task a sample 2 in both"):
        E.merge_reports([rest, one, rest])


def test_common_scores_compare_configs_on_the_prompts_they_share():
    """A config cut short (only the hard task run) is scored on the prompts every config ran."""
    def rec(config, task, index, correct, found=None):
        return E.SampleRecord(config, task, N, index, 0, None, ["1"], correct, "", 0.1, found=found)

    records = [rec("dense", "easy", i, True, 1.0) for i in range(2)]
    records += [rec("dense", "hard", 0, True, 1.0), rec("dense", "hard", 1, False, 0.5)]
    records += [rec("cut", "hard", 0, False, 0.25), rec("cut", "hard", 1, False, 0.5)]
    records += [E.SampleRecord("dense", "perplexity", N, 0, 0, None, [], None, None, None, nll=2.0)]
    configs = [E.EvalConfig("dense", "dense", "dense"), E.EvalConfig("cut", UNIFORM, "uniform")]
    rep = E.EvalReport(model={"name": "m", "dtype": "bfloat16"}, machine={}, settings={"suite": "procedural"},
                       configs=configs, lengths=[N], tasks=["easy", "hard", "perplexity"], records=records)
    assert rep.common_scores(N) == ({"dense": 0.5, "cut": 0.0}, 2)  # not dense's 3/4 over its own four
    rep.settings["suite"] = "ruler"  # RULER: the per-sample metric
    assert rep.common_scores(N) == ({"dense": 0.75, "cut": 0.375}, 2)
    assert rep.common_scores(N + 1) == ({}, 0)
    rep.records = [r for r in records if not (r.config == "cut")] + [rec("cut", "other", 0, True, 1.0)]
    assert rep.common_scores(N) == ({}, 0)


def test_decode_step_benchmark_times_steps_as_loaded_and_patched():
    """benchmarks/decode_step.py: wall time per decode step over a cache, on a tiny Llama (CPU:
    no device time), unpatched and patched with a uniform config (the dense-decode path)."""
    import importlib.util
    from pathlib import Path

    import transformers as T

    import minference.integration as integ
    from minference.patterns import AShape

    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("decode_step", root / "benchmarks" / "decode_step.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (40,))
    r = ds.measure(model, ids, 3, chunk=16)
    assert r["tokens"] == 40 and len(r["wall_ms"]) == 3 and r["wall_ms_median"] > 0
    assert r["device_ms_per_step"] is None and r["top_kernels_ms"] == {}
    integ.patch(model, E.uniform_config(model, AShape(sink=4, window=8)), dense_threshold=0)
    try:
        r = ds.measure(model, ids, 2)
        assert len(r["wall_ms"]) == 2
        assert integ.call_counts(model)["dense_decode"] > 0
    finally:
        integ.unpatch(model)
    with pytest.raises(ValueError, match="steps must be"):
        ds.measure(model, ids, 0)
    assert ds.main(["--model", "smollm2", "--device", "cpu", "--tokens", "1"]) == 2

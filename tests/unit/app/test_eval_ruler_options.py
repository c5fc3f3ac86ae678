"""``minference eval --suite ruler`` with the options the procedural suite honours too: the quality
guard (one per sparse (config, length), summary printed), the warm-up on the first timed prompt,
``--cuda-graphs`` refused, and ``--continue`` checked before the model loads."""

from __future__ import annotations

import io
import json

import pytest

import minference.integration as integ
from minference.app import evaluate as E
from minference.app import guard_options, ruler
from minference.app.cli import build_parser, main
from minference.guard import QualityGuard

from .test_ruler import UNIFORM, _texts, _write_set


@pytest.fixture(scope="module")
def ruler_set(small, tmp_path_factory):
    return _write_set(tmp_path_factory.mktemp("set"), small[1], _texts(2))


def _run(small, folder, **kw):
    return E.run_eval("smollm2", suite="ruler", prompts=folder, configs=kw.pop("configs", ["dense", UNIFORM]),
                      dense_threshold=kw.pop("dense_threshold", 0), progress=False, loaded=small, coverage=False, **kw)


def test_ruler_runs_one_quality_guard_per_sparse_config_and_length(small, ruler_set, monkeypatch, tmp_path):
    """--guard reaches every sparse patch of the RULER loop (not the config's own runtime.guard):
    one guard per (config, length) for all its prompts, named by prompt, its summary in the run
    and printed under the table as for the procedural suite; dense runs unpatched, no guard."""
    passed = []
    real = integ.patch
    monkeypatch.setattr(integ, "patch", lambda *a, **kw: passed.append(kw.get("guard")) or real(*a, **kw))
    report = _run(small, ruler_set, guard=guard_options.GuardOptions({"mode": "observe", "sample_rate": 1.0}))
    assert len(passed) == 4 and all(isinstance(g, QualityGuard) for g in passed) and len(set(map(id, passed))) == 1
    dense, sparse = report.runs
    assert dense.guard is None and sparse.guard["name"] == f"{sparse.config}@512"
    assert sparse.guard["mode"] == "observe" and sparse.guard["checked_calls"] == sparse.guard["calls"] > 0
    args = build_parser().parse_args(["eval", "--suite", "ruler", "--prompts", str(ruler_set)])
    out = io.StringIO()
    assert E._write_outputs(report, args, out) == 0
    assert f"quality guard [{sparse.config} @ 512]: mode observe" in out.getvalue()


def test_ruler_warms_up_on_the_first_prompt_it_times(small, ruler_set, monkeypatch):
    """The once-per-length prefills of a (config, length) run the first prompt timed there (the
    first task's first sample, not the last task's), also in a continued run (the first prompt it
    has left)."""
    warmed, timed = [], []
    real_once, real_answer = E._once_per_length, E._answer
    monkeypatch.setattr(E, "_once_per_length", lambda model, cfg, config, prompt, *a, **kw: (
        warmed.append(prompt.tolist()), real_once(model, cfg, config, prompt, *a, **kw))[1])
    monkeypatch.setattr(E, "_answer", lambda model, ids, *a, **kw: (
        timed.append(ids.tolist()), real_answer(model, ids, *a, **kw))[1])
    niah = [s.ids.tolist() for s in ruler.load_prompt_set(ruler_set).samples("niah_single_1", 512)]
    report = _run(small, ruler_set)
    assert timed[0] == niah[0] and warmed == [niah[0], niah[0]]  # dense, then the sparse config
    cut = E.EvalReport.from_dict(json.loads(report.to_json()))
    cut.records = [r for r in cut.records if (r.task, r.index) == ("niah_single_1", 0)]
    warmed.clear()
    timed.clear()
    _run(small, ruler_set, done=cut)
    assert timed[0] == niah[1] and warmed == [niah[1], niah[1]]


def test_ruler_refuses_cuda_graphs_before_loading_anything(ruler_set, monkeypatch, capsys):
    """RULER's prompts vary in length (more shapes than the graph cache keeps): graphs would be
    captured inside timed prefills, so the combination is refused in one line, before any load."""
    import minference.app.models as M

    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for a refused command"))
    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: pytest.fail("loaded a tokenizer for a refused command"))
    assert main(["eval", "--no-progress", "--suite", "ruler", "--prompts", str(ruler_set), "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    assert err == ("minference eval: error: --cuda-graphs is for --suite procedural: RULER's prompts vary in length, "
                   "more shapes than the graph cache's 4, so captures would fall inside timed prefills\n")


def test_continue_with_other_settings_fails_before_loading_and_names_them(small, ruler_set, monkeypatch, capsys,
                                                                          tmp_path):
    import minference.app.models as M

    done = _run(small, ruler_set, tasks=["niah_single_1"])
    done.save(tmp_path / "done.json")
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model before comparing settings"))
    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: pytest.fail("loaded a tokenizer first"))
    with pytest.raises(E.EvalError, match=r"^--continue: that report ran other settings \(dense_threshold: 0 vs "
                                          r"4096\); continue it with its options$"):
        E.run_eval("smollm2", suite="ruler", prompts=ruler_set, configs=["dense", UNIFORM], dense_threshold=4096,
                   coverage=False, progress=False, done=done)
    assert main(["eval", "--no-progress", "--suite", "ruler", "--prompts", str(ruler_set), "--config", "dense",
                 UNIFORM, "--no-coverage", "--continue", str(tmp_path / "done.json")]) == 2
    assert "that report ran other settings (dense_threshold: 0 vs None)" in capsys.readouterr().err
    # the untimed extras do not keep a continuation apart (as in a merge); coverage rows of another kind do
    settings = dict(done.settings, coverage=True, profile=True)
    E._check_continued(done, "smollm2", settings, [])
    with pytest.raises(E.EvalError, match=r"other settings \(coverage_rows: 512 vs 256\)"):
        E._check_continued(E.EvalReport.from_dict(dict(done.to_dict(), settings=dict(done.settings, coverage=True))),
                           "smollm2", dict(settings, coverage_rows=256), [])
    with pytest.raises(E.EvalError, match="that report ran the model 'smollm2', this run 'qwen0.5b'"):
        E.run_eval("qwen", suite="ruler", prompts=ruler_set, configs=["dense", UNIFORM], dense_threshold=0,
                   coverage=False, progress=False, done=done)


def test_continue_compares_each_configs_spec_before_loading(small, ruler_set, monkeypatch):
    """A config of the continued report given again with its JSON keys in another order (or a
    field at its default spelled out) is the same config; the same name with another pattern is
    refused in one line before the model loads (it once failed after a minute's load on the GPU)."""
    import minference.app.models as M

    done = _run(small, ruler_set, tasks=["niah_single_1"], configs=["dense", f"u={UNIFORM}"])
    same = "u=" + json.dumps({"block": 64, "top_k": 2, "kind": "block_sparse", "score_rows": 0})
    E._check_continued(done, "smollm2", done.settings, ["dense", same])
    other = 'u={"kind": "block_sparse", "top_k": 3, "block": 64}'
    later = E.EvalReport.from_dict(done.to_dict())  # the same configs at another length, as a merge sees them
    for r in [*later.runs, *later.records]:
        r.n_tokens *= 2
    later.lengths = [2 * n for n in later.lengths]
    later.configs[1].spec = same
    assert E.merge_reports([done, later]).configs[1].spec == f"u={UNIFORM}"
    later.configs[1].spec = other
    with pytest.raises(E.EvalError, match="config 'u' has two specs"):
        E.merge_reports([done, later])
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model before comparing configs"))
    with pytest.raises(E.EvalError, match=r"^--continue: config 'u' ran as 'u=\{\"kind\": \"block_sparse\", "
                                          r"\"top_k\": 2, \"block\": 64\}' in that report, this run gives "):
        E.run_eval("smollm2", suite="ruler", prompts=ruler_set, configs=["dense", other], dense_threshold=0,
                   coverage=False, progress=False, done=done)
    assert E._same_spec(f"u={UNIFORM}", same) and not E._same_spec(f"u={UNIFORM}", other)
    assert E._same_spec("dense", "dense=dense") and E._same_spec("a.json", "a=a.json")
    assert not E._same_spec("a.json", "./a.json") and not E._same_spec(UNIFORM, "dense")


def test_continue_refuses_a_sparse_config_whose_dense_prompts_are_done(small, ruler_set, monkeypatch):
    """A config new to the continued report would be timed on prompts whose dense TTFT is in that
    report (another run): refused before any prompt runs, naming the config and prompt."""
    done = _run(small, ruler_set)
    monkeypatch.setattr(E, "_answer", lambda *a, **kw: pytest.fail("ran a prompt"))
    other = '{"kind": "block_sparse", "top_k": 3, "block": 64}'
    with pytest.raises(E.EvalError, match=r"^--continue: BS\(top3,b64\) has niah_single_1 sample 0 at 512 tokens "
                                          r"left, which dense does not run in this call"):
        _run(small, ruler_set, configs=["dense", UNIFORM, other], done=done)


def _compile(counter_hooks, name: str) -> None:
    """What Triton does around one compile: its two JIT hooks, with the kernel as ``fn``."""
    from types import SimpleNamespace

    before, after = counter_hooks()
    before(fn=SimpleNamespace(name=name))
    after(fn=SimpleNamespace(name=name))


def test_ruler_records_the_kernels_compiled_inside_each_timed_prompt(small, ruler_set, monkeypatch):
    """A compile inside a timed prompt (a TTFT that holds a Triton compile, as on the H100 at 64K)
    is recorded on that prompt's record and listed under the table; the warm-ups' compiles are not
    any prompt's. The CPU's interpreter compiles nothing, so the hooks are fired by hand here."""
    from triton import knobs

    from minference.compiles import CompileCounter

    hooks = lambda: (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)  # noqa: E731
    monkeypatch.setattr(E, "_compile_counter", lambda dev: CompileCounter())
    real_once, real_answer = E._once_per_length, E._answer
    answered = []

    def once(*a, **kw):
        _compile(hooks, "_warm_kernel")
        return real_once(*a, **kw)

    def answer(model, ids, *a, **kw):
        answered.append(1)
        if len(answered) == 4:  # the sparse config's second prompt
            _compile(hooks, "_block_select_kernel")
        return real_answer(model, ids, *a, **kw)

    monkeypatch.setattr(E, "_once_per_length", once)
    monkeypatch.setattr(E, "_answer", answer)
    saved = hooks()
    report = _run(small, ruler_set)
    assert hooks() == saved  # the run put the hooks back
    held = [r for r in report.records if r.compiles]
    assert len(held) == 1 and held[0].config != "dense" and held[0].index == 1, [(r.config, r.index) for r in held]
    ((name, seconds),) = held[0].compiles
    assert name == "_block_select_kernel" and seconds >= 0
    again = E.EvalReport.from_dict(json.loads(report.to_json()))
    assert [r.compiles for r in again.records] == [r.compiles for r in report.records]
    text = E.format_report(report)
    assert "Kernels compiled inside timed prompts" in text and "`_block_select_kernel`" in text
    assert "_warm_kernel" not in text


#: A config lossy enough that the whole SmolLM2 answers otherwise than dense on these prompts.
LOSSY = '{"kind": "block_sparse", "top_k": 1, "block": 16, "sink_blocks": 0}'


def test_batch_decode_prefills_each_config_alone_then_decodes_them_as_one_batch(smollm2, tmp_path, monkeypatch):
    """--batch-decode: every prompt's configs prefill one by one (a TTFT each), then one decode of
    a batch of both; each row's answer and stop are those of its own decode (the rows differ:
    dense settles on the needle where the lossy config runs to the maximum), the decode time is
    the batch's, and the settings and the table say so. The whole model: the truncated one
    answers the same garbage under every config, which could not tell rows apart."""
    folder = _write_set(tmp_path / "set", smollm2[1], _texts(2))
    alone = _run(smollm2, folder, configs=["dense", LOSSY])
    widths = []
    real = E._decode
    monkeypatch.setattr(E, "_decode", lambda model, cache, nxt, *a, **kw: (
        widths.append(nxt.shape[0]), real(model, cache, nxt, *a, **kw))[1])
    batched = _run(smollm2, folder, configs=["dense", LOSSY], batch_decode=True)
    assert widths == [2] * 4  # 2 tasks x 2 samples, each one decode of both configs
    assert batched.settings["batch_decode"] is True and "batch_decode" not in alone.settings
    assert "decoded as one batch" in E.format_report(batched) and "decoded as one batch" not in E.format_report(alone)

    def key(r):
        return (r.config, r.task, r.index)

    assert [key(r) for r in batched.records] == [key(r) for r in alone.records]
    for x, y in zip(batched.records, alone.records):
        assert (x.text, x.new_tokens, x.stop, x.found) == (y.text, y.new_tokens, y.stop, y.found)
    pairs = list(zip(batched.records[0::2], batched.records[1::2]))  # (dense, lossy) of each prompt
    assert any(d.text != s.text for d, s in pairs)  # a swapped or copied row would fail above
    assert any(d.stop != s.stop for d, s in pairs)  # rows stop on their own
    assert all(d.decode_s == s.decode_s for d, s in pairs)
    with pytest.raises(E.EvalError, match="batch_decode: absent vs True"):
        E.merge_reports([alone, batched])


def test_batch_decode_refuses_a_cache_it_cannot_join_before_any_prompt(small, ruler_set, monkeypatch):
    """A model with sliding-window layers (their cache layers keep a window, not only keys and
    values) is refused in one line right after loading, before any prompt runs."""
    import copy

    model = copy.deepcopy(small[0])
    model.config.sliding_window = 4
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    monkeypatch.setattr(E, "_prefill", lambda *a, **kw: pytest.fail("a prompt ran"))
    with pytest.raises(E.EvalError, match=r"^--batch-decode: this model's KV cache has DynamicSlidingWindowLayer "
                                          r"layers, which a batched decode cannot join"):
        _run((model, small[1]), ruler_set, batch_decode=True)


def test_batch_decode_is_refused_for_the_procedural_suite(small):
    with pytest.raises(E.EvalError, match=r"^--batch-decode is for --suite ruler"):
        E.run_eval("smollm2", configs=["dense"], loaded=small, progress=False, batch_decode=True)

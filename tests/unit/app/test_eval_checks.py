"""``minference eval``'s checks before the model loads (minference.app.evaluate.run_eval): a config
file that does not read or validate is refused naming the file, a config of another model in one
line right after loading (before any prompt), sparse configs that will run dense under the dense
threshold are named in a note and their ratios shown as ``dense``, and ``--cuda-graphs`` off CUDA
is refused."""

from __future__ import annotations

import json
import types

import pytest
import torch

from minference.app import evaluate as E
from minference.app.cli import main
from minference.app.main_job import DEFAULT_CONFIG

from .test_evaluate import UNIFORM, N, _timed_report


def _no_loading(monkeypatch) -> None:
    """Loading the model or its tokenizer fails the test: the check must come first."""
    import minference.app.models as M

    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for a refused command"))
    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: pytest.fail("loaded a tokenizer for a refused command"))


def _random_llama(layers: int = 2, heads: int = 4, vocab: int = 256):
    """A random Llama (CPU, fp32) the byte tokenizer's prompts fit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=64, num_attention_heads=heads,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=8192)
    return LlamaForCausalLM(cfg).eval()


# ---------------------------------------------------------------------------------------------
# Config files.


@pytest.mark.parametrize("content, message", [
    ("{bad", "config is not valid JSON: Expecting property name"),
    ("{}", "missing required field 'format'"),
    ('{"format": "minference.pattern_config", "version": 1}', "missing required field"),
])
def test_eval_refuses_a_bad_config_file_before_loading_naming_it(content, message, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.json"
    path.write_text(content)
    _no_loading(monkeypatch)
    assert main(["eval", "--no-progress", "--config", "dense", f"mine={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minference eval: error: {path}: ") and message in err and err.count("\n") == 1
    with pytest.raises(E.EvalError, match=f"^{path}: "):
        E.check_config_spec(str(path))


def test_eval_refuses_repeated_config_names_before_loading(monkeypatch, capsys):
    _no_loading(monkeypatch)
    assert main(["eval", "--no-progress", "--config", "dense", f"dense={DEFAULT_CONFIG}"]) == 2
    assert "config names repeat: ['dense', 'dense']" in capsys.readouterr().err


def test_unnamed_uniform_specs_name_what_differs_from_the_defaults():
    """Two unnamed uniform specs that differ only in the rule's threshold, the estimate or the
    scoring rows get different names (the report's keys); default fields stay out of the name."""
    bs = '{"kind": "block_sparse", "top_k": 512, "block": 128, "rule": "relative", "threshold": %s%s}'
    names = [E._spec_name(bs % (t, extra)) for t, extra in
             (("0.03", ""), ("0.01", ""), ("0.03", ', "estimate": "query"'),
              ("0.03", ', "estimate": "query", "score_rows": 32'))]
    assert names == ["BS(top512,b128,relative0.03)", "BS(top512,b128,relative0.01)",
                     "BS(top512,b128,relative0.03,query)", "BS(top512,b128,relative0.03,query,rows32)"]
    assert E._spec_name('{"kind": "block_sparse", "top_k": 4, "block": 64}') == "BS(top4,b64)"
    assert E._spec_name('{"kind": "vertical_slash", "rule": "mass", "threshold": 0.9}') == "VS(1000,6096,mass0.9)"
    assert E._spec_name('{"kind": "vertical_slash"}') == "VS(1000,6096)"


def test_eval_config_of_another_model_is_one_line_naming_the_file_before_any_prompt(byte_tokenizer, monkeypatch,
                                                                                      capsys):
    """The bundled SmolLM2 config (30 layers x 9 heads) on a 2-layer, 4-head model: refused right
    after loading (models.py has no layer/head facts to check before), before any prompt runs, in
    one line naming the file, what differs and that --allow-mismatch would run it."""
    import minference.app.models as M

    model = _random_llama()
    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: byte_tokenizer)
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: (model, byte_tokenizer))
    monkeypatch.setattr(E, "_prefill", lambda *a, **kw: pytest.fail("ran a prompt"))
    monkeypatch.setattr(E, "_once_per_length", lambda *a, **kw: pytest.fail("ran a prompt"))
    assert main(["eval", "--no-progress", "--lengths", "512", "--tasks", "single_needle", "--dense-threshold", "0",
                 "--config", "dense", str(DEFAULT_CONFIG)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minference eval: error: {DEFAULT_CONFIG} was made for another model: ")
    assert "num_layers: config has 30, model has 2" in err and "num_heads: config has 9, model has 4" in err
    assert err.endswith(" (--allow-mismatch runs it anyway)\n") and err.count("\n") == 1


def test_eval_config_that_cannot_cover_the_model_says_so_in_one_line(byte_tokenizer, tmp_path):
    """A config of 2 layers on a 3-layer model cannot run even with --allow-mismatch: one line
    that says so (and does not offer the flag)."""
    path = tmp_path / "two.json"
    E.uniform_config(_random_llama(layers=2), E._parse_pattern(UNIFORM)).save(path)
    kw = dict(configs=["dense", str(path)], lengths=[512], tasks=["single_needle"], progress=False, coverage=False,
              loaded=(_random_llama(layers=3), byte_tokenizer))
    for allow in (False, True):
        with pytest.raises(E.EvalError) as info:
            E.run_eval("smollm2", allow_mismatch=allow, **kw)
        text = str(info.value)
        assert text.startswith(f"{path} was made for another model: ") and "\n" not in text
        assert "cannot be used even with allow_mismatch" in text and "--allow-mismatch runs it" not in text


# ---------------------------------------------------------------------------------------------
# Sparse configs under the dense threshold.


@pytest.mark.parametrize("threshold, dense_at", [
    (None, "512, 4096"),
    ("1024", "512"),
    ("0", None),
])
def test_eval_notes_sparse_configs_that_will_run_dense_before_loading(threshold, dense_at, byte_tokenizer,
                                                                      monkeypatch, capsys):
    import minference.app.models as M

    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: byte_tokenizer)
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: (_ for _ in ()).throw(M.ModelNotAvailable("stop here")))
    extra = [] if threshold is None else ["--dense-threshold", threshold]
    assert main(["eval", "--no-progress", "--lengths", "512", "4096", "--tasks", "single_needle", "--config",
                 "dense", "fast=" + UNIFORM, "all=" + '{"kind": "dense"}', *extra]) == 2
    err = capsys.readouterr().err
    assert err.endswith("minference eval: error: stop here\n")  # the note came before loading
    notes = [line for line in err.splitlines() if "will run dense" in line]
    if dense_at is None:
        assert notes == []
        return
    (note,) = notes
    assert note.startswith(f"minference eval: note: fast will run dense at {dense_at} tokens (path dense_short: ")
    assert ("49152 (dispatcher default)" if threshold is None else f"dense threshold {threshold} run dense") in note


def test_eval_note_counts_ruler_prompts_under_the_threshold():
    samples = {4096: [types.SimpleNamespace(n_tokens=n) for n in (3900, 4000)],
               8192: [types.SimpleNamespace(n_tokens=n) for n in (7990, 8100)],
               16384: [types.SimpleNamespace(n_tokens=16000)]}
    note = E._dense_short_note(["dense", UNIFORM], [None, None], 8000, samples)
    assert note.startswith("BS(top4,b64) will run dense at 4096, 8192 (1 of 2 prompts) tokens")
    assert E._dense_short_note(["dense"], [None], 8000, samples) == ""


def test_eval_table_shows_dense_for_a_sparse_config_that_ran_dense():
    """Timings of a config whose every attention call ran dense_short are dense against dense:
    its ratio cells read 'dense' with a footnote, not a speed-up; a config that ran sparse keeps
    its ratios."""
    report = _timed_report({"dense": {("a", 0): 1.0}, "fast": {("a", 0): 0.5}})
    report.run("fast", N).calls = {"dense_short": 30, "dense_decode": 5}
    table = E.format_report(report)
    row = next(line for line in table.splitlines() if line.startswith(f"| {N} | fast |"))
    assert "| 500.0 | dense | 500.0 | dense | dense |" in row and "2.00x" not in table
    assert E.DENSE_CELL_NOTE in table
    report.settings.update(suite="ruler", ruler={"seed": 0})  # RULER's TTFT per task: no ratio either
    for r in report.records:
        r.found = 1.0
    ruler = E.format_report(report).split("TTFT per task")[1]
    assert f"| {N} | fast | 500 / 500 (dense) |" in ruler and "x" not in ruler.split(f"| {N} | fast |")[1]
    report.run("fast", N).calls = {"sparse": 30}
    table = E.format_report(report)
    assert "| 500.0 | 2.00x | 500.0 | 2.00x | 0.50 |" in table and E.DENSE_CELL_NOTE not in table
    assert f"| {N} | fast | 500 / 500 (2.00x, 2.00x) |" in table


def test_eval_run_under_the_default_threshold_reports_no_speedup(byte_tokenizer, capsys):
    """A real (random-model) run at 512 tokens with the dispatcher's default threshold: the note
    before the run, the sparse config counted on dense_short only, and no ratio in the table."""
    report = E.run_eval("smollm2", configs=["dense", "fast=" + UNIFORM], lengths=[512], tasks=["single_needle"],
                        samples=1, progress=False, coverage=False, loaded=(_random_llama(), byte_tokenizer))
    assert "fast will run dense at 512 tokens" in capsys.readouterr().err
    assert report.run("fast", 512).calls == {"dense_short": 2}  # the counted warm-up prefill: 2 layers, dense
    row = next(line for line in E.format_report(report).splitlines() if line.startswith("| 512 | fast |"))
    assert row.count("| dense |") >= 1 and "x |" not in row


# ---------------------------------------------------------------------------------------------
# CUDA graphs.


def test_eval_refuses_cuda_graphs_where_they_never_run_before_loading(monkeypatch, capsys):
    _no_loading(monkeypatch)
    assert main(["eval", "--no-progress", "--cuda-graphs"]) == 2
    assert capsys.readouterr().err == ("minference eval: error: --cuda-graphs needs a CUDA device (--device cuda), "
                                       "not 'cpu': graphs never run on cpu, every call would run directly\n")
    # the CLI refuses --device cuda on a machine without CUDA itself: run_eval on a CUDA device name
    with pytest.raises(E.EvalError, match="^--cuda-graphs replays the Triton kernels' graphs: --backend torch"):
        E.run_eval("smollm2", configs=["dense", UNIFORM], lengths=[512], device="cuda", backend="torch",
                   cuda_graphs=True, progress=False)


def test_eval_refuses_cuda_graphs_for_a_loaded_cpu_model(byte_tokenizer):
    with pytest.raises(E.EvalError, match="^--cuda-graphs needs a CUDA device"):
        E.run_eval("smollm2", configs=["dense", UNIFORM], lengths=[512], tasks=["single_needle"], progress=False,
                   cuda_graphs=True, device="cuda", loaded=(_random_llama(), byte_tokenizer))


def test_eval_report_json_is_unchanged_by_the_checks(byte_tokenizer):
    """The checks add no setting: a report still merges with one written before them."""
    report = E.run_eval("smollm2", configs=["dense"], lengths=[512], tasks=["single_needle"], progress=False,
                        coverage=False, loaded=(_random_llama(), byte_tokenizer))
    assert set(json.loads(report.to_json())["settings"]) == {
        "device", "dense_threshold", "backend", "seed", "samples", "coverage", "profile", "coverage_rows",
        "nll_chunk", "nll_buckets", "allow_mismatch", "force_length", "dense_tail", "cuda_graphs", "prefill_chunk",
        "suite"}


def test_eval_config_of_another_model_is_refused_before_loading_by_its_shape(monkeypatch, capsys):
    """The bundled SmolLM2 config with ``--model qwen``: refused by the known shapes before the
    tokenizer or the weights load, one line naming the file."""
    import minference.app.models as M

    monkeypatch.setattr(M, "load_tokenizer", lambda *a, **kw: pytest.fail("loaded the tokenizer"))
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded the model"))
    assert main(["eval", "--no-progress", "--model", "qwen", "--lengths", "512", "--tasks", "single_needle",
                 "--config", "dense", str(DEFAULT_CONFIG)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minference eval: error: {DEFAULT_CONFIG} was made for another model: ") and \
        err.count("\n") == 1, err
    assert "num_layers" in err, err

"""The quality guard in the application (minference.app.guard_options): the ``--guard*`` options of
``minference eval`` and ``minference run``, one guard per sparse (config, length) in the eval, its
summary in the report and the printed output, and the JSON lines with the tasks' prompt ids."""

from __future__ import annotations

import io
import json

import pytest
import torch

import minference.app.evaluate as E
import minference.app.main_job as J
from minference.app import guard_options as G
from minference.app.cli import build_parser
from minference.config import GuardSettings, PatternConfig, Provenance, RuntimeSettings, model_signature
from minference.guard import QualityGuard
from minference.patterns import AShape


def _config(model, **guard) -> PatternConfig:
    sig = model_signature(model, fingerprint=False)
    layers = [[AShape(sink=2, window=16)] * sig.num_heads for _ in range(sig.num_layers)]
    return PatternConfig(sig, layers, Provenance(package_version="t"), RuntimeSettings(GuardSettings(**guard)))


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=8192)).eval()


@pytest.mark.parametrize("command", ["eval", "run"])
def test_both_commands_take_the_guard_options(command) -> None:
    args = build_parser().parse_args([command, "--guard", "enforce", "--guard-rate", "0.25", "--guard-min-mass", "0.7",
                                      "--guard-log", "g.jsonl"])
    assert G.from_args(args) == G.GuardOptions({"mode": "enforce", "sample_rate": 0.25, "min_mass": 0.7}, "g.jsonl")
    assert G.from_args(build_parser().parse_args([command])) == G.GuardOptions()


@pytest.mark.parametrize("argv, message", [
    (["--guard", "strict"], "invalid choice: 'strict'"),
    (["--guard-rate", "1.5"], "must be a number in [0, 1], got 1.5"),
    (["--guard-min-mass", "nan"], "must be a number in [0, 1], got nan"),
])
def test_bad_guard_options_exit_with_usage(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", *argv])
    assert message in capsys.readouterr().err


def test_options_override_the_configs_runtime_settings() -> None:
    model = _tiny()
    observe = _config(model, mode="observe", min_mass=0.3, tail_rows=4)
    guard = G.GuardOptions({"sample_rate": 0.5}).make(observe, "c")
    assert isinstance(guard, QualityGuard) and guard.name == "c"
    assert guard.settings == GuardSettings(mode="observe", min_mass=0.3, tail_rows=4, sample_rate=0.5)
    assert G.GuardOptions().make(_config(model), "c") is None  # off unless a file or an option says so
    assert G.GuardOptions({"mode": "off"}).make(observe, "c") is None
    with pytest.raises(ValueError, match="guard.min_mass must be a number in"):
        G.GuardOptions({"min_mass": 2.0})


def test_guard_options_that_make_no_guard_say_so(capsys) -> None:
    """--guard-rate / --guard-min-mass / --guard-log without --guard on a config whose guard is
    off make no guard: a one-line note on stderr says so, once; a config whose guard is on takes
    them; without such options, no note."""
    model = _tiny()
    argv = ["eval", "--guard-rate", "1", "--guard-min-mass", "0.9", "--guard-log", "g.jsonl"]
    options = G.from_args(build_parser().parse_args(argv))
    assert options.make(_config(model), "a@2048") is None and options.make(_config(model), "b@2048") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "minference eval: note: --guard-rate, --guard-min-mass, --guard-log given, but config 'a@2048' runs no "
        "quality guard") and "--guard observe" in err
    guard = options.make(_config(model, mode="observe"), "c")
    assert isinstance(guard, QualityGuard) and guard.settings.min_mass == 0.9
    assert G.GuardOptions().make(_config(model), "c") is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["eval", "run"])
def test_guard_off_with_options_that_configure_one_is_a_one_line_error(command, capsys) -> None:
    from minference.app.cli import main

    assert main([command, "--guard", "off", "--guard-rate", "1", "--guard-log", "g.jsonl"]) == 2
    assert capsys.readouterr().err == (
        f"minference {command}: error: argument --guard: off runs no guard, so --guard-rate, --guard-log would do "
        "nothing (drop them, or choose --guard observe or enforce)\n")
    assert G.from_args(build_parser().parse_args([command, "--guard", "off"])) == G.GuardOptions({"mode": "off"})


def test_eval_runs_one_guard_per_sparse_config_and_length(tmp_path, byte_tokenizer) -> None:
    """run_eval on a tiny random model (CPU, torch backend): the sparse config's runs carry the
    guard's summary, each checked prefill is a JSON line naming the task prompts it ran, and the
    printed output ends with the summary; the dense config has no guard."""
    log = tmp_path / "guard.jsonl"
    spec = '{"kind": "a_shape", "sink": 2, "window": 16}'
    options = G.GuardOptions({"mode": "observe", "sample_rate": 1.0}, str(log))
    report = E.run_eval("smollm2", configs=["dense", "a=" + spec], lengths=[2048], tasks=["single_needle"],
                        samples=2, dense_threshold=0, backend="torch", coverage=False, progress=False,
                        loaded=(_tiny(), byte_tokenizer), guard=options)
    dense, sparse = report.run("dense", 2048), report.run("a", 2048)
    assert dense.guard is None and sparse.guard["name"] == "a@2048"
    assert sparse.guard["checked_calls"] == sparse.guard["calls"] >= 4  # warm-up, TTFT and answer prefills
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == sparse.guard["checked_calls"]
    prompts = [r["prompt"] for r in records]
    assert "single_needle/2048/0" in prompts and "single_needle/2048/1" in prompts
    assert ["single_needle/2048/1"] in prompts  # the answering batch names its rows
    out = io.StringIO()
    args = build_parser().parse_args(["eval"])
    E._write_outputs(report, args, out)
    assert "quality guard [a @ 2048]: mode observe" in out.getvalue()
    assert E.EvalReport.from_dict(json.loads(report.to_json())).run("a", 2048).guard == sparse.guard
    # the command line's overrides are settings: a guarded run does not merge with an unguarded one
    assert report.settings["guard"] == {"mode": "observe", "sample_rate": 1.0}
    plain = E.EvalReport.from_dict(json.loads(report.to_json()))
    del plain.settings["guard"]
    with pytest.raises(E.EvalError, match=r"different settings cannot be merged \(report 1 vs report 2: guard: "
                                          r"\{'mode': 'observe'"):
        E.merge_reports([report, plain])


def test_run_passes_the_options_and_prints_the_summary(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(J, "run_main_job", lambda **kw: seen.update(kw) or _report())
    out = io.StringIO()
    J._run_cmd(build_parser().parse_args(["run", "--guard", "observe", "--guard-rate", "1"]), out)
    assert seen["guard"] == G.GuardOptions({"mode": "observe", "sample_rate": 1.0})
    assert "quality guard [sparse]: mode observe" in out.getvalue()


def _report() -> J.MainJobReport:
    guard = QualityGuard(GuardSettings(mode="observe"))
    run = J.RunResult(0.1, [1], "1", 1.0)
    return J.MainJobReport(n_tokens=8, key="1", dense=run, sparse=run, config_path="c", pattern_counts={},
                           guard=guard.summary())



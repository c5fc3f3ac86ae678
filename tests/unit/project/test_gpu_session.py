"""``benchmarks/gpu_session.sh`` on the CPU with a stub ``python``: a failing stage makes the
call's exit status non-zero (the device tool reports it), and a stage past the call's time bound
is skipped instead of running unbounded."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


#: A stub ``python`` line that writes "new" to the file after ``--out`` (an eval's report).
WRITES_OUT = 'while [ $# -gt 0 ]; do [ "$1" = --out ] && echo new > "$2"; shift; done\n'


def _run(tmp_path: Path, stub_rc: int, stub_body: str = "", **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "python"
    stub.write_text(f"#!/bin/sh\necho stub \"$@\"\n{stub_body}exit {stub_rc}\n")
    stub.chmod(0o755)
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    full = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), PACK="0", **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_a_failing_stage_fails_the_call(tmp_path):
    ok = _run(tmp_path, 0, STAGES="bench")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _run(tmp_path, 1, STAGES="bench e2e")
    assert bad.returncode != 0 and "failed stages: bench e2e" in bad.stdout, bad.stdout + bad.stderr
    costs = _run(tmp_path, 0, STAGES="costs", COSTS_ARGS="")  # exits 0 but writes no table: cp fails
    assert costs.returncode != 0 and "failed stages: costs" in costs.stdout, costs.stdout + costs.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_eval_past_the_calls_bound_is_skipped(tmp_path):
    run = _run(tmp_path, 0, STAGES="eval", CALL_END="0", EVAL_ARGS="")
    assert run.returncode != 0 and "skipped" in run.stdout and "stub" not in run.stdout, run.stdout + run.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_argument_prints_the_stages_and_runs_none(tmp_path):
    """The script takes its stages from the environment: ``--help`` prints the header and runs
    nothing (no install, no tests), any other argument does the same and fails."""
    for arg, rc in (("--help", 0), ("-h", 0), ("tests:ci", 1)):
        run = subprocess.run(["bash", str(SCRIPT), arg], cwd=tmp_path, env=dict(os.environ, OUT=str(tmp_path / "out")),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == rc, (arg, run.stdout, run.stderr)
        assert "Stages run in the order STAGES lists them" in run.stdout and "set -o" not in run.stdout
        assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_the_tests_stage_saves_its_durations_and_compile_report(tmp_path):
    """The GPU tier's command: longest first, and every run leaves what refreshes the durations
    file (``--save-durations`` into ``$OUT``) and says where the time went."""
    run = _run(tmp_path, 0, STAGES="tests:ci")
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("stub -m pytest"))
    assert "--longest-first tests/gpu_durations.json" in line and "--compile-report" in line
    assert f"--save-durations {tmp_path / 'out' / 'gpu_durations_ci.json'}" in line and "--durations=40" in line


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_eval_continue_picks_up_the_last_calls_report(tmp_path):
    """``EVAL_CONTINUE=FILE``: no ``--continue`` while FILE does not exist; the eval's report is
    copied to FILE after the eval, cut or not (a failing eval still fails the call); the next call
    continues FILE."""
    state = tmp_path / "m" / "r.json"
    state.parent.mkdir()
    first = _run(tmp_path, 0, WRITES_OUT, STAGES="eval", EVAL_ARGS="--suite ruler", EVAL_CONTINUE=str(state))
    assert first.returncode == 0, first.stdout + first.stderr
    line = next(x for x in first.stdout.splitlines() if x.startswith("stub -m minference.app.cli eval"))
    assert "--continue" not in line and state.read_text() == "new\n"
    state.write_text("old\n")
    cut = _run(tmp_path, 124, WRITES_OUT, STAGES="eval", EVAL_ARGS="--suite ruler", EVAL_CONTINUE=str(state))
    assert cut.returncode != 0 and "failed stages: eval" in cut.stdout, cut.stdout + cut.stderr
    line = next(x for x in cut.stdout.splitlines() if x.startswith("stub -m minference.app.cli eval"))
    assert f"--continue {state}" in line and state.read_text() == "new\n"

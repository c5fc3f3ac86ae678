"""The ``minference`` command line, run in-process."""

from __future__ import annotations

import io
import re

import pytest
from minference.reference import metrics as R
from minference.reference.attention import dense_attention_probs

from minference.app import cli


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


def test_no_command_prints_help(capsys) -> None:
    assert cli.main([]) == 2
    assert "usage: minference" in capsys.readouterr().out


def test_bad_arguments_exit_with_usage(capsys) -> None:
    for argv in (["demo", "--tokens", "0"], ["demo", "--backend", "cuda"], ["nonsense"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
    assert "usage:" in capsys.readouterr().err


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

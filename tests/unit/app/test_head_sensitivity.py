"""benchmarks/head_sensitivity.py: the ``--heads`` parser, bad input refused in one line before any
model loads, and a real SmolLM2 run whose deltas match an independent NLL computation of the
config with one head switched (portable backend, sparse from the first token)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from minference.app import ruler
from minference.app.evals import perplexity_ids
from minference.app.evaluate import sequence_nll, uniform_config
from minference.integration import patch, unpatch
from minference.patterns import AShape, Dense, pattern_to_dict

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures" / "configs"
N = 256
#: Aggressive enough to change the NLL at N tokens on every head it replaces.
PROBE = AShape(sink=4, window=16)
#: A milder BASE: sparse at N tokens, so BASE's NLL is not dense's.
MILD = AShape(sink=4, window=96)


@pytest.fixture(scope="module")
def hs():
    spec = importlib.util.spec_from_file_location("head_sensitivity", ROOT / "benchmarks" / "head_sensitivity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_heads_reads_pairs_in_layer_order_and_refuses_bad_ones_in_a_line(hs):
    assert hs.parse_heads("all", 2, 3) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert hs.parse_heads("3:2,0:0", 4, 3) == [(0, 0), (3, 2)]
    assert hs.parse_heads(" 1:1 , 0:2", 2, 3) == [(0, 2), (1, 1)]
    for text, why in (("", "layer:head pairs"), ("0:0,", "layer:head pairs"), ("0-0", "layer:head pairs"),
                      ("a:1", "layer:head pairs"), ("-1:0", "layer:head pairs"), ("0:0:0", "layer:head pairs"),
                      ("4:0", "no such head"), ("0:3", "no such head"), ("1:1,1:1", "twice")):
        with pytest.raises(ValueError, match=why) as err:
            hs.parse_heads(text, 4, 3)
        assert "\n" not in str(err.value)


@pytest.fixture
def no_model(hs, monkeypatch):
    """The script's model loader fails the test if called."""
    monkeypatch.setattr(hs, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("argv, why", [
    ([str(FIXTURES / "smollm2-135m.json"), str(FIXTURES / "qwen2.5-coder-0.5b.json")], "they must match"),
    ([str(FIXTURES / "smollm2-135m.json"), "{dir}/missing.json"], "missing.json"),
    ([str(FIXTURES / "smollm2-135m.json"), str(FIXTURES / "smollm2-135m.json"), "--heads", "0:x"], "layer:head"),
    ([str(FIXTURES / "smollm2-135m.json"), str(FIXTURES / "smollm2-135m.json"), "--heads", "30:0"], "no such head"),
    ([str(FIXTURES / "smollm2-135m.json"), str(FIXTURES / "smollm2-135m.json"), "--heads", "0:9"], "no such head"),
    ([str(FIXTURES / "smollm2-135m.json")] * 2 + ["--tokens", "1"], "argument --tokens: must be >= 2"),
    ([str(FIXTURES / "smollm2-135m.json")] * 2 + ["--samples", "0"], "argument --samples: must be >= 1"),
    ([str(FIXTURES / "smollm2-135m.json"), str(FIXTURES / "smollm2-135m.json"), "--tokens", "9000"], "exceeds"),
    ([str(FIXTURES / "qwen2.5-coder-0.5b.json")] * 2, "made for"),  # a config of another model
    ([str(FIXTURES / "smollm2-135m.json")] * 2 + ["--out", "{dir}/no/r.json"], "does not exist"),
    ([str(FIXTURES / "smollm2-135m.json")] * 2 + ["--out", str(FIXTURES / "smollm2-135m.json")], "overwrite an input"),
])
def test_bad_input_is_refused_in_one_line_before_the_model_loads(hs, no_model, tmp_path, capsys, argv, why):
    argv = [a.format(dir=tmp_path) for a in argv]
    argv = argv + ([] if "--tokens" in argv else ["--tokens", str(N)])
    argv = argv + ([] if "--out" in argv else ["--out", str(tmp_path / "r.json")])
    assert hs.main([*argv, "--model", "smollm2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("head_sensitivity: ") and why in lines[0], captured.err
    assert not captured.out and not (tmp_path / "r.json").exists()


@pytest.fixture
def run(hs, smollm2, tmp_path, monkeypatch, capsys):
    """``run(base, probe, *flags)``: the script on the session's SmolLM2 (its loader returns the
    loaded model; every ``sequence_nll`` call counted) at N tokens, 1 sample, sparse from the first
    token, BASE and PROBE uniform configs of the two patterns; returns ``(result JSON, stdout,
    stderr, forwards)``."""
    model = smollm2[0]
    loads: list[tuple] = []
    forwards: list[int] = []
    real_nll = hs.sequence_nll
    monkeypatch.setattr(hs, "load_model", lambda name, **kw: (loads.append((name, kw)), smollm2)[1])
    monkeypatch.setattr(hs, "sequence_nll", lambda *a, **kw: (forwards.append(1), real_nll(*a, **kw))[1])

    def go(base, probe, *flags):
        paths = [tmp_path / "base.json", tmp_path / "probe.json"]
        for path, pattern in zip(paths, (base, probe)):
            uniform_config(model, pattern).save(path)
        forwards.clear()
        out = tmp_path / "r.json"
        assert hs.main([*map(str, paths), "--model", "smollm2", "--tokens", str(N), "--samples", "1",
                        "--dense-threshold", "0", *flags, "--out", str(out)]) == 0
        assert [name for name, _ in loads] == ["smollm2"] and str(loads[0][1]["device"]) == "cpu"
        loads.clear()
        captured = capsys.readouterr()
        return json.loads(out.read_text()), captured.out, captured.err, len(forwards)

    return go


def test_each_delta_is_the_nll_change_of_switching_that_one_head(hs, smollm2, run):
    """BASE a mild A-shape everywhere (so its NLL is not dense's), PROBE an aggressive one, two
    heads: two entries in layer order, and each delta equals the NLL of BASE with that head set to
    the aggressive A-shape (set_head, patched here) minus BASE's own, both computed independently;
    one at least is not 0."""
    result, out, err, forwards = run(MILD, PROBE, "--heads", "3:2,0:0")
    assert "2 heads to probe, 0 skipped" in err and "4 forwards" in err and forwards == 4
    assert result["format"] == "minference.head_sensitivity" and result["version"] == 1 and result["complete"]
    assert (result["model"], result["device"], result["tokens"], result["samples"], result["seed"]) == (
        "smollm2", "cpu", N, 1, 0)
    assert (result["dense_threshold"], result["dense_tail"], result["skipped"]) == (0, 0, 0)
    assert "uniform" in result["base"]["notes"] and result["probe"]["path"].endswith("probe.json")
    assert [(e["layer"], e["head"]) for e in result["heads"]] == [(0, 0), (3, 2)]
    model, tokenizer = smollm2
    ids = perplexity_ids(tokenizer, N, 0, seed=0)
    dense = float(sequence_nll(model, ids).mean())
    base = uniform_config(model, MILD)

    def nll(config) -> float:
        patch(model, config, dense_threshold=0, backend="torch")
        try:
            return float(sequence_nll(model, ids).mean())
        finally:
            unpatch(model)

    base_nll = nll(base)
    assert result["dense_nll"] == [dense] and result["base_nll"] == [pytest.approx(base_nll, abs=1e-6)]
    assert abs(base_nll - dense) > 1e-4  # BASE runs sparse: a delta taken against dense would differ
    for e in result["heads"]:
        assert e["base"] == pattern_to_dict(MILD) and e["probe"] == pattern_to_dict(PROBE)
        probed = nll(hs.set_head(base, e["layer"], e["head"], PROBE))
        assert e["per_prompt"] == [pytest.approx(probed - base_nll, abs=1e-6)]
        assert e["delta"] == pytest.approx(probed - base_nll, abs=1e-6)
    assert any(abs(e["delta"]) > 1e-4 for e in result["heads"])
    assert f"dense NLL {dense:.4f}, BASE NLL {base_nll:.4f} ({base_nll - dense:+.4f})" in out
    rows = [line.split(" | ")[1:3] for line in out.splitlines() if line[:3] in ("| 1", "| 2", "| 3")]
    ranked = sorted(result["heads"], key=lambda e: -e["delta"])  # the largest delta first
    assert rows == [[str(e["layer"]), str(e["head"])] for e in ranked]
    assert f"sum of all 2 deltas: {sum(e['delta'] for e in result['heads']):+.4f}" in out


def test_a_probe_equal_to_base_skips_every_head(run):
    """PROBE = BASE: every head skipped and counted, only the dense and BASE forwards run."""
    result, out, err, forwards = run(PROBE, PROBE)
    assert "0 heads to probe, 270 skipped" in err and forwards == 2
    assert result["heads"] == [] and result["skipped"] == 30 * 9 and result["complete"]
    assert result["base_nll"] != result["dense_nll"]  # the A-shape everywhere does run sparse
    assert "sum of all 0 deltas: +0.0000" in out


def _fake_result(base, deltas: dict, probe=PROBE) -> dict:
    """A result of the script's format measured against ``base``: ``deltas`` maps (layer, head) to
    the NLL change of moving that head to ``probe``."""
    heads = [{"layer": l, "head": h, "base": pattern_to_dict(base.layers[l][h]), "probe": pattern_to_dict(probe),
              "delta": d, "per_prompt": [d]} for (l, h), d in sorted(deltas.items())]
    return {"format": "minference.head_sensitivity", "version": 1, "model": "smollm2", "device": "cpu",
            "tokens": N, "samples": 1, "seed": 0, "dense_threshold": 0, "dense_tail": 0,
            "base": {"path": "base.json", "notes": ""}, "probe": {"path": "probe.json", "notes": ""},
            "dense_nll": [3.0], "base_nll": [3.0], "heads": heads, "skipped": 0, "wall_s": 1.0, "complete": True}


def test_move_takes_the_least_damaging_heads_within_each_budget(hs):
    """Heads move in order of measured change (a negative one costs 0) until the next would pass
    the budget; every other head keeps BASE's pattern; the notes give the predicted change."""
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    result = _fake_result(base, {(0, 0): 0.003, (1, 2): -0.001, (2, 1): 0.001, (3, 0): 0.010})
    cases = ((0.0, [(1, 2)], 0.0), (0.001, [(1, 2), (2, 1)], 0.001), (0.005, [(0, 0), (1, 2), (2, 1)], 0.004),
             (1.0, [(0, 0), (1, 2), (2, 1), (3, 0)], 0.014))
    for budget, moved, total in cases:
        config, got, predicted = hs.move_heads(base, [result], [budget])
        assert got == moved and predicted == [pytest.approx(total)]
        for l, row in enumerate(config.layers):
            for h, pattern in enumerate(row):
                assert pattern == (PROBE if (l, h) in moved else base.layers[l][h]), (budget, l, h)
        assert f"budget {budget:g}, predicted {total:+.4f} nats per token" in config.provenance.notes


def test_move_fits_a_sum_of_decimal_deltas_equal_to_the_budget(hs):
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    result = _fake_result(base, {(l, 0): 0.001 for l in range(10)})  # their float sum is 0.009999999999999998
    assert len(hs.move_heads(base, [result], [0.01])[1]) == 10
    assert len(hs.move_heads(base, [result], [0.0099])[1]) == 9


def test_against_dense_adds_the_moved_heads_signed_changes_to_bases_own(hs):
    """The budget counts a negative change as 0 and is against BASE; the ship rule's NLL clause is
    against dense: BASE's change there (means over the prompts) plus the moved heads' changes with
    their signs."""
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    result = _fake_result(base, {(0, 0): 0.003, (1, 2): -0.010, (2, 1): 0.001})
    result.update(dense_nll=[2.0, 2.2], base_nll=[2.02, 2.22])  # BASE +0.02 against dense
    assert hs.against_dense(result, []) == (pytest.approx(0.02), pytest.approx(0.02))
    assert hs.against_dense(result, [(0, 0), (1, 2)]) == (pytest.approx(0.02), pytest.approx(0.013))
    config, moved, predicted = hs.move_heads(base, [result], [0.003])  # (1, 2) and (2, 1) fit, (0, 0) not
    assert moved == [(1, 2), (2, 1)] and predicted == [pytest.approx(0.001)]  # the bound: BASE +0.02, +0.021
    assert hs.against_dense(result, moved) == (pytest.approx(0.02), pytest.approx(0.011))


def test_move_command_prints_and_records_the_signed_estimate_against_dense(hs, tmp_path, capsys):
    """BASE +0.02 against dense; the moved heads' changes -0.010 and +0.001: the budget's sum is
    +0.001 (the negative one counted as 0), the estimate against dense +0.011; both printed, the
    estimate also in the config's notes."""
    from minference.config import load_config

    base_path = FIXTURES / "smollm2-135m.json"
    result = _fake_result(load_config(base_path), {(0, 0): 0.003, (1, 2): -0.010, (2, 1): 0.001})
    result.update(dense_nll=[2.0, 2.2], base_nll=[2.02, 2.22])
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert hs.main(["move", str(base_path), str(tmp_path / "r.json"), "--budget", "0.003",
                    "--out", str(tmp_path / "m.json")]) == 0
    line = capsys.readouterr().out.strip()
    assert "2 heads moved, predicted +0.0010 nats per token against BASE" in line
    estimate = "against dense on the measured prompts: BASE +0.0200, moved +0.0110 nats per token"
    assert estimate in line and estimate in load_config(tmp_path / "m.json").provenance.notes


def test_move_refuses_a_result_of_another_base_in_one_line(hs):
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    result = _fake_result(base, {(2, 1): 0.001})
    result["heads"][0]["base"] = pattern_to_dict(Dense())
    with pytest.raises(ValueError, match="measured against another BASE: layer 2, head 1") as err:
        hs.move_heads(base, [result], [0.01])
    assert "\n" not in str(err.value)


def test_move_command_writes_one_loadable_config_per_budget(hs, tmp_path, capsys):
    from minference.config import load_config

    base_path = FIXTURES / "smollm2-135m.json"
    base = load_config(base_path)
    result = tmp_path / "r.json"
    result.write_text(json.dumps(_fake_result(base, {(0, 0): 0.002, (5, 3): 0.0})))
    out = str(tmp_path / "m_{budget}.json")
    assert hs.main(["move", str(base_path), str(result), "--budget", "0", "0.01", "--out", out]) == 0
    lines = capsys.readouterr().out.splitlines()
    dense = ("; against dense on the measured prompts: BASE +0.0000, moved {} nats per token (moved: BASE plus every "
             "moved head's change with its sign, so far a low estimate)")
    assert lines == [f"wrote {tmp_path / 'm_0.json'}: 1 heads moved, predicted +0.0000 nats per token against BASE"
                     + dense.format("+0.0000"),
                     f"wrote {tmp_path / 'm_0.01.json'}: 2 heads moved, predicted +0.0020 nats per token against "
                     "BASE" + dense.format("+0.0020")]
    assert load_config(tmp_path / "m_0.01.json").layers[0][0] == PROBE
    assert load_config(tmp_path / "m_0.json").layers[0][0] == base.layers[0][0]
    # two budgets need '{budget}' in --out; a file of another format is refused; one line each, nothing written
    for argv, why in ((["--budget", "0", "0.01", "--out", str(tmp_path / "x.json")], "must contain"),
                      (["--budget", "-1", "--out", str(tmp_path / "x.json")], "finite and >= 0"),
                      (["--budget", "inf", "--out", str(tmp_path / "x.json")], "finite and >= 0")):
        assert hs.main(["move", str(base_path), str(result), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0]
    bad = _fake_result(base, {(0, 0): 0.002})
    bad["heads"][0]["delta"] = float("nan")  # json writes NaN; a NaN would move every later head
    result.write_text(json.dumps(bad))
    assert hs.main(["move", str(base_path), str(result), "--budget", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "layer 0, head 0 has a non-finite NLL change" in capsys.readouterr().err
    assert hs.main(["move", str(base_path), str(result), "--budget", "0", "--out", str(base_path)]) == 2
    assert "would overwrite an input" in capsys.readouterr().err
    partial = _fake_result(base, {(0, 0): 0.002})
    partial["complete"] = False
    result.write_text(json.dumps(partial))
    assert hs.main(["move", str(base_path), str(result), "--budget", "1", "--out", str(tmp_path / "p.json")]) == 0
    assert "is incomplete (1 heads measured)" in capsys.readouterr().err
    assert f"{result} was incomplete: 1 heads measured" in load_config(tmp_path / "p.json").provenance.notes
    # two prompts that rank the heads in reverse: a note, and the written config says so; when they
    # agree, no note
    for deltas, noted in (({(0, 0): (0.002, 0.0), (5, 3): (0.001, 0.001), (1, 1): (0.0, 0.002)}, True),
                          ({(0, 0): (0.002, 0.003), (5, 3): (0.001, 0.002), (1, 1): (0.0, 0.001)}, False)):
        two = _fake_result(base, {lh: sum(d) / 2 for lh, d in deltas.items()})
        for e in two["heads"]:
            e["per_prompt"] = list(deltas[(e["layer"], e["head"])])
        result.write_text(json.dumps(two))
        assert hs.main(["move", str(base_path), str(result), "--budget", "1", "--out", str(tmp_path / "a.json")]) == 0
        err = capsys.readouterr().err
        assert ("prompts rank the heads differently (rank agreement one task: -1.00" in err) is noted
        assert ("prompts disagreed" in (load_config(tmp_path / "a.json").provenance.notes or "")) is noted
    result.write_text(json.dumps({"format": "something else"}))
    assert hs.main(["move", str(base_path), str(result), "--budget", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "is not a minference.head_sensitivity v1 result" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------
# --answers: the summed NLL of RULER reference answers, teacher-forced.

ANSWER_LENGTH = 512


@pytest.fixture
def answer_set(smollm2, tmp_path):
    """A RULER prompt set at length 512 of two tasks, two prompts each (test_ruler's writer)."""
    from tests.unit.app.test_ruler import _texts, _write_set

    return _write_set(tmp_path / "set", smollm2[1], _texts(2, lengths=(ANSWER_LENGTH,)))


@pytest.mark.parametrize("flags, why", [
    (["--tasks", "qa_1"], "give --answers DIR too"),
    (["--answers", "{dir}/nowhere"], "no manifest.json"),
    (["--answers", "{set}", "--tokens", "256"], "has RULER lengths [512]"),
    (["--answers", "{set}", "--tasks", "niah_single_1,vt"], "--tasks vt: "),
    (["--answers", "{set}", "--tasks", "qa_1,qa_1"], "names a task twice"),
    (["--answers", "{set}", "--tasks", "qa_1", "--samples", "3"], "has 2 prompts of qa_1"),
    (["--answers", "{set}", "--tasks", "qa_1", "--seed", "1"], "--seed chooses the perplexity prompts"),
    (["--answers", "{corrupt}", "--tasks", "qa_1"], "does not match its sha256"),
])
def test_bad_answers_input_is_refused_in_one_line_before_the_model_loads(hs, no_model, answer_set, tmp_path, capsys,
                                                                         flags, why):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(answer_set, corrupt)
    (corrupt / f"qa_1-{ANSWER_LENGTH}.u32.xz").write_bytes(b"\0" * 16)
    flags = [f.format(dir=tmp_path, set=answer_set, corrupt=corrupt) for f in flags]
    tokens = [] if "--tokens" in flags else ["--tokens", str(ANSWER_LENGTH)]
    smol = str(FIXTURES / "smollm2-135m.json")
    assert hs.main([smol, smol, "--model", "smollm2", *tokens, *flags, "--out", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("head_sensitivity: ") and why in lines[0], captured.err
    assert not (tmp_path / "r.json").exists()


def test_answers_deltas_are_the_change_of_each_answers_summed_nll(hs, smollm2, run, answer_set):
    """--answers with two tasks of two prompts: 4 prompts x (dense + BASE + 2 heads) forwards;
    each value is the summed NLL of the target text's tokens after the prompt (a space and the
    references joined by ', ' for niah, a space and the first reference for qa), computed here
    from the model's logits, with the dense tail grown by the longest answer; each head's delta is
    that value's change against BASE."""
    result, out, err, forwards = run(MILD, PROBE, "--answers", str(answer_set), "--tasks", "niah_single_1,qa_1",
                                     "--samples", "2", "--tokens", str(ANSWER_LENGTH), "--heads", "0:0,3:2",
                                     "--dense-tail", "3")
    assert "2 heads to probe" in err and "per task" in err and "16 forwards" in err and forwards == 16
    assert (result["objective"], result["units"], result["tokens"]) == ("answers", "nats per answer", ANSWER_LENGTH)
    assert result["answers"] == {"prompts": str(answer_set), "tasks": ["niah_single_1", "qa_1"]}
    assert result["prompts"] == ["niah_single_1#0", "niah_single_1#1", "qa_1#0", "qa_1#1"]
    assert result["seed"] == 42  # the prompt set's
    model, tokenizer = smollm2
    prompts = ruler.load_prompt_set(answer_set)
    samples = prompts.samples("niah_single_1", ANSWER_LENGTH) + prompts.samples("qa_1", ANSWER_LENGTH)
    answers = [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
               for text in (" 4711", " 4712", " Town0", " Town1")]
    tail = 3 + max(a.numel() for a in answers)
    assert result["dense_tail"] == tail
    base = uniform_config(model, MILD)

    def values(config) -> list[float]:
        if config is not None:
            patch(model, config, dense_threshold=0, backend="torch", dense_tail=tail)
        try:
            out = []
            for sample, answer in zip(samples, answers):
                n = sample.ids.numel()
                with torch.no_grad():
                    logits = model(input_ids=torch.cat([sample.ids, answer])[None]).logits[0].float()
                logp = torch.log_softmax(logits[n - 1 : n - 1 + answer.numel()], dim=-1)  # the rows predicting it
                out.append(-float(logp.gather(1, answer[:, None]).sum()))
            return out
        finally:
            if config is not None:
                unpatch(model)

    dense, base_values = values(None), values(base)
    assert result["dense_nll"] == [pytest.approx(v, abs=2e-4) for v in dense]
    assert result["base_nll"] == [pytest.approx(v, abs=2e-4) for v in base_values]
    for e in result["heads"]:
        probed = values(hs.set_head(base, e["layer"], e["head"], PROBE))
        assert e["per_prompt"] == [pytest.approx(p - b, abs=2e-4) for p, b in zip(probed, base_values)]
        assert e["delta"] == pytest.approx(sum(probed) / 4 - sum(base_values) / 4, abs=2e-4)
    assert any(abs(e["delta"]) > 1e-2 for e in result["heads"])
    assert "objective answers: NLL in nats per answer" in out and "niah_single_1#0" in out


def test_answer_text_joins_every_reference_or_takes_the_first(hs):
    assert hs.answer_text("string_match_all", ["12", "34", "56"]) == " 12, 34, 56"
    assert hs.answer_text("string_match_all", ["7"]) == " 7"
    assert hs.answer_text("string_match_part", ["Town0", "town 0"]) == " Town0"
    with pytest.raises(ValueError, match="no answer target"):
        hs.answer_text("rouge", ["x"])


def test_move_with_two_results_keeps_every_sum_within_its_budget(hs):
    """Two results (NLL and answers): heads ranked by their largest share of a budget, a head that
    would pass either budget passed over while smaller ones after it still move, heads measured by
    one result only never move; different probes or a budget per result missing are refused."""
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    nll = _fake_result(base, {(0, 0): 0.002, (2, 2): 0.0035, (3, 3): 0.0, (4, 4): 0.0})
    answers = _fake_result(base, {(0, 0): 0.0, (2, 2): -0.1, (3, 3): 0.8})
    answers["objective"] = "answers"
    # shares of (0.005, 1.0): (0,0) 0.4, (2,2) 0.7, (3,3) 0.8; (2,2) would bring NLL to 0.0055 and is
    # passed over, (3,3) after it still fits; (4,4) only the NLL result measured
    config, moved, totals = hs.move_heads(base, [nll, answers], [0.005, 1.0])
    assert moved == [(0, 0), (3, 3)] and totals == [pytest.approx(0.002), pytest.approx(0.8)]
    assert "nats per answer" in config.provenance.notes and "1 heads measured by only some" in config.provenance.notes
    assert config.layers[2][2] == base.layers[2][2] and config.layers[4][4] == base.layers[4][4]
    config, moved, totals = hs.move_heads(base, [nll, answers], [0.01, 1.0])
    assert moved == [(0, 0), (2, 2), (3, 3)] and totals == [pytest.approx(0.0055), pytest.approx(0.8)]
    assert hs.move_heads(base, [nll, answers], [1.0, 0.0])[1] == [(0, 0), (2, 2)]  # a zero budget: none of it spent
    answers["heads"][0]["probe"] = pattern_to_dict(MILD)
    with pytest.raises(ValueError, match="probe layer 0, head 0 with different patterns"):
        hs.move_heads(base, [nll, answers], [1.0, 1.0])
    with pytest.raises(ValueError, match="one budget per result"):
        hs.move_heads(base, [nll, answers], [1.0])


def test_move_command_takes_one_budget_per_result(hs, tmp_path, capsys):
    from minference.config import load_config

    base_path = FIXTURES / "smollm2-135m.json"
    base = load_config(base_path)
    paths = [tmp_path / "nll.json", tmp_path / "answers.json"]
    answers = _fake_result(base, {(0, 0): 0.5})
    answers["objective"] = "answers"
    paths[0].write_text(json.dumps(_fake_result(base, {(0, 0): 0.001})))
    paths[1].write_text(json.dumps(answers))
    out = str(tmp_path / "m_{budget}.json")
    assert hs.main(["move", str(base_path), *map(str, paths), "--budget", "0.01,1", "0.01,0.1", "--out", out]) == 0
    dense = ("; against dense on the measured prompts: BASE +0.0000, moved {} nats per token; BASE +0.0000, moved {} "
             "nats per answer (moved: BASE plus every moved head's change with its sign, so far a low estimate)")
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {tmp_path / 'm_0.01_1.json'}: 1 heads moved, predicted +0.0010 nats per token, +0.5000 nats per "
        "answer against BASE" + dense.format("+0.0010", "+0.5000"),
        f"wrote {tmp_path / 'm_0.01_0.1.json'}: 0 heads moved, predicted +0.0000 nats per token, +0.0000 nats per "
        "answer against BASE" + dense.format("+0.0000", "+0.0000")]
    assert load_config(tmp_path / "m_0.01_1.json").layers[0][0] == PROBE
    for budget, why in (("0.01", "1 number(s) for 2 result(s)"), ("0.01,x", "takes numbers"),
                        ("0.01,1 0.010,1.0", "gives one budget twice")):
        assert hs.main(["move", str(base_path), *map(str, paths), "--budget", *budget.split(), "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0]
    table = tmp_path / "costs.json"
    table.write_text("{}")
    assert hs.main(["move", str(base_path), *map(str, paths), "--budget", "1,1", "--out", str(table),
                    "--from-measurements", str(paths[0]), "--cost-table", str(table)]) == 2
    assert "would overwrite an input" in capsys.readouterr().err and table.read_text() == "{}"
    answers["heads"][0]["base"] = pattern_to_dict(MILD)  # not BASE's pattern there
    paths[1].write_text(json.dumps(answers))
    assert hs.main(["move", str(base_path), *map(str, paths), "--budget", "1,1", "--out", out]) == 2
    assert "result 2 (of 2) was measured against another BASE" in capsys.readouterr().err
    answers["model"] = "qwen0.5b"
    paths[1].write_text(json.dumps(answers))
    assert hs.main(["move", str(base_path), *map(str, paths), "--budget", "1,1", "--out", out]) == 2
    assert "measured on different models (qwen0.5b, smollm2)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Cost-aware moves: damage per modelled ms saved.


def test_cost_aware_move_takes_the_most_time_per_unit_of_damage(hs):
    """With each head's modelled saving, heads move in order of share per ms saved; a head whose
    move saves nothing stays even when it lowers the NLL; the damage-only order picks another set."""
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    deltas = {(0, 0): 0.002, (1, 1): 0.001, (2, 2): 0.002, (3, 3): -0.001, (4, 4): 0.0, (5, 5): -0.002}
    saved = {(0, 0): 10.0, (1, 1): 1.0, (2, 2): 20.0, (3, 3): 5.0, (4, 4): 0.0, (5, 5): -1.0}
    result = _fake_result(base, deltas)
    # shares per ms (budget 0.0045): (3,3) 0, (2,2) 0.022, (0,0) 0.044, (1,1) 0.22: the last would pass
    config, moved, totals = hs.move_heads(base, [result], [0.0045], saved)
    assert moved == [(0, 0), (2, 2), (3, 3)] and totals == [pytest.approx(0.004)]
    assert "2 heads save none and stay; 35.0 ms saved in all" in config.provenance.notes
    assert hs.move_heads(base, [result], [0.0045])[1] == [(0, 0), (1, 1), (3, 3), (4, 4), (5, 5)]


def _smollm2_measurements(candidates, mass, out_error=None, worst=True):
    """Search measurements for SmolLM2's shape over ``candidates``: ``mass`` / ``out_error`` ``[4, C]``
    for heads 0-3 of layer 0, 0.9 / 0.1 elsewhere."""
    from minference.app import search as S
    from minference.app.models import model_shape
    from minference.config import PatternConfig, Provenance

    sig = model_shape("smollm2")
    shape = (sig.num_layers, sig.num_heads, len(candidates))
    full = lambda v: torch.full(shape, v, dtype=torch.float64)  # noqa: E731
    m, e = full(0.9), full(0.1)
    m[0, :4] = torch.tensor(mass, dtype=torch.float64)
    if out_error is not None:
        e[0, :4] = torch.tensor(out_error, dtype=torch.float64)
    config = PatternConfig(sig, [[Dense()] * sig.num_heads for _ in range(sig.num_layers)],
                           Provenance(source="search", notes="test"))
    return S.SearchResult(config, list(candidates), mass=m, density=full(0.1), worst_mass=m.clone() if worst else None,
                          cost=full(0.1), select="cheapest", tiles=full(0.1), max_tiles=full(0.1), n_tokens=N,
                          head_dim=64, out_error=None if out_error is None else e,
                          worst_out_error=None if out_error is None else e.clone())


def test_proxies_set_the_search_error_against_the_measured_change(hs, tmp_path, capsys, monkeypatch):
    """Each head's proxy change is PROBE's candidate error minus BASE's (dense 0) from the search's
    measurements; the table gives each proxy's rank agreement with the measured change, how many of
    the TOP most damaging heads it ranks among its TOP largest changes and where they rank;
    measurements of another model, without worst-case masses, or lacking a pattern are refused in one
    line."""
    from minference.app.models import model_shape
    from minference.config import PatternConfig, Provenance
    from tests.unit.app.test_frontier import fake_result

    ashape, vs, bs = fake_result().candidates
    measured = _smollm2_measurements([ashape, vs, bs], [[0.5, 0.9, 0.99], [0.5, 0.9, 0.9], [0.5, 0.9, 0.95],
                                                        [0.5, 0.9, 0.8]],
                                     out_error=[[0.5, 0.5, 0.4], [0.5, 0.5, 0.1], [0.5, 0.5, 0.2], [0.5, 0.5, 0.3]])
    measurements = tmp_path / "m.json"
    measured.save(measurements)
    sig = model_shape("smollm2")
    base = PatternConfig(sig, [[Dense()] * sig.num_heads for _ in range(sig.num_layers)], Provenance(source="manual"))
    deltas = {(0, 0): 0.001, (0, 1): 0.004, (0, 2): 0.002, (0, 3): 0.003}
    result = _fake_result(base, deltas, probe=bs)  # dense -> bs on four heads
    changes = hs.proxy_changes(result, measured, str(measurements))
    assert changes["mass"] == pytest.approx([0.01, 0.1, 0.05, 0.2])  # 1 - mass, dense 0
    assert changes["output"] == pytest.approx([0.4, 0.1, 0.2, 0.3])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    monkeypatch.setattr(hs, "TOP", 2)
    assert hs.main(["proxies", str(path), "--from-measurements", str(measurements)]) == 0
    table = capsys.readouterr().out
    # measured order (most damage first) L0H1, L0H3, L0H2, L0H0; mass ranks them 2, 1, 3, 4 (Spearman
    # 1 - 6 * 2 / 60 = 0.8, top 2 the same two heads); output error 4, 2, 3, 1 (1 - 6 * 18 / 60 = -0.8; 1 in common)
    assert "| mass | +0.80 | 2 | L0H1 2, L0H3 1, L0H2 3, L0H0 4 |" in table
    assert "| output | -0.80 | 1 | L0H1 4, L0H3 2, L0H2 3, L0H0 1 |" in table
    # refused in one line: another model's measurements, none of the worst masses, a pattern not measured
    fake_result().save(tmp_path / "tiny.json")
    _smollm2_measurements([ashape, vs, bs], [[0.5, 0.9, 0.99]] * 4, worst=False).save(tmp_path / "old.json")
    bad = json.loads(json.dumps(result))
    bad["heads"][0]["probe"] = pattern_to_dict(AShape(sink=1, window=2))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for r, m, why in ((path, tmp_path / "tiny.json", "smollm2"), (path, tmp_path / "old.json", "lacks the worst"),
                      (tmp_path / "bad.json", measurements,
                       "layer 0, head 0: the PROBE pattern A(1,2) is not a candidate")):
        assert hs.main(["proxies", str(r), "--from-measurements", str(m)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0]


def test_modelled_savings_price_each_move_with_the_cost_table(hs, tmp_path, capsys):
    """The saving of a head is the cost model's BASE pattern minus its PROBE pattern at the
    measurements' tiles; BASE's whole modelled time is printed with each config; a pattern that is
    no candidate, another shape or one of the two options alone is refused in one line."""
    from minference.app import frontier as F
    from minference.config import PatternConfig
    from tests.unit.app.test_frontier import fake_result, table

    measured = fake_result()
    measurements, costs = tmp_path / "m.json", tmp_path / "costs.json"
    measured.save(measurements)
    costs.write_text(json.dumps(table()))
    ashape, vs, bs = measured.candidates
    base = PatternConfig(measured.config.model, [[Dense(), ashape]], measured.config.provenance)
    result = _fake_result(base, {(0, 0): 0.001}, probe=bs)
    result["heads"] += _fake_result(base, {(0, 1): 0.003}, probe=vs)["heads"]
    saved, base_ms = hs.modelled_savings(base, [result], str(measurements), str(costs))
    model, n = F.CostModel.from_dict(table()), measured.n_tokens
    cost = lambda p, tiles: float(model.head_cost(p, torch.tensor(tiles, dtype=torch.float64), n))  # noqa: E731
    assert saved == {(0, 0): pytest.approx(cost(Dense(), 1.0) - cost(bs, 0.02)),
                     (0, 1): pytest.approx(cost(ashape, 0.1) - cost(vs, 0.06))}
    assert base_ms == pytest.approx(cost(Dense(), 1.0) + cost(ashape, 0.1))
    base_path, result_path = tmp_path / "base.json", tmp_path / "r.json"
    base.save(base_path)
    result_path.write_text(json.dumps(result))
    argv = ["move", str(base_path), str(result_path), "--budget", "1", "--out", str(tmp_path / "o.json")]
    assert hs.main([*argv, "--from-measurements", str(measurements), "--cost-table", str(costs)]) == 0
    left = base_ms - sum(s for s in saved.values() if s > 0)
    assert f"modelled attention + index {left:.1f} ms (BASE {base_ms:.1f})" in capsys.readouterr().out
    assert hs.main([*argv, "--cost-table", str(costs)]) == 2
    assert "--from-measurements and --cost-table go together" in capsys.readouterr().err
    other = PatternConfig(measured.config.model, [[Dense(), AShape(sink=1, window=2)]], measured.config.provenance)
    with pytest.raises(ValueError, match="layer 0, head 1: BASE's pattern .* is not a candidate") as err:
        hs.modelled_savings(other, [], str(measurements), str(costs))
    assert "\n" not in str(err.value)
    wide = PatternConfig(dataclasses.replace(measured.config.model, num_heads=3), [[Dense()] * 3],
                         measured.config.provenance)
    with pytest.raises(ValueError, match="1 layers of 2 heads, BASE 1 of 3"):
        hs.modelled_savings(wide, [], str(measurements), str(costs))


def test_continue_measures_only_the_heads_a_cut_run_lacks(hs, run, tmp_path, capsys):
    """A run of one head, continued over two: one forward (the new head; dense and BASE kept), the
    same entries as one full run, in layer order; wall time counted over both runs."""
    full, *_ = run(MILD, PROBE, "--heads", "0:0,3:2")
    first, *_ = run(MILD, PROBE, "--heads", "3:2")
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({**first, "complete": False}))
    result, _, err, forwards = run(MILD, PROBE, "--heads", "0:0,3:2", "--continue", str(cut))
    assert "1 heads to probe" in err and "1 kept from" in err and "(BASE + one per probed" in err and forwards == 2
    assert result["complete"] and [(e["layer"], e["head"]) for e in result["heads"]] == [(0, 0), (3, 2)]
    assert result["dense_nll"] == first["dense_nll"] and result["base_nll"] == first["base_nll"]
    for got, want in zip(result["heads"], full["heads"]):
        assert got["delta"] == pytest.approx(want["delta"], abs=1e-6) and got["probe"] == want["probe"]
    assert result["wall_s"] >= first["wall_s"]
    # another seed makes other prompts: refused once the tokenizer has made them, nothing written
    cut.write_text(json.dumps({**first, "complete": False, "seed": 1}))
    out = tmp_path / "other.json"
    assert hs.main([str(tmp_path / "base.json"), str(tmp_path / "probe.json"), "--model", "smollm2", "--tokens",
                    str(N), "--dense-threshold", "0", "--seed", "1", "--continue", str(cut), "--out", str(out)]) == 2
    assert "measured other prompts" in capsys.readouterr().err and not out.exists()


def test_continue_refuses_other_settings_or_patterns_in_one_line(hs, no_model, tmp_path, capsys):
    from minference.config import load_config

    smol = FIXTURES / "smollm2-135m.json"
    base = load_config(smol)
    previous = _fake_result(base, {(0, 0): 0.001})
    previous.update(probe={"path": str(smol), "notes": ""}, base_layout_sha256=hs.layout_sha256(base),
                    prompt_sha256=["x"])
    other_base = hs.set_head(base, 5, 5, PROBE)  # BASE differing on a head the cut run did not measure
    cut = tmp_path / "cut.json"
    argv = [str(smol), str(smol), "--model", "smollm2", "--tokens", str(N), "--dense-threshold", "0",
            "--continue", str(cut), "--out", str(tmp_path / "r.json")]
    for change, why in (({"tokens": 128}, "other settings: tokens 128 there, 256 here"),
                        ({"dense_tail": 5}, "dense tail 5 there, 0 here"),
                        ({"objective": "answers"}, "objective 'answers' there, 'perplexity' here"),
                        ({"base_layout_sha256": hs.layout_sha256(other_base)}, "measured against another BASE"),
                        ({"prompt_sha256": None}, "has no prompt_sha256: it was written before"),
                        ({}, "layer 0, head 0 was measured with another BASE or PROBE")):
        cut.write_text(json.dumps({k: v for k, v in {**previous, **change}.items() if v is not None}))
        assert hs.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and why in lines[0], lines
    assert not (tmp_path / "r.json").exists()


def test_a_heads_forward_starts_at_its_layer(hs, smollm2, run, monkeypatch):
    """The first layer runs for dense, BASE and the layer-0 head only; the last layer for every
    forward; the deltas are the full forwards' (the first test's independent check covers them)."""
    decoder = smollm2[0].get_decoder()
    calls = {0: 0, 29: 0}
    for i in calls:
        monkeypatch.setattr(decoder.layers[i], "forward", _counting(decoder.layers[i].forward, calls, i))
    result, _, err, forwards = run(MILD, PROBE, "--heads", "0:0,3:2,20:1")
    assert forwards == 5 and calls == {0: 3, 29: 5} and result["layers_skipped"] is True
    assert "from its layer on" in err


def _counting(forward, calls: dict, key):
    def wrapped(*args, **kwargs):
        calls[key] += 1
        return forward(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_from_layer_is_exact_on_tiny_models(hs, arch):
    """On random 4-layer Llama and Qwen2 models, patched sparse from the first token: a forward
    started at layer L from the recorded input of L gives the whole forward's NLL (CI also runs
    this on the lowest supported transformers, the GPU runner's)."""
    import transformers as T

    classes = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (96,), generator=torch.Generator().manual_seed(1))
    decoder = model.get_decoder()
    assert hs.skip_ahead_works(decoder)
    patch(model, uniform_config(model, AShape(sink=4, window=16)), dense_threshold=0, backend="torch")
    try:
        inputs: list = []
        with hs.record_layer_inputs(decoder, inputs):
            whole = sequence_nll(model, ids)
        assert len(inputs) == 4
        for first in (1, 2, 3):
            with hs.from_layer(decoder, first, inputs[first]):
                part = sequence_nll(model, ids)
            assert torch.allclose(part, whole, atol=1e-6, rtol=0), first
        assert len(decoder.layers) == 4 and not isinstance(decoder.embed_tokens, hs._Given)  # restored
    finally:
        unpatch(model)


def test_plot_draws_a_result_and_refuses_bad_input_in_one_line(hs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from minference.config import load_config

    base = load_config(FIXTURES / "smollm2-135m.json")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_fake_result(base, {(0, 0): 0.02, (3, 2): -0.001, (29, 8): 0.0004})))
    assert hs.main(["plot", str(path), "--out", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'r.png'}"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_fake_result(base, {})))
    for argv, why in (([str(path), "--out", str(tmp_path / "noext")], "image extension"),
                      ([str(empty), "--out", str(tmp_path / "e.png")], "no measured heads")):
        assert hs.main(["plot", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and why in lines[0]


# ---------------------------------------------------------------------------------------------
# Rank agreement: between prompts, and between two results (plot --against).


def _prompted_result(per_prompt: dict, objective: str = "answers", tasks: Sequence[str] = ()) -> dict:
    """A synthetic result of the script's format: ``per_prompt`` maps (layer, head) to its deltas,
    one per prompt (the delta their mean); ``tasks``: each prompt's task (default: all task a)."""
    n = len(next(iter(per_prompt.values())))
    tasks = list(tasks) or ["a"] * n
    heads = [{"layer": l, "head": h, "base": pattern_to_dict(MILD), "probe": pattern_to_dict(PROBE),
              "delta": sum(d) / len(d), "per_prompt": list(d)} for (l, h), d in sorted(per_prompt.items())]
    return {"format": "minference.head_sensitivity", "version": 1, "objective": objective, "model": "smollm2",
            "tokens": N, "samples": 1, "seed": 0, "answers": {"prompts": "set", "tasks": ["a"]},
            "prompts": [f"{t}#{i}" for i, t in enumerate(tasks)], "dense_threshold": 0, "dense_tail": 0,
            "base": {"path": "base.json", "notes": ""}, "probe": {"path": "probe.json", "notes": ""},
            "dense_nll": [3.0] * n, "base_nll": [3.0] * n, "heads": heads, "skipped": 0, "complete": True}


def test_summary_gives_the_prompts_rank_agreement(hs):
    """2 prompts: their value; 3: the mean over the pairs and the least pair; 1: no line; pairs of
    one task apart from pairs across tasks; the advice only when a task's prompts disagree, or when
    no two prompts of a task can be compared."""
    def line(result):
        return [x for x in hs.summary(result).splitlines() if "rank agreement" in x]

    two = _prompted_result({(0, 0): [0.1, 0.3], (1, 0): [0.2, 0.2], (2, 0): [0.3, 0.1]})
    assert line(two) == ["between-prompt rank agreement (Spearman) of the per-head deltas: one task: -1.00 (a#0 vs "
                         "a#1); below 0.5 within a task the per-head ranking is mostly one prompt's noise: measure "
                         "more prompts"]
    alike = _prompted_result({(0, 0): [0.1, 0.2], (1, 0): [0.2, 0.3], (2, 0): [0.3, 0.4]})
    assert line(alike) == ["between-prompt rank agreement (Spearman) of the per-head deltas: one task: +1.00 (a#0 vs "
                           "a#1)"]
    # pairs (0, 1) +1, (0, 2) -1, (1, 2) -1
    three = _prompted_result({(0, 0): [1, 1, 4], (0, 1): [2, 2, 3], (0, 2): [3, 3, 2], (0, 3): [4, 4, 1]})
    assert ("agreement (Spearman) of the per-head deltas: one task: mean -0.33 over 3 pairs, least -1.00 "
            "(a#0 vs a#2); below 0.5 within a task") in hs.summary(three)
    # the same deltas, prompt 2 of task b: a#0 and a#1 agree (+1), the pairs across tasks do not count
    mixed = _prompted_result({(0, 0): [1, 1, 4], (0, 1): [2, 2, 3], (0, 2): [3, 3, 2], (0, 3): [4, 4, 1]},
                             tasks=["a", "a", "b"])
    assert line(mixed) == ["between-prompt rank agreement (Spearman) of the per-head deltas: one task: +1.00 (a#0 vs "
                           "a#1); across tasks: mean -1.00 over 2 pairs, least -1.00 (a#0 vs b#2)"]
    assert hs._agree(mixed) is True and hs._agree(three) is False
    # one prompt per task: nothing to judge by
    split = _prompted_result({(0, 0): [0.1, 0.3], (1, 0): [0.2, 0.2], (2, 0): [0.3, 0.1]}, tasks=["a", "b"])
    assert hs._agree(split) is None
    assert line(split) == ["between-prompt rank agreement (Spearman) of the per-head deltas: across tasks: -1.00 (a#0 "
                           "vs b#1); with one prompt per task the noise cannot be told from heads that one task needs "
                           "and another does not: measure two prompts of a task"]
    one = _prompted_result({(0, 0): [0.1], (1, 0): [0.2], (2, 0): [0.3]})
    assert line(one) == [] and hs.agreement_text(one) is None
    few = _prompted_result({(0, 0): [0.1, 0.3], (1, 0): [0.2, 0.2]})  # 2 heads: undefined, not disagreement
    assert hs._agree(few) is None
    assert line(few) == ["between-prompt rank agreement (Spearman) of the per-head deltas: one task: undefined (fewer "
                         "than 3 heads, or one prompt's deltas all equal)"]


def _saved_figures(monkeypatch) -> list:
    """Each matplotlib Figure saved from now on, kept."""
    from matplotlib.figure import Figure

    saved: list = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), real(fig, *a, **kw))[1])
    return saved


def test_plot_against_another_result_adds_a_scatter_of_the_common_heads(hs, tmp_path, capsys, monkeypatch):
    """--against: a third panel (the map's colorbar a fourth axes) of the heads both measured, on
    symmetric log axes labelled with each objective's units, the rank agreement and count in its
    title, the 5 heads largest on either axis (over that axis' largest magnitude) named; the
    between-prompt agreement in the figure's title."""
    pytest.importorskip("matplotlib")
    figures = _saved_figures(monkeypatch)
    answers = {(0, 0): [0.1, 0.3], (1, 0): [2.0, 2.0], (2, 0): [0.3, 0.1], (3, 0): [-0.5, -0.5],
               (4, 0): [0.01, 0.01], (5, 0): [0.02, 0.02], (6, 0): [0.0, 0.0], (9, 9): [1.0, 1.0]}
    nll = {(0, 0): 0.001, (1, 0): 0.0, (2, 0): 0.004, (3, 0): 0.0001, (4, 0): 0.002, (5, 0): -0.001,
           (6, 0): 0.0002, (7, 7): 0.5}
    # common heads (x = NLL / 0.004, y = answers / 2.0), each head's larger: (0,0) 0.25 / 0.1; (1,0) 0 / 1;
    # (2,0) 1 / 0.1; (3,0) 0.025 / -0.25; (4,0) 0.5 / 0.005; (5,0) -0.25 / 0.01; (6,0) 0.05 / 0
    # -> the 5 named: (1,0), (2,0), (4,0), (0,0), (6,0)
    this, other = tmp_path / "answers.json", tmp_path / "nll.json"
    this.write_text(json.dumps(_prompted_result(answers)))
    other.write_text(json.dumps(_prompted_result({lh: [d] for lh, d in nll.items()}, "perplexity")))
    out = tmp_path / "a.png"
    assert hs.main(["plot", str(this), "--out", str(out), "--against", str(other)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().out.strip() == f"wrote {out}"
    (fig,) = figures
    assert len(fig.axes) == 4
    scatter = fig.axes[2]
    common = sorted(set(answers) & set(nll))
    xs, ys = [nll[lh] for lh in common], [sum(answers[lh]) / 2 for lh in common]
    assert scatter.get_title() == (f"7 heads both measured; Spearman rank agreement "
                                   f"{hs.rank_agreement(xs, ys):+.2f}")
    assert scatter.collections[0].get_offsets().tolist() == [[x, y] for x, y in zip(xs, ys)]  # x: OTHER's
    assert scatter.get_xscale() == scatter.get_yscale() == "symlog"
    assert scatter.get_xlabel() == "perplexity change (nats per token)\nnll.json"
    assert scatter.get_ylabel() == "this result: answers change (nats per answer)"
    assert sorted(t.get_text() for t in scatter.texts) == ["L0H0", "L1H0", "L2H0", "L4H0", "L6H0"]
    assert "between-prompt rank agreement of the deltas: " in fig.get_suptitle()
    # without --against: the two panels and the colorbar
    assert hs.main(["plot", str(other), "--out", str(out)]) == 0
    assert len(figures[-1].axes) == 3 and "between-prompt" not in figures[-1].get_suptitle()


def test_plot_against_refuses_other_models_and_no_common_heads_in_one_line(hs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    this, other = tmp_path / "this.json", tmp_path / "other.json"
    this.write_text(json.dumps(_prompted_result({(0, 0): [0.1], (1, 0): [0.2]})))
    for result, why in ((_prompted_result({(5, 5): [0.1]}, "perplexity"), "no heads in common"),
                        ({**_prompted_result({(0, 0): [0.1]}), "model": "qwen0.5b"},
                         "different models (smollm2 and qwen0.5b)")):
        other.write_text(json.dumps(result))
        assert hs.plot_main([str(this), "--out", str(tmp_path / "x.png"), "--against", str(other)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("head_sensitivity: --against: ") and why in lines[0], lines
        assert not captured.out and not (tmp_path / "x.png").exists()

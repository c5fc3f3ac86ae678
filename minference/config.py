"""PatternConfig: which pattern and budgets each (layer, global query head) uses, and provenance.

A config is plain JSON with a published schema (:data:`SCHEMA`, also in
``fixtures/configs/pattern_config.schema.json``)::

    {"format": "minference.pattern_config", "version": 1,
     "model": {"model_id", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "rope", "weights_fingerprint"},
     "layers": [[pattern, ...per GLOBAL query head], ...per layer],
     "provenance": {"source", "package_version", "created", "hardware", "calibration_fingerprint",
                    "calibration_lengths", "seed", "metric", "target_density", "scores", "densities",
                    "notes"}}

``pattern`` is :func:`minference.patterns.pattern_to_dict` of an :class:`~minference.patterns.AShape`,
:class:`~minference.patterns.VerticalSlash`, :class:`~minference.patterns.BlockSparse` or
:class:`~minference.patterns.Dense`. Kernel tuning never appears here.

The published MInference format is read too (:func:`from_minference`): a JSON list over layers of
``{"<head>": [type, vertical, slash, score]}`` where ``type`` is ``"vertical_and_slash"``
(``VerticalSlash(vertical, slash)``), ``"stream_llm"`` (A-shape: ``AShape(sink=vertical,
window=slash)``) or ``"block_sparse"`` (``BlockSparse(top_k=vertical)``).

Loading is safe for untrusted files: regular files only (a named pipe, a directory or a device is
refused without blocking or reading), a size limit (:data:`MAX_CONFIG_BYTES`, from the file's
stat, before reading), plain :mod:`json` (no
pickle, no code), duplicate keys and non-finite numbers (NaN, Infinity, and literals such as ``1e400``
that overflow to infinity) refused, then the shapes (layer and head counts against ``model``, at most
:data:`MAX_CONFIG_PAIRS` pairs) before any entry, then schema validation by the ``jsonschema``
library (imported on first use), then the pattern dataclasses' own checks. Every error names where in
the file it is (``$.layers[3][5].vertical: must be >= 0, got -1``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, Protocol

import torch

from minference.patterns import (
    PATTERN_TYPES,
    AShape,
    BlockSparse,
    Pattern,
    VerticalSlash,
    pattern_from_dict,
    pattern_to_dict,
)

__all__ = [
    "SCHEMA",
    "FORMAT",
    "VERSION",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_PAIRS",
    "ConfigError",
    "ConfigMismatchError",
    "ModelSignature",
    "Provenance",
    "PatternConfig",
    "GUARD_MODES",
    "GuardSettings",
    "RuntimeSettings",
    "validate_schema",
    "load_config",
    "from_minference",
    "to_minference",
    "model_signature",
    "weights_fingerprint",
    "data_fingerprint",
    "hardware_string",
    "compare_signatures",
]

FORMAT = "minference.pattern_config"
VERSION = 1
#: Refuse config files larger than this (a 128-layer x 128-head config is well under 4 MiB).
MAX_CONFIG_BYTES = 64 * 1024 * 1024
#: Refuse configs with more (layer, head) pairs than this (8x Llama-3.1-405B's 126 x 128), before any
#: pattern entry is validated: the schema walks the entries one by one (a few tenths of a millisecond
#: for each distinct one on a CPU core; repeats are cheaper), so this bounds the work.
MAX_CONFIG_PAIRS = 1 << 17
#: Values sampled per parameter tensor for the weights fingerprint (evenly strided).
FINGERPRINT_SAMPLES = 4096
#: Relative tolerance when comparing floating RoPE settings (JSON round trips floats exactly; this only
#: forgives float32/float64 storage differences such as 1e-5 read back from a GGUF header).
ROPE_RTOL = 1e-6

_SCHEMA_TEXT = r"""{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "$id": "minference/pattern_config.schema.json",
  "title": "minference PatternConfig",
  "description": "Sparse prefill pattern and budgets per layer and GLOBAL query head, with model and provenance.",
  "type": "object",
  "required": ["format", "version", "model", "layers", "provenance"],
  "additionalProperties": false,
  "properties": {
    "format": {"const": "minference.pattern_config"},
    "version": {"const": 1},
    "model": {"$ref": "#/$defs/model"},
    "layers": {
      "description": "layers[l][h]: pattern of layer l, global query head h (TP rank r: r * H_local + h).",
      "type": "array",
      "minItems": 1,
      "items": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/pattern"}}
    },
    "provenance": {"$ref": "#/$defs/provenance"},
    "runtime": {"$ref": "#/$defs/runtime"}
  },
  "$defs": {
    "model": {
      "type": "object",
      "required": ["model_id", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope",
                   "weights_fingerprint"],
      "additionalProperties": false,
      "properties": {
        "model_id": {"type": "string"},
        "architecture": {"type": ["string", "null"]},
        "num_layers": {"type": "integer", "minimum": 1},
        "num_heads": {"type": "integer", "minimum": 1},
        "num_kv_heads": {"type": ["integer", "null"], "minimum": 1},
        "head_dim": {"type": ["integer", "null"], "minimum": 1},
        "rope": {
          "description": "RoPE settings (rope_theta, rope_type, scaling factors); null when not recorded.",
          "type": ["object", "null"]
        },
        "weights_fingerprint": {
          "description": "sha256 of parameter names, shapes, dtypes and a strided value sample; null: not recorded.",
          "type": ["string", "null"]
        }
      }
    },
    "provenance": {
      "type": "object",
      "required": ["source", "package_version"],
      "additionalProperties": false,
      "properties": {
        "source": {"enum": ["search", "minference_json", "manual"]},
        "package_version": {"type": "string"},
        "created": {"type": ["string", "null"]},
        "hardware": {"type": ["string", "null"]},
        "calibration_fingerprint": {"type": ["string", "null"]},
        "calibration_lengths": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 1}},
        "seed": {"type": ["integer", "null"]},
        "metric": {"type": ["string", "null"]},
        "target_density": {"type": ["number", "null"], "minimum": 0},
        "scores": {
          "description": "scores[l][h]: the search metric of the chosen pattern (e.g. captured attention mass).",
          "type": ["array", "null"],
          "items": {"type": "array", "items": {"type": ["number", "null"]}}
        },
        "densities": {
          "description": "densities[l][h]: fraction of causal query-key pairs computed, at the calibration length.",
          "type": ["array", "null"],
          "items": {"type": "array", "items": {"type": ["number", "null"]}}
        },
        "notes": {"type": ["string", "null"]}
      }
    },
    "pattern": {
      "oneOf": [
        {"$ref": "#/$defs/a_shape"},
        {"$ref": "#/$defs/vertical_slash"},
        {"$ref": "#/$defs/block_sparse"},
        {"$ref": "#/$defs/dense"}
      ]
    },
    "a_shape": {
      "type": "object",
      "required": ["kind", "sink", "window"],
      "additionalProperties": false,
      "properties": {
        "kind": {"const": "a_shape"},
        "sink": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "window": {"type": "integer", "minimum": 1, "maximum": 2147483647}
      }
    },
    "vertical_slash": {
      "type": "object",
      "required": ["kind", "vertical", "slash"],
      "additionalProperties": false,
      "properties": {
        "kind": {"const": "vertical_slash"},
        "vertical": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "slash": {"type": "integer", "minimum": 1, "maximum": 2147483647},
        "last_q": {"type": "integer", "minimum": 1, "maximum": 2147483647},
        "sink_columns": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "local_diagonals": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "aggregation": {"enum": ["sum", "max"]},
        "extra_rows": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "rule": {"enum": ["top_k", "mass", "relative"]},
        "threshold": {
          "description": "gamma of rule 'mass' or alpha of rule 'relative', in (0, 1]; null for 'top_k'.",
          "type": ["number", "null"], "minimum": 0, "maximum": 1
        },
        "min_vertical": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "min_slash": {"type": "integer", "minimum": 0, "maximum": 2147483647}
      }
    },
    "block_sparse": {
      "type": "object",
      "required": ["kind", "top_k"],
      "additionalProperties": false,
      "properties": {
        "kind": {"const": "block_sparse"},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 2147483647},
        "block": {"type": "integer", "minimum": 1, "maximum": 2147483647},
        "sink_blocks": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "force_diagonal": {"type": "boolean"},
        "rule": {"enum": ["top_k", "mass", "relative"]},
        "threshold": {
          "description": "gamma of rule 'mass' or alpha of rule 'relative', in (0, 1]; null for 'top_k'.",
          "type": ["number", "null"], "minimum": 0, "maximum": 1
        },
        "min_blocks": {"type": "integer", "minimum": 0, "maximum": 2147483647},
        "estimate": {"enum": ["pooled", "query"]},
        "score_rows": {
          "description": "queries of a block that score it (estimate 'query'): 0 all, r: r of them, block // r apart.",
          "type": "integer", "minimum": 0, "maximum": 2147483647
        }
      }
    },
    "dense": {
      "type": "object",
      "required": ["kind"],
      "additionalProperties": false,
      "properties": {"kind": {"const": "dense"}}
    },
    "runtime": {
      "description": "How the config is run, set by the operator, not found by the search (optional; defaults apply).",
      "type": "object",
      "additionalProperties": false,
      "properties": {"guard": {"$ref": "#/$defs/guard"}}
    },
    "guard": {
      "description": "The quality guard (minference.guard, docs/guard.md); fields left out take their defaults.",
      "type": "object",
      "additionalProperties": false,
      "properties": {
        "mode": {"enum": ["off", "observe", "enforce"]},
        "sample_rate": {"type": "number", "minimum": 0, "maximum": 1},
        "tail_rows": {"type": "integer", "minimum": 0, "maximum": 65536},
        "spread_rows": {"type": "integer", "minimum": 0, "maximum": 65536},
        "min_mass": {"type": "number", "minimum": 0, "maximum": 1},
        "flag_rate": {"type": "number", "minimum": 0, "maximum": 1},
        "flag_min_calls": {"type": "integer", "minimum": 1, "maximum": 2147483647},
        "max_saved_prompts": {"type": "integer", "minimum": 0, "maximum": 65536},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2147483647}
      }
    }
  }
}
"""
#: The published JSON schema (identical to ``fixtures/configs/pattern_config.schema.json``).
SCHEMA: dict = json.loads(_SCHEMA_TEXT)


class ConfigError(ValueError):
    """A config file or object that is malformed (the message says where)."""


class ConfigMismatchError(ValueError):
    """A config made for a different model (the message lists every difference)."""

    def __init__(self, differences: list[str]):
        self.differences = list(differences)
        super().__init__(
            "pattern config does not match the model:\n  - " + "\n  - ".join(self.differences)
            + "\npass allow_mismatch=True (CLI: --allow-mismatch) to use it anyway"
        )


# ---------------------------------------------------------------------------------------------
# Schema validation: the maintained ``jsonschema`` library, imported on first use (``import
# minference`` works without it; loading a config needs it).

#: What the message says when ``jsonschema`` is missing (a machine without a package index).
JSONSCHEMA_HINT = (
    "validating a pattern config needs the 'jsonschema' package: pip install 'jsonschema>=4.18' "
    "(offline: carry the wheels of jsonschema, jsonschema-specifications, referencing and rpds-py; attrs "
    "and typing-extensions are its other needs)"
)
_INT32_MAX = 2**31 - 1


def _is_integer(checker: Any, x: Any) -> bool:
    """JSON-schema ``integer``, strictly: a Python int (not a bool). Draft 2020-12 also counts 2.0,
    which the pattern dataclasses would then hold as a float."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_number(checker: Any, x: Any) -> bool:
    """JSON-schema ``number`` without NaN and +-inf (a dict built in Python can hold them)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


def _local(root: dict, ref: str) -> Any:
    """The node a local ``$ref`` (``#/...``) names, or ``None``."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _union_tag(root: dict, branches: Any) -> tuple[str, list[str]] | None:
    """``(key, [tag per branch])`` when every ``oneOf`` branch is an object schema that requires the
    same property ``key`` to be a distinct string ``const`` (a tagged union: the pattern ``kind``)."""
    if not isinstance(branches, list) or not branches:
        return None
    tags = []
    for b in branches:
        if isinstance(b, dict) and set(b) == {"$ref"}:
            b = _local(root, b["$ref"])
        if not isinstance(b, dict):
            return None
        consts = [(k, p["const"]) for k, p in b.get("properties", {}).items() if isinstance(p, dict) and "const" in p]
        if len(consts) != 1 or not isinstance(consts[0][1], str) or consts[0][0] not in b.get("required", []):
            return None
        tags.append(consts[0])
    keys = {k for k, _ in tags}
    values = [v for _, v in tags]
    if len(keys) != 1 or len(set(values)) != len(values):
        return None
    return keys.pop(), values


#: Distinct valid pattern entries remembered per validator class.
_MEMO_ENTRIES = 1 << 16


def _entry_key(entry: dict) -> tuple | None:
    """A hashable key of a flat entry that tells ``1``, ``1.0`` and ``True`` apart (they are equal in
    Python, not in a schema); ``None`` when a value is not a JSON scalar."""
    key = []
    for name, value in entry.items():
        if value is not None and not isinstance(value, (str, int, float)):
            return None
        key.append((name, type(value), value))
    return tuple(sorted(key, key=lambda item: item[0]))


class _TypeChecker(Protocol):
    """The part of a jsonschema ``TypeChecker`` that :func:`_validator_class` uses."""

    def redefine_many(self, definitions: dict[str, Callable[[Any, Any], bool]]) -> _TypeChecker: ...


class _ValidatorClass(Protocol):
    """The parts of a jsonschema validator class (``jsonschema.protocols.Validator``) that
    :func:`_validator_class` reads (jsonschema ships no type information)."""

    VALIDATORS: ClassVar[dict[str, Callable[..., Iterator[Exception]]]]
    TYPE_CHECKER: ClassVar[_TypeChecker]


def _validator_class(draft: type[_ValidatorClass], root: dict) -> type:
    """``draft`` (a jsonschema validator class) with the strict ``integer`` and finite ``number``
    types, and ``oneOf`` told tagged unions of ``root`` (the schema) apart by their tag."""
    import jsonschema

    library_one_of = draft.VALIDATORS["oneOf"]
    tags: dict[int, tuple[str, list[str]] | None] = {}
    known_valid: set = set()  # (id(branch), entry key) of entries found valid: validity is a pure function

    def one_of(validator, branches, instance, schema):
        # A tagged union validates only the branch its tag names: the same verdict as oneOf (each
        # other branch fails on its const), that branch's own errors (the library's oneOf says only
        # "not valid under any of the given schemas"), and a quarter of the work for four kinds.
        key = id(branches)  # a list inside ``root``, alive as long as the class
        if key not in tags:
            tags[key] = _union_tag(root, branches)
        tag = tags[key]
        if tag is None or not isinstance(instance, dict):
            yield from library_one_of(validator, branches, instance, schema)
            return
        name, values = tag
        if name not in instance:
            yield jsonschema.ValidationError(f"missing required field {name!r}", validator="required",
                                             validator_value=[name], instance=instance)
            return
        value = instance[name]
        if not isinstance(value, str) or value not in values:
            yield jsonschema.ValidationError(f"must be one of {sorted(values)}", validator="enum", path=[name],
                                             validator_value=sorted(values), instance=value)
            return
        i = values.index(value)
        # A searched config repeats a few distinct patterns (the bundled ones: 9 in 336 heads, 5 in
        # 270), so each distinct valid entry is walked once.
        memo = _entry_key(instance)
        if memo is not None:
            memo = (id(branches[i]), memo)
            if memo in known_valid:
                return
        failed = False
        for error in validator.descend(instance, branches[i], schema_path=i):
            failed = True
            yield error
        if memo is not None and not failed:
            if len(known_valid) >= _MEMO_ENTRIES:
                known_valid.clear()
            known_valid.add(memo)

    types = draft.TYPE_CHECKER.redefine_many({"integer": _is_integer, "number": _is_finite_number})
    return jsonschema.validators.extend(draft, validators={"oneOf": one_of}, type_checker=types)


def _jsonschema():
    try:
        import jsonschema
        import jsonschema.validators
    except ImportError as err:
        raise ImportError(JSONSCHEMA_HINT) from err
    return jsonschema


def _make_validator(schema: dict, *, check: bool) -> Any:
    jsonschema = _jsonschema()
    draft = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if check:
        try:
            draft.check_schema(schema)
        except jsonschema.SchemaError as err:
            raise ConfigError(f"schema is not a valid {draft.__name__} schema: {err.message}") from None
    return _validator_class(draft, schema)(schema)


@functools.lru_cache(maxsize=1)
def _schema_validator() -> Any:
    return _make_validator(SCHEMA, check=False)  # SCHEMA is checked against its meta-schema by the tests


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: Any) -> str:
    """One line naming the JSON path (``$.layers[3][5].vertical``) and what is wrong there."""
    return f"{err.json_path}: {_detail(err)}"


def _detail(err: Any) -> str:
    kind, rule, x = err.validator, err.validator_value, err.instance
    if kind == "type":
        if isinstance(x, float) and not math.isfinite(x):
            return f"non-finite number {x} is not allowed in a config"
        types = rule if isinstance(rule, list) else [rule]
        return f"must be {' or '.join(types)}, got {type(x).__name__} {_short(x)}"
    if kind == "const":
        return f"must be {rule!r}, got {_short(x)}"
    if kind == "enum":
        return f"must be one of {rule}, got {_short(x)}"
    if kind in ("minimum", "maximum"):
        return f"must be {'>=' if kind == 'minimum' else '<='} {rule}, got {_short(x)}"
    if kind == "minItems":
        return f"needs at least {rule} item(s), got {len(x)}"
    if kind == "required" and isinstance(x, dict):
        missing = [k for k in rule if k not in x]
        return f"missing required field {missing[0]!r}"
    if kind == "additionalProperties" and rule is False and isinstance(x, dict):
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(k for k in x if k not in allowed)
        return f"unknown field {extra[0]!r} (allowed: {allowed})"
    if kind == "oneOf":
        if not err.context:
            return "must match exactly one alternative, matched more than one"
        from jsonschema.exceptions import best_match

        return f"must match exactly one alternative, matched none; closest: {_message(best_match(err.context))}"
    return err.message


def validate_schema(data: Any, schema: dict | None = None) -> None:
    """Raise :class:`ConfigError` (naming the JSON path) unless ``data`` satisfies ``schema``
    (default :data:`SCHEMA`), by the ``jsonschema`` library under the draft the schema declares
    (Draft 2020-12 when it declares none). Two deliberate differences from the spec: ``integer``
    excludes 2.0 and ``number`` excludes NaN and infinities. The first error found is reported."""
    validator = _schema_validator() if schema is None else _make_validator(schema, check=True)
    err = next(iter(validator.iter_errors(data)), None)
    if err is not None:
        raise ConfigError(_message(err))


def _check_shape(num_layers: Any, num_heads: Any, layers: list) -> None:
    """Layer and head counts (``layers[l]`` holds the patterns of layer ``l``) against the model's,
    and the :data:`MAX_CONFIG_PAIRS` limit: O(layers) work, done before any entry is looked at.
    Counts that are not positive ints are left to the schema (which then reports them)."""
    rows = [row for row in layers if isinstance(row, list)]
    pairs = max(len(layers), sum(len(row) for row in rows))
    if _positive_int(num_layers) and _positive_int(num_heads):
        pairs = max(pairs, num_layers * num_heads)
    if pairs > MAX_CONFIG_PAIRS:
        raise ConfigError(f"config has {pairs} (layer, head) pairs, more than the limit of {MAX_CONFIG_PAIRS} "
                          f"(minference.config.MAX_CONFIG_PAIRS)")
    if _positive_int(num_layers) and len(layers) != num_layers:
        raise ConfigError(f"layers has {len(layers)} entries but model.num_layers is {num_layers}")
    if _positive_int(num_heads):
        for l, row in enumerate(layers):
            if isinstance(row, list) and len(row) != num_heads:
                raise ConfigError(f"layers[{l}] has {len(row)} heads but model.num_heads is {num_heads}")


def _positive_int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


# ---------------------------------------------------------------------------------------------
# Runtime settings: how a config is run (set by the operator), kept apart from the searched pattern
# data. Optional in the file ("runtime"); every field left out takes its default here.

#: Modes of the quality guard (:mod:`minference.guard`, docs/guard.md).
GUARD_MODES = ("off", "observe", "enforce")


def _setting_error(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"guard.{name} must be {rule}, got {value!r}")


def _int_setting(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _setting_error(name, f"an int in [{lo}, {hi}]", value)


def _unit_setting(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise _setting_error(name, "a number in [0, 1]", value)  # NaN fails the comparison too


@dataclass(frozen=True)
class GuardSettings:
    """Settings of the quality guard (:class:`minference.guard.QualityGuard`; docs/guard.md).

    Attributes:
        mode: ``"off"`` (default: nothing runs), ``"observe"`` (sampled calls are checked and
            reported) or ``"enforce"`` (also: on a checked call, a head whose captured mass is
            below ``min_mass`` is recomputed densely).
        sample_rate: fraction of prefill calls (model forwards that run a sparse layer) that are
            checked, drawn at random (``seed``); 1 checks every call.
        tail_rows: query rows checked per batch row at the end of the rows the pattern computes
            (the rows that make the first generated token; with a dense tail, the rows just before it).
        spread_rows: query rows checked per batch row, spread evenly over the earlier rows.
        min_mass: the floor on a head's captured attention mass (mean over its checked rows).
        flag_rate: the config is flagged for re-search once at least this fraction of the
            checked calls had a head below the floor ...
        flag_min_calls: ... over at least this many checked calls.
        max_saved_prompts: prompt ids kept of the calls that had a head below the floor.
        seed: seed of the sampling draws.
    """

    mode: str = "off"
    sample_rate: float = 0.0625
    tail_rows: int = 16
    spread_rows: int = 16
    min_mass: float = 0.5
    flag_rate: float = 0.05
    flag_min_calls: int = 20
    max_saved_prompts: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in GUARD_MODES:
            raise _setting_error("mode", f"one of {GUARD_MODES}", self.mode)
        for name in ("sample_rate", "min_mass", "flag_rate"):
            _unit_setting(name, getattr(self, name))
        for name, hi in (("tail_rows", 65536), ("spread_rows", 65536), ("max_saved_prompts", 65536),
                         ("flag_min_calls", 2**31 - 1), ("seed", 2**31 - 1)):
            _int_setting(name, getattr(self, name), 1 if name == "flag_min_calls" else 0, hi)
        if self.tail_rows + self.spread_rows == 0:
            raise ValueError("guard.tail_rows + guard.spread_rows must be >= 1 (no query row to check)")


@dataclass(frozen=True)
class RuntimeSettings:
    """How a config is run: settings an operator sets, which the offline search never writes."""

    guard: GuardSettings = field(default_factory=GuardSettings)

    def to_dict(self) -> dict:
        """The fields that differ from their defaults (``{}`` when all are defaults)."""
        guard = {k: v for k, v in dataclasses.asdict(self.guard).items() if v != getattr(GuardSettings, k)}
        return {"guard": guard} if guard else {}

    @classmethod
    def from_dict(cls, data: Any) -> RuntimeSettings:
        """From the ``runtime`` object of a config (already schema-checked, or a plain dict)."""
        if data is None:
            return cls()
        if not isinstance(data, dict) or set(data) - {"guard"}:
            raise ConfigError(f"$.runtime: must be an object with the field 'guard' only, got {_short(data)}")
        guard = data.get("guard", {})
        if not isinstance(guard, dict):
            raise ConfigError(f"$.runtime.guard: must be an object, got {_short(guard)}")
        try:
            return cls(GuardSettings(**guard))
        except TypeError as err:  # an unknown field
            raise ConfigError(f"$.runtime.guard: {err}") from None
        except ValueError as err:
            raise ConfigError(f"$.runtime.{err}") from None


# ---------------------------------------------------------------------------------------------
# The config objects.


@dataclass(frozen=True)
class ModelSignature:
    """What a config was made for; ``None`` fields were not recorded and are not checked."""

    model_id: str
    architecture: str | None
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope: dict | None = None
    weights_fingerprint: str | None = None


@dataclass
class Provenance:
    """How a config was made (search settings, scores, versions, machine)."""

    source: str = "manual"
    package_version: str = ""
    created: str | None = None
    hardware: str | None = None
    calibration_fingerprint: str | None = None
    calibration_lengths: list[int] | None = None
    seed: int | None = None
    metric: str | None = None
    target_density: float | None = None
    scores: list[list[float | None]] | None = None
    densities: list[list[float | None]] | None = None
    notes: str | None = None


@dataclass
class PatternConfig:
    """Patterns per layer and GLOBAL query head, for one model.

    Attributes:
        model: the model signature the config was made for.
        layers: ``layers[l][h]`` is the pattern of layer ``l``, global query head ``h``.
        provenance: how it was made.
        runtime: how it is run (:class:`RuntimeSettings`: the quality guard's mode and thresholds);
            not searched, written to the file only where it differs from the defaults.
    """

    model: ModelSignature
    layers: list[list[Pattern]]
    provenance: Provenance = field(default_factory=Provenance)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def __post_init__(self) -> None:
        _check_shape(self.model.num_layers, self.model.num_heads, self.layers)
        for l, row in enumerate(self.layers):
            for h, p in enumerate(row):
                if not isinstance(p, tuple(PATTERN_TYPES.values())):
                    raise ConfigError(f"layers[{l}][{h}] is not a pattern: {type(p).__name__}")

    def plan(self, layer: int) -> list[Pattern]:
        """Patterns of ``layer`` indexed by global query head (the dispatcher's ``plan``)."""
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        return list(self.layers[layer])

    def counts(self) -> dict[str, int]:
        """How many (layer, head) pairs use each pattern kind."""
        out = {kind: 0 for kind in PATTERN_TYPES}
        for row in self.layers:
            for p in row:
                out[p.kind] += 1
        return out

    def to_dict(self) -> dict:
        """Plain-JSON form (satisfies :data:`SCHEMA`)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": dataclasses.asdict(self.model),
            "layers": [[pattern_to_dict(p) for p in row] for row in self.layers],
            "provenance": dataclasses.asdict(self.provenance),
            **({"runtime": runtime} if (runtime := self.runtime.to_dict()) else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> PatternConfig:
        """Validate ``data`` against :data:`SCHEMA` and build the config.

        The shapes are checked first (layer and head counts against ``model``, at most
        :data:`MAX_CONFIG_PAIRS` pairs: work proportional to the layers), then every entry."""
        if isinstance(data, dict) and isinstance(data.get("layers"), list):
            model = given if isinstance(given := data.get("model"), dict) else {}
            _check_shape(model.get("num_layers"), model.get("num_heads"), data["layers"])
        validate_schema(data)
        layers = []
        for l, row in enumerate(data["layers"]):
            built = []
            for h, p in enumerate(row):
                try:
                    built.append(pattern_from_dict(dict(p)))
                except (TypeError, ValueError) as err:
                    raise ConfigError(f"$.layers[{l}][{h}]: {err}") from None
            layers.append(built)
        return cls(ModelSignature(**data["model"]), layers, Provenance(**data["provenance"]),
                   RuntimeSettings.from_dict(data.get("runtime")))

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as indented JSON (one head per line)."""
        data = self.to_dict()
        with open(path, "w", encoding="utf-8") as f:
            f.write(_dumps(data))

    def check(self, signature: ModelSignature, *, allow_mismatch: bool = False) -> list[str]:
        """Compare with ``signature``; raise :class:`ConfigMismatchError` on any difference unless
        ``allow_mismatch`` (then the differences are returned). Heads/layers must still fit."""
        diffs = compare_signatures(self.model, signature)
        if diffs and not allow_mismatch:
            raise ConfigMismatchError(diffs)
        if signature.num_layers > len(self.layers) or signature.num_heads > self.model.num_heads:
            raise ConfigMismatchError(
                diffs + [f"config covers {len(self.layers)} layers x {self.model.num_heads} heads, the model needs "
                         f"{signature.num_layers} x {signature.num_heads}: cannot be used even with allow_mismatch"]
            )
        return diffs


def _dumps(data: dict) -> str:
    """JSON with one pattern per line: readable diffs of configs."""
    layers = data["layers"]
    body = dict(data, layers="__LAYERS__")
    text = json.dumps(body, indent=2, allow_nan=False)
    rows = ",\n".join(
        "    [\n" + ",\n".join("      " + json.dumps(p, allow_nan=False) for p in row) + "\n    ]" for row in layers
    )
    return text.replace('"__LAYERS__"', "[\n" + rows + "\n  ]") + "\n"


# ---------------------------------------------------------------------------------------------
# Loading.


def _reject_constant(name: str) -> None:
    raise ConfigError(f"non-finite number {name} is not allowed in a config")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: valid JSON, but a float64 overflows to infinity
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ConfigError(f"non-finite number {shown} (overflows to {value}) is not allowed in a config")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_regular_file(path: str | os.PathLike) -> bytes:
    """The bytes of ``path`` if it is a regular file (symlinks followed) of at most
    :data:`MAX_CONFIG_BYTES`, else a :class:`ConfigError` before anything is read.

    Opened non-blocking, then the open file is ``fstat``-ed: a named pipe without a writer would
    block ``open()`` for ever, a character device (``/dev/zero``) reads without end, and a check
    on the path before opening could be raced by a swap. The size limit comes from the stat, not
    from reading; the read itself stops one byte past the limit (a file that grows meanwhile).
    A missing file stays a ``FileNotFoundError``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{os.fsdecode(path)} is {_file_kind(info.st_mode)}, not a regular file; a config is "
                              "read from a regular file, bytes, or parsed JSON")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{os.fsdecode(path)}: {info.st_size} bytes exceeds the {MAX_CONFIG_BYTES}-byte limit "
                              "for configs")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def _read_json(source: str | os.PathLike | bytes | bytearray | memoryview) -> Any:
    if isinstance(source, (bytes, bytearray, memoryview)):
        raw = bytes(source)
    elif not isinstance(source, (str, os.PathLike)):
        # an int would be taken for a file descriptor by open() and os.path.getsize()
        raise TypeError(f"config source must be a path, bytes, or parsed JSON (dict or list), "
                        f"got {type(source).__name__}")
    else:
        raw = _read_regular_file(source)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config exceeds the {MAX_CONFIG_BYTES}-byte limit")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float,
                          object_pairs_hook=_no_duplicates)
    except ConfigError:
        raise
    except UnicodeDecodeError as err:
        raise ConfigError(f"config is not UTF-8 text: {err}") from None
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than int() converts
        raise ConfigError(f"config is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError("config is nested too deeply to be a pattern config") from None


def load_config(
    source: str | os.PathLike | bytes | dict | list,
    model: Any = None,
    *,
    signature: ModelSignature | None = None,
    allow_mismatch: bool = False,
    fingerprint: bool = True,
) -> PatternConfig:
    """Load a PatternConfig (native or MInference format) and check it against the model.

    Args:
        source: a path (str or os.PathLike) to a regular file, raw bytes, or already-parsed JSON
            (dict: native format; list: MInference). Anything else raises TypeError; a path that
            is not a regular file (a directory, a named pipe, a device such as ``/dev/zero``) or
            is larger than :data:`MAX_CONFIG_BYTES` raises :class:`ConfigError` before any byte
            is read (nothing blocks, nothing is read without a bound).
        model: a transformers model to check against (its signature is computed, with the weights
            fingerprint when ``fingerprint``); or pass ``signature`` directly. Neither: no check.
        allow_mismatch: use the config even if it was made for a different model (the caller
            knows better); head and layer counts must still cover the model.
    """
    data = source if isinstance(source, (dict, list)) else _read_json(source)
    if model is not None and signature is None:
        signature = model_signature(model, fingerprint=fingerprint)
    if isinstance(data, list):
        config = from_minference(data, signature=signature)
    elif isinstance(data, dict):
        config = PatternConfig.from_dict(data)
    else:
        kind = type(data).__name__
        raise ConfigError(f"config must be a JSON object (native) or list (MInference format), got {kind}")
    if signature is not None:
        config.check(signature, allow_mismatch=allow_mismatch)
    return config


# ---------------------------------------------------------------------------------------------
# The published MInference format.

_MINF_TYPES = ("vertical_and_slash", "stream_llm", "block_sparse")


def _int_budget(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: budget must be an integer, got {_short(value)}")
    if int(value) != value:
        raise ConfigError(f"{where}: budget must be an integer, got {value}")
    if value > _INT32_MAX:  # as the native schema's "maximum": the kernels index in int32
        raise ConfigError(f"{where}: budget must be <= {_INT32_MAX} (int32), got {int(value)}")
    return int(value)


def _minference_pattern(entry: Any, where: str) -> tuple[Pattern, float | None]:
    if not isinstance(entry, list) or len(entry) != 4:
        raise ConfigError(f"{where}: expected [type, vertical, slash, score], got {_short(entry)}")
    kind, v, s, score = entry
    if kind not in _MINF_TYPES:
        raise ConfigError(f"{where}: unknown pattern type {kind!r}; expected one of {list(_MINF_TYPES)}")
    v, s = _int_budget(v, f"{where}[1]"), _int_budget(s, f"{where}[2]")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))
                              or not math.isfinite(score)):
        raise ConfigError(f"{where}[3]: score must be a finite number or null, got {_short(score)}")
    try:
        if kind == "vertical_and_slash":
            pattern: Pattern = VerticalSlash(vertical=v, slash=s)
        elif kind == "stream_llm":
            pattern = AShape(sink=v, window=s)
        else:
            pattern = BlockSparse(top_k=v)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
    return pattern, None if score is None else float(score)


def from_minference(data: Any, *, signature: ModelSignature | None = None, model_id: str = "unknown") -> PatternConfig:
    """Read the published MInference config format: a list over layers of
    ``{"<head>": [type, vertical, slash, score]}`` with every head ``0..H-1`` present.

    The file records no model, so the signature is taken from ``signature`` where given (only the
    layer and head counts are checked against the file); otherwise from the file's own counts.
    Layer 0 sets the head count; every layer's count (and :data:`MAX_CONFIG_PAIRS`) is checked
    before any entry is read.
    """
    if isinstance(data, (str, bytes, bytearray, memoryview, os.PathLike)):
        data = _read_json(data)
    if not isinstance(data, list) or not data:
        raise ConfigError("MInference config must be a non-empty JSON list over layers")
    for l, row in enumerate(data):
        if not isinstance(row, dict) or not row:
            raise ConfigError(f"$[{l}]: expected an object mapping head index to a pattern, got {_short(row)}")
    num_heads = len(data[0])
    if len(data) * num_heads > MAX_CONFIG_PAIRS:
        raise ConfigError(f"config has {len(data) * num_heads} (layer, head) pairs, more than the limit of "
                          f"{MAX_CONFIG_PAIRS} (minference.config.MAX_CONFIG_PAIRS)")
    for l, row in enumerate(data):
        if len(row) != num_heads:
            raise ConfigError(f"$[{l}]: heads must be 0..{num_heads - 1} (as in layer 0), got {len(row)} heads")
    layers, scores = [], []
    for l, row in enumerate(data):
        heads = {}
        for key, entry in row.items():
            if not isinstance(key, str) or not re.fullmatch(r"0|[1-9][0-9]*", key):
                raise ConfigError(f"$[{l}]: head key {key!r} is not a non-negative integer")
            heads[int(key)] = _minference_pattern(entry, f"$[{l}][{key!r}]")
        if sorted(heads) != list(range(num_heads)):
            missing = sorted(set(range(num_heads)) - set(heads))
            raise ConfigError(f"$[{l}]: heads must be 0..{num_heads - 1} (as in layer 0); missing {missing}, "
                              f"got {len(heads)} heads")
        layers.append([heads[h][0] for h in range(num_heads)])
        scores.append([heads[h][1] for h in range(num_heads)])
    recorded = ModelSignature(model_id=model_id, architecture=None, num_layers=len(layers), num_heads=num_heads)
    if signature is not None:
        recorded = dataclasses.replace(
            signature, num_layers=len(layers), num_heads=num_heads,
        )
    provenance = Provenance(source="minference_json", package_version=_version(), metric="minference_score",
                            scores=scores, created=_now())
    return PatternConfig(recorded, layers, provenance)


def to_minference(config: PatternConfig) -> list[dict]:
    """Write a config in the MInference format (Dense heads and the adaptive budget rules cannot be
    expressed and raise)."""
    out = []
    for l, row in enumerate(config.layers):
        layer = {}
        for h, p in enumerate(row):
            score = None
            if config.provenance.scores is not None:
                score = config.provenance.scores[l][h]
            if (rule := getattr(p, "rule", "top_k")) != "top_k":
                raise ConfigError(f"layer {l} head {h}: budget rule {rule!r} has no MInference-format equivalent")
            if isinstance(p, VerticalSlash):
                layer[str(h)] = ["vertical_and_slash", p.vertical, p.slash, score]
            elif isinstance(p, AShape):
                layer[str(h)] = ["stream_llm", p.sink, p.window, score]
            elif isinstance(p, BlockSparse):
                layer[str(h)] = ["block_sparse", p.top_k, 0, score]
            else:
                raise ConfigError(f"layer {l} head {h}: {type(p).__name__} has no MInference-format equivalent")
        out.append(layer)
    return out


# ---------------------------------------------------------------------------------------------
# Model signatures and fingerprints.


def _version() -> str:
    from minference import __version__

    return __version__


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def hardware_string() -> str:
    """The machine a config was searched on: CPU/GPU names, core count, torch version."""
    parts = [platform.machine(), platform.processor() or platform.system(), f"{os.cpu_count()} cpus"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    parts.append(f"torch {torch.__version__}")
    return ", ".join(p for p in parts if p)


def weights_fingerprint(model: torch.nn.Module, samples: int = FINGERPRINT_SAMPLES) -> str:
    """sha256 over every parameter's name and shape and ``samples`` evenly strided values, so two
    different checkpoints of one architecture differ without hashing it all.

    The values are rounded to bfloat16 and the dtype is not hashed: one checkpoint loaded in
    float32 (a config searched on a CPU) and in bfloat16 (served on a GPU) is one model. A
    parameter sharded by tensor parallelism (a DTensor) is gathered first, one at a time, so a
    sharded model hashes as the whole one; every rank must call this (it is a collective)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not isinstance(p, torch.Tensor):
            continue
        if hasattr(p, "full_tensor") and hasattr(p, "placements"):  # torch.distributed.tensor.DTensor
            p = p.full_tensor()
        h.update(f"{name}|{tuple(p.shape)}".encode())
        flat = p.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].to(device="cpu", dtype=torch.bfloat16).float().contiguous()
        h.update(sample.numpy().tobytes())
    return "sha256:" + h.hexdigest()


def data_fingerprint(texts: list[str] | list[list[int]]) -> str:
    """sha256 of calibration data (texts or token id lists), order-sensitive."""
    h = hashlib.sha256()
    for t in texts:
        h.update(json.dumps(t).encode())
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def _rope(cfg: Any) -> dict | None:
    rope = getattr(cfg, "rope_parameters", None)
    if rope is None:
        theta = getattr(cfg, "rope_theta", None)
        scaling = getattr(cfg, "rope_scaling", None)
        if theta is None and scaling is None:
            return None
        rope = dict(scaling or {})
        if theta is not None:
            rope["rope_theta"] = theta
    if not isinstance(rope, dict):
        return None
    out: dict[str, int | float | str | list[int | float] | None] = {}
    for key, value in rope.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) for x in value):
            out[key] = list(value)
    if getattr(cfg, "partial_rotary_factor", None) is not None and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    return out


def model_signature(model: Any, *, model_id: str | None = None, fingerprint: bool = True) -> ModelSignature:
    """Signature of a transformers model (layers, heads, kv heads, head dim, rope, fingerprint)."""
    cfg = getattr(model, "config", model)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text_cfg.num_attention_heads)
    kv = getattr(text_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    arch = (getattr(cfg, "architectures", None) or [None])[0] or getattr(cfg, "model_type", None)
    name = model_id or getattr(cfg, "name_or_path", None) or getattr(cfg, "_name_or_path", None) or "unknown"
    fp = weights_fingerprint(model) if fingerprint and isinstance(model, torch.nn.Module) else None
    return ModelSignature(
        model_id=str(name), architecture=arch, num_layers=int(text_cfg.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(kv), head_dim=int(head_dim), rope=_rope(text_cfg), weights_fingerprint=fp,
    )


def _values_differ(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return not math.isclose(a, b, rel_tol=ROPE_RTOL)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) != set(b) or any(_values_differ(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_values_differ(x, y) for x, y in zip(a, b))
    return a != b


def compare_signatures(config: ModelSignature, model: ModelSignature) -> list[str]:
    """Human-readable differences between the config's recorded model and ``model`` (fields
    recorded as ``None`` on either side are not compared; ``model_id`` is informational)."""
    diffs = []
    for f in ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope", "weights_fingerprint"):
        a, b = getattr(config, f), getattr(model, f)
        if a is None or b is None:
            continue
        if _values_differ(a, b):
            diffs.append(f"{f}: config has {a!r}, model has {b!r}")
    return diffs

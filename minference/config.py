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

Loading is safe for untrusted files: a size limit, plain :mod:`json` (no pickle, no code), duplicate
keys and NaN/Infinity refused, then schema validation by the small validator in this module (no
``jsonschema`` dependency), then the pattern dataclasses' own checks. Every error names where in the
file it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

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
    "ConfigError",
    "ConfigMismatchError",
    "ModelSignature",
    "Provenance",
    "PatternConfig",
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
    "provenance": {"$ref": "#/$defs/provenance"}
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
        "estimate": {"enum": ["pooled", "query"]}
      }
    },
    "dense": {
      "type": "object",
      "required": ["kind"],
      "additionalProperties": false,
      "properties": {"kind": {"const": "dense"}}
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
# A small JSON-schema validator for the subset SCHEMA uses.

_ANNOTATIONS = {"$schema", "$id", "$defs", "$comment", "title", "description", "default"}
_TYPES = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "boolean": lambda x: isinstance(x, bool),
    "null": lambda x: x is None,
}


def _resolve(root: dict, ref: str) -> dict:
    if not ref.startswith("#/"):
        raise ConfigError(f"schema: only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _discriminated(root: dict, branches: list, instance: Any) -> dict | None:
    """The one ``oneOf`` branch whose ``const`` property matches ``instance`` (clear errors for tagged unions)."""
    if not isinstance(instance, dict):
        return None
    resolved = [_resolve(root, b["$ref"]) if "$ref" in b else b for b in branches]
    tags = []
    for b in resolved:
        consts = [(k, p["const"]) for k, p in b.get("properties", {}).items() if isinstance(p, dict) and "const" in p]
        if len(consts) != 1:
            return None
        tags.append(consts[0])
    keys = {k for k, _ in tags}
    if len(keys) != 1:
        return None
    (key,) = keys
    for (_, value), b in zip(tags, resolved):
        if instance.get(key) == value:
            return b
    allowed = sorted(str(v) for _, v in tags)
    raise ConfigError(f"{{path}}.{key}: must be one of {allowed}, got {instance.get(key)!r}")


def _validate(root: dict, schema: dict, x: Any, path: str) -> None:
    for key in schema:
        if key not in _ANNOTATIONS and key not in _KEYWORDS:
            raise ConfigError(f"schema: unsupported keyword {key!r} at {path}")
    if "$ref" in schema:
        _validate(root, _resolve(root, schema["$ref"]), x, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](x) for t in types):
            raise ConfigError(f"{path}: must be {' or '.join(types)}, got {type(x).__name__} {_short(x)}")
    if "const" in schema and not _json_equal(x, schema["const"]):
        raise ConfigError(f"{path}: must be {schema['const']!r}, got {_short(x)}")
    if "enum" in schema and not any(_json_equal(x, e) for e in schema["enum"]):
        raise ConfigError(f"{path}: must be one of {schema['enum']}, got {_short(x)}")
    if _TYPES["number"](x):
        if "minimum" in schema and x < schema["minimum"]:
            raise ConfigError(f"{path}: must be >= {schema['minimum']}, got {x}")
        if "maximum" in schema and x > schema["maximum"]:
            raise ConfigError(f"{path}: must be <= {schema['maximum']}, got {x}")
    if isinstance(x, list):
        if "minItems" in schema and len(x) < schema["minItems"]:
            raise ConfigError(f"{path}: needs at least {schema['minItems']} item(s), got {len(x)}")
        if "items" in schema:
            for i, item in enumerate(x):
                _validate(root, schema["items"], item, f"{path}[{i}]")
    if isinstance(x, dict):
        for key in schema.get("required", []):
            if key not in x:
                raise ConfigError(f"{path}: missing required field {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in x.items():
            if key in props:
                _validate(root, props[key], value, f"{path}.{key}")
            elif extra is False:
                raise ConfigError(f"{path}: unknown field {key!r} (allowed: {sorted(props)})")
            elif isinstance(extra, dict):
                _validate(root, extra, value, f"{path}.{key}")
    if "oneOf" in schema:
        try:
            branch = _discriminated(root, schema["oneOf"], x)
        except ConfigError as err:
            raise ConfigError(str(err).replace("{path}", path)) from None
        if branch is not None:
            _validate(root, branch, x, path)
        else:
            matches = 0
            for b in schema["oneOf"]:
                try:
                    _validate(root, b, x, path)
                    matches += 1
                except ConfigError:
                    pass
            if matches != 1:
                raise ConfigError(f"{path}: must match exactly one alternative, matched {matches}")


_KEYWORDS = {"$ref", "type", "const", "enum", "minimum", "maximum", "minItems", "items", "required",
             "properties", "additionalProperties", "oneOf"}


def _json_equal(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (_TYPES["number"](a) and _TYPES["number"](b) and a == b
                                              and isinstance(a, bool) == isinstance(b, bool))


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_schema(data: Any, schema: dict | None = None) -> None:
    """Raise :class:`ConfigError` (naming the JSON path) unless ``data`` satisfies ``schema``
    (default :data:`SCHEMA`). Supports the keywords the published schema uses."""
    schema = SCHEMA if schema is None else schema
    _validate(schema, schema, data, "$")


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
    """

    model: ModelSignature
    layers: list[list[Pattern]]
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        if len(self.layers) != self.model.num_layers:
            raise ConfigError(f"layers has {len(self.layers)} entries but model.num_layers is {self.model.num_layers}")
        for l, row in enumerate(self.layers):
            if len(row) != self.model.num_heads:
                raise ConfigError(f"layers[{l}] has {len(row)} heads but model.num_heads is {self.model.num_heads}")
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
        }

    @classmethod
    def from_dict(cls, data: Any) -> PatternConfig:
        """Validate ``data`` against :data:`SCHEMA` and build the config."""
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
        return cls(ModelSignature(**data["model"]), layers, Provenance(**data["provenance"]))

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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_json(source: str | os.PathLike | bytes) -> Any:
    if isinstance(source, bytes):
        raw = source
    else:
        size = os.path.getsize(source)
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: {size} bytes exceeds the {MAX_CONFIG_BYTES}-byte limit for configs")
        with open(source, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config exceeds the {MAX_CONFIG_BYTES}-byte limit")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as err:
        raise ConfigError(f"config is not UTF-8 text: {err}") from None
    except json.JSONDecodeError as err:
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
        source: a path, raw bytes, or already-parsed JSON (dict: native format; list: MInference).
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
    return int(value)


def _minference_pattern(entry: Any, where: str) -> tuple[Pattern, float | None]:
    if not isinstance(entry, list) or len(entry) != 4:
        raise ConfigError(f"{where}: expected [type, vertical, slash, score], got {_short(entry)}")
    kind, v, s, score = entry
    if kind not in _MINF_TYPES:
        raise ConfigError(f"{where}: unknown pattern type {kind!r}; expected one of {list(_MINF_TYPES)}")
    v, s = _int_budget(v, where), _int_budget(s, where)
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        raise ConfigError(f"{where}: score must be a number, got {_short(score)}")
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
    """
    if isinstance(data, (str, bytes, os.PathLike)):
        data = _read_json(data)
    if not isinstance(data, list) or not data:
        raise ConfigError("MInference config must be a non-empty JSON list over layers")
    layers, scores = [], []
    num_heads = None
    for l, row in enumerate(data):
        if not isinstance(row, dict) or not row:
            raise ConfigError(f"$[{l}]: expected an object mapping head index to a pattern, got {_short(row)}")
        heads = {}
        for key, entry in row.items():
            if not isinstance(key, str) or not re.fullmatch(r"0|[1-9][0-9]*", key):
                raise ConfigError(f"$[{l}]: head key {key!r} is not a non-negative integer")
            heads[int(key)] = _minference_pattern(entry, f"$[{l}][{key!r}]")
        if num_heads is None:
            num_heads = len(heads)
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
            if getattr(p, "rule", "top_k") != "top_k":
                raise ConfigError(f"layer {l} head {h}: budget rule {p.rule!r} has no MInference-format equivalent")
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
    float32 (a config searched on a CPU) and in bfloat16 (served on a GPU) is one model."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not isinstance(p, torch.Tensor):
            continue
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
    out = {}
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

"""PatternConfig: schema, safe loading, the MInference format, model matching."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minference import config as C
from minference.patterns import PATTERN_TYPES, AShape, BlockSparse, Dense, VerticalSlash, pattern_to_dict

ROOT = Path(__file__).resolve().parents[3]
SCHEMA_FILE = ROOT / "fixtures" / "configs" / "pattern_config.schema.json"
MINF_EXAMPLE = ROOT / "fixtures" / "configs" / "minference_example.json"


def tiny_llama(heads=4, kv=2, layers=2, hidden=64, rope_theta=10000.0, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, rope_theta=rope_theta)
    return LlamaForCausalLM(cfg).eval()


def make_config(sig: C.ModelSignature) -> C.PatternConfig:
    kinds = [AShape(sink=4, window=16), VerticalSlash(vertical=8, slash=16), BlockSparse(top_k=3, block=16), Dense()]
    layers = [[kinds[(l + h) % len(kinds)] for h in range(sig.num_heads)] for l in range(sig.num_layers)]
    prov = C.Provenance(source="manual", package_version="0.1.0", scores=[[0.5] * sig.num_heads] * sig.num_layers)
    return C.PatternConfig(sig, layers, prov)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def sig(model):
    return C.model_signature(model, model_id="tiny-llama")


def test_published_schema_file_is_the_schema_in_code():
    assert json.loads(SCHEMA_FILE.read_text()) == C.SCHEMA


@pytest.mark.parametrize("kind", sorted(PATTERN_TYPES))
def test_schema_pattern_fields_match_dataclasses(kind):
    props = set(C.SCHEMA["$defs"][kind]["properties"])
    assert props == set(PATTERN_TYPES[kind].__dataclass_fields__)


def test_round_trip_through_file(tmp_path, sig):
    cfg = make_config(sig)
    path = tmp_path / "c.json"
    cfg.save(path)
    back = C.load_config(path, signature=sig)
    assert back.layers == cfg.layers
    assert back.model == cfg.model
    assert back.provenance == cfg.provenance
    C.validate_schema(json.loads(path.read_text()))


def test_configs_written_before_extra_rows_load_with_the_default(sig):
    """``VerticalSlash.extra_rows`` came later: files without it load as 0."""
    data = make_config(sig).to_dict()
    stripped = 0
    for row in data["layers"]:
        for p in row:
            if p["kind"] == "vertical_slash":
                assert p.pop("extra_rows") == 0
                stripped += 1
    back = C.load_config(data, signature=sig)
    assert stripped and back.layers == make_config(sig).layers


def test_dict_output_is_schema_valid(sig):
    C.validate_schema(make_config(sig).to_dict())


def _mutated(sig, fn):
    data = make_config(sig).to_dict()
    fn(data)
    return data


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["layers"][0][0].update(window=0), "$.layers[0][0].window: must be >= 1"),
        (lambda d: d["layers"][1][0].update(kind="bogus"), "$.layers[1][0].kind: must be one of"),
        (lambda d: d["layers"][0][0].update(extra=1), "unknown field 'extra'"),
        (lambda d: d["layers"][0][1].update(vertical=True), "$.layers[0][1].vertical: must be integer"),
        (lambda d: d["layers"][0][1].update(vertical=2.5), "$.layers[0][1].vertical: must be integer"),
        # Draft 2020-12 counts 2.0 as an integer; the dataclasses would then hold a float
        (lambda d: d["layers"][0][1].update(vertical=2.0), "$.layers[0][1].vertical: must be integer"),
        (lambda d: d["layers"][1][2].pop("kind"), "$.layers[1][2]: missing required field 'kind'"),
        (lambda d: d["layers"][1][0].update(extra_rows=-1), "$.layers[1][0].extra_rows: must be >= 0, got -1"),
        (lambda d: d["layers"][1].__setitem__(1, 7), "$.layers[1][1]: must match exactly one alternative"),
        (lambda d: d["provenance"].update(target_density=float("inf")),
         "$.provenance.target_density: non-finite number inf"),
        (lambda d: d["provenance"]["scores"][1].__setitem__(2, float("nan")),
         "$.provenance.scores[1][2]: non-finite number nan"),
        (lambda d: d["model"].pop("num_heads"), "$.model: missing required field 'num_heads'"),
        (lambda d: d.update(version=2), "$.version: must be 1"),
        (lambda d: d["provenance"].update(source="pickle"), "$.provenance.source: must be one of"),
        (lambda d: d["layers"].append(d["layers"][0]), "layers has 3 entries but model.num_layers is 2"),
        (lambda d: d["layers"][1].pop(), "layers[1] has 3 heads but model.num_heads is 4"),
    ],
)
def test_bad_values_are_refused_with_their_location(sig, mutate, needle):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(_mutated(sig, mutate))
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"a": NaN}', "non-finite"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b'"a string"', "JSON object (native) or list"),
    ],
)
def test_untrusted_bytes_are_refused(raw, needle):
    with pytest.raises(C.ConfigError, match=None) as err:
        C.load_config(raw)
    assert needle in str(err.value)


def _numbers_in(sig, target_density: str) -> bytes:
    text = json.dumps(make_config(sig).to_dict())
    text = text.replace('"target_density": null', f'"target_density": {target_density}')
    assert target_density in text
    return text.encode()


@pytest.mark.parametrize("number", ["1e400", "-1e999", "123456789e999"])
def test_numbers_that_overflow_to_infinity_are_refused(sig, number):
    """``float("1e400")`` is inf: json's default float parser let such a config load with inf."""
    with pytest.raises(C.ConfigError, match=rf"non-finite number {number} \(overflows to -?inf\)"):
        C.load_config(_numbers_in(sig, number))
    with pytest.raises(C.ConfigError, match="non-finite number"):
        C.load_config(f'[{{"0": ["stream_llm", 1, 2, {number}]}}]'.encode())
    assert C.load_config(_numbers_in(sig, "1e300")).provenance.target_density == 1e300


def test_integers_too_long_to_convert_are_a_config_error(sig):
    """int() refuses more than 4300 digits with a plain ValueError: it must come out as a ConfigError."""
    with pytest.raises(C.ConfigError, match="not valid JSON"):
        C.load_config(_numbers_in(sig, "1" + "0" * 5000))


def test_minference_scores_must_be_finite():
    with pytest.raises(C.ConfigError, match=r"\$\[0\]\['0'\]\[3\]: score must be a finite number"):
        C.from_minference([{"0": ["stream_llm", 1, 2, float("inf")]}])


@pytest.mark.parametrize("source", [0, 1.5, True, None, object()])
def test_a_source_that_is_no_path_nor_bytes_is_a_type_error(source):
    with pytest.raises(TypeError, match="config source must be a path, bytes, or parsed JSON"):
        C.load_config(source)


def test_an_int_source_is_not_read_as_a_file_descriptor(tmp_path, sig):
    """open(3) opens file descriptor 3: an int source must not read whatever file that is."""
    import os

    path = tmp_path / "c.json"
    make_config(sig).save(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TypeError, match="got int"):
            C.load_config(fd)
    finally:
        os.close(fd)
    assert C.load_config(bytearray(path.read_bytes())).layers == make_config(sig).layers


def _entries_never_validated(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("entries were validated before the shapes were checked")

    monkeypatch.setattr(C, "validate_schema", fail)
    monkeypatch.setattr(C, "pattern_from_dict", fail)


def test_head_count_is_checked_before_any_entry(monkeypatch, sig):
    """A layer of 100,000 bogus entries against num_heads = 4: the error is the head count's, and
    no entry is validated (the schema validator and the pattern builder are never called)."""
    data = make_config(sig).to_dict()
    data["layers"][1] = [{"kind": "bogus"}] * 100_000
    _entries_never_validated(monkeypatch)
    with pytest.raises(C.ConfigError) as err:
        C.load_config(data)
    assert str(err.value) == "layers[1] has 100000 heads but model.num_heads is 4"
    with pytest.raises(C.ConfigError, match="layers has 3 entries but model.num_layers is 2"):
        C.load_config(dict(data, layers=[data["layers"][0]] * 3))


def test_millions_of_heads_are_refused_by_the_pair_limit_before_any_entry(monkeypatch, sig):
    """A self-consistent config of 3 million heads (counts agree with ``model``): refused by
    MAX_CONFIG_PAIRS, with no entry validated."""
    data = make_config(sig).to_dict()
    n = 3_000_000
    data["model"].update(num_layers=1, num_heads=n)
    data["layers"] = [[{"kind": "dense"}] * n]
    data["provenance"]["scores"] = None
    _entries_never_validated(monkeypatch)
    with pytest.raises(C.ConfigError, match=f"config has {n} .layer, head. pairs, more than the limit of 131072"):
        C.load_config(data)
    # declared counts alone (a schema error elsewhere, a short layer list) are enough
    data["model"].update(num_layers=2, num_heads=n)
    data["layers"] = [[{"kind": "dense"}], "not a row"]
    with pytest.raises(C.ConfigError, match=f"config has {2 * n} .layer, head. pairs"):
        C.load_config(data)


def test_minference_format_checks_every_head_count_before_any_entry():
    """Layer 0 sets the head count; a later layer of bogus entries is refused by its count, and
    a file of more than MAX_CONFIG_PAIRS pairs by the limit, before any entry is read."""
    bogus = dict.fromkeys(map(str, range(70_000)), ["bogus", 1, 2, 1.0])
    with pytest.raises(C.ConfigError) as err:
        C.from_minference([{"0": ["stream_llm", 1, 2, 1.0]}, bogus])
    assert str(err.value) == "$[1]: heads must be 0..0 (as in layer 0), got 70000 heads"
    with pytest.raises(C.ConfigError, match="config has 140000 .layer, head. pairs, more than the limit"):
        C.from_minference([bogus, bogus])


@pytest.mark.parametrize("index, name", [(1, "vertical"), (2, "slash")])
def test_minference_budgets_beyond_int32_are_refused_at_load(index, name):
    entry = ["vertical_and_slash", 100, 200, 1.0]
    entry[index] = 2**31
    raw = json.dumps([{"0": ["stream_llm", 1, 2, 1.0], "1": entry}]).encode()
    with pytest.raises(C.ConfigError, match=rf"^\$\[0\]\['1'\]\[{index}\]: budget must be <= 2147483647 \(int32\)"):
        C.load_config(raw)
    entry[index] = 2**31 - 1
    cfg = C.load_config(json.dumps([{"0": ["stream_llm", 1, 2, 1.0], "1": entry}]).encode())
    assert getattr(cfg.layers[0][1], name) == 2**31 - 1


def test_native_budgets_beyond_int32_are_refused_at_load_with_their_path(sig):
    for kind, field in [("a_shape", "sink"), ("vertical_slash", "last_q"), ("vertical_slash", "extra_rows"),
                        ("block_sparse", "block"), ("block_sparse", "min_blocks")]:
        data = make_config(sig).to_dict()
        l, h = next((l, h) for l, row in enumerate(data["layers"]) for h, p in enumerate(row) if p["kind"] == kind)
        data["layers"][l][h][field] = 2**31
        raw = json.dumps(data).encode()
        with pytest.raises(C.ConfigError, match=rf"^\$\.layers\[{l}\]\[{h}\]\.{field}: must be <= 2147483647"):
            C.load_config(raw)


def test_size_limit(tmp_path, monkeypatch, sig):
    path = tmp_path / "c.json"
    make_config(sig).save(path)
    monkeypatch.setattr(C, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(C.ConfigError, match="limit"):
        C.load_config(path)


def test_the_size_limit_comes_from_the_stat_before_any_read(tmp_path, monkeypatch, sig):
    """A file over the limit is refused from its stat: nothing is read (before issue 34 too, via
    getsize; now from the open file's fstat, so the file checked is the file read)."""
    import os

    path = tmp_path / "c.json"
    make_config(sig).save(path)
    monkeypatch.setattr(C, "MAX_CONFIG_BYTES", path.stat().st_size - 1)
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("read before the size check"))
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: pytest.fail("read before the size check"))
    with pytest.raises(C.ConfigError, match=f"{path.stat().st_size} bytes exceeds the"):
        C.load_config(path)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_without_a_writer_is_refused_without_blocking(tmp_path):
    """Issue 34: open() on a FIFO with no writer blocked for ever. The load runs in a daemon
    thread so that a regression fails here (and is unblocked) instead of hanging the suite."""
    import os
    import threading

    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    result = {}

    def load():
        try:
            C.load_config(str(fifo))
        except Exception as err:  # noqa: BLE001 -- reported below
            result["err"] = err

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # blocked in open(): give it a writer so that it ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=10)
        pytest.fail("load_config blocked on a named pipe")
    assert isinstance(result.get("err"), C.ConfigError), result
    assert f"{fifo} is a named pipe, not a regular file" in str(result["err"])


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_a_device_is_refused_before_it_is_read(path, kind, monkeypatch):
    """/dev/zero reports size 0 and reads without end: refused from its stat, nothing read."""
    import os

    if not os.path.exists(path):
        pytest.skip(f"no {path} here")
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: pytest.fail(f"{path} was read"))
    with pytest.raises(C.ConfigError, match=f"{path} is {kind}, not a regular file"):
        C.load_config(path)


def test_a_directory_is_refused_and_a_missing_file_is_file_not_found(tmp_path, sig):
    with pytest.raises(C.ConfigError, match="is a directory, not a regular file"):
        C.load_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        C.load_config(tmp_path / "missing.json")
    real = tmp_path / "real.json"
    make_config(sig).save(real)
    (tmp_path / "link.json").symlink_to(real)  # a symlink to a regular file is that file
    assert C.load_config(tmp_path / "link.json").layers == make_config(sig).layers


def test_schema_is_a_valid_draft_2020_12_schema():
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    assert validator_for(C.SCHEMA) is Draft202012Validator
    Draft202012Validator.check_schema(C.SCHEMA)


def test_validation_is_the_jsonschema_library():
    """Every keyword of the draft works (the hand-written validator knew only the ones SCHEMA used)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
              "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}}, "maxProperties": 1}
    C.validate_schema({"name": "abc"}, schema)
    with pytest.raises(C.ConfigError, match=r"^\$\.name: 'ABC' does not match"):
        C.validate_schema({"name": "ABC"}, schema)
    with pytest.raises(C.ConfigError, match="not a valid Draft202012Validator schema"):
        C.validate_schema(1, {"type": "strin"})


def test_validator_oneof_without_tag():
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    C.validate_schema(2.5, schema)
    with pytest.raises(C.ConfigError, match=r"^\$: must match exactly one alternative, matched more than one"):
        C.validate_schema(2, schema)
    with pytest.raises(C.ConfigError, match=r"matched none; closest: \$: must be integer, got str"):
        C.validate_schema("s", schema)


def test_tagged_oneof_gives_the_library_verdict():
    """The pattern ``oneOf`` validates only the branch its ``kind`` names; its verdict must be the
    library's own ``oneOf`` (same strict integer / finite number types): every kind (and a bogus,
    a missing and a non-string one) with every field set to each of a few values."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import extend

    types = Draft202012Validator.TYPE_CHECKER.redefine_many({"integer": C._is_integer, "number": C._is_finite_number})
    plain = extend(Draft202012Validator, type_checker=types)(C.SCHEMA)
    ours = C._schema_validator()
    fields = sorted({f for kind in PATTERN_TYPES for f in C.SCHEMA["$defs"][kind]["properties"]} - {"kind"})
    values = [-1, 0, 1, 2**31, 2.0, 0.5, True, None, "sum", "query", "top_k"]
    entries = []
    for kind in [*sorted(PATTERN_TYPES), "bogus", 3, None]:
        base = pattern_to_dict(PATTERN_TYPES[kind]()) if kind in PATTERN_TYPES else {}
        base = {k: v for k, v in base.items() if k != "kind"}
        tag = {} if kind is None else {"kind": kind}
        entries += [{**base, **tag}, {**tag}, {**base, **tag, "extra": 1}]
        entries += [{**base, field: value, **tag} for field in fields for value in values]
    model = {"model_id": "m", "architecture": None, "num_layers": 1, "num_heads": 1, "num_kv_heads": None,
             "head_dim": None, "rope": None, "weights_fingerprint": None}
    verdicts = []
    for entry in entries:
        doc = {"format": C.FORMAT, "version": 1, "model": model, "layers": [[entry]],
               "provenance": {"source": "manual", "package_version": "0"}}
        verdicts.append(ours.is_valid(doc))
        assert verdicts[-1] == plain.is_valid(doc), entry
    assert 0 < sum(verdicts) < len(verdicts)  # both verdicts exercised


def test_the_library_imports_without_jsonschema_and_loading_says_what_is_missing(monkeypatch, sig):
    """The H200 image has no jsonschema: ``import minference`` must not need it (no module-level
    import), and loading a config without it names the package and the wheels to carry."""
    import ast
    import sys

    tree = ast.parse(Path(C.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.split(".")[0] == "jsonschema"]
    data = make_config(sig).to_dict()
    C._schema_validator.cache_clear()
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    try:
        with pytest.raises(ImportError, match="needs the 'jsonschema' package.*rpds-py"):
            C.load_config(data)
    finally:
        C._schema_validator.cache_clear()


def test_minference_format_maps_each_type():
    cfg = C.load_config(MINF_EXAMPLE)
    assert cfg.model.num_layers == 2 and cfg.model.num_heads == 4
    assert cfg.layers[0][0] == VerticalSlash(vertical=1000, slash=6096)
    assert cfg.layers[0][1] == AShape(sink=100, window=800)
    assert cfg.layers[0][2] == BlockSparse(top_k=16)
    assert cfg.layers[1][3] == BlockSparse(top_k=100)
    assert cfg.provenance.source == "minference_json"
    assert cfg.provenance.scores[1][0] == pytest.approx(0.8)
    # and back again
    again = C.from_minference(C.to_minference(cfg))
    assert again.layers == cfg.layers


@pytest.mark.parametrize(
    "data, needle",
    [
        ([{"0": ["vertical_and_slash", 10, 20, 1.0], "2": ["stream_llm", 1, 2, 1.0]}], "missing [1]"),
        ([{"0": ["full", 10, 20, 1.0]}], "unknown pattern type 'full'"),
        ([{"0": ["stream_llm", 1.5, 20, 1.0]}], "budget must be an integer"),
        ([{"0": ["stream_llm", 1, 0, 1.0]}], "AShape.window must be >= 1"),
        ([{"x": ["stream_llm", 1, 2, 1.0]}], "not a non-negative integer"),
        ([{"0": ["stream_llm", 1, 2]}], "expected [type, vertical, slash, score]"),
        ([{"0": ["stream_llm", 1, 2, 1.0]}, {"0": ["stream_llm", 1, 2, 1.0], "1": ["stream_llm", 1, 2, 1.0]}],
         "heads must be 0..0"),
    ],
)
def test_minference_format_errors(data, needle):
    with pytest.raises(C.ConfigError) as err:
        C.from_minference(data)
    assert needle in str(err.value)


def test_minference_format_checks_head_and_layer_counts(sig):
    data = json.loads(MINF_EXAMPLE.read_text())
    cfg = C.load_config(data[:2], signature=sig)  # 2 layers x 4 heads: fits the tiny model
    assert cfg.model.head_dim == sig.head_dim
    with pytest.raises(C.ConfigMismatchError, match="num_layers: config has 1, model has 2"):
        C.load_config(data[:1], signature=sig)
    with pytest.raises(C.ConfigMismatchError, match="cannot be used even with allow_mismatch"):
        C.load_config(data[:1], signature=sig, allow_mismatch=True)


def test_signature_of_a_model(sig):
    assert (sig.num_layers, sig.num_heads, sig.num_kv_heads, sig.head_dim) == (2, 4, 2, 16)
    assert sig.rope["rope_theta"] == 10000.0
    assert sig.weights_fingerprint.startswith("sha256:")


@pytest.mark.parametrize(
    "other, field",
    [
        (dict(heads=8, kv=2, hidden=128), "num_heads"),
        (dict(kv=4), "num_kv_heads"),
        (dict(hidden=128), "head_dim"),
        (dict(rope_theta=500000.0), "rope"),
        (dict(layers=3), "num_layers"),
        (dict(seed=1), "weights_fingerprint"),
    ],
)
def test_mismatch_is_refused_naming_the_field(sig, other, field):
    cfg = make_config(sig)
    other_model = tiny_llama(**other)
    with pytest.raises(C.ConfigMismatchError) as err:
        C.load_config(cfg.to_dict(), other_model)
    assert f"{field}: config has" in str(err.value)
    assert "allow_mismatch" in str(err.value)


def test_allow_mismatch_returns_the_differences(sig):
    cfg = make_config(sig)
    other = C.model_signature(tiny_llama(seed=1))
    assert cfg.check(other, allow_mismatch=True) == [
        f"weights_fingerprint: config has {sig.weights_fingerprint!r}, model has {other.weights_fingerprint!r}"
    ]
    C.load_config(cfg.to_dict(), signature=other, allow_mismatch=True)


def test_matching_model_loads(model, sig):
    assert C.load_config(make_config(sig).to_dict(), model).layers == make_config(sig).layers


def test_unrecorded_fields_are_not_compared(sig):
    partial = dataclasses.replace(sig, rope=None, weights_fingerprint=None, head_dim=None)
    assert C.compare_signatures(partial, C.model_signature(tiny_llama(rope_theta=1.0, seed=3))) == []


def test_fingerprint_is_the_same_in_float32_and_bfloat16(model):
    import copy

    assert C.weights_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == C.weights_fingerprint(model)


def test_fingerprint_sees_a_single_changed_weight(model):
    before = C.weights_fingerprint(model)
    with torch.no_grad():
        w = model.model.layers[0].self_attn.q_proj.weight
        old = w[0, 0].item()
        w[0, 0] += 1.0
        try:
            assert C.weights_fingerprint(model) != before
        finally:
            w[0, 0] = old
    assert C.weights_fingerprint(model) == before


def _patterns():
    from hypothesis import strategies as st

    small = st.integers(0, 10_000)
    pos = st.integers(1, 10_000)
    return st.one_of(
        st.builds(AShape, sink=small, window=pos),
        st.builds(VerticalSlash, vertical=small, slash=pos, last_q=pos, sink_columns=small, local_diagonals=small,
                  aggregation=st.sampled_from(["sum", "max"]), extra_rows=small),
        st.builds(BlockSparse, top_k=pos, block=pos, sink_blocks=small, force_diagonal=st.booleans()),
        st.just(Dense()),
    )


def test_any_config_round_trips_and_any_negative_budget_is_refused():
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.lists(st.lists(_patterns(), min_size=3, max_size=3), min_size=1, max_size=3), st.data())
    def check(layers, data):
        sig = C.ModelSignature(model_id="m", architecture=None, num_layers=len(layers), num_heads=3)
        cfg = C.PatternConfig(sig, layers)
        raw = json.dumps(cfg.to_dict()).encode()
        assert C.load_config(raw).layers == layers
        d = json.loads(raw)
        l = data.draw(st.integers(0, len(layers) - 1))
        h = data.draw(st.integers(0, 2))
        fields = [k for k, v in d["layers"][l][h].items() if isinstance(v, int) and not isinstance(v, bool)]
        if fields:
            name = data.draw(st.sampled_from(fields))
            d["layers"][l][h][name] = -1
            with pytest.raises(C.ConfigError, match=rf"\$\.layers\[{l}\]\[{h}\]\.{name}: must be >= "):
                C.load_config(d)

    check()


def test_deep_nesting_and_huge_budgets_are_refused(sig):
    with pytest.raises(C.ConfigError, match="nested too deeply"):
        C.load_config(b"[" * 100_000 + b"]" * 100_000)
    data = make_config(sig).to_dict()
    data["layers"][0][0]["window"] = 2**40
    with pytest.raises(C.ConfigError, match=r"\$\.layers\[0\]\[0\]\.window: must be <= 2147483647"):
        C.load_config(data)

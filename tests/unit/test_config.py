"""PatternConfig: schema, safe loading, the MInference format, model matching."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minference import config as C
from minference.patterns import PATTERN_TYPES, AShape, BlockSparse, Dense, VerticalSlash

ROOT = Path(__file__).resolve().parents[2]
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


def test_size_limit(tmp_path, monkeypatch, sig):
    path = tmp_path / "c.json"
    make_config(sig).save(path)
    monkeypatch.setattr(C, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(C.ConfigError, match="limit"):
        C.load_config(path)


def test_validator_rejects_unknown_schema_keywords():
    with pytest.raises(C.ConfigError, match="unsupported keyword 'pattern'"):
        C.validate_schema("x", {"type": "string", "pattern": "^x$"})


def test_validator_oneof_without_tag_counts_matches():
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    C.validate_schema(2.5, schema)
    with pytest.raises(C.ConfigError, match="matched 2"):
        C.validate_schema(2, schema)


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

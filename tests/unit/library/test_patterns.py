"""Pattern dataclasses: defaults, validation of every field, and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from minference.patterns import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LAST_Q,
    PATTERN_TYPES,
    AShape,
    BlockSparse,
    Dense,
    VerticalSlash,
    pattern_from_dict,
    pattern_to_dict,
)

ALL = [AShape(), VerticalSlash(), BlockSparse(), Dense(), AShape(sink=0, window=1),
       VerticalSlash(vertical=0, slash=1, last_q=1, sink_columns=0, local_diagonals=0, aggregation="max"),
       VerticalSlash(extra_rows=16),
       BlockSparse(top_k=1, block=16, sink_blocks=0, force_diagonal=False),
       BlockSparse(top_k=4, block=128, rule="relative", threshold=0.03, estimate="query", score_rows=32)]


def test_defaults_are_named_and_published_values() -> None:
    assert (AShape().sink, AShape().window) == (128, 4096)
    assert (VerticalSlash().vertical, VerticalSlash().slash) == (1000, 6096)
    assert VerticalSlash().last_q == DEFAULT_LAST_Q and BlockSparse().block == DEFAULT_BLOCK_SIZE
    assert VerticalSlash().extra_rows == 0
    assert BlockSparse().force_diagonal is True
    assert {cls().kind for cls in PATTERN_TYPES.values()} == set(PATTERN_TYPES)


@pytest.mark.parametrize("pattern", ALL, ids=repr)
def test_json_round_trip(pattern) -> None:
    data = json.loads(json.dumps(pattern_to_dict(pattern)))
    assert data["kind"] == pattern.kind
    assert pattern_from_dict(data) == pattern


def test_patterns_are_frozen_and_hashable() -> None:
    p = AShape(sink=4, window=64)
    with pytest.raises(AttributeError):
        p.sink = 5
    assert len({p, AShape(sink=4, window=64), AShape()}) == 2


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: AShape(sink=-1), ValueError, "AShape.sink must be >= 0"),
        (lambda: AShape(window=0), ValueError, "AShape.window must be >= 1"),
        (lambda: AShape(sink=1.5), TypeError, "AShape.sink must be an int"),
        (lambda: AShape(window=True), TypeError, "AShape.window must be an int"),
        (lambda: VerticalSlash(vertical=-1), ValueError, "VerticalSlash.vertical"),
        (lambda: VerticalSlash(slash=0), ValueError, "VerticalSlash.slash must be >= 1"),
        (lambda: VerticalSlash(last_q=0), ValueError, "VerticalSlash.last_q"),
        (lambda: VerticalSlash(sink_columns=-2), ValueError, "VerticalSlash.sink_columns"),
        (lambda: VerticalSlash(local_diagonals=-1), ValueError, "VerticalSlash.local_diagonals"),
        (lambda: VerticalSlash(aggregation="mean"), ValueError, "aggregation"),
        (lambda: VerticalSlash(extra_rows=-1), ValueError, "VerticalSlash.extra_rows must be >= 0"),
        (lambda: VerticalSlash(extra_rows=2.0), TypeError, "VerticalSlash.extra_rows must be an int"),
        (lambda: VerticalSlash(vertical="10"), TypeError, "VerticalSlash.vertical must be an int"),
        (lambda: BlockSparse(top_k=0), ValueError, "BlockSparse.top_k"),
        (lambda: BlockSparse(block=0), ValueError, "BlockSparse.block"),
        (lambda: BlockSparse(sink_blocks=-1), ValueError, "BlockSparse.sink_blocks"),
        (lambda: BlockSparse(force_diagonal=1), TypeError, "force_diagonal must be a bool"),
        (lambda: BlockSparse(score_rows=-1, estimate="query"), ValueError, "BlockSparse.score_rows must be >= 0"),
        (lambda: BlockSparse(score_rows=4), ValueError, "score_rows=4 needs estimate='query'"),
        (lambda: BlockSparse(block=32, score_rows=32, estimate="query"), ValueError,
         "score_rows=32 is every query of a 32-token block: use 0"),
    ],
)
def test_invalid_fields(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make()


def test_from_dict_refuses_bad_input() -> None:
    with pytest.raises(TypeError, match="dict"):
        pattern_from_dict([("kind", "dense")])
    with pytest.raises(ValueError, match="unknown pattern kind"):
        pattern_from_dict({"kind": "diagonal"})
    with pytest.raises(ValueError, match="unknown pattern kind"):
        pattern_from_dict({"sink": 1})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['windw'\]"):
        pattern_from_dict({"kind": "a_shape", "sink": 1, "windw": 4})
    with pytest.raises(ValueError, match="AShape.window"):
        pattern_from_dict({"kind": "a_shape", "window": 0})
    assert pattern_from_dict({"kind": "vertical_slash", "vertical": 7}) == VerticalSlash(vertical=7)


@pytest.mark.parametrize("cls", list(PATTERN_TYPES.values()))
def test_kind_cannot_be_overridden(cls) -> None:
    other = "dense" if cls is not Dense else "a_shape"
    with pytest.raises(ValueError, match="kind must be"):
        cls(kind=other)

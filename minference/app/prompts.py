"""Deterministic long prompts built from bundled original prose: passkey eval and calibration.

Two disjoint text pools live in ``fixtures/text/``: ``eval_*.txt`` is the haystack of the
passkey retrieval evaluation, ``calib_*.txt`` the filler of the calibration prompts used by the
offline pattern search, so a configuration is never tuned on the text it is judged on. Files
hold paragraphs separated by blank lines and contain no digits (digits belong to the keys).

Prompts are token-exact: every returned prompt has exactly ``n_tokens`` ids. Paragraphs are
tokenised once each and concatenated in a seeded random order (a fresh permutation per pass
over the pool), then truncated; the needle and the question are tokenised separately, so the
ids are valid token sequences even where a cut falls inside a sentence.

Passkey prompt layout (plain text, no chat template)::

    PASSKEY_INTRO  filler[:cut]  PASSKEY_NEEDLE(key)  filler[cut:]  PASSKEY_QUESTION

with ``cut = round(depth * len(filler))`` and the question ending in ``"The pass key is "``.
The answer ids are the tokens that follow the question when ``question + key`` is tokenised as
one string (for SmolLM2, one token per digit).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from minference._checks import check_int

__all__ = [
    "TEXT_DIR",
    "EVAL_TEXTS",
    "CALIBRATION_TEXTS",
    "PASSKEY_DIGITS",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "CALIBRATION_FACTS",
    "paragraphs",
    "passkey_prompt",
    "calibration_prompts",
    "PasskeyScore",
    "score_passkey",
]

#: Bundled prose (the repository's ``fixtures/text``).
TEXT_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "text"
#: Haystack files of the passkey evaluation.
EVAL_TEXTS = ("eval_harbor.txt", "eval_workshop.txt", "eval_library.txt")
#: Filler files of the calibration prompts (disjoint from :data:`EVAL_TEXTS`).
CALIBRATION_TEXTS = ("calib_orchard.txt", "calib_observatory.txt")
#: Digits of a key drawn when ``key=None``.
PASSKEY_DIGITS = 5
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is "
#: Facts hidden in each calibration prompt; the closing question asks about one of them.
CALIBRATION_FACTS = 4
_CALIBRATION_NAMES = ("Arwen Tolle", "Bastian Quill", "Corra Venn", "Dario Pike", "Elsbeth Marr", "Fenwick Hale",
                      "Greta Sorn", "Hollis Brae", "Ines Lark", "Jory Wend")
_CALIBRATION_FACT = "\nA note for later: the locker of {name} holds the number {value}.\n"
_CALIBRATION_QUESTION = "\n\nWhich number does the locker of {name} hold? The locker of {name} holds the number "
_CALIBRATION_DIGITS = 4


@cache
def paragraphs(names: tuple[str, ...]) -> tuple[str, ...]:
    """Paragraphs (blank-line separated, whitespace-normalised) of the named files in :data:`TEXT_DIR`."""
    out = []
    for name in names:
        path = TEXT_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"bundled text {path} is missing (fixtures/text ships with the repository)")
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if text:
                out.append(text)
    return tuple(out)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _filler(tokenizer, names: tuple[str, ...], n: int, rng: random.Random) -> list[int]:
    """``n`` filler token ids: paragraphs in seeded random order, a new permutation per pass."""
    pieces = [_encode(tokenizer, p + "\n\n") for p in paragraphs(names)]
    ids: list[int] = []
    while len(ids) < n:
        order = list(range(len(pieces)))
        rng.shuffle(order)
        for i in order:
            ids.extend(pieces[i])
    return ids[:n]


def _answer_ids(tokenizer, question: str, answer: str) -> list[int]:
    """Tokens that follow ``question`` when ``question + answer`` is tokenised as one string."""
    q = _encode(tokenizer, question)
    full = _encode(tokenizer, question + answer)
    if full[: len(q)] != q or len(full) == len(q):
        raise ValueError(f"the tokenizer merges the answer {answer!r} into the question; cannot split them")
    return full[len(q) :]


def passkey_prompt(
    tokenizer, n_tokens: int, key: int | str | None, depth: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A passkey-retrieval prompt of exactly ``n_tokens`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (e.g. from :func:`minference.app.models.load_smollm2`).
        n_tokens: prompt length in tokens.
        key: the pass key (a non-negative int or a digit string); ``None`` draws a
            :data:`PASSKEY_DIGITS`-digit key from ``seed``.
        depth: where the needle sits in the filler, ``0`` (start) to ``1`` (end).
        seed: fixes the filler order (and the key when ``key is None``).

    Returns:
        ``(input_ids [n_tokens], answer_ids [L])`` int64: the prompt, ending in
        ``"The pass key is "``, and the key's tokens as they follow it.
    """
    check_int("n_tokens", n_tokens, 1)
    check_int("seed", seed, 0)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    rng = random.Random(seed)
    if key is None:
        key = rng.randrange(10 ** (PASSKEY_DIGITS - 1), 10**PASSKEY_DIGITS)
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"key must be an int, a digit string or None, got {type(key).__name__}")
    key = str(key)
    if not key.isdigit():
        raise ValueError(f"key must be a non-negative integer or a digit string, got {key!r}")
    intro = _encode(tokenizer, PASSKEY_INTRO)
    needle = _encode(tokenizer, PASSKEY_NEEDLE.format(key=key))
    question = _encode(tokenizer, PASSKEY_QUESTION)
    n_filler = n_tokens - len(intro) - len(needle) - len(question)
    if n_filler < 0:
        need = n_tokens - n_filler
        raise ValueError(f"n_tokens={n_tokens} is too short for a passkey prompt (needs at least {need})")
    filler = _filler(tokenizer, EVAL_TEXTS, n_filler, rng)
    cut = round(depth * n_filler)
    ids = intro + filler[:cut] + needle + filler[cut:] + question
    answer = _answer_ids(tokenizer, PASSKEY_QUESTION, key)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(answer, dtype=torch.long)


def calibration_prompts(tokenizer, n_tokens: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` calibration prompts of exactly ``n_tokens`` tokens each, for the offline search.

    Filler comes from :data:`CALIBRATION_TEXTS` (never the eval haystack). Each prompt hides
    :data:`CALIBRATION_FACTS` facts ("the locker of <name> holds the number <n>") at seeded
    random depths and ends with a question about one of them, so retrieval heads are exercised
    as in the evaluation but on different text and a different needle format.

    Returns:
        list of ``count`` int64 tensors ``[n_tokens]``.
    """
    check_int("n_tokens", n_tokens, 1)
    check_int("count", count, 0)
    check_int("seed", seed, 0)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        names = rng.sample(_CALIBRATION_NAMES, CALIBRATION_FACTS)
        values = [rng.randrange(10 ** (_CALIBRATION_DIGITS - 1), 10**_CALIBRATION_DIGITS) for _ in names]
        facts = [_encode(tokenizer, _CALIBRATION_FACT.format(name=n, value=v)) for n, v in zip(names, values)]
        asked = rng.randrange(len(names))
        question = _encode(tokenizer, _CALIBRATION_QUESTION.format(name=names[asked]))
        n_filler = n_tokens - sum(map(len, facts)) - len(question)
        if n_filler < 0:
            raise ValueError(
                f"n_tokens={n_tokens} is too short for a calibration prompt (needs at least {n_tokens - n_filler})"
            )
        filler = _filler(tokenizer, CALIBRATION_TEXTS, n_filler, rng)
        cuts = sorted(rng.randrange(n_filler + 1) for _ in facts)
        ids: list[int] = []
        prev = 0
        for cut, fact in zip(cuts, facts):
            ids += filler[prev:cut] + fact
            prev = cut
        ids += filler[prev:] + question
        prompts.append(torch.tensor(ids, dtype=torch.long))
    return prompts


@dataclass(frozen=True)
class PasskeyScore:
    """Teacher-forced scoring of an answer: per answer token, greedy hit and logit margin.

    Attributes:
        correct: ``[L]`` bool, the greedy token equals the answer token.
        margins: ``[L]`` float, answer logit minus the best other logit (negative when wrong;
            small positive values are near-ties worth reporting).
    """

    correct: torch.Tensor
    margins: torch.Tensor

    @property
    def accuracy(self) -> float:
        """Fraction of answer tokens predicted greedily."""
        return float(self.correct.double().mean())

    @property
    def min_margin(self) -> float:
        """Smallest margin over the answer tokens."""
        return float(self.margins.min())


@torch.no_grad()
def score_passkey(model, input_ids: torch.Tensor, answer_ids: torch.Tensor) -> PasskeyScore:
    """Teacher-forced check that ``model`` continues ``input_ids [N]`` with ``answer_ids [L]``.

    Runs one forward pass over ``input_ids + answer_ids[:-1]`` and keeps only the last ``L``
    logits (``logits_to_keep``), so memory does not grow with the vocabulary times ``N``.
    """
    for name, x in (("input_ids", input_ids), ("answer_ids", answer_ids)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.long:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
        if x.numel() == 0:
            raise ValueError(f"{name} must not be empty")
    device = next(model.parameters()).device
    L = answer_ids.numel()
    ids = torch.cat([input_ids, answer_ids[:-1]]).to(device)[None]
    logits = model(input_ids=ids, logits_to_keep=L).logits[0].float().cpu()  # [L, V]
    target = answer_ids.cpu()
    picked = logits.gather(-1, target[:, None])[:, 0]
    others = logits.scatter(-1, target[:, None], float("-inf")).max(-1).values
    return PasskeyScore(correct=logits.argmax(-1) == target, margins=picked - others)


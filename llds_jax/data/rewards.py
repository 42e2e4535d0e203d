"""Search-R1's exact-match reward: answer normalization, final-answer extraction and EM.

An answer that normalizes to nothing ("", "a", "The.") is scored by the run's rule (`reward.empty_answer`):
"search_r1" (the default, the paper's code): plain exact match, as Search-R1's `compute_score_em` computes it, so
it earns 1.0 when one of the gold answers normalizes to nothing too; "zero": it never earns reward.
"""
from __future__ import annotations

import re
import string
from collections.abc import Sequence

from llds_jax.bounds import ConfigError

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PUNCTUATION = frozenset(string.punctuation)
EMPTY_ANSWER_RULES = ("search_r1", "zero")
DEFAULT_EMPTY_ANSWER = "search_r1"


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, replace the words a/an/the by a space, collapse whitespace (in this order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    normalized = normalize_answer(prediction)
    return float(any(normalize_answer(gold) == normalized for gold in golden_answers))


def extract_final_answer(model_text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in the model's own text, or None."""
    matches = _ANSWER_RE.findall(model_text)
    return matches[-1].strip() if matches else None


def final_answer_turn(turn_texts: Sequence[str]) -> int | None:
    """Index of the last of the model's turns (texts in order) holding a complete `<answer>...</answer>`, or None.

    The final answer is the last one inside that turn. Turns are never joined: an answer opened in one turn and
    closed in a later one is no answer, as in Search-R1, where the observation between them breaks it.
    """
    for i in range(len(turn_texts) - 1, -1, -1):
        if _ANSWER_RE.search(turn_texts[i]):
            return i
    return None


def em_reward(model_text: str, golden_answers: str | Sequence[str],
              empty_answer: str = DEFAULT_EMPTY_ANSWER) -> float:
    """Exact match of the model's final answer against the gold answers; 0.0 when it gave no answer. An answer that
    normalizes to nothing scores by the rule `empty_answer` (see the module docstring)."""
    if empty_answer not in EMPTY_ANSWER_RULES:
        raise ConfigError(f"reward.empty_answer must be one of {EMPTY_ANSWER_RULES}; got {empty_answer!r}")
    answer = extract_final_answer(model_text)
    if answer is None or (empty_answer == "zero" and not normalize_answer(answer)):
        return 0.0
    return exact_match(answer, golden_answers)

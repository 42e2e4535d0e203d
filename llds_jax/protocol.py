"""The Search-R1 text protocol: prompt, turn cut, action parsing and observations.

Pure Python, no JAX. Every string here must match Search-R1 byte for byte (see
docs/method.md); the sampler and the rollout loop build on these functions.

A leaf: it imports nothing of llds_jax, so the data and sft modules that write prompts and observations
(llds_jax.data.qa, llds_jax.data.synthetic, llds_jax.sft.demonstrations) use it without depending on the rollout
engine (tests/architecture/test_protocol_leaf.py).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

SEARCH_CLOSE = "</search>"
ANSWER_CLOSE = "</answer>"
# Decoded-text markers that end a turn; the sampler may stop a sequence once one appears.
STOP_STRINGS = (SEARCH_CLOSE, ANSWER_CLOSE)

# Characters a token spans at most: the longest token of the Qwen2.5 vocabulary (128 characters). A text's last k
# tokens lie within its last k x MAX_CHARS_PER_TOKEN characters.
MAX_CHARS_PER_TOKEN = 128

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def make_prompt(question: str) -> str:
    """The Search-R1 user message for `question` (stripped, with `?` appended when missing)."""
    question = question.strip()
    if not question:
        raise ValueError("make_prompt: the question is empty")
    return _prompt_text(question)


def bounded_question(question: str, max_prompt_tokens: int) -> str:
    """`question` unchanged when its stripped text is at most `max_question_chars` characters, else that text's
    last so many characters: its start cut, as `fit_prompt` cuts it. Questions are bounded when they are read, so
    that fitting one costs at most that much text (a 1 MB question took seconds to fit).

    What fit_prompt keeps is unchanged. It reads whether the whole prompt fits, and the question's last
    max_prompt_tokens tokens. A question longer than the bound has more than 2 x max_prompt_tokens tokens (no
    token spans more than MAX_CHARS_PER_TOKEN characters), bounded or not: its prompt is cut either way (and
    counted in the rollout's prompts_cut). Its last max_prompt_tokens tokens lie in the last half of the bound. A
    byte-level BPE (Qwen2.5, Llama 3) splits text at spaces and punctuation before it merges, so the bounded text's
    tokens are the whole question's from the first split after the cut on: the kept tokens differ only when one
    word (a run without a space or punctuation) of more than max_prompt_tokens x MAX_CHARS_PER_TOKEN characters
    (262,144 at the default 2048 tokens) crosses the cut.
    """
    limit = max_question_chars(max_prompt_tokens)
    stripped = question.strip()
    return stripped[-limit:] if len(stripped) > limit else question


def max_question_chars(max_prompt_tokens: int) -> int:
    """The characters of a question `bounded_question` keeps at most: 2 x max_prompt_tokens x MAX_CHARS_PER_TOKEN
    (twice the text the prompt's question tokens can span)."""
    return 2 * max_prompt_tokens * MAX_CHARS_PER_TOKEN


def _prompt_text(question: str) -> str:
    """The user message of a stripped question (`?` appended when missing; a question cut to nothing gives `?`)."""
    return SEARCH_R1_TEMPLATE.format(question=question if question.endswith("?") else question + "?")


def _encoded_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a user message, in the tokenizer's chat template when it has one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def fit_prompt(tokenizer, question: str, max_prompt_tokens: int) -> tuple[list[int], int]:
    """Token ids of the prompt for `question` as Search-R1 feeds them to the policy, at most `max_prompt_tokens`,
    and how many of the question's tokens were cut to fit (0 when it fits).

    With a chat template the prompt is one user message followed by the generation prompt; without one it is the
    raw prompt text; encoded with `add_special_tokens=False`. An over-long prompt loses the start of its question,
    never the instruction or the template (before issue 58 the last `max_prompt_tokens` tokens were kept, so the
    search instruction was cut): the most question tokens, counted from its end, that fit are kept. ValueError
    when the prompt with no question at all is longer than `max_prompt_tokens`.
    """
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    ids = _encoded_prompt(tokenizer, make_prompt(question))
    if len(ids) <= max_prompt_tokens:
        return ids, 0
    question_ids = list(tokenizer.encode(question.strip(), add_special_tokens=False))

    def kept(n: int) -> list[int]:  # the prompt of the question's last n tokens
        tail = tokenizer.decode(question_ids[len(question_ids) - n:], skip_special_tokens=True) if n else ""
        return _encoded_prompt(tokenizer, _prompt_text(tail.lstrip("\ufffd").strip()))

    if len(kept(0)) > max_prompt_tokens:
        raise ValueError(f"the prompt's instruction alone is {len(kept(0))} tokens, more than max_prompt_tokens = "
                         f"{max_prompt_tokens}")
    # kept(lo) fits; the largest n that fits is searched (lengths grow with n, up to a character split between two
    # tokens), n at most max_prompt_tokens (n tokens re-encode to about n: more cannot fit), so that what is kept
    # depends on the question's last max_prompt_tokens tokens only, not on its length (`bounded_question`).
    lo, hi = 0, min(len(question_ids) - 1, max_prompt_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(kept(mid)) <= max_prompt_tokens:
            lo = mid
        else:
            hi = mid - 1
    return kept(lo), len(question_ids) - lo


def chat_prompt_ids(tokenizer, question: str, max_prompt_tokens: int) -> list[int]:
    """The token ids of `fit_prompt`."""
    return fit_prompt(tokenizer, question, max_prompt_tokens)[0]


def turn_finished(text: str) -> bool:
    """True when decoded turn text contains a closing `</search>` or `</answer>` (the turn is over)."""
    return any(stop in text for stop in STOP_STRINGS)


def cut_turn(text: str) -> str:
    """The turn text cut right after the first `</search>`, else after the first `</answer>`, else whole.

    `</search>` wins even when an `</answer>` comes before it (Search-R1's rule).
    """
    for close in STOP_STRINGS:
        end = text.find(close)
        if end >= 0:
            return text[:end + len(close)]
    return text


@dataclasses.dataclass(frozen=True)
class Action:
    """The action of one turn: kind "search", "answer" or None (invalid), and its stripped content."""
    kind: Literal["search", "answer"] | None
    content: str = ""


def parse_action(text: str) -> Action:
    """The first `<search>...</search>` or `<answer>...</answer>` of the cut turn text.

    Tags are case sensitive and content may span lines. No match gives `Action(None, "")`.
    """
    match = _ACTION_RE.search(cut_turn(text))
    if match is None:
        return Action(None, "")
    return Action(match.group(1), match.group(2).strip())


def format_docs(contents: Sequence[str]) -> str:
    """Search-R1's passage string: `Doc {i}(Title: {title}) {text}\\n` per document, i from 1.

    `contents`: each document's wiki-18 `contents`, whose first line is the title (quotes kept) and the remaining
    lines the text.
    """
    parts = []
    for i, text in enumerate(contents, start=1):
        title, _, text = text.partition("\n")
        parts.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(parts)


def format_observation(contents: Sequence[str]) -> str:
    """The observation appended after a search turn: the documents (their `contents`) in an <information> block."""
    return "\n\n<information>" + format_docs(contents).strip() + "</information>\n\n"


@dataclasses.dataclass(frozen=True)
class TurnCut:
    """Where a sampled turn ends: keep `token_ids[:num_tokens]`; `text` is the cut turn text."""
    num_tokens: int
    text: str


def cut_turn_tokens(token_ids: Sequence[int], tokenizer) -> TurnCut:
    """The shortest prefix of a turn's sampled tokens whose decoded text reaches the cut point.

    The text is decoded with `skip_special_tokens=True`, as Search-R1 does, and cut with `cut_turn`.
    The sampled tokens themselves stay the trained tokens (no re-tokenization), so the cut lands on a
    token boundary: when one token straddles the cut (e.g. `>\\n\\n` completing `</search>`), that
    token is kept, and the decoded kept tokens may run a few characters past `text`. The action must
    be parsed from `text`. Without a closing tag every token is kept.
    """
    ids = list(token_ids)
    text = cut_turn(tokenizer.decode(ids, skip_special_tokens=True))
    if not turn_finished(text):
        return TurnCut(len(ids), text)

    def reaches_cut(n: int) -> bool:
        # A prefix decodes to a prefix of the full text, up to a trailing partial UTF-8 character;
        # the cut ends in ASCII `>`, so reaching the cut is monotone in n.
        return tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(text)

    lo, hi = 0, len(ids)  # invariant: reaches_cut(hi); not reaches_cut(lo) since text is non-empty
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reaches_cut(mid):
            hi = mid
        else:
            lo = mid
    return TurnCut(hi, text)

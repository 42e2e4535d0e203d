"""Incremental stop-string matching on the host (`StopMatcher`): whether a turn's decoded text holds a stop string
(`protocol.STOP_STRINGS`: `</search>`, `</answer>`), decoding only each decode chunk's new tokens and a few before
them, instead of the whole turn after every chunk.

Incremental detokenization. Call a token position *clean* when the text of the tokens before it ends with a whole
character (for a byte-level BPE, the UTF-8 decoder stands between characters there). Each sequence keeps its last
clean position c, the decoded context tokens[c - CONTEXT_TOKENS:c] and `tail`, the last (longest stop - 1)
characters of the text before c. A push decodes tokens[c - CONTEXT_TOKENS:] and drops the context from its front:
what remains is the turn's text from c on, as a decode of the whole turn ends (the context gives decoders that look
back, e.g. for a leading space, what they need). A stop string new to this push ends in that text, so it lies within
`tail` + that text: only that is searched. Then c moves to the end when the text does not end in U+FFFD; else (an
unfinished character, or an undecodable byte, is held back) to the last clean position among the last PROBE_TOKENS
tokens, each candidate tested by decoding the CONTEXT_TOKENS tokens before it: a text ending in a character other
than U+FFFD ends in a whole character, whose lead byte lies in the window.

The result equals `protocol.turn_finished(tokenizer.decode(turn, skip_special_tokens=True))` (in general: a stop
string in the decoded turn) after every push (tests/rollout/test_stop_strings.py: the real Qwen2.5 tokenizer,
multibyte characters, stop strings split every way) when the tokenizer's decode joins at clean positions (text(a + b)
= text(a) + text(b) where a ends clean: byte-level BPE such as Qwen2.5's, special tokens skipped, decoded with
clean_up_tokenization_spaces=False) and no stop string holds U+FFFD. Tokens decoded per push: the new ones,
CONTEXT_TOKENS before the window, those since c (at most PROBE_TOKENS once a clean position was found among them;
more only while none is, e.g. a run of undecodable bytes), CONTEXT_TOKENS for the new context, and at most
PROBE_TOKENS x CONTEXT_TOKENS + CONTEXT_TOKENS + PROBE_TOKENS more when the text ends in U+FFFD; never the whole
turn.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Hashable

from llds_jax import protocol

CONTEXT_TOKENS = 4  # tokens before the clean position decoded with each window (and to test a candidate position)
PROBE_TOKENS = 3  # positions before the end tried as the next clean position when the text ends in U+FFFD
HELD = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


@dataclasses.dataclass
class _Turn:
    """One sequence's turn so far: its tokens, last clean position `clean`, the decoded context before it
    (tokens[clean - CONTEXT_TOKENS:clean]), the last characters of the text before it, and whether a stop string
    was seen."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    clean: int = 0
    context: str = ""
    tail: str = ""
    finished: bool = False


class StopMatcher:
    """Per-sequence incremental stop-string matching (see the module docstring).

    Args:
      tokenizer: a Hugging Face tokenizer (`batch_decode`, or its Rust `backend_tokenizer`'s `decode_batch`).
      stop_strings: the strings that end a turn (none may hold U+FFFD).
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = protocol.STOP_STRINGS):
        if not stop_strings or any(not s or HELD in s for s in stop_strings):
            raise ValueError(f"StopMatcher: stop strings must be non-empty and hold no U+FFFD, got {stop_strings!r}")
        self._tokenizer, self._stops = tokenizer, tuple(stop_strings)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._keep = max(map(len, self._stops)) - 1  # characters of earlier text a new stop string may start in
        self._turns: dict[Hashable, _Turn] = {}

    def reset(self, seq: Hashable) -> None:
        """Sequence `seq` starts a new turn (no tokens yet)."""
        self._turns[seq] = _Turn()

    def forget(self, seq: Hashable) -> None:
        """Drops sequence `seq`'s state."""
        self._turns.pop(seq, None)

    def push(self, seq: Hashable, new_ids: Sequence[int]) -> bool:
        """Appends tokens to sequence `seq`'s turn; returns whether its text so far holds a stop string."""
        return self.push_many([seq], [new_ids])[0]

    def push_many(self, seqs: Sequence[Hashable], new_ids: Sequence[Sequence[int]]) -> list[bool]:
        """`push` of several sequences (distinct, each reset before its first push) in batched decodes."""
        turns = [self._turns[seq] for seq in seqs]
        for turn, ids in zip(turns, new_ids):
            turn.tokens.extend(int(i) for i in ids)
        texts = self._decode([turn.tokens[_context_start(turn.clean):] for turn in turns])
        whole = []  # (turn, its text from its clean position) of the turns whose text ends in a whole character
        for turn, text in zip(turns, texts):
            since_clean = text[len(turn.context):]  # the turn's text from its clean position on
            turn.finished = turn.finished or any(stop in turn.tail + since_clean for stop in self._stops)
            if since_clean.endswith(HELD):
                self._probe(turn, since_clean)
            else:
                whole.append((turn, since_clean))
        contexts = self._decode([turn.tokens[_context_start(len(turn.tokens)):] for turn, _ in whole])
        for (turn, since_clean), context in zip(whole, contexts):
            self._settle(turn, len(turn.tokens), context, since_clean)
        return [turn.finished for turn in turns]

    def _decode(self, windows: list[list[int]]) -> list[str]:
        """`batch_decode(windows, skip_special_tokens=True, clean_up_tokenization_spaces=False)`; for a tokenizer
        with a Rust backend, that backend's own batch decode (what transformers' decode calls for each window without
        the clean-up, minus its per-id Python conversions)."""
        if self._backend is not None:
            return self._backend.decode_batch(windows, skip_special_tokens=True)
        return self._tokenizer.batch_decode(windows, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _probe(self, turn: _Turn, since_clean: str) -> None:
        """Moves the clean position of a turn whose text ends in U+FFFD to the last clean position among its last
        PROBE_TOKENS tokens, if one is: a position whose CONTEXT_TOKENS tokens before it decode to text ending in a
        character other than U+FFFD (an empty text says nothing)."""
        end = len(turn.tokens)
        for position in range(end - 1, max(turn.clean, end - PROBE_TOKENS - 1), -1):
            start = _context_start(position)
            [context] = self._decode([turn.tokens[start:position]])
            if context and not context.endswith(HELD):
                after = self._decode([turn.tokens[start:]])[0][len(context):]  # the text from `position` on
                self._settle(turn, position, context, since_clean[:len(since_clean) - len(after)])
                return

    def _settle(self, turn: _Turn, position: int, context: str, settled: str) -> None:
        """The turn's clean position moves to `position`, whose decoded context is `context`; `settled` is the text
        between the old clean position and it."""
        turn.tail = (turn.tail + settled)[-self._keep:] if self._keep else ""
        turn.clean, turn.context = position, context


def _context_start(position: int) -> int:
    """Where the decoded context of a clean position starts."""
    return max(0, position - CONTEXT_TOKENS)

"""Incremental stop-string matching (`llds_jax.rollout.stop_strings`) against a full re-decode of the turn after
every chunk, `protocol.turn_finished(tokenizer.decode(tokens, skip_special_tokens=True))`, with the real Qwen2.5
tokenizer."""
import itertools

import numpy as np
import pytest

from llds_jax import protocol
from llds_jax.rollout import stop_strings
from llds_jax.rollout.stop_strings import StopMatcher

MULTIBYTE = "中文é€🙂"  # 3-, 3-, 2-, 3- and 4-byte characters


def byte_token_ids(tokenizer) -> list[int]:
    """The id of the one-byte token of each byte 0..255: byte-level BPE spells byte b as a printable character,
    itself for the printable Latin-1 bytes and 256, 257, ... for the others in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    return [tokenizer.convert_tokens_to_ids(chars[b]) for b in range(256)]


def full_redecode(tokenizer, tokens: list[int]) -> bool:
    return protocol.turn_finished(tokenizer.decode(tokens, skip_special_tokens=True))


def chunks_of(tokens: list[int], sizes) -> list[list[int]]:
    out, at = [], 0
    for size in sizes:
        if at >= len(tokens):
            break
        out.append(tokens[at:at + size])
        at += size
    return out


def reference_steps(tokenizer, chunks) -> list[bool]:
    """After each chunk: whether a full re-decode of the turn so far has held a stop string."""
    seen, out, tokens = False, [], []
    for chunk in chunks:
        tokens += chunk
        seen = seen or full_redecode(tokenizer, tokens)
        out.append(seen)
    return out


def matcher_steps(matcher: StopMatcher, chunks) -> list[bool]:
    matcher.reset("s")
    return [matcher.push("s", chunk) for chunk in chunks]


@pytest.fixture(scope="module")
def bytes_of(qwen_tokenizer):
    """text -> one token per UTF-8 byte."""
    ids = byte_token_ids(qwen_tokenizer)
    return lambda text: [ids[b] for b in text.encode()]


def test_byte_tokens_spell_their_bytes(qwen_tokenizer, bytes_of):
    assert qwen_tokenizer.decode(bytes_of(MULTIBYTE + "</search>")) == MULTIBYTE + "</search>"
    assert qwen_tokenizer.decode(bytes_of("中")[:2]) == "\ufffd"  # an unfinished character


def adversarial_turns(tokenizer, bytes_of) -> list[list[int]]:
    """Turns whose stop string is split at every set of its character boundaries (2^8 splits of each; the pieces
    encoded alone and as bytes, alternately), next to multibyte characters split into bytes; near misses (a stop
    string broken by a character, or by an unfinished one), and a stop string broken only by a special token
    (skipped in decoding: it counts)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    turns = []
    for stop in protocol.STOP_STRINGS:
        for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(stop)), k)
                                                  for k in range(len(stop))):
            pieces = [stop[a:b] for a, b in zip((0, *cuts), (*cuts, len(stop)))]
            spelled = sum((encode(p) if i % 2 else bytes_of(p) for i, p in enumerate(pieces)), [])
            turns.append(encode("x <search> q") + bytes_of(MULTIBYTE) + spelled + bytes_of("🙂") + encode("!"))
    for broken in ("</sea中rch>", "</answer 中>", "</search"):
        turns.append(bytes_of(MULTIBYTE) + bytes_of(broken) + encode(" tail"))
    turns.append(bytes_of("</sea") + bytes_of("中")[:1] + bytes_of("rch></ans") + [endoftext] + bytes_of("wer>"))
    turns.append(encode("a 中文 </") + [endoftext] + encode("search> b"))
    return turns


def random_turns(tokenizer, bytes_of, count: int, seed: int) -> list[list[int]]:
    """Random ids over the whole vocabulary (special tokens, lone bytes of multibyte characters and all), with
    stop strings (as text tokens or as bytes) and multibyte characters spliced in at random places."""
    rs = np.random.RandomState(seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    inserts = [encode("</search>"), bytes_of("</search>"), encode(" </answer>"), bytes_of("</answer>"),
               bytes_of(MULTIBYTE), bytes_of("🙂")[:3], encode("</"), bytes_of("rch>")]
    turns = []
    for _ in range(count):
        tokens = rs.randint(0, len(tokenizer), size=rs.randint(5, 60)).tolist()
        for _ in range(rs.randint(0, 4)):
            at = rs.randint(0, len(tokens) + 1)
            tokens[at:at] = inserts[rs.randint(len(inserts))]
        turns.append(tokens)
    return turns


@pytest.mark.parametrize("chunk", range(1, 9))
def test_first_finished_step_equals_a_full_redecode(qwen_tokenizer, bytes_of, chunk):
    """After every chunk (of `chunk` tokens, and of random sizes 1..8) the matcher says what a full re-decode says,
    for adversarial turns (an eighth of them each: the 8 chunk sizes together run every split of each stop string)
    and random ones; the cases reach both answers."""
    rs = np.random.RandomState(chunk)
    turns = (adversarial_turns(qwen_tokenizer, bytes_of)[chunk - 1::8]
             + random_turns(qwen_tokenizer, bytes_of, 60, seed=chunk))
    matcher = StopMatcher(qwen_tokenizer)
    finished = unfinished = 0
    for tokens in turns:
        for sizes in ([chunk] * len(tokens), rs.randint(1, 9, size=len(tokens))):
            chunks = chunks_of(tokens, sizes)
            expected = reference_steps(qwen_tokenizer, chunks)
            assert matcher_steps(matcher, chunks) == expected, (tokens, [len(c) for c in chunks])
            finished += expected[-1]
            unfinished += not expected[-1]
    assert finished > 60 and unfinished > 20


class CountingTokenizer:
    """The tokenizer, counting the tokens each `batch_decode` call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens = tokenizer, 0

    def batch_decode(self, windows, **kwargs):
        self.tokens += sum(map(len, windows))
        return self.tokenizer.batch_decode(windows, **kwargs)


@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_tokens_decoded_per_chunk_do_not_grow_with_the_turn(qwen_tokenizer, chunk):
    """A 3,400-token turn of mixed English, Chinese and emoji (a tenth of its token boundaries split a character,
    some chunks end there): each push decodes at most its new tokens + 2 x CONTEXT_TOKENS + 2 x PROBE_TOKENS +
    PROBE_TOKENS x CONTEXT_TOKENS, however long the turn and the chunk (a full re-decode grows with the turn);
    and the matcher stays right."""
    text = " ".join(f"step {i}: 检索 {i} 个文档🙂, été €{i};" for i in range(150))
    tokens = qwen_tokenizer.encode(text, add_special_tokens=False) + qwen_tokenizer.encode(" </answer>")
    chunks = chunks_of(tokens, [chunk] * len(tokens))
    ends = np.cumsum([len(c) for c in chunks])
    assert any(qwen_tokenizer.decode(tokens[:end]).endswith("\ufffd") for end in ends)
    counting = CountingTokenizer(qwen_tokenizer)
    matcher = StopMatcher(counting)
    matcher.reset(0)
    c, p = stop_strings.CONTEXT_TOKENS, stop_strings.PROBE_TOKENS
    per_push, results = [], []
    for piece in chunks:
        before = counting.tokens
        results.append(matcher.push(0, piece))
        per_push.append(counting.tokens - before - len(piece))
    assert max(per_push) <= 2 * c + 2 * p + p * c, max(per_push)
    assert results == [False] * (len(results) - 1) + [True]


@pytest.mark.parametrize("stops", [("🙂", "文档"), ("é€", "</search>")])
def test_multibyte_stop_strings_match_once_their_characters_are_whole(qwen_tokenizer, bytes_of, stops):
    """Stop strings of multibyte characters, whose bytes come in different chunks: the matcher agrees with a full
    re-decode after every chunk (an unfinished character is held back, not settled as U+FFFD)."""
    rs = np.random.RandomState(len(stops[0]))
    encode = lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    turns = [bytes_of(f"ab {stop} cd") for stop in stops] + [encode(f"x {stop}") for stop in stops]
    turns += random_turns(qwen_tokenizer, bytes_of, 30, seed=5)
    turns += [t[:rs.randint(len(t))] + bytes_of(stops[rs.randint(2)]) + t for t in turns[-30:]]
    matcher = StopMatcher(qwen_tokenizer, stops)
    finished = 0
    for tokens in turns:
        for sizes in ([1] * len(tokens), [2] * len(tokens), rs.randint(1, 9, size=len(tokens))):
            chunks = chunks_of(tokens, sizes)
            expected = list(itertools.accumulate(
                (any(s in qwen_tokenizer.decode(sum(chunks[:k + 1], []), skip_special_tokens=True) for s in stops)
                 for k in range(len(chunks))), lambda a, b: a or b))
            assert matcher_steps(matcher, chunks) == expected, (tokens, [len(c) for c in chunks])
            finished += expected[-1]
    assert finished > 30

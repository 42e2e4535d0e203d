"""The engine's host side against a scripted device: a 'model' whose next token is a function of the context it
reads back through the page tables (so any wrong page, slot, position, copy or roll back changes what it samples)
and of the sequence's PRNG stream (key, n). Every turn must equal the one sampled from the true context directly,
whatever the token budget, the slots and the order sequences share steps in, one call at a time or with the next
call dispatched before the one in flight is absorbed (overlap: its decoding sequences' tokens taken from the call
before, the samples of a turn that ended there discarded and its writes rolled back)."""
import zlib

import numpy as np
import pytest

from llds_jax.rollout.engine import Engine
from llds_jax.rollout.step_calls import EngineConfig, Immediate, StepResult

VOCAB, STOP = 50, 0


def next_token(context: list[int], key_data, n: int) -> int:
    """The scripted policy: a hash of the whole context and of the stream's n-th draw; STOP about 1 in 12."""
    h = zlib.crc32(np.asarray(context, np.int64).tobytes()) ^ zlib.crc32(np.asarray([*key_data, n], np.int64).tobytes())
    return STOP if h % 12 == 0 else 1 + h % (VOCAB - 1)


def logp_of(token: int, n: int) -> float:
    return -0.01 * token - 0.001 * n


class ScriptedRunner(Immediate):
    """The device side, in NumPy: a pool of token ids [pages, page_size] written and read through the batch's
    slots and page tables, copies made first; decoding seqs feed back their own samples. It answers at once
    (`Immediate`: under overlap, a batch token of the call before's samples is resolved from its result).

    The tests' one runner double. The step estimate's `llds_jax.aot.scripted_agent.ScriptedRunner` (product code,
    which the schedule tests run through `aot.rollout_schedule`) is another job: its tokens follow each script's
    turn lengths and it records each call's cost, but it reads no page, so a wrong page, slot, copy or roll back
    would not change what it samples; this one's tokens are a function of the context read back through the page
    tables."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.pool = np.full((config.num_pages, config.page_size), -1, np.int64)
        self.batches = []
        self.sourced = 0  # batch tokens taken from the call before's samples

    def context(self, table_p, length):
        size = self.config.page_size
        return [int(self.pool[table_p[i // size], i % size]) for i in range(length)]

    def dispatch(self, params, batch, previous):
        self.sourced += int(np.sum(batch.source_s >= 0))
        return super().dispatch(params, batch, previous)

    def run(self, params, batch):
        assert (batch.source_s == -1).all()  # resolved
        self.batches.append(batch)
        size, chunk = self.config.page_size, batch.decode_chunk
        for source, target in batch.page_copies:
            if source or target:
                self.pool[target] = self.pool[source]
        for row in range(batch.num_seqs):  # token i of q new ones sits at position kv_len - q + i
            first, end = batch.cu_q_lens_s[row], batch.cu_q_lens_s[row + 1]
            for i, token in enumerate(batch.tokens_t[first:end]):
                pos = batch.kv_lens_s[row] - (end - first) + i
                self.pool[batch.page_table_sm[row, pos // size], pos % size] = token
        s_count = len(batch.samples_s)
        tokens, logps, n = np.zeros((s_count, chunk), np.int32), np.zeros((s_count, chunk), np.float32), \
            np.zeros(s_count, np.int32)
        for row in range(batch.num_seqs):
            length = int(batch.kv_lens_s[row])
            for i in range(batch.samples_s[row]):
                if i:  # the previous sample is written, as the decode step does
                    pos = length
                    self.pool[batch.page_table_sm[row, pos // size], pos % size] = tokens[row, i - 1]
                    length += 1
                count = int(batch.count_s[row]) + i
                token = next_token(self.context(batch.page_table_sm[row], length), batch.key_data_s[row], count)
                tokens[row, i], logps[row, i], n[row] = token, logp_of(token, count), i + 1
                if token == STOP:
                    break
        return StepResult(tokens, logps, n)


class Reference:
    """The same conversations sampled from the true context, one token at a time."""

    def __init__(self):
        self.tokens, self.sampled, self.keys = {}, {}, {}

    def add(self, seq, prompt, key):
        self.tokens[seq], self.sampled[seq], self.keys[seq] = list(prompt), 0, key

    def turn(self, seq, budget, chunk, stop_text):
        out = []
        while len(out) < budget:
            token = next_token(self.tokens[seq] + out, self.keys[seq], self.sampled[seq])
            self.sampled[seq] += 1
            out.append(token)
            if token == STOP:
                break
            if len(out) % chunk == 0 and stop_text(out):  # text stops are seen at the end of a call only
                break
        self.tokens[seq] += out
        return out


class TextStops:
    """A stop 'string': the turn holds token 7 (checked at the end of each call, fed new tokens only)."""

    def __init__(self):
        self.seen, self.pushed = {}, []

    def reset(self, seq):
        self.seen[seq] = False

    def forget(self, seq):
        del self.seen[seq]

    def push_many(self, seqs, new_ids):
        self.pushed += [len(new) for new in new_ids]
        for seq, new in zip(seqs, new_ids):
            self.seen[seq] = self.seen[seq] or 7 in new
        return [self.seen[seq] for seq in seqs]


def make(max_seqs=4, budgets=(4, 8, 16), chunk=3, page_size=4, num_pages=64, max_context=64, stops=True,
         overlap=False):
    config = EngineConfig(max_seqs=max_seqs, token_budgets=budgets, decode_chunk=chunk, page_size=page_size,
                          num_pages=num_pages, max_context=max_context, stop_ids=(STOP,))
    runner = ScriptedRunner(config)
    return Engine(runner, None, config, TextStops() if stops else None, overlap=overlap), runner


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["one-call", "overlap"])


def key(i):
    return np.asarray([i, 1000 + i], np.uint32)


def run_until_ended(engine):
    ended = {}
    for _ in range(200):
        if not engine.running:
            return ended
        for seq, turn in engine.step():
            ended[seq] = turn
    raise AssertionError("the engine did not end every turn")


def conversations(engine, plan, turns=3, budget=9):
    """Runs `plan` (seq -> prompt) through `turns` turns: each turn keeps its first half and appends an
    observation of 3 tokens. Returns seq -> list of sampled turns (token lists)."""
    out = {seq: [] for seq in plan}
    for seq, prompt in plan.items():
        engine.add_request(seq, prompt, key(seq), budget)
    for turn in range(turns):
        for seq, sampled in sorted(run_until_ended(engine).items()):
            out[seq].append(list(sampled.token_ids))
            if turn + 1 < turns:
                engine.extend(seq, len(sampled.token_ids) // 2, [40 + turn, 41, 42], budget)
    return out


def reference(plan, chunk=3, turns=3, budget=9):
    ref = Reference()
    out = {seq: [] for seq in plan}
    for seq, prompt in plan.items():
        ref.add(seq, prompt, key(seq))
    for turn in range(turns):
        for seq in plan:
            sampled = ref.turn(seq, budget, chunk, lambda toks: 7 in toks)
            out[seq].append(sampled)
            if turn + 1 < turns:
                start = len(ref.tokens[seq]) - len(sampled)
                ref.tokens[seq] = ref.tokens[seq][:start + len(sampled) // 2] + [40 + turn, 41, 42]
    return out


PLAN = {0: [5, 6, 8, 9, 10, 11, 12], 1: [5, 6, 8, 9, 10, 11, 12], 2: [13, 14, 15], 3: list(range(20, 38)),
        4: [5, 6, 8, 9, 10, 11, 12], 5: [30, 31]}


@pytest.mark.parametrize("max_seqs, budgets, page_size", [(6, (6, 12, 32), 4), (6, (6,), 1), (6, (8, 64), 5),
                                                          (6, (6, 7), 3)])
@OVERLAP
def test_turns_equal_sampling_from_the_true_context_at_any_budget_and_page_size(max_seqs, budgets, page_size,
                                                                                 overlap):
    engine, runner = make(max_seqs=max_seqs, budgets=budgets, page_size=page_size, num_pages=512, overlap=overlap)
    assert conversations(engine, PLAN) == reference(PLAN)
    assert all(int(b.cu_q_lens_s[b.num_seqs]) <= len(b.tokens_t) <= budgets[-1] for b in runner.batches)
    assert (runner.sourced > 0) == overlap


@OVERLAP
def test_the_stop_matcher_is_fed_each_calls_new_tokens_only(overlap):
    engine, _ = make(max_seqs=6, num_pages=512, overlap=overlap)
    conversations(engine, PLAN)
    pushed = engine.stop_matcher.pushed
    assert pushed and max(pushed) <= 3 and sum(pushed) == engine.counts.sampled_tokens  # chunk 3: never a turn


@OVERLAP
def test_a_groups_samples_share_the_prompts_pages_and_encode_one_token_each(overlap):
    engine, runner = make(max_seqs=6, budgets=(64,), num_pages=128, overlap=overlap)
    conversations(engine, PLAN, turns=1)
    first = runner.batches[0]
    # Step 1 encodes each distinct prompt once (sequences 1 and 4 wait for 0), step 2 their last prompt token.
    assert first.num_seqs == 4 and int(first.cu_q_lens_s[4]) == 7 + 3 + 18 + 2
    assert engine.counts.shared_prompt_tokens == 2 * 6
    second = runner.batches[1]
    # Step 2: the two sharers' last prompt tokens beside the decoding sequences' pending tokens.
    assert {int(second.cu_q_lens_s[i + 1] - second.cu_q_lens_s[i]) for i in range(second.num_seqs)} == {1}
    n = second.num_seqs
    assert n >= 2 and list(second.kv_lens_s[n - 2:n]) == [7, 7]  # decoding sequences first, then 1 and 4


@OVERLAP
def test_a_fork_continues_from_its_parents_turn_start_with_its_own_stream(overlap):
    engine, runner = make(max_seqs=4, num_pages=64, overlap=overlap)
    plan = {0: list(range(1, 11))}
    turns = conversations(engine, plan, turns=2)
    parent = engine.context(0)
    # Turn 1 of sequence 0 began after: prompt, half of turn 0, observation [40, 41, 42].
    start = 10 + len(turns[0][0]) // 2 + 3
    engine.fork(9, 0, 1, key(9), 6)
    copies_before = engine.counts.page_copies
    forked = run_until_ended(engine)[9]
    assert engine.context(9)[:start] == parent[:start]
    ref = Reference()
    ref.add(9, parent[:start], key(9))
    assert list(forked.token_ids) == ref.turn(9, 6, 3, lambda toks: 7 in toks)
    assert engine.counts.page_copies - copies_before <= 1


@OVERLAP
def test_finish_and_roll_back_give_every_page_back(overlap):
    engine, _ = make(max_seqs=6, num_pages=128, overlap=overlap)
    conversations(engine, PLAN, turns=2)
    for seq in PLAN:
        engine.finish(seq)
    assert engine.pages.free_pages == 127 and engine.running == 0 and engine.can_admit(64)


@OVERLAP
@pytest.mark.parametrize("num_pages", [17, 20, 26])
def test_turns_through_a_pool_small_enough_to_preempt_equal_sampling_from_the_true_context(num_pages, overlap):
    # 17 pages of 4 slots hold one sequence at max_context 64 beside the padding page: every sequence is preempted
    # (its pages given back, its context encoded again later) while another needs pages.
    engine, runner = make(max_seqs=6, budgets=(6, 12, 32), page_size=4, num_pages=num_pages, overlap=overlap)
    assert conversations(engine, PLAN) == reference(PLAN)
    assert engine.counts.preemptions > 0 and (runner.sourced > 0) == overlap
    for seq in PLAN:
        engine.finish(seq)
    assert engine.pages.free_pages == num_pages - 1  # no page lost to a preemption


@OVERLAP
def test_a_fork_of_a_preempted_parent_encodes_the_parents_context_and_samples_as_from_it(overlap):
    engine, _ = make(max_seqs=4, page_size=4, num_pages=17, overlap=overlap)
    turns = conversations(engine, {0: list(range(1, 11))}, turns=2)  # sequence 0 ends turn 1 holding its pages
    parent = engine.context(0)
    engine.add_request(1, list(range(100, 160)), key(1), 4)  # 60 tokens: 15 of the 16 free pages and more
    run_until_ended(engine)  # nothing else can run: the ended sequence 0 is preempted for sequence 1
    assert engine.counts.preemptions == 1 and engine.pages.held(0) == 0
    engine.finish(1)
    start = len(parent) - len(turns[0][1])  # turn 1 began after the prompt, half of turn 0 and an observation
    engine.fork(9, 0, 1, key(9), 6)
    forked = run_until_ended(engine)[9]
    assert engine.context(9)[:start] == parent[:start]
    ref = Reference()
    ref.add(9, parent[:start], key(9))
    assert list(forked.token_ids) == ref.turn(9, 6, 3, lambda toks: 7 in toks)


@OVERLAP
def test_admission_takes_what_sequences_still_have_to_write_and_waits_for_preempted_ones(overlap):
    # 32 pages to hand out; the watermark keeps 1.
    engine, _ = make(max_seqs=6, page_size=4, num_pages=33, overlap=overlap)
    assert engine.can_admit(31 * 4) and not engine.can_admit(31 * 4 + 1)
    engine.add_request(0, list(range(1, 61)), key(0), 4)  # owes 15 pages before it has written a token
    assert engine.can_admit(16 * 4) and not engine.can_admit(16 * 4 + 1)
    engine.add_request(1, list(range(1, 61)), key(1), 4)
    run_until_ended(engine)  # the two share the prompt's pages
    assert engine.counts.preemptions == 0 and engine.counts.shared_prompt_tokens == 59
    engine.add_request(2, list(range(200, 261)), key(2), 3)
    engine.add_request(3, list(range(300, 361)), key(3), 3)
    run_until_ended(engine)  # 2 and 3 cannot both be held beside 0 and 1: the younger is preempted
    assert engine.counts.preemptions >= 1 and not engine.can_admit(1)  # and is waiting to come back


def test_errors_name_the_problem():
    engine, _ = make(max_seqs=2, max_context=16)
    engine.add_request(0, [1, 2, 3], key(0), 4)
    with pytest.raises(ValueError, match="sequence 0 is already in flight"):
        engine.add_request(0, [1], key(0), 4)
    with pytest.raises(ValueError, match="14 context tokens \\+ a turn of 4 exceed the engine's 16"):
        engine.add_request(1, list(range(14)), key(1), 4)
    with pytest.raises(ValueError, match="sequence 0's turn has not ended"):
        engine.extend(0, 0, [1], 4)
    with pytest.raises(ValueError, match="EngineConfig: token_budgets \\(2,\\) must ascend and reach max_seqs 4"):
        EngineConfig(max_seqs=4, token_budgets=(2,), decode_chunk=1, page_size=1, num_pages=4, max_context=4)

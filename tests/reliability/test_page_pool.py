"""A page pool (`rollout.num_pages`) too small for what the rollout policy admits at once (issue 66): through the real
command, one stderr line naming rollout.num_pages and the pages it needs, exit status 2, before the run folder is
claimed or the model loaded (before: the continuous policy spun in silence, the barrier policy ended its first rollout
with a traceback, the engine skipped a sequence for ever). A pool that holds one sequence is enough for the continuous
policy, and the engine never runs out of pages (issue 67: pages by use, preemption by recompute): a rollout through
a pool of one samples what a full pool does; a step that can schedule nothing while sequences run is an error naming
the state.

The demo's numbers (configs/demo_cpu.py): pages of 16 slots, sequences of up to 512 tokens: 32 pages a sequence, and
the padding page; the barrier policy admits a step's 8 x 8 = 64 sequences at once (2049 pages), the evaluation 256
(eval.batch_size: 8193 pages); the continuous policy admits what fits, so it needs one sequence's 33."""
import os

import jax
import numpy as np
import pytest

from llds_jax.config import ConfigError
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from llds_jax import config as config_lib
from llds_jax.train import run_builder
from tests.configs import CONFIGS, load
from tests.reliability.test_config_errors import assert_one_line, config_text, launch
from tests.rollout.test_agent import EchoRetriever, example, steered_params
from tests.rollout.test_engine import key, make

ONE_SEQUENCE = ("rollout.num_pages ({}) cannot hold one sequence of rollout.max_context_tokens (512): it needs at "
                "least 33 pages (32 of rollout.page_size 16 slots and the padding page; 0: sized to fit)")
SESSION = ("rollout.num_pages ({}) cannot hold a session of the {} policy: the {}'s {} sequences ({}) at "
           "rollout.max_context_tokens (512) need {} x 32 pages of rollout.page_size 16 slots and the padding page, "
           "at least {} (0: sized to fit; or rollout.continuous_batching, which admits what fits)")
STEP = "a host's data.prompts_per_step x data.samples_per_prompt"
TREES = ("--config.rollout.trees=4",)  # 4 trees x (1 + 1 round x 1 fork) = the 8 samples of a prompt
CONTINUOUS = ("--config.rollout.continuous_batching=True",)
SMALL_EVAL = ("--config.eval.batch_size=8",)  # the training rollout's session is then the larger one


@pytest.fixture
def demo_sized(tmp_path) -> str:
    """configs/tiny_test.py without the demo, at the demo's sizes (8 prompts x 8 samples, evaluations of 256), its
    model.path an empty folder: a run that got past the checks would stop at the model's load."""
    (tmp_path / "model").mkdir()
    path = tmp_path / "cfg.py"
    path.write_text(config_text(f"c.model.path = {str(tmp_path / 'model')!r}; c.data.prompts_per_step = 8; "
                                "c.data.samples_per_prompt = 8; c.eval.batch_size = 256"))
    return str(path)


@pytest.mark.parametrize("flags, pages, message", [
    ((), 3, ONE_SEQUENCE.format(3)),
    (TREES, 3, ONE_SEQUENCE.format(3)),
    (CONTINUOUS, 20, ONE_SEQUENCE.format(20)),
    ((), 150, SESSION.format(150, "barrier", "evaluation", 256, "eval.batch_size", 256, 8193)),
    (SMALL_EVAL, 150, SESSION.format(150, "barrier", "training rollout", 64, STEP, 64, 2049)),
    (TREES + SMALL_EVAL, 150, SESSION.format(150, "tree", "training rollout", 64, STEP, 64, 2049)),
    (TREES, 2049, SESSION.format(2049, "barrier", "evaluation", 256, "eval.batch_size", 256, 8193)),
    (SMALL_EVAL + ("--config.rollout.partial=True", "--config.objective.tis_cap=2.0"), 2049,
     SESSION.format(2049, "barrier", "training rollout", 128,
                    "a host's data.prompts_per_step x rollout.over_sampling x data.samples_per_prompt", 128, 4097)),
    (("--config.rollout.max_batch_size=16",), 400,
     SESSION.format(400, "barrier", "training rollout", 16, "rollout.max_batch_size", 16, 513)),
], ids=["barrier-3", "tree-3", "continuous-20", "barrier-150-eval", "barrier-150", "tree-150", "tree-2049-eval",
        "partial-over-sampled", "max-batch-size"])
def test_a_pool_too_small_for_what_the_policy_admits_is_one_line_before_the_run_starts(demo_sized, tmp_path, flags,
                                                                                       pages, message):
    run_dir = tmp_path / "run"
    proc = launch(demo_sized, f"--config.rollout.num_pages={pages}", f"--config.run_dir={run_dir}", *flags)
    assert_one_line(proc, message)
    assert not run_dir.exists() and os.listdir(tmp_path / "model") == []


@pytest.mark.parametrize("flags, message", [
    (CONTINUOUS + ("--config.rollout.num_pages=20",), ONE_SEQUENCE.format(20)),
    (("--config.rollout.num_pages=150",),
     SESSION.format(150, "barrier", "evaluation", 256, "eval.batch_size", 256, 8193)),
    (("--config.rollout.num_pages=400",) + TREES,
     SESSION.format(400, "barrier", "evaluation", 256, "eval.batch_size", 256, 8193)),
], ids=["continuous-20", "barrier-150", "tree-400"])
def test_the_issues_demo_commands_end_in_one_line_before_building_anything(tmp_path, flags, message):
    """The demo's own config, as issue 66 ran it: before, 180 s of silence (continuous) or a 27-frame traceback
    after the warm start and compiles (barrier, tree). Now nothing is built: no assets, no run folder."""
    assets, run_dir = tmp_path / "assets", tmp_path / "run"
    proc = launch(os.path.join(CONFIGS, "demo_cpu.py"), f"--config.demo.assets_dir={assets}",
                  f"--config.run_dir={run_dir}", *flags)
    assert_one_line(proc, message)
    assert not assets.exists() and not run_dir.exists()


def test_the_check_asks_for_exactly_what_a_hosts_sessions_admit():
    """At the need the pool passes, one page below it does not; a host of two runs half the step; a continuous
    policy's pool of 150 pages (4 sequences at once) is legal: it admits what fits."""
    cfg = load("demo_cpu")
    cfg.eval.batch_size = 8
    for num_pages, process_count in ((2049, 1), (1025, 2)):
        cfg.rollout.num_pages = num_pages
        run_builder.check_pool(config_lib.typed(cfg), process_count)
        cfg.rollout.num_pages = num_pages - 1
        with pytest.raises(ConfigError, match=f"the training rollout's {64 // process_count} sequences .* at least "
                                              f"{num_pages} "):
            run_builder.check_pool(config_lib.typed(cfg), process_count)
    cfg.rollout.num_pages, cfg.rollout.continuous_batching = 150, True
    run = config_lib.typed(cfg)
    run_builder.check_pool(run, 1)
    (_, train), (_, evaluation) = run_builder.rollout_shapes(run, 1)
    assert (train.max_seqs, evaluation.max_seqs, train.num_pages, (train.num_pages - 1) // train.pages_per_seq) == \
        (64, 8, 150, 4)


def test_the_engine_refuses_a_pool_of_less_than_one_sequence_and_runs_two_in_a_pool_of_one():
    """Pages of 4 slots, sequences of up to 16 tokens: 4 pages each. The issue's probes: a pool of 4 pages (a
    sequence whose prompt needs more pages than the pool was skipped for ever) is refused whole; in a pool of 6
    (one sequence and the padding page) two sequences, which made no progress in 1,000 steps, both end their turns,
    one preempted for the other."""
    with pytest.raises(ValueError, match=r"^EngineConfig: num_pages 4 cannot hold one sequence of max_context 16: "
                                         r"it needs 5 \(4 pages of 4 slots and the padding page\)$"):
        EngineConfig(max_seqs=2, token_budgets=(2, 4), decode_chunk=3, page_size=4, num_pages=4, max_context=16)
    engine, _ = make(max_seqs=2, num_pages=6, max_context=16)
    engine.add_request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], key(0), 4)
    engine.add_request(1, [11, 12, 13, 14, 15, 16, 17, 18, 19], key(1), 4)
    turns = []
    for _ in range(100):
        if not engine.running:
            break
        turns += engine.step()
    assert sorted(seq for seq, _ in turns) == [0, 1] and engine.counts.preemptions >= 1


def test_a_step_that_can_schedule_nothing_while_sequences_run_names_the_state():
    """Pages the engine does not know of (a leak) leave two admitted sequences nothing to write into: the step says
    so instead of returning nothing for ever."""
    engine, _ = make(max_seqs=2, num_pages=9, max_context=16)
    engine.add_request(0, [1, 2, 3, 4, 5], key(0), 4)
    engine.add_request(1, [6, 7, 8], key(1), 4)
    engine.pages.add(99)
    engine.pages.write(99, 4 * engine.pages.free_pages)
    with pytest.raises(RuntimeError, match=r"^Engine.step: nothing can be scheduled while 2 sequences run \(0 of 9 "
                                           r"pages free; sequence 0 input 0/5 tokens cached, 0 pages; sequence 1 "
                                           r"input 0/3 tokens cached, 0 pages\)$"):
        engine.step()
    engine.pages.free(99)
    ended = []
    while engine.running:
        ended += engine.step()
    assert [seq for seq, _ in ended] == [0, 1]


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_a_rollout_through_a_pool_of_one_sequence_samples_what_a_full_pool_does(qwen_tokenizer, continuous):
    """A legal small pool is not refused and does not hang: 4 conversations through a pool that holds one at
    max_context (33 pages of 8 slots for 256 tokens) sample, token for token and log-prob for log-prob, the
    trajectories of a pool that holds all four."""
    from flax import nnx
    from llds_jax.model import ModelConfig, Transformer

    model = Transformer(ModelConfig.tiny(vocab_size=151936), rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    params = steered_params(model)
    sampling = SamplingConfig(temperature=0.9, top_p=1.0, decode_chunk=8, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    examples = [example(i, f"question number {i} " + "about the long history of a city " * 12, ("paris",))
                for i in range(4)]  # prompts of about 150 tokens: two fit in the small pool, not four
    cfg = AgentConfig(max_turns=2, max_turn_tokens=24, max_observation_tokens=40, max_prompt_tokens=192,
                      max_context_tokens=256, continuous_batching=continuous)
    runs = [agent.rollout(PagedSampler(graphdef, model.cfg, sampling, engine_config(cfg, sampling, 4, 8, 512, pages)),
                          params, qwen_tokenizer, EchoRetriever(), agent.RolloutRequest(examples, jax.random.key(0),
                                                                                        cfg))
            for pages in (0, 33)]
    full, small = runs
    assert (full.stats.counts.preemptions, len(small.trajectories)) == (0, 4)
    # The barrier policy admits all four at once: they preempt one another. The continuous one admits a conversation
    # when the pool has room for it (one at a time here).
    assert (small.stats.counts.preemptions > 0) == (not continuous)
    for a, b in zip(full.trajectories, small.trajectories, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.sampler_logp, b.sampler_logp)

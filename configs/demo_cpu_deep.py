"""The demo on the k-hop world (issue 69, a long horizon): questions that need k = 1..6 searches, on one CPU machine.

    python -m llds_jax.launch --config=configs/demo_cpu_deep.py

configs/demo_cpu.py's shape (its tokenizer, policy, warm start and RL schedule) on `demo.world = "khop"`
(llds_jax.data.khop: chains of up to 6 relations over people, companies and cities; the test split has as many
questions of each k), with the turns and context the 6-hop questions need: 6 searches, then the answer, and 2
turns to spare (rollout.max_turns 8, eval.max_turns 8). Assets in runs/demo_world_deep (their own warm start), the
run in runs/demo_cpu_deep. The test split's data_source is `hop_<k>`, so the evaluation's tables at the start and
after the last step are EM (and searches) by hop count.

The context policy drop_observations (llds_jax/rollout/context.py) keeps the last 2 information blocks whole and
replaces older ones by a marker, each edit starting a segment trained as a sequence of its own: a trajectory's row
holds its segments, so the training length follows the longest row's segments (rounded to train.sequence_bucket;
a longer one than any before compiles the updates once more).
"""
from configs import demo_cpu
from llds_jax.apps import demo_config


def get_config():
    c = demo_cpu.get_config()
    c.demo.world = "khop"
    c.run_dir = demo_config.per_retriever(c, "runs/demo_cpu_deep")
    c.demo.assets_dir = demo_config.per_retriever(c, "runs/demo_world_deep")  # sft.output_dir follows it
    c.rollout.max_turns = 8             # a 6-hop question's 6 searches and 2 to spare, then the answer turn
    c.eval.max_turns = 8
    # The world's BPE: prompts of 24 (k = 1) to 45 (k = 6) tokens, turns of at most 18, observations of at most
    # 38; a 6-hop demonstration is 387 tokens, and 64 + 9 x 32 + 8 x 48 < 768 holds the turns' caps.
    c.rollout.max_context_tokens = 768
    c.optim.pack_row_tokens = 768       # a segment of the most tokens per row
    c.rollout.context_policy = "drop_observations"  # rollout.keep_observations: 2 information blocks kept whole
    return c

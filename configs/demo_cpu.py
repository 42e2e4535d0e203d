"""The main job on one CPU machine: a generated search world, its embedded BM25 index, a small Qwen2-architecture
policy with the real Qwen2.5 tokenizer, GRPO + LLDS with the real multi-turn rollout loop.

    python -m llds_jax.launch --config=configs/demo_cpu.py
"""
from llds_jax.config import default_config


def get_config():
    c = default_config()
    c.run_dir = "runs/demo_cpu"
    c.demo.enabled = True
    c.model.dtype = "float32"
    c.model.remat = False
    c.mesh.fsdp = 1
    c.data.prompts_per_step = 4
    c.data.samples_per_prompt = 4
    c.rollout.max_turns = 2
    c.rollout.max_turn_tokens = 32
    c.rollout.max_observation_tokens = 200
    c.rollout.max_context_tokens = 1024
    c.rollout.max_prompt_tokens = 512
    c.rollout.top_p = 1.0
    c.optim.mini_batch_size = 8
    c.optim.micro_batch_size = 8
    c.optim.learning_rate = 1e-4
    c.optim.reference_dtype = "float32"
    c.train.total_steps = 10
    c.train.sequence_bucket = 64
    c.train.checkpoint_every = 10
    c.train.eval_every = 0
    c.train.lld_every = 5
    c.train.transcripts_every = 5
    c.eval.max_examples = 32
    c.eval.batch_size = 32
    return c

"""A tiny end-to-end run for tests: the demo's generated world and embedded index, a 1-layer policy, a few
short turns. Every piece of a real run is exercised (rollout with search, updates, LLD metrics, checkpoints,
TensorBoard, evaluation); nothing is learned."""
from llds_jax.apps import demo_config
from llds_jax.config import default_config


def get_config():
    c = default_config()
    c.run_dir = "runs/tiny_test"
    c.app = demo_config.APP             # the demo application (llds_jax.apps.demo) prepares the run
    c.demo = demo_config.section()
    c.demo.enabled = True
    c.demo.num_people = 20
    c.demo.hidden_size = 32
    c.demo.num_layers = 1
    c.demo.intermediate_size = 64
    c.model.dtype = "float32"
    c.model.remat = False
    c.mesh.fsdp = 1
    c.data.prompts_per_step = 2
    c.data.samples_per_prompt = 2
    c.rollout.max_turns = 1
    c.rollout.max_turn_tokens = 8
    c.rollout.max_observation_tokens = 48
    c.rollout.max_prompt_tokens = 256
    c.rollout.max_context_tokens = 512
    c.rollout.decode_chunk = 8
    c.optim.mini_batch_size = 2
    c.optim.micro_batch_size = 1
    c.optim.learning_rate = 1e-3
    c.optim.warmup_ratio = 0.0
    c.optim.reference_dtype = "float32"
    c.optim.logp_time_chunk = 64
    c.train.total_steps = 2
    c.train.checkpoint_every = 1
    c.train.lld_every = 1
    c.train.eval_every = 2
    c.train.eval_max_examples = 2
    c.train.transcripts_every = 1
    c.train.sequence_bucket = 64
    c.eval.max_examples = 4
    c.eval.batch_size = 4
    return c

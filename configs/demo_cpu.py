"""The main job on one CPU machine (no accelerator, no network): learn to search a generated world.

    python -m llds_jax.launch --config=configs/demo_cpu.py

1. Assets (runs/demo_world, built once): a world of 400 fictional people and 100 companies written as wiki-18
   passages, single- and two-hop questions (train/test split by person), the embedded BM25 index, a byte-level BPE
   trained on the world (docs/demo.md says why not Qwen2.5's 152k vocabulary), a random 4-layer Qwen2-architecture
   policy (1.08M parameters), and demonstrations: one set that always searches, and one of an imperfect
   demonstrator that searches on 30% of the questions and guesses on the rest.
2. Warm start (runs/demo_world/warm_start, cached): 320 supervised steps on the searching demonstrations (the policy
   learns to copy the name into the query and the answer out of the document), then 80 on the mixed ones (it
   learns to search only now and then). Greedy decoding takes the more likely branch, the guess: test EM is low.
3. GRPO + LLDS with the real rollout loop (searches hit the embedded index); the test set is evaluated before the
   first step and after the last, and both are printed side by side. `python -m llds_jax.train.report runs/demo_cpu`
   draws the plots.
"""
from llds_jax.apps import demo_config
from llds_jax.config import default_config


def get_config():
    c = default_config()
    c.app = demo_config.APP             # the demo application (llds_jax.apps.demo) prepares the run
    c.demo = demo_config.section()
    c.demo.enabled = True
    # runs/demo_cpu and runs/demo_world; another retriever's folders end in its name (runs/demo_cpu_e5_device, ...)
    c.run_dir = demo_config.per_retriever(c, "runs/demo_cpu")
    c.demo.assets_dir = demo_config.per_retriever(c, "runs/demo_world")
    c.demo.tokenizer = "world"
    c.demo.vocab_size = 1024            # an upper bound: the world's BPE runs out of merges at 738 entries
    c.demo.num_people = 400
    c.demo.hidden_size = 128
    c.demo.num_layers = 4
    c.demo.num_heads = 4
    c.demo.num_kv_heads = 2
    c.demo.intermediate_size = 512
    c.demo.initializer_range = 0.1      # Qwen2.5's 0.02 leaves a 128-wide model's attention near uniform for long
    c.demo.search_fraction = 0.3

    c.sft.enabled = True
    c.sft.output_dir = c.demo.get_ref("assets_dir") + "/warm_start"  # follows demo.assets_dir
    c.sft.steps = 400
    c.sft.curriculum_steps = 320        # first only demonstrations that search: copying names, reading answers
    c.sft.batch_size = 32
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 10
    c.sft.sequence_bucket = 64
    c.sft.log_every = 40

    c.model.dtype = "float32"
    c.model.remat = False
    c.model.attention_query_block = 64  # blockwise tiles of 64 x 64: a packed row's tiles outside every query's
    c.model.attention_key_block = 64    # trajectory are skipped (rows of 384 hold 3-4 trajectories)
    c.mesh.fsdp = 1
    c.data.prompts_per_step = 8
    c.data.samples_per_prompt = 8
    c.rollout.max_turns = 2             # two searches (a two-hop question needs both), then the answer turn
    c.rollout.max_turn_tokens = 32
    c.rollout.max_observation_tokens = 128
    c.rollout.max_prompt_tokens = 64
    c.rollout.max_context_tokens = 512
    c.rollout.retrieval_top_k = 1       # the top hit is the entity's passage; a second one only adds a distractor
    c.rollout.top_p = 1.0
    c.rollout.decode_chunk = 8
    c.optim.mini_batch_size = 16        # 4 updates per rollout batch
    c.optim.micro_batch_size = 16
    c.optim.learning_rate = 2e-4
    c.optim.warmup_ratio = 0.0
    c.optim.reference_dtype = "float32"
    c.optim.logp_time_chunk = 128
    c.optim.pack_row_tokens = 384       # packed rows twice the usual batch length (192): 13.7% padding, not 34%
    c.train.total_steps = 20
    c.train.sequence_bucket = 64
    c.train.checkpoint_every = 10
    c.train.eval_every = 0
    c.train.eval_at_start = True
    c.train.lld_every = 1
    c.train.transcripts_every = 10
    c.eval.max_turns = 2
    c.eval.max_examples = 0             # the whole test split
    c.eval.batch_size = 256
    return c

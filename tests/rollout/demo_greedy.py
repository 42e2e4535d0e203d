"""The demo's rollouts, recorded from the dense-cache engine before the paged engine replaced it
(tests/rollout/fixtures/demo_greedy/trajectories.json), and the rollout engine run on the same settings to be checked
against them.

The policy is the demo's warm start for seed 0 (`python -m llds_jax.launch --config=configs/demo_cpu.py`: a 4-layer
Qwen2-architecture policy trained on the generated world), stored in bfloat16 (tests/rollout/fixtures/demo_greedy/policy) and
run in float32; the world is the demo's for seed 0 (`synthetic.make_world(400, seed=0)`) with its BM25 index; the
rollout settings are configs/demo_cpu.py's (2 searching turns of up to 32 tokens, observations of up to 128, top-1
retrieval, decode chunks of 8). Three settings, greedy and sampled at temperature 1: chains (16 test questions x 2
samples greedy, 32 x 4 sampled) in one turn-synchronous batch, the same in a continuous batch of 8 (16) rows, and
trees (2 per question; 4 questions with one fork each greedy, 8 with two sampled).

The record is a fixed reference: it was written by this module's `main` at db635b6 with the dense engine
(`git show db635b6:tests/rollout/demo_greedy.py`), which is gone; it is never re-recorded from the engine it checks.
"""
from __future__ import annotations

import asyncio
import os

import jax
from flax import nnx

from index_builder.corpus import CorpusReader
from index_builder.to_bm25 import build_bm25
from llds_jax.data import synthetic
from llds_jax.data.qa import read_qa
from llds_jax.model import hf_io
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from llds_jax.search.factory import make_retriever
from llds_jax.model.tokenizer import load_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "demo_greedy")
POLICY = os.path.join(FIXTURE, "policy")
TRAJECTORIES = os.path.join(FIXTURE, "trajectories.json")
DEMO_AGENT = dict(max_turns=2, max_turn_tokens=32, max_observation_tokens=128, max_prompt_tokens=64,
                  max_context_tokens=512, retrieval_top_k=1)
SETTINGS = {"chains": dict(questions=16, samples=2, agent={}),
            "continuous": dict(questions=16, samples=2, agent=dict(continuous_batching=True, max_batch_size=8)),
            "trees": dict(questions=4, samples=4, agent=dict(trees=2, tree_rounds=1, tree_forks=1)),
            # The demo's training rollout samples at temperature 1 (it searches; greedy decoding mostly answers at
            # once).
            "chains_sampled": dict(questions=32, samples=4, agent={}, greedy=False),
            "continuous_sampled": dict(questions=32, samples=4, greedy=False,
                                       agent=dict(continuous_batching=True, max_batch_size=16)),
            "trees_sampled": dict(questions=8, samples=6, greedy=False,
                                  agent=dict(trees=2, tree_rounds=1, tree_forks=2))}


class Demo:
    """The policy, tokenizer, world index and test questions, built once."""

    def __init__(self, work_dir: str):
        self.model = hf_io.load_model(POLICY, dtype="float32", param_dtype="float32")
        self.graphdef, self.params = nnx.split(self.model)
        self.tokenizer = load_tokenizer(POLICY)
        files = synthetic.write_world(synthetic.make_world(num_people=400, seed=0), os.path.join(work_dir, "world"))
        self.index = os.path.join(work_dir, "index")
        build_bm25(CorpusReader(files["corpus.jsonl"]), self.index)
        self.questions = read_qa(files["test.parquet"])
        self.stop_ids = agent.turn_stop_ids(self.tokenizer)

    def rollout(self, setting: str) -> list[dict]:
        """Each trajectory's tokens, loss mask and end reason under `setting` on the rollout engine."""
        spec = SETTINGS[setting]
        config = AgentConfig(**DEMO_AGENT, **spec["agent"])
        examples = [q for q in self.questions[:spec["questions"]] for _ in range(spec["samples"])]
        sampling = SamplingConfig(greedy=spec.get("greedy", True), top_p=1.0, decode_chunk=8, stop_ids=self.stop_ids)
        slots = config.max_batch_size or len(examples)
        sampler = PagedSampler(self.graphdef, self.model.cfg, sampling,
                               engine_config(config, sampling, slots, page_size=16, max_step_tokens=256))

        async def run():
            async with make_retriever({"backend": "bm25", "index_dir": self.index}) as retriever:
                request = agent.RolloutRequest(examples, jax.random.key(0), config)
                return await agent.rollout_async(sampler, self.params, self.tokenizer, retriever, request)

        result = asyncio.run(run())
        return [{"tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist(), "end_reason": t.end_reason}
                for t in result.trajectories]


"""Runs of the reliability tests: a policy that searches, the generated world's questions and a scripted
retrieval server (tests/reliability/scripted_retriever.py), launched as real processes."""
import os
from collections.abc import Sequence

import pytest

from tests.e2e.runs import Launched, start

# One run's sizes: 32 trajectories sampled in 2 sessions of 16, then 32 updates of one trajectory each, each batch
# padded to a multiple of 64 tokens (steps differ in length: a resumed run must pad as the first attempt did).
SETTINGS = {
    "data.prompts_per_step": 16, "data.samples_per_prompt": 2, "rollout.max_batch_size": 16,
    "rollout.max_turn_tokens": 10, "rollout.max_observation_tokens": 64, "rollout.max_prompt_tokens": 256,
    "rollout.max_context_tokens": 512, "optim.mini_batch_size": 1, "optim.micro_batch_size": 1,
    "train.sequence_bucket": 64, "train.total_steps": 3, "train.lld_every": 0, "train.eval_every": 0,
    "train.final_eval": False, "train.transcripts_every": 0, "train.checkpoint_every": 100,
}


class SearchingRuns:
    """Launches of the tiny run config with the searching policy and the world's questions (SETTINGS), all with one
    JAX compilation cache (a later launch reuses what an earlier one compiled)."""

    def __init__(self, root, assets: dict, config_writer):
        self.root, self.assets, self.config_writer = root, assets, config_writer
        self.launches = 0

    def run_dir(self, name: str) -> str:
        return os.path.join(self.root, "runs", name)

    def start(self, retriever: dict, name: str, *args: str, launcher: Sequence[str] = ("-m", "llds_jax.launch"),
              run_dir: str | None = None, env: dict | None = None, **settings) -> Launched:
        """Starts a run in `run_dir` (default run_dir(name)) with the `retriever` section and SETTINGS updated by
        `settings` (keys with "__" for "."); its output goes to a new log file. `launcher`: as for
        tests.e2e.runs.start; `env`: environment variables to add."""
        self.launches += 1
        stem = os.path.join(self.root, f"{name}_{self.launches}")
        settings = {**SETTINGS, **{key.replace("__", "."): value for key, value in settings.items()}}
        config = self.config_writer(f"{stem}.py", self.assets, retriever=retriever, **settings)
        return start(config, 1, f"{stem}.log", f"--config.run_dir={run_dir or self.run_dir(name)}", *args,
                     env={"JAX_COMPILATION_CACHE_DIR": os.path.join(self.root, "jax_cache"), **(env or {})},
                     launcher=launcher)


@pytest.fixture(scope="session")
def searching_runs(tmp_path_factory, world, policy, config_writer) -> SearchingRuns:
    assets = {"model": policy[0], "train": world[1]["train.parquet"], "test": world[1]["test.parquet"], "index": ""}
    return SearchingRuns(str(tmp_path_factory.mktemp("searching_runs")), assets, config_writer)

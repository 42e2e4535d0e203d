"""The study's design: named arms (config overrides), named settings (config files), seeds, and the runs and
per-seed warm starts they make, each with its `python -m llds_jax.launch` command.

Folders under the study's output folder `OUT`:

- `OUT/seeds/seed_K/world` and `OUT/seeds/seed_K/warm_start`: seed K's generated world (demo.assets_dir) and warm
  start (sft.output_dir), shared by every setting and arm of that seed (so every seed has its own world, warm start
  and sampling, and an arm differs from another of the same seed only in its overrides);
- `OUT/runs/SETTING/ARM/seed_K`: one run's folder (run_dir).

A run's overrides are, in this order (a later one wins): the seed's (seed, demo.assets_dir, sft.output_dir, run_dir),
the arm's, then the extra overrides given to every launch.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FINAL_EVAL = "final_step_{steps}"  # llds_jax.launch: <run_dir>/eval/final_step_N after the last step


class StudyError(ValueError):
    """A study specification problem; the message names the arm, setting, seed list or config key."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """A variant run in every setting: config values it sets (`values`, key -> value) and scales (`scales`, key ->
    factor on the setting's own value, e.g. a learning rate 1/2.5 of the setting's)."""
    name: str
    description: str
    values: Mapping[str, Any]
    scales: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def overrides(self, setting_cfg: ml_collections.ConfigDict) -> list[str]:
        """`KEY=VALUE` strings (scaled values from `setting_cfg`, printed with 6 significant digits)."""
        values = [f"{key}={value}" for key, value in self.values.items()]
        return values + [f"{key}={config_value(setting_cfg, key) * factor:.6g}" for key, factor in self.scales.items()]


_GRPO = {"objective.llds.enabled": False}
_LLDS = {"objective.llds.enabled": True, "objective.llds.lam": 0.2, "objective.llds.gate": "action"}
# partial rollouts (docs/partial-rollouts.md, issue 59): both arms GRPO + LLDS (the llds arm) with the behaviour
# correction rollout.partial needs (truncated importance sampling, cap 2), on the continuous policy (where a partial
# step's cut comes the moment its last needed group completes); only partial2 over-samples (2x the step's groups)
# and carries the unfinished conversations, at most 1 policy version old
_SYNC_TIS = {**_LLDS, "objective.tis_cap": 2.0, "rollout.continuous_batching": True}
_PARTIAL2 = {**_SYNC_TIS, "rollout.partial": True, "rollout.over_sampling": 2.0, "rollout.max_staleness": 1}
_TREES = {"rollout.trees": 2, "rollout.tree_forks": 3, "data.samples_per_prompt": 8,
          "objective.advantages": "tree_grpo"}
ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("grpo", "GRPO (LLDS off)", _GRPO),
    Arm("llds", "GRPO + LLDS (lambda 0.2, action gate)", _LLDS),
    Arm("llds_lam1", "GRPO + LLDS at lambda 1.0 (action gate)", {**_LLDS, "objective.llds.lam": 1.0}),
    Arm("grpo_low_lr", "GRPO at 1/2.5 of the setting's learning rate", _GRPO, {"optim.learning_rate": 0.4}),
    Arm("grpo_kl10", "GRPO with 10x the setting's KL coefficient", _GRPO, {"objective.kl_coef": 10.0}),
    Arm("llds_token", "GRPO + LLDS, token-level gate", {**_LLDS, "objective.llds.gate": "token"}),
    Arm("llds_response", "GRPO + LLDS, response gate", {**_LLDS, "objective.llds.gate": "response"}),
    Arm("llds_low_lr", "GRPO + LLDS at 1/2.5 of the setting's learning rate", _LLDS, {"optim.learning_rate": 0.4}),
    # the stability methods peers ship: DAPO's clip-higher (its upper epsilon 0.28) and truncated importance
    # sampling of the sampler's log-probs (cap 2, the threshold ms-swift's token-level truncation defaults to)
    Arm("grpo_clip_higher", "GRPO with DAPO's clip-higher (upper clip 0.28)",
        {**_GRPO, "objective.clip_ratio_high": 0.28}),
    Arm("grpo_tis", "GRPO with truncated importance sampling (cap 2)", {**_GRPO, "objective.tis_cap": 2.0}),
    # tree rollouts (docs/tree-rollouts.md) with LLDS and Tree-GRPO's advantages: the setting's group of 8 as 2 trees
    # of a chain and 3 forks; 16 leaves (2 x (1 + 7)) with twice the mini-batch, so a step still makes the setting's
    # number of updates; 4 leaves (1 x (1 + 3)) with half of it
    Arm("llds_trees", "GRPO + LLDS on tree rollouts, 2 trees x (1 + 3) leaves", {**_LLDS, **_TREES}),
    Arm("llds_trees_wide", "GRPO + LLDS on tree rollouts, 2 trees x (1 + 7) leaves",
        {**_LLDS, **_TREES, "rollout.tree_forks": 7, "data.samples_per_prompt": 16}, {"optim.mini_batch_size": 2.0}),
    Arm("llds_trees_quarter", "GRPO + LLDS on tree rollouts, 1 tree x (1 + 3) leaves",
        {**_LLDS, **_TREES, "rollout.trees": 1, "data.samples_per_prompt": 4},
        {"optim.mini_batch_size": 0.5, "optim.micro_batch_size": 0.5}),
    Arm("sync_tis", "GRPO + LLDS with truncated importance sampling (cap 2), continuous rollouts, synchronous",
        _SYNC_TIS),
    Arm("partial2", "sync_tis with partial rollouts: 2x the groups started, the unfinished carried (staleness <= 1)",
        _PARTIAL2),
)}
# The gate ablation's action arm is the llds arm itself (the same overrides): one run folder, not two.
ARM_ALIASES = {"llds_action": "llds"}

SETTINGS: dict[str, str] = {
    "stress": "configs/demo_cpu_grpo.py",        # lr 5e-4, 8 updates per batch of 64, one group per update
    "default": "configs/demo_cpu.py",            # lr 2e-4, 4 updates per batch of 64
    "paper_shaped": "configs/demo_cpu_paper.py",  # lr 2e-4 after a 28.5% warmup, 10 updates of 2 groups of 4
    "collapse": "configs/demo_cpu_collapse.py",  # stress at lr 1e-3 for 30 steps: GRPO collapses (issue 33)
    "late_collapse": "configs/demo_cpu_late_study.py",  # stress for 80 steps: GRPO learns, then declines (issue 40)
    "tree_study": "configs/demo_cpu_tree_study.py",  # default, greedy EM every 5 steps: chains vs trees (issue 42)
    "good_lr": "configs/demo_cpu_long_horizon.py:2e-4",  # stress at lr 2e-4 for 200 steps: GRPO trains well (issue 56)
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the study: `overrides` are `KEY=VALUE` strings for `--config.KEY=VALUE`."""
    setting: str
    arm: str
    seed: int
    config: str
    overrides: tuple[str, ...]
    run_dir: str
    total_steps: int

    @property
    def name(self) -> str:
        return f"{self.setting}/{self.arm}/seed_{self.seed}"

    def command(self, mode: str = "train") -> list[str]:
        """The launch command of this run (`mode` "sft": only its world and warm start)."""
        mode_flag = [] if mode == "train" else [f"--mode={mode}"]
        return [sys.executable, "-m", "llds_jax.launch", f"--config={self.config}", *mode_flag,
                *(f"--config.{override}" for override in self.overrides)]

    def finished(self) -> bool:
        """True when the final evaluation after the last step has been written (the run's last output)."""
        return os.path.exists(os.path.join(self.run_dir, "eval", FINAL_EVAL.format(steps=self.total_steps),
                                           "results.json"))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The runs (by setting, arm, seed) and, per seed, the run whose `--mode=sft` command builds that seed's world
    and warm start before any of its runs start."""
    out: str
    runs: tuple[Run, ...]
    warm_starts: Mapping[int, Run]


def config_value(cfg: ml_collections.ConfigDict, key: str) -> Any:
    """The value (or section) of a dotted key, e.g. "optim.learning_rate"."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def parse_seeds(text: str) -> list[int]:
    """`N` -> seeds 0..N-1; `A-B` -> A..B; `A,B,...` -> those (a single seed K: `K,` or `K-K`)."""
    try:
        if "," in text:
            seeds = [int(part) for part in text.split(",") if part.strip()]
        elif "-" in text.strip()[1:]:
            first, last = (int(part) for part in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        raise StudyError(f"--seeds must be N, A-B or a comma-separated list of integers, got {text!r}") from None
    if not seeds or len(set(seeds)) < len(seeds) or min(seeds) < 0:
        raise StudyError(f"--seeds must name at least one seed, each once and >= 0, got {text!r}")
    return seeds


def parse_arms(text: str) -> list[tuple[str, int | None]]:
    """`grpo,llds,grpo_low_lr:4` -> [(name, how many of the seeds it runs: None for all)]; aliases resolved."""
    arms = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, count = part.partition(":")
        name = ARM_ALIASES.get(name, name)
        if name not in ARMS:
            known = sorted([*ARMS, *ARM_ALIASES])
            raise StudyError(f"unknown arm {name!r} in --arms (known: {', '.join(known)})")
        if count and (not count.isdigit() or int(count) < 1):
            raise StudyError(f"--arms: the seed count after {name}: must be a positive integer, got {count!r}")
        if name in (a for a, _ in arms):
            raise StudyError(f"--arms names {name!r} twice (llds_action is llds)")
        arms.append((name, int(count) if count else None))
    if not arms:
        raise StudyError("--arms names no arm")
    return arms


def parse_controls(text: str) -> list[str]:
    """`grpo,grpo_low_lr` -> the arms the paired table compares every other arm with, in that order; aliases
    resolved."""
    controls = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name = ARM_ALIASES.get(part, part)
        if name not in ARMS:
            known = sorted([*ARMS, *ARM_ALIASES])
            raise StudyError(f"unknown arm {part!r} in --controls (known: {', '.join(known)})")
        if name in controls:
            raise StudyError(f"--controls names {name!r} twice (llds_action is llds)")
        controls.append(name)
    if not controls:
        raise StudyError("--controls names no arm")
    return controls


def parse_settings(text: str) -> dict[str, str]:
    """`stress,default` -> {name: config file}; `NAME=PATH[:ARGS]` adds a setting of your own config file (ARGS goes
    to its `get_config`, e.g. `lr7e4=configs/demo_cpu_late_collapse.py:7e-4`)."""
    settings = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, path = part.partition("=")
        if not path and name not in SETTINGS:
            raise StudyError(f"unknown setting {name!r} in --settings (known: {', '.join(SETTINGS)}; or NAME=PATH)")
        settings[name] = path or os.path.join(REPO, SETTINGS[name])
    if not settings:
        raise StudyError("--settings names no setting")
    return settings


def seed_folder(out: str, seed: int) -> str:
    """Where a seed's world (`world/`) and warm start (`warm_start/`) go."""
    return os.path.join(out, "seeds", f"seed_{seed}")


def seed_overrides(out: str, seed: int) -> list[str]:
    """The seed's own world, warm start and sampling."""
    folder = seed_folder(out, seed)
    return [f"seed={seed}", f"demo.assets_dir={os.path.join(folder, 'world')}",
            f"sft.output_dir={os.path.join(folder, 'warm_start')}"]


# What a seed's world and warm start depend on (llds_jax.apps.demo.assets_for, llds_jax.sft.stage.fingerprint): every
# run of a seed must agree on these, or their launches would rebuild the shared folders under one another.
WARM_START_KEYS = ("seed", "demo", "sft", "model", "rollout.max_prompt_tokens", "rollout.retrieval_top_k",
                   "optim.logp_time_chunk")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(a command's own arguments, the `--config.KEY=VALUE` launch arguments after `--`)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def load(config: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """The run config of a config file (`PATH[:ARGS]`) with `KEY=VALUE` overrides (llds_jax.config.loader.load_config);
    StudyError naming the file, key or value when it cannot be loaded."""
    from llds_jax.config.loader import file_of, load_config
    if not os.path.isfile(file_of(config)):
        raise StudyError(f"config file not found: {file_of(config)}")
    try:
        return load_config(config, overrides)
    except (KeyError, ValueError) as e:
        raise StudyError(f"{config} with overrides {' '.join(overrides)}: {e.args[0] if e.args else e}") from None


def _check_run_config(run: Run, cfg: ml_collections.ConfigDict) -> None:
    demo = "demo" in cfg and cfg.demo.enabled  # a config without the demo application has no demo section
    if not (demo and cfg.sft.enabled):
        raise StudyError(f"{run.name}: the study needs demo.enabled and sft.enabled (a world and a warm start per "
                         f"seed); {run.config} has demo.enabled={demo}, sft.enabled={cfg.sft.enabled}")
    if not cfg.train.final_eval:
        raise StudyError(f"{run.name}: train.final_eval is off: the study's table needs the final evaluation")


def _warm_start_settings(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    values = {}
    for key in WARM_START_KEYS:
        value = config_value(cfg, key)
        values[key] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return values


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                return _first_difference(a[key], b[key], f"{prefix}{key}.")
            return f"{prefix}{key} ({a.get(key)!r} vs {b.get(key)!r})"
    return ""


def make_plan(out: str, settings: Mapping[str, str], arms: Sequence[tuple[str, int | None]], seeds: Sequence[int],
              extra: Sequence[str] = ()) -> Plan:
    """Every (setting, arm, seed) run, an arm with a count running the first `count` of `seeds`; each config is
    loaded with its overrides (an unknown key or a bad value raises StudyError naming it)."""
    runs, warm_starts, warm_settings = [], {}, {}
    for setting, config in settings.items():
        setting_cfg = load(config, extra)
        for arm_name, count in arms:
            arm = ARMS[arm_name]
            for seed in seeds[:count]:
                run_dir = os.path.join(out, "runs", setting, arm_name, f"seed_{seed}")
                overrides = (*seed_overrides(out, seed), f"run_dir={run_dir}", *arm.overrides(setting_cfg), *extra)
                cfg = load(config, overrides)
                run = Run(setting, arm_name, seed, config, overrides, run_dir, cfg.train.total_steps)
                _check_run_config(run, cfg)
                warm = _warm_start_settings(cfg)
                if seed not in warm_starts:
                    warm_starts[seed], warm_settings[seed] = run, warm
                elif warm != warm_settings[seed]:
                    raise StudyError(f"{run.name} and {warm_starts[seed].name} need different worlds or warm starts "
                                     f"for seed {seed} (they differ in {_first_difference(warm_settings[seed], warm)})"
                                     f": a setting or arm must not change {', '.join(WARM_START_KEYS)}")
                runs.append(run)
    return Plan(out, tuple(runs), warm_starts)

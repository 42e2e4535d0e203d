"""What LLDS costs per training step: the same `RLTrainStep` with `objective.llds.enabled` True (lambda 0.2, action
gate: the default) and False (plain GRPO), same params, same batch, timed side by side in one process.

One random model (`bench/train_step.py`'s `model_config`) and one synthetic multi-turn rollout batch
(`synthetic_batch`: no padding, so the forwards run on one row per trajectory, `optim.pack_trajectories` off) feed
two train steps that differ only in the LLDS switch. Timed for each side, in interleaved rounds (`measure`: best of
`--repeats` rounds after a warm-up call, wall and process CPU time):

- update: one optimizer update, the jitted mini-batch update (`_jitted_update`, as `train_on_batch` calls it: K
  micro-batches of forward + backward, gradient accumulation, clip, AdamW);
- step: `train_on_batch` with `measure_lld=False` (`train.lld_every = 0`, or a step it skips): the batch laid out,
  old and reference log-probs (two forwards), the likelihood metrics, the U updates, the metrics fetched;
- step + LLD: `train_on_batch` with `measure_lld=True` (a step `train.lld_every` measures): the same plus the LLD
  measurement: the LLD forward after the updates (and before them with a bfloat16 model; a float32 model's log-probs
  before the updates are old_logp itself) and `lld_metrics`;
- LLD forward: one LLD forward over the batch (forward only; identical programs on both sides: a noise gauge);
- LLD metrics: `lld_metrics` (Delta_traj, LLD rate) of two log-prob arrays.

XLA's cost analysis of each side's compiled update (FLOPs and bytes accessed) is printed too: a count, not a timing,
so its ratio is free of the machine's noise.

The LLD measurement is a diagnostic (`train.lld_every`), not part of the LLDS loss: both sides pay it alike. The GRPO
side still computes the LLDS gate diagnostics of `update_metrics` (stop-gradient); what LLDS adds is its loss term
and that term's backward.

    python bench/llds_cost.py                                   # the demo's model: hidden 128, 4 layers, vocab 1024
    python bench/llds_cost.py --hidden 256 --vocab 4096 --seq 256
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import matmul_params, measure, model_config, synthetic_batch  # noqa: E402

from llds_jax.model import Transformer  # noqa: E402
from llds_jax.programs import Role  # noqa: E402
from llds_jax.rl.batch import RolloutBatch  # noqa: E402
from llds_jax.config.sections import LLDSConfig, ObjectiveConfig, UpdateConfig  # noqa: E402
from llds_jax.rl.train_step import RLTrainStep  # noqa: E402

SIDES = ("GRPO", "LLDS")
PARTS = ("update", "step", "step + LLD", "LLD forward", "LLD metrics")


class Side:
    """One train step (GRPO or GRPO + LLDS) with its own state, the reference params and the batch prepared once."""

    def __init__(self, model: nnx.Module, objective: ObjectiveConfig, update: UpdateConfig, batch: RolloutBatch):
        self.step = RLTrainStep(model, objective, update)
        self.state = self.step.init_state()
        self.ref_params = self.step.reference_params(self.state.params)
        self.batch = batch
        self.prepared = self.step.prepare_batch(batch)
        self.old_logp = self.step.sequence_logp(self.state.params, self.prepared)
        self.ref_logp = self.step.sequence_logp(self.ref_params, self.prepared)
        self.index = 0
        self.metrics: dict[str, float] = {}  # of the latest train_on_batch
        self.first_metrics: dict[str, float] = {}  # of the first: trained on again, the batch stops firing the gate

    def update(self):
        """The next optimizer update (the jitted mini-batch update on update index % U's mini-batch)."""
        index, p = self.index % self.prepared.num_updates, self.prepared
        self.state, _ = self.step._jitted_update(self.state)(
            self.state, p.batch, p.update_rows(index), p.batch_stats, self.old_logp, self.ref_logp, jnp.int32(index))
        self.index += 1
        return self.state.params

    def train(self, measure_lld: bool):
        """`train_on_batch` on the batch (the whole per-step update work)."""
        self.state, metrics = self.step.train_on_batch(self.state, self.ref_params, self.batch,
                                                       measure_lld=measure_lld)
        self.metrics = metrics.scalars
        self.first_metrics = self.first_metrics or metrics.scalars
        return self.state.params

    def update_cost(self) -> dict[str, float]:
        """XLA's cost analysis of the compiled update program (FLOPs, bytes accessed): not a timing, no noise."""
        p = self.prepared
        compiled = self.step._jitted_update(self.state).lower(
            self.state, p.batch, p.update_rows(0), p.batch_stats, self.old_logp, self.ref_logp, jnp.int32(0)).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return {key: float(cost.get(key, float("nan"))) for key in ("flops", "bytes accessed")}

    def lld_forward(self):
        """The LLD measurement's forward as `train_on_batch` runs it: its own float32 program with a model that
        does not compute in float32, else the policy's log-probs program."""
        lld_program = self.step._batch_programs(self.state, False, True).get(Role.LLD_LOGP)
        return self.step.sequence_logp(self.state.params, self.prepared, lld_program)

    def lld_metrics(self):
        return self.step._lld(self.old_logp, self.ref_logp, self.prepared.batch)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=192, help="tokens per trajectory")
    p.add_argument("--batch", type=int, default=64, help="trajectories per rollout batch (a multiple of --mini)")
    p.add_argument("--mini", type=int, default=16, help="trajectories per optimizer update")
    p.add_argument("--micro", type=int, default=16, help="trajectories per micro-batch (divides --mini)")
    p.add_argument("--chunk", type=int, default=128, help="optim.logp_time_chunk")
    p.add_argument("--lam", type=float, default=0.2, help="objective.llds.lam of the LLDS side")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--remat", action="store_true", help="model.remat (rematerialize decoder blocks)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "blockwise"), help="model.attention")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (best reported)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Prints the table; returns {"timings": part -> side -> best Timing, "update_cost": side -> XLA's cost analysis of
    the update, "first_metrics": side -> the scalars of its first train_on_batch}."""
    args = parse_args(argv)
    cfg = model_config(args)
    on_cpu = jax.devices()[0].platform == "cpu"
    update = UpdateConfig(mini_batch_size=args.mini, micro_batch_size=args.micro, learning_rate=1e-5,
                          logp_time_chunk=args.chunk, reference_dtype="float32", pack_trajectories=False)
    batch = synthetic_batch(args.batch, args.seq, args.vocab)
    model = Transformer(cfg, rngs=nnx.Rngs(0))  # one model: both steps start from the same params
    objectives = {"GRPO": ObjectiveConfig(llds=LLDSConfig(enabled=False)),
                  "LLDS": ObjectiveConfig(llds=LLDSConfig(enabled=True, lam=args.lam))}
    sides = {name: Side(model, objective, update, batch) for name, objective in objectives.items()}
    u = sides["GRPO"].prepared.num_updates
    print(f"model: {cfg.num_params() / 1e6:.2f}M params ({matmul_params(cfg) / 1e6:.2f}M matmul weights), "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}x{cfg.head_dim}, vocab {cfg.vocab_size}, compute {cfg.dtype}, remat {cfg.remat}, "
          f"attention {cfg.attention}")
    k = args.mini // args.micro
    print(f"batch: {args.batch} trajectories x {args.seq} tokens, {u} updates of {args.mini} "
          f"({k} micro-batch{'es' * (k > 1)} of {args.micro}), log-prob chunk {args.chunk}; LLDS side: "
          f"lambda {args.lam}, action gate; devices: {jax.devices()[0].platform} x{jax.device_count()}, "
          f"{os.cpu_count()} CPUs; best of {args.repeats} interleaved rounds after a warm-up")
    fns = {}
    for part in PARTS:
        for name, side in sides.items():
            fns[(part, name)] = {"update": side.update, "step": lambda s=side: s.train(False),
                                 "step + LLD": lambda s=side: s.train(True), "LLD forward": side.lld_forward,
                                 "LLD metrics": side.lld_metrics}[part]
    t = measure(fns, args.repeats)
    result = {part: {name: t[(part, name)] for name in SIDES} for part in PARTS}

    head = f"  {'part':<37}{'GRPO s':>9}{'LLDS s':>9}{'ratio':>8}"
    head += f"{'GRPO CPU s':>12}{'LLDS CPU s':>12}{'ratio CPU':>11}" if on_cpu else ""
    print(head)
    labels = {"update": "update (1 jitted mini-batch update)", "step": f"step (train_on_batch, {u} updates)",
              "step + LLD": "step + LLD measurement", "LLD forward": "  LLD forward (1 call)",
              "LLD metrics": "  LLD metrics (lld_metrics)"}
    for part in PARTS:
        g, l = result[part]["GRPO"], result[part]["LLDS"]
        line = f"  {labels[part]:<37}{g.wall:>9.4f}{l.wall:>9.4f}{l.wall / g.wall:>8.3f}"
        line += f"{g.cpu:>12.4f}{l.cpu:>12.4f}{l.cpu / g.cpu:>11.3f}" if on_cpu else ""
        print(line)
    for name in SIDES:
        base, lld, forward = result["step"][name], result["step + LLD"][name], result["LLD forward"][name]
        n = 2 if sides[name].step._lld_in_float32 else 1  # a float32 model reuses old_logp before the updates
        print(f"[{name}] the LLD measurement adds {lld.wall - base.wall:.3f} s ({lld.cpu - base.cpu:.3f} CPU s) to a "
              f"step: {(lld.wall - base.wall) / base.wall:+.1%} ({(lld.cpu - base.cpu) / base.cpu:+.1%} CPU); its {n} "
              f"LLD forward(s) alone {n * forward.wall / base.wall:.1%} ({n * forward.cpu / base.cpu:.1%} CPU)")
    costs = {name: side.update_cost() for name, side in sides.items()}
    g, l = costs["GRPO"], costs["LLDS"]
    print(f"[xla] compiled update, XLA's cost analysis, GRPO vs LLDS: GFLOP {g['flops'] / 1e9:.4f} vs "
          f"{l['flops'] / 1e9:.4f} ({l['flops'] / g['flops'] - 1:+.3%}), GB accessed {g['bytes accessed'] / 1e9:.4f} "
          f"vs {l['bytes accessed'] / 1e9:.4f} ({l['bytes accessed'] / g['bytes accessed'] - 1:+.3%})")
    llds_metrics = sides["LLDS"].first_metrics
    updates = f"updates 2-{u}" if u > 2 else f"update {u}"
    print(f"[check] LLDS side, first step on the batch ({updates}): loss/llds "
          f"{llds_metrics.get('loss/llds', float('nan')):.3e}, "
          f"llds/gate_share {llds_metrics.get('llds/gate_share', float('nan')):.3f}; GRPO side has loss/llds: "
          f"{'loss/llds' in sides['GRPO'].metrics}; finite losses: "
          f"{all(np.isfinite(s.metrics['actor/loss']) for s in sides.values())}")
    return {"timings": result, "update_cost": costs,
            "first_metrics": {name: side.first_metrics for name, side in sides.items()}}


if __name__ == "__main__":
    main()

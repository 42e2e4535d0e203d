"""bench/llds_cost_pod.py compiles configs/qwen7b_v4.py's update, shrunk to a tiny architecture and batch, with and
without LLDS by XLA's TPU compiler for a 4-chip v4 slice: both sides compile, only the update differs, and the
printed table agrees with itself and with the returned costs."""
import json
import re

import pytest

from llds_jax.model import ModelConfig, to_hf_config
from tests.bench.loading import load_bench

# configs/qwen7b_v4.py shrunk: 8 prompts x 4 samples in 2 updates of 16, micro-batch 8, 256-token batches.
SHRINK = ["model.preset=", "data.prompts_per_step=8", "data.samples_per_prompt=4", "optim.mini_batch_size=16",
          "optim.micro_batch_size=8", "rollout.max_batch_size=16", "rollout.max_prompt_tokens=64",
          "rollout.max_turn_tokens=16", "rollout.max_observation_tokens=32", "rollout.max_context_tokens=256",
          "rollout.max_response_tokens=256", "train.sequence_bucket=64", "eval.batch_size=8",
          "rollout.num_pages=0", "rollout.max_step_tokens=2048"]  # the pool for the 16 slots, steps as before
LABELS = ["arguments, MiB per chip", "temporaries, MiB per chip", "resident, MiB per chip", "total, MiB per chip",
          "GFLOP per call (matrix products)", "HBM GB per call", "ICI GB per call", "ms per call (estimate)",
          "s per step (estimate, 2 calls)"]


def printed_rows(out: str) -> dict[str, tuple[float, float, float, float]]:
    """label -> (GRPO, LLDS, LLDS - GRPO, LLDS / GRPO) as the comparison table prints them."""
    rows = {}
    for label in LABELS:
        match = re.search(re.escape(label) + r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\n", out)
        assert match, (label, out)
        rows[label] = tuple(float(x) for x in match.groups())
    return rows


def test_the_llds_switch_cannot_be_overridden():
    module = load_bench("llds_cost_pod")
    with pytest.raises(SystemExit):
        module.parse_args(["--override", "objective.llds.enabled=False"])
    assert module.parse_args(["--config.optim.micro_batch_size=8"]).override == ["optim.micro_batch_size=8"]


@pytest.mark.slow
def test_llds_cost_pod_compiles_both_sides_of_a_tiny_update(tmp_path, capsys):
    cfg = ModelConfig.tiny(vocab_size=640, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                           head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))  # the architecture alone, no weights
    module = load_bench("llds_cost_pod")
    overrides = [arg for o in [*SHRINK, f"model.path={tmp_path}"] for arg in ("--override", o)]
    sides = module.main([*overrides, "--topology", "v4:2x2x1"])
    out = capsys.readouterr().out

    assert "compiled for v4:2x2x1: 4 chips" in out and "LLDS: True (llds, lambda 0.2, gate action)" in out
    # The LLDS switch changes the update's module and nothing else of the run.
    assert re.search(r"differing: update \(2 per step\) \(the other \d+ lower to identical modules\)", out), out
    assert set(sides) == {"GRPO", "LLDS"}
    for name, side in sides.items():
        row = side.row
        assert not row.error and row.name == "update (2 per step)", (name, row)
        assert min(row.arguments, row.temporaries, row.resident) > 0, (name, row)
        assert row.total >= row.arguments + row.temporaries + row.resident, (name, row)
        assert side.calls == 2 and side.per_step_s == pytest.approx(2 * side.estimate.seconds)
        assert side.estimate.seconds > 0
        assert f"update (2 per step), {name}" in out  # compile_check's memory table, one row per side
    grpo, llds = sides["GRPO"], sides["LLDS"]
    # The LLDS term adds elementwise work (a gate, a hinge, a masked mean and their backward): no fewer matrix
    # FLOPs, more HBM traffic, the same resident arrays.
    assert llds.cost.flops >= grpo.cost.flops and llds.cost.hbm_bytes > grpo.cost.hbm_bytes
    assert llds.row.resident == grpo.row.resident

    rows = printed_rows(out)
    for label, (g, l, diff, ratio) in rows.items():
        # 7 significant digits of each value, the difference to 4, the ratio to 6 decimals of the exact values.
        assert ratio == pytest.approx(l / g, rel=2e-6, abs=1e-6), label
        assert diff == pytest.approx(l - g, rel=1e-3, abs=2e-6 * max(abs(g), abs(l))), label
    assert rows["s per step (estimate, 2 calls)"][:2] == pytest.approx((grpo.per_step_s, llds.per_step_s), rel=1e-6)
    assert rows["total, MiB per chip"][:2] == pytest.approx((grpo.row.total / 2**20, llds.row.total / 2**20), rel=1e-6)
    assert rows["GFLOP per call (matrix products)"][3] >= 1

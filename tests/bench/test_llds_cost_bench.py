"""bench/llds_cost.py runs end to end at tiny shapes on CPU: both sides timed, and only the LLDS side has the term."""
import math

import pytest

from tests.bench.loading import load_bench


@pytest.mark.slow
def test_llds_cost_bench_runs_tiny_on_cpu(capsys):
    module = load_bench("llds_cost")
    result = module.main(["--vocab", "64", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2",
                          "--kv-heads", "1", "--head-dim", "16", "--seq", "32", "--batch", "8", "--mini", "4",
                          "--micro", "2", "--chunk", "32", "--repeats", "1"])
    out = capsys.readouterr().out
    timings = result["timings"]
    assert set(timings) == set(module.PARTS)
    for part, sides in timings.items():
        assert set(sides) == {"GRPO", "LLDS"}
        for side, t in sides.items():
            assert math.isfinite(t.wall) and t.wall > 0 and math.isfinite(t.cpu), (part, side, t)
    metrics = result["first_metrics"]
    assert "loss/llds" in metrics["LLDS"] and "loss/llds" not in metrics["GRPO"]
    assert all(math.isfinite(m["actor/loss"]) and m["actor/updates"] == 2 for m in metrics.values())
    # The LLDS term is a little elementwise work on [B, T] log-probs: more FLOPs than GRPO's update, but few.
    flops = {side: cost["flops"] for side, cost in result["update_cost"].items()}
    assert flops["GRPO"] < flops["LLDS"] < 1.05 * flops["GRPO"], flops
    for line in ("step (train_on_batch, 2 updates)", "step + LLD measurement", "ratio CPU", "[GRPO]", "[LLDS]"):
        assert line in out

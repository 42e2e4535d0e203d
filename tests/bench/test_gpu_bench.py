"""bench/gpu.py, the prepared accelerator benchmark, runs end to end with tiny shapes on CPU and reports sane ratios."""
import math

import pytest

from tests.bench.loading import load_bench


@pytest.mark.slow
def test_gpu_bench_runs_tiny_on_cpu_and_its_ratios_are_in_range(capsys):
    result = load_bench("gpu").main(["--tiny", "--no-remat"])
    out = capsys.readouterr().out
    ratios = {key: value for key, value in result.items() if "mfu" in key or "roofline" in key}
    assert "train_mfu" in ratios
    assert {key for key in ratios if key.startswith("part_mfu/")}, "the train-step breakdown is missing"
    assert len([key for key in ratios if key.startswith("decode_roofline/")]) == 2  # float32: no bf16-copy variant
    for key, value in ratios.items():
        assert math.isfinite(value) and 0 < value <= 1.5, (key, value)
    assert result["peak_flops"] > 0 and result["bandwidth"] > 0 and result["train_tokens_s"] > 0
    for line in ("[peak]", "[train]", "[decode]", "update (jit RLTrainStep)", "of roofline"):
        assert line in out

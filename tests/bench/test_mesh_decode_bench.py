"""bench/mesh_decode.py runs end to end at tiny shapes on CPU: both sides timed, the same tokens sampled."""
import math

import pytest

from tests.bench.loading import load_bench


@pytest.mark.slow
def test_mesh_decode_bench_runs_tiny_on_cpu(capsys):
    module = load_bench("mesh_decode")
    result = module.main(["--vocab", "512", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2",
                          "--kv-heads", "2", "--head-dim", "16", "--batch", "4", "--prompt-len", "8", "--new-tokens",
                          "8", "--decode-chunk", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert len(result["seconds"]) == 2 and all(math.isfinite(s) and s > 0 for s in result["seconds"].values())
    # 4 rows x 8 tokens from the same streams: a layout that mixed rows or keys would agree on ~1 in 512 draws.
    assert result["total"] == 32 and result["agree"] > result["total"] // 2, result
    assert "ratio mesh / one device:" in out and "mesh data 2 x tensor 2" in out

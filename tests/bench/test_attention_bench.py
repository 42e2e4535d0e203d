"""bench/attention.py runs end to end at small shapes on CPU: the blockwise path agrees with the dense one and its
compiled temporaries shrink once T spans several blocks."""
import pytest

from tests.bench.loading import load_bench


@pytest.mark.slow
def test_attention_bench_runs_small_on_cpu(capsys):
    module = load_bench("attention")
    results = module.main(["--seqs", "64,256", "--batch", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                           "--query-block", "32", "--key-block", "32", "--repeats", "1", "--update-layers", "1",
                           "--update-vocab", "64"])
    out = capsys.readouterr().out
    assert "update program (1 layers" in out
    by_part = {(r["seq"], r["part"]): r for r in results}
    assert set(by_part) == {(64, "fwd"), (64, "fwd+bwd"), (256, "fwd"), (256, "fwd+bwd"), (256, "update")}
    for (seq, part), r in by_part.items():
        if part != "update":
            assert r["max_rel_diff"] < 1e-5 and r["s_dense"] > 0 and r["s_blockwise"] > 0, (seq, part, r)
    # 256 queries in 8 x 8 tiles of 32: the dense [2, 1, 2, 256, 256] float32 scores (1 MiB) are gone.
    assert by_part[(256, "fwd")]["temp_blockwise"] * 4 < by_part[(256, "fwd")]["temp_dense"]
    assert by_part[(256, "update")]["temp_blockwise"] < by_part[(256, "update")]["temp_dense"]

"""bench/paged_step.py compiles both attention implementations of the ragged step for a v4 topology at tiny shapes:
the kernel's row holds the Pallas kernel, both hold the same donated pool."""
from llds_jax.aot import compile_check
from tests.bench.loading import load_bench


def test_paged_step_bench_compiles_both_implementations_tiny(capsys):
    module = load_bench("paged_step")
    with compile_check.no_persistent_cache_writes():
        kernel, reference = module.main([
            "--preset", "qwen2.5-0.5b", "--layers", "1", "--tokens", "32", "--seqs", "4", "--context", "256",
            "--page-size", "16", "--overrides",
            "vocab_size=512,hidden_size=256,intermediate_size=512,num_heads=8,num_kv_heads=4,head_dim=128"])
    assert (kernel["implementation"], kernel["kernels"], reference["kernels"]) == ("kernel", 1, 0)
    # 1 layer x 64 pages x 16 slots x 2 combined heads per chip x 128, bf16
    assert kernel["pool"] == reference["pool"] == 64 * 16 * 2 * 128 * 2 / (1 << 30)
    assert "reference" in capsys.readouterr().out

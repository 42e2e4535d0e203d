"""bench/engine_host.py runs its batches to the end and reports a host time per call for each sequence count."""
from tests.bench.loading import load_bench


def test_the_host_bench_reports_each_sequence_count(capsys):
    bench = load_bench("engine_host")
    results = bench.main(["--sequences", "8", "16", "--repeats", "1", "--turns", "2", "--prompt-tokens", "20",
                          "--turn-tokens", "16", "--observation-tokens", "8", "--decode-chunk", "4",
                          "--page-size", "8", "--max-step-tokens", "64"])
    assert sorted(results) == [8, 16] and all(ms > 0 for ms in results.values())
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [int(row[0]) for row in rows] == [8, 16]

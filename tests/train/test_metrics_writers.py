"""MetricsWriter: TensorBoard events read back, JSONL round trip, console line, process-0-only writes."""
import io
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llds_jax.train.formats import format_duration, format_number, format_percent, format_si
from llds_jax.train.metrics import MetricsWriter, as_preformatted, budget_line, console_line


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def events(log_dir):
    acc = EventAccumulator(str(log_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_tensorboard_scalars_and_text(tmp_path):
    writer = MetricsWriter(str(tmp_path), console=None)
    writer.write(1, {"reward/mean": 0.5, "lld/rate": np.float32(0.25)})
    writer.write(2, {"reward/mean": jnp.float32(0.75), "lld/rate": 0.125})
    transcript = "<think> who? </think>\n<search> capital of France </search>"
    writer.write_texts(2, {"samples/0": transcript})
    writer.close()
    acc = events(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("lld/rate")] == [(1, 0.25), (2, 0.125)]
    [text] = acc.Tensors("samples/0/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == (
        "    <think> who? </think>\n    <search> capital of France </search>")


def test_jsonl_round_trip(tmp_path):
    writer = MetricsWriter(str(tmp_path), console=None)
    writer.write(1, {"reward/mean": 0.5, "actor/updates": 4, "lld/rate": float("nan")})
    writer.write(2, {"reward/mean": 0.75, "flag": True})
    writer.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(isinstance(r.pop("time"), float) for r in records)
    assert records == [{"step": 1, "reward/mean": 0.5, "actor/updates": 4.0, "lld/rate": None},
                       {"step": 2, "reward/mean": 0.75, "flag": 1.0}]
    acc = events(tmp_path)
    assert "lld/rate" not in acc.Tags()["scalars"]  # undefined values leave a gap in TensorBoard
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(str(tmp_path), console=None)
    for step in range(1, 5):
        writer.write(step, {"loss": float(step)})
    writer.close()
    resumed = MetricsWriter(str(tmp_path), start_step=3, console=None)  # checkpoint at step 2
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_flush_every_flush_secs(tmp_path):
    clock = FakeClock()
    writer = MetricsWriter(str(tmp_path), console=None, flush_secs=10, clock=clock)
    writer.write(1, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()
    clock.now = 10.0
    writer.write(2, {"loss": 2.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    writer.close()


def test_console_line_with_eta(tmp_path):
    clock, out = FakeClock(), io.StringIO()
    writer = MetricsWriter(str(tmp_path), total_steps=100, console=out, clock=clock)
    writer.write(10, {"reward/mean": 0.41234, "lld/rate": 0.031, "actor/grad_norm": 0.8231,
                      "perf/tokens_per_s": 12345.0, "other": 1.0})
    clock.now = 30.0  # 2 steps in 30 s: 15 s per step, 88 steps left
    writer.write(12, {"reward/mean": 0.5, "eval/em_mean": 0.398, "rollout/sampled_tokens": 18304.0,
                      "rollout/prompt_tokens": 2048.0, "rollout/observation_tokens": 1536.0, "rollout/searches": 37.0,
                      "rollout/trajectories": 64.0})
    writer.close()
    assert out.getvalue().splitlines() == [
        "step 10/100  reward 0.412  LLD 3.1%  gnorm 0.823  tok/s 12.3k",
        "step 12/100  reward 0.5  EM 0.398  ETA 22m00s",
        "step 12 budget: 18,304 tokens generated, 2,048 prompt tokens, 1,536 observation tokens, 37 searches, "
        "64 trajectories",
    ]


def test_the_eta_leaves_out_the_evaluation_before_training_and_the_first_steps_compile(tmp_path):
    """A run writes step 0 (the evaluation before RL), then step 1, whose time holds the programs' compile: the
    ETA counts from step 1's write, at the pace of the steps after it."""
    clock, out = FakeClock(), io.StringIO()
    writer = MetricsWriter(str(tmp_path), total_steps=20, console=out, clock=clock)
    for step, now in ((0, 0.0), (1, 600.0), (2, 610.0), (3, 620.0)):  # 10 min to step 1, then 10 s per step
        clock.now = now
        writer.write(step, {"reward/mean": 0.5})
    writer.close()
    assert out.getvalue().splitlines() == ["step 0/20  reward 0.5", "step 1/20  reward 0.5",
                                           "step 2/20  reward 0.5  ETA 3m00s", "step 3/20  reward 0.5  ETA 2m50s"]


def test_a_writer_that_writes_nothing_leaves_no_event_file(tmp_path):
    """A rerun of a finished run opens the writer at its next step and writes nothing: no empty event file beside
    the run's (a resumed writer that writes makes its own)."""
    first = MetricsWriter(str(tmp_path), start_step=1)
    first.write(1, {"reward/mean": 0.5})
    first.close()
    rerun = MetricsWriter(str(tmp_path), start_step=2)
    rerun.flush()
    rerun.close()
    assert len(os.listdir(tmp_path / "tensorboard")) == 1
    resumed = MetricsWriter(str(tmp_path), start_step=2)
    resumed.write(2, {"reward/mean": 0.7})
    resumed.close()
    assert len(os.listdir(tmp_path / "tensorboard")) == 2


def test_budget_line_says_one_search_and_several_searches():
    one = {"rollout/sampled_tokens": 1.0, "rollout/prompt_tokens": 1.0, "rollout/observation_tokens": 0.0,
           "rollout/searches": 1.0, "rollout/trajectories": 1.0}
    assert budget_line(3, one) == ("step 3 budget: 1 token generated, 1 prompt token, 0 observation tokens, 1 search, "
                                   "1 trajectory")
    assert budget_line(3, {**one, "rollout/searches": 2.0}).split(", ")[3] == "2 searches"
    assert budget_line(3, {"reward/mean": 0.5}) is None
    trees = {**one, "rollout/forked_prefix_tokens": 1234.0}  # tree rollouts only
    assert budget_line(3, trees).endswith("1 trajectory, 1,234 forked-prefix tokens trained again")
    # issue 58 item 10: prompts whose question was cut are counted, when there are any
    assert budget_line(3, {**one, "rollout/prompts_cut": 0.0}) == budget_line(3, one)
    partial = {**one, "rollout/partial/resumed": 3.0, "rollout/partial/carried": 1.0,
               "rollout/partial/dropped": 2.0}  # rollout.partial only
    assert budget_line(3, partial).endswith("1 trajectory, 3 conversations resumed, 1 conversation carried on, "
                                            "2 conversations dropped as stale")
    assert budget_line(3, {**one, "rollout/prompts_cut": 2.0}).split(", ")[2] == (
        "2 prompts cut to rollout.max_prompt_tokens (their questions' start)")


def test_formatters():
    assert [format_number(x) for x in (0.41234, 12.345, 123.4, 1234.5, -0.000123)] == [
        "0.412", "12.3", "123", "1.23k", "-0.000123"]
    assert [format_si(x) for x in (12.0, 1234.5, 2.5e6, 3e9, float("inf"))] == ["12", "1.23k", "2.5M", "3G", "inf"]
    assert format_percent(0.031) == "3.1%"
    assert [format_duration(s) for s in (42, 245, 11520, 273600)] == ["42s", "4m05s", "3h12m", "3d04h"]
    assert console_line(5, {"lld/rate": math.nan, "actor/grad_norm": math.inf}) == "step 5  gnorm inf"
    assert as_preformatted("a\nb") == "    a\n    b"


def test_non_main_process_writes_nothing(tmp_path):
    out = io.StringIO()
    writer = MetricsWriter(str(tmp_path / "run"), total_steps=10, process_index=1, console=out)
    writer.write(1, {"reward/mean": 0.5})
    writer.write_texts(1, {"samples/0": "text"})
    writer.close()
    assert not (tmp_path / "run").exists() and out.getvalue() == ""


def test_bad_metrics_are_errors_naming_the_key(tmp_path):
    writer = MetricsWriter(str(tmp_path), console=None)
    with pytest.raises(ValueError, match="metric 'reward/all' must be a number"):
        writer.write(1, {"reward/all": np.zeros(3)})
    with pytest.raises(ValueError, match="metric name 'step' is reserved"):
        writer.write(1, {"step": 1})
    with pytest.raises(ValueError, match="console field 'x' \\(y\\): format must be one of"):
        MetricsWriter(str(tmp_path), console_fields=[("x", "y", "percent")])
    writer.close()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a metrics record"):
        MetricsWriter(str(tmp_path), console=None)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage\n')  # issue 44: named no file
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'metrics.jsonl'}: not UTF-8 text \(byte 12\)"):
        MetricsWriter(str(tmp_path), console=None)

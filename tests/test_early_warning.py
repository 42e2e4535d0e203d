"""The lead-lag test of LLD as an early warning of collapse (llds_jax.apps.study.early_warning), on hand-built curves
whose warnings, collapse steps and counts are worked out here by hand."""
import csv
import json

from llds_jax.apps.study import early_warning, outcomes, stats
from llds_jax.apps.study.early_warning import classify, summarize, warning_step
from llds_jax.apps.study.outcomes import DELTA_TRAJ, GRAD_NORM, LLD_RATE, REWARD, RunResult

RATE_RULE = early_warning.SIGNALS[LLD_RATE][0]


def test_a_warning_needs_the_rule_on_consecutive_logged_values():
    assert warning_step([1, 2, 3, 4], [0.2, 0.6, 0.3, 0.7], RATE_RULE) is None  # never twice in a row
    assert warning_step([1, 2, 3, 4], [0.2, 0.6, 0.5, 0.7], RATE_RULE) == 3  # 0.5 counts (>=)
    # step 2 has no value (no correct trajectory): steps 1 and 3 are consecutive logged values
    assert warning_step([1, 3, 4], [0.9, 0.8, 0.1], RATE_RULE) == 3
    assert warning_step([], [], RATE_RULE) is None


def test_the_delta_traj_and_grad_norm_rules():
    delta_rule = early_warning.SIGNALS[DELTA_TRAJ][0]
    assert warning_step([1, 2, 3], [0.0, -0.1, -0.2], delta_rule) == 3  # 0 is not a fall
    grad_rule = early_warning.SIGNALS[GRAD_NORM][0]
    # baseline: median of the first 5 values (1, 2, 1, 1, 3) = 1, so the rule is >= 2
    assert warning_step([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 1, 1, 3, 1.9, 2.0, 2.5], grad_rule) == 8


def run(name_seed, rate_values, collapse_at=None, final_em=0.5):
    """A stress/grpo run whose reward is 0.5 every step until `collapse_at`, 0 from then on (the collapse rule's 3
    steps below 0.1 start there), with `rate_values` as its LLD rate at steps 1, 2, ..."""
    steps = list(range(1, 13))
    rewards = [0.0 if collapse_at is not None and s >= collapse_at else 0.5 for s in steps]
    curves = {metric: ([], []) for metric in outcomes.CURVES}
    curves[REWARD] = (steps, rewards)
    curves[LLD_RATE] = (list(range(1, len(rate_values) + 1)), list(rate_values))
    step = stats.collapse_step(steps, rewards)
    assert step == collapse_at
    return RunResult("stress", "grpo", name_seed, final_em, step, stats.collapsed(step, final_em), None, curves)


HIGH, LOW = 0.8, 0.2


def test_each_run_is_caught_missed_a_false_alarm_or_quiet():
    caught = run(0, [LOW, HIGH, HIGH, LOW, LOW], collapse_at=6)  # warns at 3, collapse at 6: lead 3
    late = run(1, [LOW, LOW, LOW, HIGH, HIGH], collapse_at=6)  # warns at 5: lead 1 < 2
    silent = run(2, [LOW] * 5, collapse_at=6)
    alarm = run(3, [HIGH, HIGH] + [LOW] * 10)
    quiet = run(4, [LOW] * 12)
    em_only = run(5, [HIGH] * 12, final_em=0.0)  # collapsed by its final EM alone: no step, left out
    readings = {r.seed: classify(r, LLD_RATE) for r in (caught, late, silent, alarm, quiet, em_only)}
    assert [(o.kind, o.warned_at, o.collapse_step, o.lead) for o in list(readings.values())[:5]] == [
        ("caught", 3, 6, 3), ("missed", 5, 6, None), ("missed", None, 6, None), ("false alarm", 2, None, None),
        ("quiet", None, None, None)]
    assert readings[5] is None
    summary = summarize([caught, late, silent, alarm, quiet, em_only], "stress", LLD_RATE)
    assert (summary.runs, summary.caught, summary.missed, summary.false_alarms, summary.quiet) == (5, 1, 2, 1, 1)
    assert (summary.precision, summary.recall, summary.median_lead) == (1 / 2, 1 / 3, 3.0)


def test_undefined_shares_are_none():
    summary = summarize([run(0, [LOW] * 12)], "stress", LLD_RATE)
    assert (summary.precision, summary.recall, summary.median_lead) == (None, None, None)


def test_written_tables(tmp_path):
    results = [run(0, [LOW, HIGH, HIGH, LOW, LOW], collapse_at=6), run(1, [LOW] * 12)]
    md, table_csv, table_json = early_warning.write(results, str(tmp_path))
    text = open(md).read()
    assert "| stress | lld/rate (LLD rate >= 0.5) | 2 | 1 | 0 | 0 | 1 | 1.00 | 1.00 | 3.00 |" in text
    with open(table_csv) as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["signal"], r["kind"], r["lead"]) for r in rows if r["signal"] == LLD_RATE] == [
        ("stress/grpo/seed_0", LLD_RATE, "caught", "3"), ("stress/grpo/seed_1", LLD_RATE, "quiet", "")]
    assert len(rows) == 2 * len(early_warning.SIGNALS)
    written = json.load(open(table_json))
    assert written["lead_steps"] == early_warning.LEAD_STEPS and len(written["summaries"]) == 3

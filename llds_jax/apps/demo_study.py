"""The multi-seed study of the CPU demo (issue 19): arms x settings x seeds, then one table and one figure per setting.

    python -m llds_jax.apps.demo_study [--settings stress,default,paper_shaped] [--arms grpo,llds,grpo_low_lr:4,...]
        [--seeds 8] [--out runs/demo_study] [--jobs 2] [--controls grpo,grpo_low_lr,...] [--endpoints ...]
        [--primary ENDPOINT [--margin M]]
        [--dry-run | --report [--recorded RUNS_CSV [--recorded-steps STEPS_CSV_GZ]]] [-- --config.KEY=VALUE ...]

Every run is `python -m llds_jax.launch` (llds_jax.apps.study.plan: folders and overrides). Each seed has its own
world, warm start and sampling (`OUT/seeds/seed_K/`), built once by `--mode=sft` before that seed's runs start and
shared by all its settings and arms. Up to `--jobs` commands run at once (default 2, for the 2-core machine), each
logging to `OUT/logs/`. Arguments after `--` go to every launch (e.g. `-- --config.train.total_steps=10`).

Arms (`NAME` or `NAME:K`, K = how many of the seeds it runs, the first K): grpo, llds (lambda 0.2, action gate),
grpo_low_lr (1/2.5 of the setting's learning rate), grpo_kl10 (10x the setting's KL coefficient), llds_token and
llds_response (the gate ablation; llds_action is llds), llds_low_lr (LLDS at 1/2.5 of the learning rate), llds_lam1
(LLDS at lambda 1.0), and the stability methods peers ship: grpo_clip_higher (DAPO's clip-higher, upper clip 0.28) and
grpo_tis (truncated importance sampling of the sampler's log-probs, cap 2). Settings: stress
(configs/demo_cpu_grpo.py), default (configs/demo_cpu.py), paper_shaped (configs/demo_cpu_paper.py), collapse
(configs/demo_cpu_collapse.py, the pre-registered study of issue 33), late_collapse (configs/demo_cpu_late_study.py,
issue 40's), good_lr (configs/demo_cpu_long_horizon.py at lr 2e-4, issue 56's), or `NAME=CONFIG_FILE[:ARGS]`.
Seeds: `N` (0..N-1), `A-B` or `A,B,...`.

Resumable: a run whose final evaluation (`eval/final_step_N/results.json`) exists is skipped; any other is launched
again and resumes from its latest checkpoint (the trainer does that by itself). Ctrl-C (or `timeout -s INT 90m ...`)
stops the running launches, which save their state, and writes the outputs of the runs finished so far (exit status
130); runs are ordered seed by seed, so a study stopped early holds whole seeds of every arm. The outputs, rewritten
from every finished run of the plan at the end of each invocation (also when some runs failed, which it lists; exit
status 1 then):

- `OUT/table.md`, `table.csv`, `table.json` (and `runs.csv`): per setting x arm the final greedy test EM (mean over
  seeds, 95% bootstrap interval, per seed), collapse count and steps to collapse, mean LLD rate
  (llds_jax.apps.study.table defines each column);
- `OUT/paired.md`, `paired.csv`, `paired.json` (also printed): per setting, each arm minus each control arm
  (`--controls`, default every arm named grpo*) on the seeds both ran, for final EM and mean LLD rate (`--endpoints`;
  also `collapsed`, on which the exact sign-flip test is McNemar's): mean
  difference, bootstrap and t intervals, exact sign-flip p, its Holm adjustment over the whole table, and how many
  seeds go each way (llds_jax.apps.study.paired);
- `OUT/primary.md`, `primary.json` (also printed; with `--primary ENDPOINT`): a registered primary endpoint apart
  from the paired table's family: each arm minus each control, the exact two-sided sign-flip p (unadjusted), the t
  interval and, with `--margin M`, the exact one-sided non-inferiority p at that margin (llds_jax.apps.study.primary);
- `OUT/arms.md`, `arms.json` (also printed): each arm's own value of each endpoint but the pairwise ones, its mean
  over seeds with a 95% t interval (llds_jax.apps.study.arms);
- `OUT/early_warning.md`, `.csv`, `.json` (also printed; runs with per-step metrics): per setting and signal (LLD
  rate, Delta_traj of correct trajectories, grad norm), how often a fixed threshold warned at least 2 steps before
  a collapse and how often in runs that did not collapse: precision and recall (llds_jax.apps.study.early_warning);
- `OUT/survival.md`, `.csv`, `.json` (also printed): time to collapse censored at the last step: per arm every seed's
  time and the Kaplan-Meier median, and each arm against each control on the same seeds (lasted longer, shorter,
  tied; exact sign test, Holm) (llds_jax.apps.study.survival);
- `OUT/auc.md`, `.csv`, `.json` (also printed; runs with per-step metrics): per setting and diagnostic, the
  step-matched AUC of its 3-step trailing mean 3, 4 and 5 steps before each collapse against the runs that did not
  collapse at the same step, pooled with a seed-resampling interval and against the reward-drop and KL baselines
  (llds_jax.apps.study.auc);
- `OUT/sequence.md` (runs with per-step metrics): per run, the order of events: its peak train reward, the step the
  reward halved, the step the correct trajectories' likelihood fell, its collapse step (llds_jax.apps.study.sequence);
- `OUT/steps.csv.gz`: every run's per-step metrics (llds_jax.apps.study.steps), from which, with `runs.csv`, the
  tables and plots are recomputed without the run folders;
- `OUT/plots/SETTING.png`: per-seed curves of train reward, correct trajectories' token-mean log-prob and LLD rate.

Before running, the command prints the runs and an estimated wall time (llds_jax.apps.study.budget: measured rates of
the study's own finished jobs, else constants from docs/demo.md). `--dry-run` prints the same and the commands, and runs
nothing. `--report` runs nothing either: it writes the outputs of the plan's finished runs (a study run in parts,
e.g. one setting per session, reported as one table) and names the runs not in them. With `--recorded RUNS_CSV` (the
`runs.csv` of an earlier report, e.g. docs/evidence/runs.csv) a run not finished here is taken from that record: its
numbers go into the tables, and into the plots when its curves are in the record's steps file (`--recorded-steps`,
default the `steps.csv.gz` next to the runs.csv when there is one; the collapse and LLD rate computed from them must
be the record's); a run both finished here and recorded is reported from here, and the command prints whether its
numbers reproduce the record's.

Budget (2 cores, about 90 minutes; the measured times: docs/evidence.md, "Budget"). Issue 19's full design (3
settings; grpo and llds on 8 seeds; grpo_low_lr, grpo_kl10, llds_token, llds_response on 4: 96 runs, 8 warm starts)
does not fit. What fits, keeping 20 steps per run (the stress collapse of docs/demo.md came at step 17) and both
controls:

    python -m llds_jax.apps.demo_study --settings stress,paper_shaped --seeds 4 \
        --arms grpo,llds,grpo_low_lr:2,grpo_kl10:2 --out runs/demo_study

24 runs (per setting: grpo and llds on seeds 0-3, each control on seeds 0-1) and 4 warm starts. A loaded machine
is slower: check the printed estimate, or bound the wall time with `timeout -s INT 90m` (the outputs then cover the
seeds finished). The whole design runs in parts with the same
`--out`, each part resumable (docs/evidence.md lists the parts run so far), and one table of every finished run:

    python -m llds_jax.apps.demo_study --settings stress,default,paper_shaped --seeds 8 \
        --arms grpo,llds,grpo_low_lr:4,grpo_kl10:4,llds_token:4,llds_response:4 --out runs/demo_study [--report]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from llds_jax.apps.study import (arms, auc, budget, early_warning, outcomes, paired, plots, plan, primary, runner,
                                 sequence, steps, survival, table)
from llds_jax.train.formats import format_duration

# llds_jax.sft.stage.DONE_FILE, written last into sft.output_dir (not imported: that module loads JAX, which the
# study's own process never needs).
WARM_START_DONE = "warm_start.json"


def _warm_start_built(out: str, seed: int) -> bool:
    return os.path.exists(os.path.join(plan.seed_folder(out, seed), "warm_start", WARM_START_DONE))


def warm_start_job(seed: int) -> str:
    """The name of the job that builds a seed's world and warm start."""
    return f"seed_{seed}/warm_start"


def jobs_of(study: plan.Plan, pending: Sequence[plan.Run]) -> list[runner.Job]:
    """Per seed with pending runs: its world + warm start (`--mode=sft`), then its runs (after that), seed by seed
    (so that a study stopped early holds whole seeds of every arm)."""
    logs = os.path.join(study.out, "logs")
    jobs = []
    for seed in sorted({run.seed for run in pending}):
        warm = warm_start_job(seed)
        jobs.append(runner.Job(warm, tuple(study.warm_starts[seed].command("sft")),
                               os.path.join(logs, f"seed_{seed}_warm_start.log")))
        jobs += [runner.Job(run.name, tuple(run.command()), os.path.join(logs, run.name.replace("/", "_") + ".log"),
                            (warm,)) for run in pending if run.seed == seed]
    return jobs


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = plan.split_argv(argv)
    parser = argparse.ArgumentParser(prog="python -m llds_jax.apps.demo_study", description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="stress", help="comma-separated: stress, default, paper_shaped, "
                        "NAME=CONFIG_FILE (default: stress)")
    parser.add_argument("--arms", default="grpo,llds", help="comma-separated NAME or NAME:K (default: grpo,llds)")
    parser.add_argument("--seeds", default="8", help="N (0..N-1), A-B or A,B,... (default: 8)")
    parser.add_argument("--out", default="runs/demo_study", help="study folder (default: runs/demo_study)")
    parser.add_argument("--jobs", type=int, default=2, help="launches at once (default: 2, for 2 cores)")
    parser.add_argument("--controls", help="comma-separated arms the paired table compares every other arm with "
                        f"(default: every arm whose name starts with {paired.CONTROL_PREFIX})")
    parser.add_argument("--endpoints", default=",".join(paired.DEFAULT_ENDPOINTS),
                        help=f"comma-separated endpoints of the paired table, one Holm family: "
                             f"{', '.join(paired.ENDPOINTS)} (default: {','.join(paired.DEFAULT_ENDPOINTS)})")
    parser.add_argument("--primary", metavar="ENDPOINT", help="a primary endpoint, tested apart from the paired "
                        "table's family (primary.md): each arm minus each control, exact sign-flip p")
    parser.add_argument("--margin", type=float, help="with --primary: the non-inferiority margin of its one-sided "
                        "exact test (e.g. 0.02)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--dry-run", action="store_true", help="print the plan, estimate and commands; run nothing")
    modes.add_argument("--report", action="store_true",
                       help="write the tables, steps file and plots of the plan's finished runs; run nothing")
    parser.add_argument("--recorded", metavar="RUNS_CSV", help="with --report: the runs.csv of an earlier report; "
                        "the plan's runs not finished here are taken from it (in the tables; in the plots when its "
                       "steps file has their curves)")
    parser.add_argument("--recorded-steps", metavar="STEPS_CSV_GZ", help="with --recorded: the steps.csv.gz of that "
                        f"report (default: the {steps.FILE} next to RUNS_CSV, when there is one)")
    args = parser.parse_args(own)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.recorded and not args.report:
        parser.error("--recorded is only read by --report")
    if args.recorded_steps and not args.recorded:
        parser.error("--recorded-steps is only read with --recorded")
    if args.margin is not None and not args.primary:
        parser.error("--margin is only read with --primary")
    for override in extra:
        if not override.startswith("--config."):
            parser.error(f"arguments after -- must be --config.KEY=VALUE overrides, got {override!r}")
    return args, [override[len("--config."):] for override in extra]


def _print_plan(study: plan.Plan, pending: Sequence[plan.Run], builds: int, rates: budget.Rates) -> None:
    done = len(study.runs) - len(pending)
    print(f"study {study.out}: {len(study.runs)} runs over {len(study.warm_starts)} seeds; {done} finished "
          f"(skipped), {len(pending)} to run, {builds} worlds + warm starts to build", flush=True)
    groups: dict[tuple[str, str], list[int]] = {}
    for run in study.runs:
        groups.setdefault((run.setting, run.arm), []).append(run.seed)
    for (setting, arm), seeds in groups.items():
        print(f"  {setting:14s} {arm:14s} seeds {','.join(map(str, seeds))}", flush=True)
    wall = budget.estimate_s(pending, builds, rates)
    print(f"estimated wall time: {format_duration(wall)} ({sum(r.total_steps for r in pending)} run steps at "
          f"{rates.step_s:.1f} s, {builds} warm starts at {rates.warm_start_s:.0f} s of the machine; {rates.source})",
          flush=True)


def run_study(study: plan.Plan, pending: Sequence[plan.Run], jobs: int) -> list[runner.Outcome]:
    """Runs the pending runs (and their seeds' warm starts), printing progress and recording timings."""
    by_name = {run.name: run for run in pending}
    warm_seeds = {warm_start_job(seed): seed for seed in study.warm_starts}
    job_list = jobs_of(study, pending)
    built_before = {seed: _warm_start_built(study.out, seed) for seed in study.warm_starts}
    left = list(pending)
    ended = 0

    def on_start(job: runner.Job) -> None:
        print(f"start  {job.name}  (log {job.log})", flush=True)

    def on_end(outcome: runner.Outcome) -> None:
        nonlocal ended
        ended += 1
        name = outcome.job.name
        run = by_name.get(name)
        if outcome.status is not None:
            budget.append_timing(study.out, {
                "job": name, "kind": "warm_start" if run is None else "run",
                "setting": None if run is None else run.setting, "steps": 0 if run is None else run.total_steps,
                "seconds": outcome.seconds, "jobs": jobs, "status": outcome.status,
                "built": run is None and not built_before[warm_seeds[name]]})
        if run is not None:
            left.remove(run)
        state = ("skipped: the job it waits for failed" if outcome.status is None else
                 f"exit status {outcome.status} after {format_duration(outcome.seconds)}")
        if run is not None and run.finished():
            state += f", final EM {outcomes.read_result(run).final_em:.3f}"
        remaining = budget.estimate_s(left, 0, budget.rates(budget.read_timings(study.out)))
        print(f"[{ended}/{len(job_list)}] {name}: {state}; about {format_duration(remaining)} of runs left",
              flush=True)

    return runner.run_jobs(job_list, jobs, on_start, on_end)


def write_outputs(study: plan.Plan, recorded: Mapping[str, outcomes.RunResult] | None = None,
                  controls: Sequence[str] | None = None,
                  endpoints: Sequence[str] = paired.DEFAULT_ENDPOINTS, primary_endpoint: str | None = None,
                  margin: float | None = None) -> None:
    """Writes the tables, steps file and plots of every finished run of the plan (nothing when none finished),
    printing the paired table and each path. A run of the plan not finished here but in `recorded` (run name -> its
    numbers from a runs.csv, with curves when its steps file had them) is in the tables, and in the plots when it
    has curves; a run in both is reported from here, after a line saying whether it reproduces the record
    (`compare_recorded`). `controls`, `endpoints`: the paired table's control arms (None: llds_jax.apps.study.paired's
    default) and endpoints; `primary_endpoint` (with its non-inferiority `margin`): the primary table's endpoint (None:
    no primary table)."""
    recorded = recorded or {}
    here = [outcomes.read_result(run) for run in study.runs if run.finished()]
    for line in compare_recorded(here, recorded):
        print(line, flush=True)
    finished = {result.name: result for result in here}
    results = [finished.get(run.name) or recorded[run.name] for run in study.runs
               if run.name in finished or run.name in recorded]
    if results:
        controls = paired.default_controls(results) if controls is None else controls
        comparisons = paired.comparisons(results, controls, endpoints)
        for line in table.paired_tables(comparisons):
            print(line, flush=True)
        primaries = [] if primary_endpoint is None else primary.rows(results, controls, primary_endpoint, margin)
        if primary_endpoint is not None:
            for line in ["primary endpoint, apart from the paired family", "", *primary.markdown(primaries), ""]:
                print(line, flush=True)
        own = arms.rows(results, list(dict.fromkeys([*([primary_endpoint] if primary_endpoint else []), *endpoints])))
        for line in ["each arm's endpoints", "", *arms.markdown(own), ""]:
            print(line, flush=True)
        total_steps = {run.name: run.total_steps for run in study.runs}
        final_steps = {run.setting: run.total_steps for run in study.runs}
        for line in ["time to collapse, censored at the last step", "",
                     *survival.markdown(*survival.tables(results, total_steps, controls)), ""]:
            print(line, flush=True)
        curved = [result for result in results if result.has_curves]  # the early warning needs the curves
        if curved:
            for line in ["early warning of collapse (runs with per-step metrics)", "",
                         *early_warning.markdown(early_warning.summaries(curved)), "",
                         "early warning by step-matched AUC", "", *auc.markdown(auc.rows(curved)), ""]:
                print(line, flush=True)
        paths = (table.write(table.rows(results, total_steps), results, study.out) +
                 table.write_paired(comparisons, controls, study.out) + arms.write(own, study.out) +
                 (primary.write(primaries, study.out) if primary_endpoint is not None else []) +
                 [steps.write(results, study.out)] +
                 survival.write(results, total_steps, study.out, controls) +
                 (early_warning.write(curved, study.out) + auc.write(curved, study.out) +
                  sequence.write(curved, study.out) + plots.write(curved, study.out, final_steps) if curved else []))
        for path in paths:
            print(path, flush=True)


def read_recorded(runs_csv: str, steps_path: str | None) -> tuple[dict[str, outcomes.RunResult], str | None]:
    """The runs of an earlier report's runs.csv (run name -> numbers) with their curves from the steps file
    `steps_path`, else from the steps.csv.gz next to the runs.csv when there is one; and the steps file read
    (None: none, the runs have no curves). OSError or StudyError naming the file."""
    results = table.read_runs(runs_csv)
    next_to = os.path.join(os.path.dirname(runs_csv), steps.FILE)
    steps_path = steps_path or (next_to if os.path.exists(next_to) else None)
    if steps_path:
        results = steps.attach(results, steps.read(steps_path), steps_path)
    return {result.name: result for result in results}, steps_path


def compare_recorded(here: Sequence[outcomes.RunResult], recorded: Mapping[str, outcomes.RunResult]) -> list[str]:
    """One line per run of `here` also in `recorded`: whether its numbers (final EM, collapse, mean LLD rate) are
    the record's exactly, else both."""
    lines = []
    for result in here:
        if result.name in recorded:
            record = recorded[result.name]
            numbers = [(field, getattr(result, field), getattr(record, field))
                       for field in ("final_em", "collapse_step", "collapsed", "lld_rate_mean")]
            differ = [f"{field} {a} here, {b} recorded" for field, a, b in numbers if a != b]
            lines.append(f"{result.name}: " + ("; ".join(differ) if differ else
                                               f"reproduces the record exactly (final EM {result.final_em:.6f})"))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = _parse(sys.argv[1:] if argv is None else argv)
    try:
        controls = plan.parse_controls(args.controls) if args.controls else None
        endpoints = paired.parse_endpoints(args.endpoints)
        if args.primary:
            primary.rows([], [], args.primary, args.margin)  # a bad endpoint or margin is refused before any run
        study = plan.make_plan(os.path.normpath(args.out), plan.parse_settings(args.settings),
                               plan.parse_arms(args.arms), plan.parse_seeds(args.seeds), extra)
    except plan.StudyError as e:
        print(f"llds_jax.apps.demo_study: error: {e}", file=sys.stderr)
        return 2
    pending = [run for run in study.runs if not run.finished()]
    if args.report:
        print(f"study {study.out}: {len(study.runs) - len(pending)} of {len(study.runs)} runs finished", flush=True)
        recorded = {}
        if args.recorded:
            try:
                recorded, steps_path = read_recorded(args.recorded, args.recorded_steps)
            except (OSError, plan.StudyError) as e:
                print(f"llds_jax.apps.demo_study: error: --recorded: {e}", file=sys.stderr)
                return 2
            taken = [run.name for run in pending if run.name in recorded]
            if steps_path is None:
                print(f"runs not finished here taken from {args.recorded} (in the table, not the plots): "
                      f"{len(taken)}", flush=True)
            else:
                curved = sum(recorded[name].has_curves for name in taken)
                print(f"runs not finished here taken from {args.recorded}, their curves from {steps_path}: "
                      f"{len(taken)} ({curved} with curves, in the plots too)", flush=True)
        write_outputs(study, recorded, controls, endpoints, args.primary, args.margin)
        missing = [run.name for run in pending if run.name not in recorded]
        if missing:
            print(f"not in the outputs (not finished): {', '.join(missing)}", flush=True)
        return 0
    builds = len({run.seed for run in pending if not _warm_start_built(study.out, run.seed)})
    _print_plan(study, pending, builds, budget.rates(budget.read_timings(study.out)))
    if args.dry_run:
        for job in jobs_of(study, pending):
            print(f"+ {job.shell()}")
        return 0
    interrupted = False
    try:
        run_study(study, pending, args.jobs)
    except KeyboardInterrupt:
        interrupted = True
        print("llds_jax.apps.demo_study: interrupted; the running launches saved their state; table and plots of the "
              "finished runs follow", file=sys.stderr)
    write_outputs(study, controls=controls, endpoints=endpoints, primary_endpoint=args.primary, margin=args.margin)
    if interrupted:
        return 130
    unfinished = [run.name for run in study.runs if not run.finished()]
    if unfinished:
        print(f"llds_jax.apps.demo_study: {len(unfinished)} run(s) not finished (see {study.out}/logs): "
              f"{', '.join(unfinished)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

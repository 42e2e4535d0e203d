"""A plain report of a training run folder: PNG plots of its metrics log and a `summary.md`.

    python -m llds_jax.train.report RUN_DIR [--out DIR] [--compare OTHER_RUN_DIR ...]

Reads what the trainer leaves in a run folder: `metrics.jsonl` (MetricsWriter's per-step log; TensorBoard is not
read), `config.json`, `checkpoints/` and every `eval/*/results.json` (evaluation.write_results: `eval/step_N` during
training, `eval/final_step_N` after it or from --mode=eval, `eval/start` before step 1 with train.eval_at_start, and
any other evaluation written the same way). Writes into `RUN_DIR/report/` (or --out) the plots of `PLOTS`:

- `reward_em.png`: training reward (`reward/mean`) and exact match of the evaluations (`eval/em_*` of the log and
  the eval folders' results.json) over steps;
- `likelihood.png`: likelihood of correct vs incorrect trajectories before each step's updates (token-mean and
  summed log-prob), first vs later actions;
- `lld.png`: LLD rate, tie share and Delta_traj of correct trajectories after the updates;
- `grad_norm.png`, `entropy.png`, `searches.png` (valid searches per trajectory, i.e. per question sample),
  `llds.png` (LLDS loss and gate share);

and `summary.md`: per run its config highlights, first / last / min / max of the key metrics, the EM of every
evaluation found (the final one and a start-of-training one marked), and the plots linked relatively. With
--compare the other runs are overlaid in the same plots, labelled by folder name (e.g. GRPO vs GRPO + LLDS), and
the summary lists each run. A plot or panel whose metrics no run has is skipped, with a note in the summary.

The paths written are printed, one per line. A missing run folder or a missing / empty metrics file ends the
command with one line naming the path and exit status 2, and so does an --out that is a file or a folder of
files the report did not write (llds_jax.runtime.output_folder: nothing in it is touched); a corrupted line of a metrics
file (not JSON, not UTF-8) is reported as `file:line` on stderr, skipped and counted in the summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from llds_jax.runtime import output_folder

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.md"
SUMMARY_TITLE = "# Run report: "  # the first line of every summary.md the report writes
EXIT_BAD_INPUT = 2
EM_PREFIX = "eval/em_"
EM_MEAN = "mean"  # evaluation.MEAN_KEY (not imported: the report needs no JAX)


class ReportError(Exception):
    """Bad input: the message names the path."""


# ----- reading a run folder ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class EvalResult:
    """One evaluation folder's results.json: EM per data_source (and "mean"), question counts."""
    name: str
    step: int | None
    em: dict[str, float]
    counts: dict[str, int]

    @property
    def is_final(self) -> bool:
        return self.name.startswith("final")

    @property
    def is_start(self) -> bool:
        return self.step == 0 or bool(re.search(r"init|start|warm", self.name))


@dataclasses.dataclass
class Run:
    """What the report reads from one run folder."""
    name: str
    folder: epath.Path
    records: list[dict[str, Any]]  # metrics records by step (the last one written for a step)
    skipped_lines: int
    config: dict[str, Any] | None
    evals: list[EvalResult]
    checkpoints: list[int]
    notes: list[str]  # problems met while reading (unreadable config or results files)

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a metric over the log; steps where it is absent, null or non-finite are left out."""
        steps, values = [], []
        for record in self.records:
            value = record.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
        return steps, values

    def em_points(self) -> dict[str, dict[int, float]]:
        """EM per data_source during training: {source: {step: EM}} from the log's `eval/em_*` and the results of
        the eval folders that are not final ones (a folder overrides the log at the same step); evaluations
        without a step are left out."""
        points: dict[str, dict[int, float]] = {}
        for key in sorted({k for r in self.records for k in r if k.startswith(EM_PREFIX)}):
            for step, value in zip(*self.series(key)):
                points.setdefault(key[len(EM_PREFIX):], {})[step] = value
        for result in self.evals:
            if result.step is None or result.is_final:
                continue
            for source, value in result.em.items():
                points.setdefault(source, {})[result.step] = value
        return points

    def best_periodic_eval(self) -> tuple[int, float] | None:
        """(step, mean EM) of the evaluation during training (step > 0, not a final one) with the highest mean EM,
        the earliest of equals; None without one. The paper reports the checkpoint its periodic test evaluations
        rated best."""
        points = sorted((-em, step) for step, em in self.em_points().get(EM_MEAN, {}).items() if step > 0)
        return (points[0][1], -points[0][0]) if points else None

    def final_em_points(self) -> dict[int, float]:
        """Mean EM of the final evaluations (usually on more questions than those during training): {step: EM}."""
        return {r.step: r.em[EM_MEAN] for r in self.evals if r.is_final and r.step is not None and EM_MEAN in r.em}


def read_metrics(path: epath.Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics JSONL file by step (the last one written for a step wins), and the number of
    corrupted lines skipped (each reported on stderr as `path:line`)."""
    if not path.exists():
        raise ReportError(f"no metrics file: {path}")
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:  # a torn or garbled write: the line alone is lost
            problem = f"not UTF-8 text (byte {e.start})"
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg})"
        else:
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                by_step[step] = record
                continue
            problem = "not a metrics record with an integer 'step'"
        print(f"{path}:{lineno}: skipped: {problem}", file=sys.stderr)
        skipped += 1
    if not by_step:
        raise ReportError(f"metrics file is empty: {path}" if not skipped else
                          f"metrics file has no readable record ({skipped} corrupted lines): {path}")
    return [by_step[step] for step in sorted(by_step)], skipped


def eval_step(name: str) -> int | None:
    """The step of an eval folder name: `step_40` -> 40, `final_step_1005` -> 1005; a start-of-training name
    without a number (`start`, `initial`, `warm_start`) -> 0; else None."""
    match = re.search(r"(\d+)$", name)
    if match:
        return int(match.group(1))
    return 0 if re.search(r"init|start|warm", name) else None


def read_evals(folder: epath.Path, notes: list[str]) -> list[EvalResult]:
    """Every `eval/*/results.json` of a run folder, by step (folders without a step last)."""
    eval_dir = folder / "eval"
    results = []
    if not eval_dir.is_dir():
        return results
    for sub in eval_dir.iterdir():
        path = sub / "results.json"
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
            em = {str(k): float(v) for k, v in data["em"].items()}
            counts = {str(k): int(v) for k, v in data.get("counts", {}).items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            print(f"{path}: skipped: not an evaluation results file ({type(e).__name__}: {e})", file=sys.stderr)
            notes.append(f"skipped unreadable `{path}`")
            continue
        results.append(EvalResult(sub.name, eval_step(sub.name), em, counts))
    return sorted(results, key=lambda r: (r.step is None, r.step or 0, r.is_final, r.name))


def read_run(folder: str, name: str | None = None) -> Run:
    """Reads a run folder (local or gs://); `name` labels it (default: the folder's name). Raises ReportError
    when the folder or its metrics are missing."""
    path = epath.Path(folder)
    if not path.exists():
        raise ReportError(f"run folder not found: {folder}")
    if not path.is_dir():
        raise ReportError(f"not a run folder (not a directory): {folder}")
    records, skipped = read_metrics(path / METRICS_FILE)
    notes: list[str] = []
    config = None
    config_path = path / "config.json"
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            print(f"{config_path}: skipped: not valid JSON ({e.msg})", file=sys.stderr)
            notes.append(f"skipped unreadable `{config_path}`")
    ckpt_dir = path / "checkpoints"
    checkpoints = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    return Run(name or unique_names([folder])[0], path, records, skipped, config, read_evals(path, notes),
               checkpoints, notes)


def unique_names(folders: Sequence[str]) -> list[str]:
    """Run labels: folder names, with their parent folder (then an index) where two runs share a name."""
    paths = [epath.Path(f) if "://" in f else epath.Path(os.path.abspath(f)) for f in folders]  # "." has a name
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(names)) < len(names):
        names = [f"{n} [{i + 1}]" for i, n in enumerate(names)]
    return names


# ----- plots ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Panel:
    """One axes: metrics (name, legend label) over steps. `em` adds the evaluations' EM points."""
    title: str
    series: tuple[tuple[str, str], ...]
    em: bool = False
    zero_line: bool = False
    ylim: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Plot:
    filename: str
    title: str
    panels: tuple[Panel, ...]


PLOTS: tuple[Plot, ...] = (
    Plot("reward_em.png", "Reward and exact match", (
        Panel("reward (train rollouts) and EM (evaluations)", (("reward/mean", "reward"),), em=True),)),
    Plot("likelihood.png", "Likelihood of correct vs incorrect trajectories (before the step's updates)", (
        Panel("token-mean log-prob per trajectory", (("lld/logp_mean_correct", "correct"),
                                                     ("lld/logp_mean_incorrect", "incorrect"))),
        Panel("summed log-prob per trajectory", (("lld/logp_sum_correct", "correct"),
                                                 ("lld/logp_sum_incorrect", "incorrect"))),
        Panel("token-mean log-prob: first vs later actions", (("lld/logp_mean_first_action", "first action"),
                                                              ("lld/logp_mean_later_actions", "later actions"))),
    )),
    Plot("lld.png", "Lazy likelihood displacement (after the step's updates)", (
        Panel("share of correct trajectories with Delta_traj < 0 (LLD rate) and == 0 (ties)",
              (("lld/rate", "LLD rate"), ("lld/tie_share", "ties")), ylim=(-0.03, 1.03)),
        Panel("Delta_traj of correct trajectories (mean)", (("lld/delta_traj_correct", "Delta_traj"),),
              zero_line=True),
    )),
    Plot("grad_norm.png", "Gradient norm before clipping", (
        Panel("gradient norm over the step's updates", (("actor/grad_norm", "mean"),
                                                        ("actor/grad_norm_max", "max"))),)),
    Plot("entropy.png", "Entropy of the policy on loss tokens", (
        Panel("entropy (token mean)", (("actor/entropy", "entropy"),)),)),
    Plot("searches.png", "Searches per question", (
        Panel("valid searches per trajectory (rollout mean)", (("rollout/valid_searches", "valid searches"),)),
        Panel("turns per trajectory", (("rollout/turns", "turns"),)),
    )),
    Plot("llds.png", "What LLDS does", (
        Panel("LLDS loss term", (("loss/llds", "loss/llds"),)),
        Panel("share of preserved actions whose gate fired", (("llds/gate_share", "gate share"),),
              ylim=(-0.03, 1.03)),
    )),
)

# Rows of the summary's metrics table.
KEY_METRICS: tuple[str, ...] = (
    "reward/mean", "eval/em_mean", "lld/logp_mean_correct", "lld/logp_mean_incorrect", "lld/logp_sum_correct",
    "lld/logp_sum_incorrect", "lld/rate", "lld/tie_share", "lld/delta_traj_correct", "actor/grad_norm",
    "actor/grad_norm_max", "actor/entropy", "actor/ref_kl_k3", "rollout/valid_searches", "rollout/response_length",
    "loss/llds", "llds/gate_share", "actor/nonfinite_total",
)

# (config key, label) of the summary's config table.
CONFIG_HIGHLIGHTS: tuple[tuple[str, str], ...] = (
    ("objective.llds.enabled", "LLDS enabled"),
    ("objective.llds.variant", "LLDS variant"),
    ("objective.llds.lam", "LLDS lambda"),
    ("objective.llds.gate", "LLDS gate"),
    ("objective.llds.answer_weighting", "answer weighting (MA)"),
    ("optim.learning_rate", "learning rate"),
    ("optim.warmup_ratio", "warmup ratio"),
    ("train.total_steps", "total steps"),
    ("data.prompts_per_step", "prompts per step"),
    ("data.samples_per_prompt", "group size (samples per prompt)"),
    ("optim.mini_batch_size", "mini-batch (trajectories per update)"),
    ("objective.kl_coef", "KL coefficient"),
    ("model.path", "model"),
    ("seed", "seed"),
)

_LINESTYLES = ("-", "--", ":", "-.")


def series_color(index: int):
    """The `index`-th color of matplotlib's tab10 cycle (wrapping after 10)."""
    from matplotlib import colormaps
    return colormaps["tab10"](index % 10)


def _panel_has_data(panel: Panel, runs: Sequence[Run]) -> bool:
    return any(run.series(metric)[0] for run in runs for metric, _ in panel.series) or (
        panel.em and any(run.em_points() or run.final_em_points() for run in runs))


def plot_figure(plot: Plot, runs: Sequence[Run]):
    """The matplotlib Figure of `plot` over `runs` (None when no run has any of its metrics) and the titles of its
    panels left out for lack of data. Colors tell the series apart for one run, the runs apart with several."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in plot.panels if _panel_has_data(p, runs)]
    missing = [p.title for p in plot.panels if p not in panels]
    if not panels:
        return None, missing
    compare = len(runs) > 1
    fig = Figure(figsize=(9, 1.2 + 2.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(plot.title)
    for ax, panel in zip(axes, panels):
        for r, run in enumerate(runs):
            for s, (metric, label) in enumerate(panel.series):
                steps, values = run.series(metric)
                if not steps:
                    continue
                ax.plot(steps, values, label=f"{run.name} {label}" if compare else label,
                        color=series_color(r if compare else s), linestyle=_LINESTYLES[s % len(_LINESTYLES)] if compare
                        else "-", marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.3)
            if panel.em:
                _plot_em(ax, run, r, compare, first_color=len(panel.series))
        if panel.zero_line:
            ax.axhline(0.0, color="gray", linewidth=0.8)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(panel.title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    return fig, missing


def _plot_em(ax, run: Run, r: int, compare: bool, first_color: int) -> None:
    """EM points of a run: the mean (and, for a single run, each data_source) of the evaluations during training
    as markers joined by a thin line; the final evaluations' mean as stars."""
    points = run.em_points()
    sources = [EM_MEAN] if compare else sorted(points, key=lambda s: (s != EM_MEAN, s))
    for i, source in enumerate(s for s in sources if s in points):
        steps = sorted(points[source])
        label = f"EM {source}" if not compare else f"{run.name} EM {source}"
        ax.plot(steps, [points[source][k] for k in steps], label=label,
                color=series_color(r if compare else first_color + i), marker="s" if source == EM_MEAN else "^",
                markersize=6 if source == EM_MEAN else 4, linestyle=":" if compare else "-", linewidth=0.8)
    final = run.final_em_points()
    if final:
        steps = sorted(final)
        ax.plot(steps, [final[k] for k in steps], linestyle="none", marker="*", markersize=12,
                color=series_color(r if compare else first_color + len(sources)),
                label=f"{run.name} EM mean (final eval)" if compare else "EM mean (final eval)")


def save_figure(fig, path: epath.Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)  # Figure.savefig renders PNG with the Agg canvas (no pyplot)
    path.write_bytes(buffer.getvalue())


# ----- summary -------------------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A number in 6 significant digits (0.125 -> '0.125', 1e-06 -> '1e-06'); other values as they are."""
    if isinstance(value, float):
        return f"{value:.6g}"
    return "—" if value is None else str(value)


def _config_value(config: Mapping[str, Any] | None, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def objective_line(config: Mapping[str, Any] | None) -> str:
    if config is None:
        return "objective: unknown (no config.json)"
    if not _config_value(config, "objective.llds.enabled"):
        return "objective: GRPO (LLDS off)"
    return (f"objective: GRPO + LLDS (variant {_config_value(config, 'objective.llds.variant')}, lambda "
            f"{fmt(_config_value(config, 'objective.llds.lam'))}, gate {_config_value(config, 'objective.llds.gate')}"
            f", answer weighting {_config_value(config, 'objective.llds.answer_weighting')})")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a markdown table (a `|` inside a cell escaped)."""
    cells = lambda row: "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"  # noqa: E731
    return [cells(header), "|" + "---|" * len(header), *map(cells, rows)]


def metrics_table(run: Run) -> list[str]:
    rows = []
    for metric in KEY_METRICS:
        steps, values = run.series(metric)
        if not steps:
            continue
        rows.append([metric, f"{steps[0]}–{steps[-1]} (n={len(steps)})", fmt(values[0]), fmt(values[-1]),
                     fmt(min(values)), fmt(max(values))])
    absent = [m for m in KEY_METRICS if not run.series(m)[0]]
    lines = (markdown_table(["metric", "steps", "first", "last", "min", "max"], rows) if rows
             else ["No key metric in the log."])
    if absent:
        lines += ["", "Without any finite value in the log (absent, or null e.g. for want of a correct trajectory): "
                  + ", ".join(f"`{m}`" for m in absent) + "."]
    return lines


def _eval_label(result: EvalResult) -> str:
    tags = [t for t, on in (("start", result.is_start), ("final", result.is_final)) if on and t not in result.name]
    return result.name + (f" ({', '.join(tags)})" if tags else "")


def eval_table(run: Run) -> list[str]:
    """One row per evaluation folder: EM per data_source, the mean last, and the questions evaluated."""
    sources = sorted({s for r in run.evals for s in r.em if s != EM_MEAN})
    rows = []
    for result in run.evals:
        total = sum(result.counts.values()) if result.counts else None
        rows.append([_eval_label(result), "—" if result.step is None else str(result.step),
                     *(fmt(result.em.get(s)) for s in sources), fmt(result.em.get(EM_MEAN)), fmt(total)])
    return markdown_table(["evaluation", "step", *sources, EM_MEAN, "questions"], rows)


def final_em_table(runs: Sequence[Run]) -> list[str] | None:
    """EM per data_source of each run's last final evaluation, runs side by side (None when no run has one)."""
    finals = {run.name: [r for r in run.evals if r.is_final][-1] for run in runs if any(r.is_final for r in run.evals)}
    if not finals:
        return None
    sources = sorted({s for r in finals.values() for s in r.em if s != EM_MEAN}) + [EM_MEAN]
    rows = [[s, *(fmt(finals[name].em.get(s)) if name in finals else "—" for name in (r.name for r in runs))]
            for s in sources]
    rows.append(["(evaluation)", *(finals[r.name].name if r.name in finals else "—" for r in runs)])
    return markdown_table(["data_source", *(r.name for r in runs)], rows)


def best_eval_table(runs: Sequence[Run]) -> list[str] | None:
    """Each run's best periodic evaluation (`Run.best_periodic_eval`) next to its final one's mean EM (None when no
    run has a periodic evaluation)."""
    best = {run.name: run.best_periodic_eval() for run in runs}
    if not any(best.values()):
        return None
    rows = []
    for run in runs:
        finals = run.final_em_points()
        final = fmt(finals[max(finals)]) if finals else "—"
        step, em = best[run.name] or (None, None)
        rows.append([run.name, "—" if step is None else str(step), fmt(em), final])
    return markdown_table(["run", "best periodic evaluation: step", f"its {EM_MEAN} EM", f"final {EM_MEAN} EM"], rows)


def summary_markdown(runs: Sequence[Run], plots: Sequence[tuple[Plot, bool, list[str]]]) -> str:
    """The summary.md text; `plots` holds (plot, written, titles of panels left out)."""
    names = ", ".join(r.name for r in runs)
    lines = [f"{SUMMARY_TITLE}{names}", ""]
    if len(runs) > 1:
        lines += [f"{len(runs)} runs compared, overlaid in each plot (labels are the run folder names).", ""]
    lines += ["## Config highlights", ""]
    lines += markdown_table(["key", *(r.name for r in runs)],
                    [[f"{label} (`{key}`)", *(fmt(_config_value(r.config, key)) for r in runs)]
                     for key, label in CONFIG_HIGHLIGHTS])
    lines.append("")
    final = final_em_table(runs)
    if final is not None:
        lines += ["## Final EM", "", *final, ""]
    best = best_eval_table(runs)
    if best is not None:
        lines += ["## Best periodic evaluation", "",
                  "The paper reports the checkpoint its periodic test evaluations (`train.eval_every`) rated best; "
                  "chosen on the evaluation questions themselves, so it reads higher than a held-out choice would.",
                  "", *best, ""]
    for run in runs:
        steps = [r["step"] for r in run.records]
        lines += [f"## Run {run.name}", "", f"- folder: `{run.folder}`", f"- {objective_line(run.config)}",
                  f"- metrics: {len(steps)} records (steps {steps[0]}–{steps[-1]}) in `{METRICS_FILE}`",
                  f"- skipped lines (corrupted JSON): {run.skipped_lines}",
                  f"- checkpoints: {', '.join(map(str, run.checkpoints)) if run.checkpoints else 'none'}"]
        lines += [f"- note: {note}" for note in run.notes]
        lines += ["", "### Key metrics", "", *metrics_table(run), "", "### Evaluations", ""]
        if run.evals:
            lines += [f"From `eval/*/results.json` ({len(run.evals)} found), by step; `final` is the evaluation after "
                      "training, `start` one before it.", "", *eval_table(run), ""]
        else:
            lines += ["No `eval/*/results.json` in the run folder.", ""]
    lines += ["## Plots", ""]
    for plot, written, missing in plots:
        if written:
            lines += [f"### {plot.title}", "", f"![{plot.title}]({plot.filename})", ""]
            lines += [f"_Panel left out (no finite value of its metrics): {title}._" for title in missing]
            if missing:
                lines.append("")
        else:
            metrics = ", ".join(m for p in plot.panels for m, _ in p.series)
            lines += [f"- `{plot.filename}` skipped: none of its metrics ({metrics}) has a finite value in the log "
                      "(absent, or null e.g. for want of a correct trajectory).", ""]
    return "\n".join(lines).rstrip() + "\n"


# ----- the command ---------------------------------------------------------------------------------------------------
def _is_summary(out_dir: str) -> bool:
    """Whether the folder's summary.md is one the report wrote (its title line)."""
    try:
        with open(os.path.join(out_dir, SUMMARY_FILE), "rb") as f:
            return f.read(len(SUMMARY_TITLE)) == SUMMARY_TITLE.encode()
    except OSError:
        return False


# A report folder of an older version (before the marker): a summary.md of the report's, beside its plots.
REPORT = output_folder.Kind("report", strangers=output_folder.proven_by(
    _is_summary, lambda entry: entry in {plot.filename for plot in PLOTS} | {SUMMARY_FILE}))


def write_report(run_dirs: Sequence[str], out_dir: str | None = None) -> list[str]:
    """Writes the plots and summary.md of `run_dirs` (the first is the main run) into `out_dir` (default
    `<first run>/report`); returns the paths written."""
    runs = [read_run(folder, name) for folder, name in zip(run_dirs, unique_names(run_dirs))]
    out = epath.Path(out_dir) if out_dir else runs[0].folder / "report"
    if "://" not in os.fspath(out):  # local: gs:// has no folders to mix up
        try:  # a folder of the user's own files is never written into (llds_jax.runtime.output_folder)
            output_folder.claim(str(out), "--out", REPORT)
        except output_folder.FolderNotOursError as e:
            raise ReportError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    written, plots = [], []
    for plot in PLOTS:
        fig, missing = plot_figure(plot, runs)
        if fig is not None:
            save_figure(fig, out / plot.filename)
            written.append(str(out / plot.filename))
        plots.append((plot, fig is not None, missing))
    (out / SUMMARY_FILE).write_text(summary_markdown(runs, plots))
    written.append(str(out / SUMMARY_FILE))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llds_jax.train.report",
                                     description="Plots and summary.md of a training run folder.")
    parser.add_argument("run_dir", help="run folder (metrics.jsonl, config.json, eval/, checkpoints/)")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    parser.add_argument("--compare", nargs="+", default=[], metavar="OTHER_RUN_DIR",
                        help="other run folders overlaid in the same plots")
    args = parser.parse_args(argv)
    try:
        paths = write_report([args.run_dir, *args.compare], args.out)
    except ReportError as e:
        print(f"llds_jax.train.report: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

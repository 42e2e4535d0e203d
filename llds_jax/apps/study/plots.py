"""The study's figures: one PNG per setting (`plots/SETTING.png`), three panels over training steps (train reward,
token-mean log-prob of correct trajectories before the updates, LLD rate), one colour per arm, one thin line per
seed and, for an arm of several seeds, a thick line of their mean; and one PNG per collapsed run
(`plots/collapses/SETTING_ARM_seed_K.png`) with every per-step diagnostic on one figure, its collapse step and the
early-warning signals' warnings marked. Matplotlib's Figure with the Agg canvas (llds_jax.report.save_figure): no
display needed."""
from __future__ import annotations

import os
from collections.abc import Sequence

from etils import epath

from llds_jax import report
from llds_jax.apps.study import early_warning
from llds_jax.apps.study.outcomes import CURVES, LIKELIHOOD, LLD_RATE, REWARD, RunResult

PANELS = ((REWARD, "train reward (share of correct trajectories)"),
          (LIKELIHOOD, "correct trajectories: token-mean log-prob before the updates"),
          (LLD_RATE, "LLD rate (share of correct trajectories whose log-likelihood fell)"))


def mean_curve(curves: Sequence[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """Per step, the mean over the seeds' curves that have a value at that step (a run logs no LLD rate at a step
    without correct trajectories); `curves`: per seed (steps, values)."""
    by_step: dict[int, list[float]] = {}
    for steps, values in curves:
        for step, value in zip(steps, values):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return steps, [sum(by_step[step]) / len(by_step[step]) for step in steps]


def setting_figure(setting: str, results: Sequence[RunResult]):
    """The Figure of one setting's runs: arms coloured in the order they first appear, each seed a thin line, each
    arm of several seeds also a thick line of their mean (`mean_curve`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    arms = list(dict.fromkeys(r.arm for r in results))
    fig = Figure(figsize=(9, 1.2 + 2.8 * len(PANELS)), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True, squeeze=False)[:, 0]
    seeds = sorted({r.seed for r in results})
    fig.suptitle(f"setting {setting}: {len(seeds)} seed(s); thin lines: one seed each, thick: an arm's mean")
    for ax, (metric, title) in zip(axes, PANELS):
        for index, arm in enumerate(arms):
            curves = [r.curves[metric] for r in results if r.arm == arm and r.curves[metric][0]]
            for steps, values in curves:
                ax.plot(steps, values, color=report.series_color(index), linewidth=0.6, alpha=0.45,
                        label=arm if len(curves) == 1 else None)
            if len(curves) > 1:
                ax.plot(*mean_curve(curves), color=report.series_color(index), linewidth=2.2,
                        label=f"{arm} (mean of {len(curves)})")
        ax.set_title(f"{title} ({metric})", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    # One legend for the three panels, below them (every run logs a train reward: the first panel has every arm).
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
    return fig


def collapse_figure(result: RunResult):
    """The Figure of one collapsed run: a panel per metric of CURVES over its steps, a dashed line at its collapse
    step and, on each early-warning signal's panel, a dotted line at the step the signal warned."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 1.2 + 1.9 * len(CURVES)), layout="constrained")
    axes = fig.subplots(len(CURVES), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(f"{result.name}: collapsed at step {result.collapse_step} (dashed); dotted: the signal's warning")
    for ax, metric in zip(axes, CURVES):
        steps, values = result.curves[metric]
        ax.plot(steps, values, color=report.series_color(0), marker=".", linewidth=1.2)
        if result.collapse_step is not None:
            ax.axvline(result.collapse_step, color="black", linestyle="--", linewidth=1)
        if metric in early_warning.SIGNALS:
            rule, words = early_warning.SIGNALS[metric]
            warned = early_warning.warning_step(steps, values, rule)
            if warned is not None:
                ax.axvline(warned, color=report.series_color(1), linestyle=":", linewidth=1.5)
            ax.set_title(f"{metric} (warning: {words})", fontsize=9)
        else:
            ax.set_title(metric, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def write(results: Sequence[RunResult], out: str) -> list[str]:
    """Writes `out/plots/SETTING.png` for each setting in `results` and `out/plots/collapses/SETTING_ARM_seed_K.png`
    for each of its collapsed runs; returns their paths."""
    folder = os.path.join(out, "plots")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for setting in dict.fromkeys(r.setting for r in results):
        path = os.path.join(folder, f"{setting}.png")
        report.save_figure(setting_figure(setting, [r for r in results if r.setting == setting]), epath.Path(path))
        paths.append(path)
    for result in results:
        if result.collapsed:
            path = os.path.join(folder, "collapses", f"{result.setting}_{result.arm}_seed_{result.seed}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            report.save_figure(collapse_figure(result), epath.Path(path))
            paths.append(path)
    return paths

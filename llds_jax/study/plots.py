"""The study's figures: one PNG per setting (`plots/SETTING.png`), three panels over training steps (train reward,
token-mean log-prob of correct trajectories before the updates, LLD rate), one colour per arm, one thin line per
seed. Matplotlib's Figure with the Agg canvas (llds_jax.report.save_figure): no display needed."""
from __future__ import annotations

import os
from collections.abc import Sequence

from etils import epath

from llds_jax import report
from llds_jax.study.outcomes import LIKELIHOOD, LLD_RATE, REWARD, RunResult

PANELS = ((REWARD, "train reward (share of correct trajectories)"),
          (LIKELIHOOD, "correct trajectories: token-mean log-prob before the updates"),
          (LLD_RATE, "LLD rate (share of correct trajectories whose log-likelihood fell)"))


def setting_figure(setting: str, results: Sequence[RunResult]):
    """The Figure of one setting's runs: arms coloured in the order they first appear, each seed a thin line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    arms = list(dict.fromkeys(r.arm for r in results))
    fig = Figure(figsize=(9, 1.2 + 2.8 * len(PANELS)), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True, squeeze=False)[:, 0]
    seeds = sorted({r.seed for r in results})
    fig.suptitle(f"setting {setting}: {len(seeds)} seed(s), one thin line each")
    for ax, (metric, title) in zip(axes, PANELS):
        for index, arm in enumerate(arms):
            labelled = False
            for result in (r for r in results if r.arm == arm):
                steps, values = result.curves[metric]
                if steps:
                    ax.plot(steps, values, color=report.series_color(index), linewidth=0.8, alpha=0.7,
                            label=None if labelled else arm)
                    labelled = True
        ax.set_title(f"{title} ({metric})", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    return fig


def write(results: Sequence[RunResult], out: str) -> list[str]:
    """Writes `out/plots/SETTING.png` for each setting in `results`; returns their paths."""
    folder = os.path.join(out, "plots")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for setting in dict.fromkeys(r.setting for r in results):
        path = os.path.join(folder, f"{setting}.png")
        report.save_figure(setting_figure(setting, [r for r in results if r.setting == setting]), epath.Path(path))
        paths.append(path)
    return paths

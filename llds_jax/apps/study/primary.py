"""A study's registered primary endpoint, apart from the secondary family of `paired` (issue 56): each arm minus each
control on the seeds both ran, the exact two-sided sign-flip p-value (unadjusted: the primary is a family of its
own), the paired t interval, and the exact one-sided non-inferiority test at a margin: the sign-flip test of the
differences plus the margin (`stats.sign_flip_p_greater` with null -margin; a p at or below the level says the arm
is worse than the control by less than the margin)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llds_jax.train import report
from llds_jax.apps.study import files, paired, stats
from llds_jax.apps.study.outcomes import RunResult
from llds_jax.apps.study.plan import StudyError


@dataclasses.dataclass(frozen=True)
class Primary:
    """`arm` minus `control` in `setting` on `endpoint` over `seeds`: the paired comparison (`paired.Comparison`;
    its `holm_p` is its own p) and, with a `margin`, the one-sided exact p of non-inferiority at it (None without)."""
    comparison: paired.Comparison
    margin: float | None
    non_inferiority_p: float | None


def rows(results: Sequence[RunResult], controls: Sequence[str], endpoint: str,
         margin: float | None = None) -> list[Primary]:
    """The primary comparisons of `results` on `endpoint` (a key of paired.ENDPOINTS but a pairwise one), each arm
    against each control (`paired.pairs`), with the non-inferiority test at `margin` (> 0) when given."""
    if endpoint not in paired.ENDPOINTS or endpoint in paired.PAIRWISE:
        raise StudyError(f"--primary: {endpoint!r} is not an endpoint of one run; known: "
                         f"{', '.join(e for e in paired.ENDPOINTS if e not in paired.PAIRWISE)}")
    if margin is not None and not margin > 0:
        raise StudyError(f"--margin must be a positive number, got {margin}")
    found = []
    for setting in dict.fromkeys(r.setting for r in results):
        arms = list(dict.fromkeys(r.arm for r in results if r.setting == setting))
        for arm, control in paired.pairs(arms, controls):
            comparison = paired.compare(setting, arm, control, endpoint,
                                        paired.values(results, setting, arm, endpoint),
                                        paired.values(results, setting, control, endpoint))
            if comparison is not None:
                found.append(Primary(comparison, margin, None if margin is None else
                                     stats.sign_flip_p_greater(comparison.differences, -margin)))
    return found


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def markdown(found: Sequence[Primary]) -> list[str]:
    """The primary table as markdown lines, then a line saying what the columns are."""
    table_rows = []
    for row in found:
        c = row.comparison
        table_rows.append([
            c.setting, c.arm, c.control, paired.ENDPOINTS[c.endpoint],
            f"{len(c.seeds)} ({','.join(map(str, c.seeds))})",
            _signed(c.mean), "—" if c.t_low is None else f"[{_signed(c.t_low)}, {_signed(c.t_high)}]",
            f"{c.sign_flip_p:.4f}", "—" if row.margin is None else f"{row.margin:g}",
            "—" if row.non_inferiority_p is None else f"{row.non_inferiority_p:.4f}",
            f"{c.higher} / {c.lower} / {c.equal}"])
    lines = report.markdown_table(
        ["setting", "arm", "control", "endpoint", "seeds", "mean difference", "95% t CI",
         "exact sign-flip p, two-sided", "non-inferiority margin", "exact non-inferiority p, one-sided",
         "seeds higher / lower / equal"], table_rows)
    return lines + ["", "Arm minus control on the same seeds; the two-sided p enumerates every sign assignment of the "
                        "differences (exact up to 16 seeds), unadjusted; the one-sided p is the same test of the "
                        "differences plus the margin, against a centre above 0 (llds_jax.apps.study.primary)."]


def write(found: Sequence[Primary], out: str) -> list[str]:
    """Writes primary.md and primary.json into `out`; returns their paths."""
    return files.write_markdown_and_json(out, "primary", markdown(found), [
        {**dataclasses.asdict(row.comparison), "margin": row.margin, "non_inferiority_p": row.non_inferiority_p}
        for row in found])

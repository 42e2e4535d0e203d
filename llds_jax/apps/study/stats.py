"""The study's statistics: a bootstrap interval of a mean over seeds; for paired differences (an arm minus a control
on the same seeds) the exact sign-flip test, a t interval and Holm's adjustment over a family of tests; the collapse
rule.

Collapse (a definition, not the paper's: the paper reads collapse off its curves): a run collapsed when its training
reward (`reward/mean`, the share of correct trajectories of a step's rollout batch) is below 0.1 on 3 consecutive
steps, or when its final greedy test EM is below 0.05. Its step of collapse is the first of the first such 3 steps
(None when only the final EM says it collapsed).

Lasting collapse and lasting decline (issue 56's rules, which tell a transient dip from a collapse): a run's *end* is
the mean train reward of its last END_STEPS logged steps; it *recovered* when its end is at least half its highest
3-step trailing mean train reward (the mean of its rewards logged at steps s-2..s). A collapse is *lasting* when the
run has a collapse step and did not recover, or when its final greedy EM is below 0.05; a collapse step the run
recovered from is a transient collapse. A run *declined* at the first step whose 3-step trailing mean train reward
is below half the highest 3-step mean up to that step; the decline is *lasting* when the run did not recover, else
it was a transient dip.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SEED = 0          # the interval of the same values is the same on every call
BOOTSTRAP_RESAMPLES = 10_000
COLLAPSE_REWARD = 0.1       # train reward/mean below this ...
COLLAPSE_STEPS = 3          # ... on this many consecutive steps
COLLAPSE_EM = 0.05          # or a final greedy test EM below this
END_STEPS = 10              # a run's end: the mean train reward of its last this many logged steps
TRAILING_STEPS = 3          # the decline rule's trailing mean
SIGN_FLIP_EXACT_N = 16      # sign_flip_p enumerates all 2^n sign assignments up to this many differences
SIGN_FLIP_TIE_RTOL = 1e-9   # sums within this share of sum(|d|) of the observed one count as reaching it


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (e.g. one final EM per seed): `resamples` draws of
    len(values) values with replacement (numpy's default_rng(seed)), the (1 - confidence) / 2 and
    (1 + confidence) / 2 quantiles of their means. One value v gives (v, v)."""
    values_n = np.asarray(values, dtype=np.float64)
    if values_n.ndim != 1 or values_n.size == 0:
        raise ValueError(f"bootstrap_interval needs a non-empty list of numbers, got {values!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means_b = values_n[rng.integers(0, values_n.size, size=(resamples, values_n.size))].mean(axis=1)
    low, high = np.quantile(means_b, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def _differences(differences: Sequence[float], name: str) -> np.ndarray:
    differences_n = np.asarray(differences, dtype=np.float64)
    if differences_n.ndim != 1 or differences_n.size == 0:
        raise ValueError(f"{name} needs a non-empty list of numbers, got {differences!r}")
    return differences_n


def _sign_sums(d_n: np.ndarray, resamples: int, seed: int) -> tuple[np.ndarray, int]:
    """(sum(s * d) for each sign assignment s, the count added to numerator and denominator): all 2^n assignments
    for n <= SIGN_FLIP_EXACT_N (0 added), else `resamples` random ones (numpy's default_rng(seed); 1 added)."""
    n = d_n.size
    if n <= SIGN_FLIP_EXACT_N:
        bits_an = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1
        return (1 - 2 * bits_an) @ d_n, 0
    signs_bn = np.random.default_rng(seed).choice([-1.0, 1.0], size=(resamples, n))
    return signs_bn @ d_n, 1


def sign_flip_p(differences: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                seed: int = BOOTSTRAP_SEED) -> float:
    """Two-sided p-value of the paired permutation (sign-flip) test of "the differences are symmetric about 0":
    the share of sign assignments s in {-1, +1}^n whose |sum(s * d)| reaches |sum(d)| (a sum within
    SIGN_FLIP_TIE_RTOL * sum(|d|) of it counts, so rounding does not split ties). `differences`: n paired
    differences (e.g. an arm's final EM minus a control's, one per seed). Exact for n <= SIGN_FLIP_EXACT_N (all
    2^n assignments, the observed one among them, so p >= 2 / 2^n); for a larger n, `resamples` random
    assignments (numpy's default_rng(seed)) and p = (1 + reaching) / (1 + resamples), as scipy.stats.permutation_test
    does."""
    d_n = _differences(differences, "sign_flip_p")
    sums_a, adjust = _sign_sums(d_n, resamples, seed)
    reaching = np.abs(sums_a) >= abs(d_n.sum()) - SIGN_FLIP_TIE_RTOL * np.abs(d_n).sum()
    return float((reaching.sum() + adjust) / (sums_a.size + adjust))


def sign_flip_p_greater(differences: Sequence[float], null: float = 0.0, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> float:
    """One-sided p-value of the sign-flip test of "the differences are symmetric about `null`" against "centred
    above it": the share of sign assignments s whose sum(s * (d - null)) reaches sum(d - null) from above (ties as
    in `sign_flip_p`). With `null` = -margin it is the exact non-inferiority test at that margin: a small p says the
    arm is worse than the control by less than the margin. Exact for n <= SIGN_FLIP_EXACT_N (p >= 1 / 2^n), else
    sampled as `sign_flip_p` is."""
    shifted_n = _differences(differences, "sign_flip_p_greater") - null
    sums_a, adjust = _sign_sums(shifted_n, resamples, seed)
    reaching = sums_a >= shifted_n.sum() - SIGN_FLIP_TIE_RTOL * np.abs(shifted_n).sum()
    return float((reaching.sum() + adjust) / (sums_a.size + adjust))


def _t_central_mass(theta: float, df: int) -> float:
    """P(|T| <= sqrt(df) tan(theta)) for Student's t with `df` (a positive integer) degrees of freedom: the finite
    series of Abramowitz & Stegun 26.7.3 (df odd) and 26.7.4 (df even) in theta = arctan(t / sqrt(df))."""
    c, s = np.cos(theta), np.sin(theta)
    series = 0.0
    if df % 2:
        term = c
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c * c * (2 * k) / (2 * k + 1)
        return float(2 / np.pi * (theta + s * series))
    term = 1.0
    for k in range(1, df // 2 + 1):
        series += term
        term *= c * c * (2 * k - 1) / (2 * k)
    return float(s * series)


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = `confidence` for Student's t with `df` degrees of freedom (the (1 + confidence) / 2
    quantile), by bisection on theta = arctan(t / sqrt(df)) of `_t_central_mass`, to float precision."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if df < 1 or int(df) != df:
        raise ValueError(f"t_quantile needs a positive integer df, got {df!r}")
    low, high = 0.0, np.pi / 2
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if _t_central_mass(middle, int(df)) < confidence:
            low = middle
        else:
            high = middle
    return float(np.sqrt(df) * np.tan((low + high) / 2))


def t_interval(differences: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The paired t interval of the mean of `differences` (n >= 2 paired differences, one per seed): mean
    -/+ t_quantile(confidence, n - 1) * sd / sqrt(n), sd with n - 1 in the denominator (equal differences give
    (mean, mean))."""
    d_n = _differences(differences, "t_interval")
    if d_n.size < 2:
        raise ValueError(f"t_interval needs at least 2 differences, got {differences!r}")
    half = t_quantile(confidence, d_n.size - 1) * d_n.std(ddof=1) / np.sqrt(d_n.size)
    mean = d_n.mean()
    return float(mean - half), float(mean + half)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni step-down adjusted p-values of a family of m tests, in the order given: with the p-values
    sorted ascending p_(1) <= ... <= p_(m), adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j)). A test
    is rejected at family-wise level alpha when its adjusted p <= alpha."""
    p_m = np.asarray(p_values, dtype=np.float64)
    if p_m.ndim != 1 or np.any((p_m < 0) | (p_m > 1)):
        raise ValueError(f"holm needs a list of p-values in [0, 1], got {p_values!r}")
    order = np.argsort(p_m, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (p_m.size - np.arange(p_m.size)) * p_m[order]))
    result = np.empty_like(p_m)
    result[order] = adjusted
    return [float(p) for p in result]


def collapse_step(steps: Sequence[int], rewards: Sequence[float], threshold: float = COLLAPSE_REWARD,
                  consecutive: int = COLLAPSE_STEPS) -> int | None:
    """The first step of the first `consecutive` consecutive steps (step numbers k, k+1, ...) whose reward is below
    `threshold`; None when there is no such run of steps. `steps` ascending, one reward each."""
    if len(steps) != len(rewards):
        raise ValueError(f"collapse_step: {len(steps)} steps but {len(rewards)} rewards")
    first, length, previous = None, 0, None
    for step, reward in zip(steps, rewards):
        if reward < threshold:
            if length and step == previous + 1:
                length += 1
            else:
                first, length = step, 1
            if length >= consecutive:
                return first
        else:
            length = 0
        previous = step
    return None


def collapsed(step: int | None, final_em: float, em_threshold: float = COLLAPSE_EM) -> bool:
    """The collapse rule: a collapse step (from `collapse_step`) or a final greedy test EM below `em_threshold`."""
    return step is not None or final_em < em_threshold


def _end(rewards: Sequence[float]) -> float:
    return float(np.mean(rewards[-END_STEPS:]))


def _recovered(steps: Sequence[int], rewards: Sequence[float], rule: str) -> bool:
    """Whether the run's end (mean train reward of its last END_STEPS steps) is at least half its highest 3-step
    trailing mean."""
    if not len(rewards):
        raise ValueError(f"{rule} needs at least one reward")
    return _end(rewards) >= max(trailing_means(steps, rewards)) / 2


def lasting_collapse(steps: Sequence[int], rewards: Sequence[float], final_em: float) -> bool:
    """Issue 56's rule: a collapse step (`collapse_step`) the run did not recover from (its end, the mean train
    reward of its last END_STEPS steps, below half its highest 3-step trailing mean), or a final greedy EM below
    COLLAPSE_EM. `steps` ascending, one reward each (at least one)."""
    recovered = _recovered(steps, rewards, "lasting_collapse")
    return (collapse_step(steps, rewards) is not None and not recovered) or final_em < COLLAPSE_EM


def trailing_means(steps: Sequence[int], rewards: Sequence[float]) -> list[float]:
    """Per logged step s, the mean of the rewards logged at steps s - TRAILING_STEPS + 1 ... s."""
    if len(steps) != len(rewards):
        raise ValueError(f"trailing_means: {len(steps)} steps but {len(rewards)} rewards")
    return [float(np.mean([r for t, r in zip(steps, rewards) if s - TRAILING_STEPS < t <= s])) for s in steps]


def decline_step(steps: Sequence[int], rewards: Sequence[float]) -> int | None:
    """The first step whose 3-step trailing mean reward is below half the highest 3-step mean up to it (None: no
    such step)."""
    means = trailing_means(steps, rewards)
    running = np.maximum.accumulate(means) if means else []
    return next((s for s, m, peak in zip(steps, means, running) if m < peak / 2), None)


def lasting_decline(steps: Sequence[int], rewards: Sequence[float]) -> bool:
    """Issue 56's rule: a decline step (`decline_step`) the run did not recover from (its end, the mean train reward
    of its last END_STEPS steps, below half its highest 3-step trailing mean)."""
    recovered = _recovered(steps, rewards, "lasting_decline")
    return decline_step(steps, rewards) is not None and not recovered

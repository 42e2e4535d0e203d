"""Compact numbers and durations for console lines (no heavy imports: `--help` and the study's planner use them)."""
from __future__ import annotations

import math


def format_number(x: float) -> str:
    """Three significant digits; SI suffixes from 1000 on: 0.41234 -> '0.412', 12345 -> '12.3k'."""
    return format_si(x) if abs(x) >= 1000 else f"{x:.3g}"


def format_si(x: float) -> str:
    """1234.5 -> '1.23k', 2.5e6 -> '2.5M', 12 -> '12'."""
    if not math.isfinite(x):
        return str(x)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def format_percent(x: float) -> str:
    """A fraction as a percentage: 0.031 -> '3.1%'."""
    return f"{100 * x:.1f}%"


def format_duration(seconds: float) -> str:
    """Compact duration: 42 -> '42s', 245 -> '4m05s', 11520 -> '3h12m', 273600 -> '3d04h'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"

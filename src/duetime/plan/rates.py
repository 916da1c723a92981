"""A rate that changes over time: a day's diurnal curve or a trace of rates per interval."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Interval:
    start_s: float
    duration_s: float
    rate: float


def diurnal(peak: float, trough: float, *, hours: float = 24.0, interval_s: float = 900.0,
            peak_hour: float = 14.0) -> list[Interval]:
    """A day's rate as a cosine between ``trough`` (12 hours from the peak) and ``peak`` (at
    ``peak_hour``), each interval at its mean rate."""
    if not 0 < trough <= peak:
        raise ValueError(f"diurnal: want 0 < trough <= peak, got trough {trough}, peak {peak}")
    n = max(1, round(hours * 3600 / interval_s))
    out = []
    for k in range(n):
        a, b = k * interval_s, (k + 1) * interval_s
        w = 2 * math.pi / 86400.0
        phase = peak_hour * 3600
        # the mean of trough + (peak - trough) (1 + cos(w (t - phase))) / 2 over [a, b]
        mean_cos = (math.sin(w * (b - phase)) - math.sin(w * (a - phase))) / (w * interval_s)
        out.append(Interval(a, interval_s, trough + (peak - trough) * (1 + mean_cos) / 2))
    return out


def read_rates(path: str | Path) -> list[Interval]:
    """A rate trace: CSV with ``start_s`` and ``rate`` columns, one row per interval (each
    lasts until the next row's start; the last as long as the one before it)."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(rows) < 2 or not {"start_s", "rate"} <= set(rows[0]):
        raise ValueError(f"{path}: want a CSV with columns start_s and rate, two rows or more")
    try:
        pts = [(float(r["start_s"]), float(r["rate"])) for r in rows]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: start_s and rate must be numbers") from None
    if any(b[0] <= a[0] for a, b in pairwise(pts)):
        raise ValueError(f"{path}: start_s must increase")
    if any(r <= 0 or not math.isfinite(r) for _, r in pts):
        raise ValueError(f"{path}: rates must be positive")
    out = [Interval(s, pts[k + 1][0] - s, r) for k, (s, r) in enumerate(pts[:-1])]
    out.append(Interval(pts[-1][0], out[-1].duration_s, pts[-1][1]))
    return out


def level(rate: float, step: float) -> float:
    """``rate`` rounded up to the grid (1 + step)^k (k an integer)."""
    k = math.ceil(math.log(rate) / math.log1p(step) - 1e-9)
    return (1 + step) ** k

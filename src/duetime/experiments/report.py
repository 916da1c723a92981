"""Writing an experiment's outputs: results.csv, summary.json, PNG plots and report.md."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or in CI
import matplotlib.pyplot as plt

FIRST_COLUMNS = ["router", "rate", "mean_ttft_s", "p95_ttft_s", "on_time", "utility",
                 "ontime_utility"]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    cols = list(FIRST_COLUMNS)
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in cols})


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def md_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |\n"
                          for r in rows)


def _grouped_lines(ax: Any, rows: list[dict[str, Any]], x: str, y: str, group: str) -> None:
    """A line per ``group`` value (in the order they first appear), points sorted by x;
    ``sfs`` drawn thicker."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        groups.setdefault(str(r[group]), []).append((float(r[x]), float(r[y])))
    for name, pts in groups.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name,
                lw=2.2 if name == "sfs" else 1.2)


def line_plot(path: Path, rows: list[dict[str, Any]], x: str, y: str, *, group: str = "router",
              title: str = "", xlabel: str = "", ylabel: str = "") -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    _grouped_lines(ax, rows, x, y, group)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def scatter_plot(path: Path, xs: list[float], ys: list[float], labels: list[str], *, title: str,
                 xlabel: str, ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    ax.plot(xs, ys, marker="o")
    for x, y, lab in zip(xs, ys, labels, strict=True):
        ax.annotate(lab, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bar_plot(path: Path, shares: dict[str, dict[str, dict[str, float]]], models: list[str],
             tasks: list[str], title: str) -> None:
    """Stacked bars: for each router and task, the share sent to each model."""
    routers = list(shares)
    fig, axes = plt.subplots(1, len(routers), figsize=(3.2 * len(routers), 3.8), dpi=110,
                             sharey=True, squeeze=False)
    for ax, router in zip(axes[0], routers, strict=True):
        bottom = [0.0] * len(tasks)
        for m in models:
            vals = [shares[router][t][m] for t in tasks]
            ax.bar(tasks, vals, bottom=bottom, label=m)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(router, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    axes[0][0].set_ylabel("share of the task's requests")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def panels_plot(path: Path, panels: list[tuple[str, list[dict[str, Any]]]], x: str, y: str, *,
                group: str = "router", title: str = "", xlabel: str = "", ylabel: str = "",
                logy: bool = False) -> None:
    """Side-by-side line plots sharing the y axis, one per (panel title, rows); a line per
    ``group`` value, in the order they first appear."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), dpi=110,
                             sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels, strict=True):
        _grouped_lines(ax, rows, x, y, group)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel or x)
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("log")
    axes[0][0].set_ylabel(ylabel or y)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

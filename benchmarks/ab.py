"""Run one benchmark script of two checkouts side by side: A, B, B, A, A, B, ... alternating,
and print each one's table with every number replaced by its median over the runs, then B's
table with each number's ratio B / A.

Each checkout runs its own copy of the script with its own virtual environment
(``CHECKOUT/.venv/bin/python CHECKOUT/SCRIPT ARGS``, working directory CHECKOUT); the tables
are matched cell by cell (the two must print the same layout). On a shared, noisy machine the
ratio of medians taken in one interleaved run is the number to quote, not either side alone.

    python benchmarks/ab.py --a ../base --b . --runs 5 -- benchmarks/forecast_speed.py --quick
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _run(checkout: Path, script: str, args: list[str]) -> str:
    python = checkout / ".venv" / "bin" / "python"
    out = subprocess.run([str(python), str(checkout / script), *args], cwd=checkout,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"ab: {checkout}/{script} failed ({out.returncode}):\n{out.stderr}")
    return out.stdout


def _cells(text: str) -> list[list[str]]:
    """Each line split into alternating text and number pieces."""
    rows = []
    for line in text.splitlines():
        pieces, last = [], 0
        for m in NUMBER.finditer(line):
            pieces += [line[last:m.start()], m.group()]
            last = m.end()
        pieces.append(line[last:])
        rows.append(pieces)
    return rows


def _medians(texts: list[str]) -> list[list[str | float]]:
    """The first run's layout with every number the median over the runs."""
    runs = [_cells(t) for t in texts]
    out: list[list[str | float]] = []
    for i, row in enumerate(runs[0]):
        cells: list[str | float] = []
        for j, piece in enumerate(row):
            if j % 2 == 0:
                cells.append(piece)
                continue
            vals = []
            for r in runs:
                if i < len(r) and j < len(r[i]):
                    vals.append(float(r[i][j]))
            cells.append(statistics.median(vals))
        out.append(cells)
    return out


def _fmt(x: float, like: str) -> str:
    decimals = len(like.split(".")[1]) if "." in like and "e" not in like.lower() else 0
    return f"{x:.{decimals}f}"


def _render(med: list[list[str | float]], first: list[list[str]],
            ratio_to: list[list[str | float]] | None = None) -> str:
    lines = []
    for i, row in enumerate(med):
        parts = []
        for j, c in enumerate(row):
            if isinstance(c, str):
                parts.append(c)
                continue
            text = _fmt(c, first[i][j])
            if ratio_to is not None and i < len(ratio_to) and j < len(ratio_to[i]) \
                    and isinstance(ratio_to[i][j], float) and ratio_to[i][j]:
                text += f"({c / ratio_to[i][j]:.2f})"
            parts.append(text)
        lines.append("".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="checkout A (e.g. the previous commit)")
    ap.add_argument("--b", required=True, type=Path, help="checkout B (e.g. this one)")
    ap.add_argument("--runs", type=int, default=5, help="runs of each (default 5)")
    ap.add_argument("script", help="the benchmark script, relative to each checkout")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = ap.parse_args()
    extra = [a for a in args.args if a != "--"]
    out: dict[str, list[str]] = {"A": [], "B": []}
    for k in range(args.runs):
        order = ("A", "B") if k % 2 == 0 else ("B", "A")
        for side in order:
            out[side].append(_run(args.a if side == "A" else args.b, args.script, extra))
            print(f"ab: run {k + 1}/{args.runs} {side} done", file=sys.stderr, flush=True)
    med_a, med_b = _medians(out["A"]), _medians(out["B"])
    first_a, first_b = _cells(out["A"][0]), _cells(out["B"][0])
    print(f"== A: {args.a} (median of {args.runs} runs)")
    print(_render(med_a, first_a))
    print(f"\n== B: {args.b} (median of {args.runs} runs; (x) = B / A)")
    print(_render(med_b, first_b, med_a))


if __name__ == "__main__":
    main()

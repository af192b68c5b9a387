"""`phalanx plot RUN_DIR`: a PNG of the curves `px.log()` wrote, one panel per metric against step.

Needs matplotlib (`pip install 'phalanx[plot]'`); imported only when the command runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from phalanx.logging.sinks import CSV_FILE, JSONL_FILE

_NOT_CURVES = ("step", "time")


def read_metrics(run_dir: str) -> dict[str, list[tuple[float, float]]]:
    """metric -> [(step, value)] from metrics.jsonl, else metrics.csv, in the run directory."""
    jsonl, csv_path = os.path.join(run_dir, JSONL_FILE), os.path.join(run_dir, CSV_FILE)
    if os.path.exists(jsonl):
        with open(jsonl, encoding="utf-8") as fp:
            rows = [json.loads(line) for line in fp if line.strip()]
    elif os.path.exists(csv_path):
        with open(csv_path, newline="", encoding="utf-8") as fp:
            rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fp)]
    else:
        raise FileNotFoundError(
            f"no {JSONL_FILE} or {CSV_FILE} in {run_dir!r}. HINT: pass the run directory a script logged to "
            "with px.log() (printed as 'run dir' at start-up; px.run_dir in the script)."
        )
    curves: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name not in _NOT_CURVES and isinstance(value, (int, float)) and math.isfinite(value):
                curves.setdefault(name, []).append((row["step"], value))
    return curves


def plot(run_dir: str, out: str | None = None, metrics: list[str] | None = None) -> str:
    """Write the PNG and return its path (default RUN_DIR/metrics.png)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("phalanx plot needs matplotlib. HINT: pip install 'phalanx[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    curves = read_metrics(run_dir)
    if metrics:
        missing = [m for m in metrics if m not in curves]
        if missing:
            raise ValueError(f"metric(s) {missing} not logged in {run_dir!r}; logged: {', '.join(curves)}")
        curves = {m: curves[m] for m in metrics}
    if not curves:
        raise ValueError(f"{run_dir!r} has metrics files but no numeric metrics to plot")
    fig, axes = plt.subplots(len(curves), 1, figsize=(7, 2.6 * len(curves)), sharex=True, squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], curves.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl or metrics.csv")
    parser.add_argument("--out", "-o", help="PNG to write (default RUN_DIR/metrics.png)")
    parser.add_argument("--metrics", help="comma-separated metric names to plot (default: all)")


def main(args: argparse.Namespace) -> int:
    try:
        out = plot(args.run_dir, args.out, args.metrics.split(",") if args.metrics else None)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"phalanx plot: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0

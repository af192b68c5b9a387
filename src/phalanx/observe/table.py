"""The job's status as a plain-text table (`phalanx top`; no torch, no terminal library)."""

from __future__ import annotations

import time
from typing import Any

from phalanx.logging.printable import printable, printable_lines
from phalanx.observe import records

BOLD_RED, RESET = "\x1b[1;31m", "\x1b[0m"


def _bytes(n: Any) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _phase_names(ranks: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for r in ranks:
        for name in r.get("phases") or {}:
            if name not in names:
                names.append(name)
    return names


def rank_state(rank: dict[str, Any], status: dict[str, Any] | None = None) -> str:
    """`running`, or what is wrong: `silent 12 s (backward, step 40)`, `no progress 8 s (...)`,
    `failed`, `left`."""
    state = rank.get("state", "running")
    if status is not None:
        state = records.shown_state(status, rank)
    if state == "silent":
        return f"silent {rank.get('silent_s', 0):.0f} s ({rank.get('phase')}, step {rank.get('step')})"
    if state == "no progress":
        return f"no progress {rank.get('still_s', 0):.0f} s ({rank.get('phase')}, step {rank.get('step')})"
    return state


def not_running_line(run_dir: str, status: dict[str, Any] | None) -> str | None:
    """Why no job is running in `run_dir`, or None when one is."""
    if status is None:
        return (
            f"no job is running in {run_dir}: it has no {records.SUBDIR}/{records.STATUS} (started with "
            "step_anatomy off, not yet at its first step, or not a phalanx run dir)"
        )
    if status.get("ended"):
        ended = time.strftime("%H:%M:%S", time.localtime(status["time"]))
        return f"no job is running in {run_dir}: it ended at {ended}"
    if not records.is_running(status):
        return (
            f"no job is running in {run_dir}: its last status is {status['age_s']:.0f} s old "
            "(the job stopped, or its rank 0 is stuck)"
        )
    return None


def render(run_dir: str, status: dict[str, Any] | None, color: bool = False) -> str:
    """The whole screen: a header, one row per rank, the straggler line, the watchdog's verdict.
    Names (run, hosts, phases) are the job's data: their control characters are escaped (printable)."""
    run_dir = printable(run_dir)
    lines = [f"phalanx top: {run_dir}"]
    why = not_running_line(run_dir, status)
    if why:
        lines.append(why)
    if status is None:
        return "\n".join(lines)
    metrics = status.get("metrics") or {}
    loss = metrics.get("loss")
    lines.append(
        f"attempt {status.get('attempt')}  world size {status.get('world_size')}  step {status.get('step')}"
        + (f"  loss {loss:.4g} (step {metrics.get('step')})" if isinstance(loss, (int, float)) else "")
    )
    if status.get("not_measured"):  # a loop without a prepared loader: steps are optimizer steps
        lines.append(printable(f"steps count {status.get('steps_count')}; not measured: {status['not_measured']}"))
    ranks = status.get("ranks", [])
    names = _phase_names(ranks)
    head = ["rank", "host", "local", "state", "step", "steps/s", *(f"{printable(n)} ms" for n in names), "memory"]
    body = []
    for r in ranks:
        phases = r.get("phases") or {}
        body.append(
            [
                str(r.get("rank")),
                printable(r.get("host") or "-"),
                str(r.get("local_rank", "-")),
                printable(rank_state(r, status)),
                str(r.get("step", "-")),
                f"{r['steps_per_s']:.2f}" if r.get("steps_per_s") else "-",
                *(f"{phases[n]:.1f}" if n in phases else "-" for n in names),
                _bytes(r.get("memory")),
            ]
        )
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    straggler = (status.get("straggler") or {}).get("rank")
    for row in [head, *body]:
        text = "  ".join(cell.rjust(w) for cell, w in zip(row, widths))
        if color and row is not head and row[0] == str(straggler):
            text = f"{BOLD_RED}{text}{RESET}"
        lines.append(text)
    lines.append(printable(status.get("straggler_message") or "straggler: none"))
    for attempt, verdict in (status.get("earlier") or {}).items():  # restarts: why each earlier attempt ended
        lines.append(printable_lines(f"attempt {attempt} (earlier): {verdict}"))
    if status.get("verdict"):
        lines.append(printable_lines(status["verdict"]))
    return "\n".join(lines)

"""The job's records in its run dir, as rank 0 writes them and `phalanx top` and the dashboard
read them (no torch here: the launcher side imports it).

RUN_DIR/observe/status.json  the latest view of every rank, rewritten about once a second
                             (atomically: a reader never sees half a file)
RUN_DIR/observe/stragglers.jsonl  one line per straggler named or let go
RUN_DIR/observe/verdict-ATTEMPT.txt  the watchdog's report, when it stopped that attempt of the job
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

SUBDIR = "observe"
STATUS, STRAGGLERS = "status.json", "stragglers.jsonl"


def verdict_name(attempt: str) -> str:
    """The watchdog's report for one attempt of the job (restarts write their own)."""
    return f"verdict-{attempt}.txt"


STALE_AFTER_S = 5.0  # a status older than this: the job is not running (or its rank 0 is stuck)


def path(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, SUBDIR, name)


def write_json(run_dir: str, name: str, value: Any) -> None:
    """Replace RUN_DIR/observe/NAME with `value` as JSON in one rename."""
    target = path(run_dir, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(value))  # one C-encoded string: json.dump's chunks cost the GIL longer
    os.replace(tmp, target)


def append_line(run_dir: str, name: str, value: Any) -> None:
    target = path(run_dir, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "a") as f:
        f.write(json.dumps(value) + "\n")


def write_text(run_dir: str, name: str, text: str) -> None:
    target = path(run_dir, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write(text)


def read_status(run_dir: str) -> dict[str, Any] | None:
    """The latest status, with `age_s` (seconds since it was written) and `verdict` added; None when
    the run dir has none (no job with phalanx >= this version has run there)."""
    try:
        with open(path(run_dir, STATUS)) as f:
            status = json.load(f)
    except FileNotFoundError:
        return None
    status["age_s"] = max(0.0, time.time() - float(status.get("time", 0)))
    status["verdict"] = read_verdict(run_dir, str(status.get("attempt")))
    status["earlier"] = {
        attempt: text for attempt, text in verdicts(run_dir).items() if attempt != str(status.get("attempt"))
    }
    return status


def read_verdict(run_dir: str, attempt: str) -> str | None:
    try:
        with open(path(run_dir, verdict_name(attempt))) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def verdicts(run_dir: str) -> dict[str, str]:
    """attempt -> the watchdog's report, for every attempt that has one, oldest file first."""
    try:
        names = sorted(
            os.listdir(os.path.join(run_dir, SUBDIR)), key=lambda name: os.path.getmtime(path(run_dir, name))
        )
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        if name.startswith("verdict-") and name.endswith(".txt"):
            text = read_verdict(run_dir, name[len("verdict-") : -len(".txt")])
            if text:
                found[name[len("verdict-") : -len(".txt")]] = text
    return found


def shown_state(status: dict[str, Any], rank: dict[str, Any]) -> str:
    """A rank's state as the views show it: never "running" once the job ended, or when its status
    stopped coming (the job died or was stopped: its rank 0 writes no more)."""
    state = rank.get("state", "running")
    if state != "running":
        return state
    if status.get("ended"):
        return "ended"
    if "age_s" in status and not is_running(status):
        return "stopped (last seen running)"
    return state


def is_running(status: dict[str, Any]) -> bool:
    return not status.get("ended") and status["age_s"] <= STALE_AFTER_S


def newest_run(root: str = "runs") -> str | None:
    """The run under `root` whose status was written last (else the newest folder), or None."""
    try:
        names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))]
    except FileNotFoundError:
        return None
    if not names:
        return None

    def last_touched(name: str) -> float:
        status = path(os.path.join(root, name), STATUS)
        return os.path.getmtime(status if os.path.exists(status) else os.path.join(root, name))

    return os.path.abspath(os.path.join(root, max(names, key=last_touched)))


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float as the string "nan", "inf" or "-inf": a diverging job's
    NaN loss is what the user must see, and strict JSON (the dashboard's replies) has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def api_status(status: dict[str, Any]) -> dict[str, Any]:
    """The `GET /api/status` shape: {"step", "attempt", "running", "ended", "ranks": [{"rank", "host",
    "local_rank", "step", "state", "phases"}], "straggler": null or {"rank", "phase", "ms_per_step"},
    "verdict": the watchdog's report of this attempt or null, "earlier": {attempt: its report}}."""
    return {
        "step": status.get("step"),
        "attempt": status.get("attempt"),
        "running": bool(status) and "age_s" in status and is_running(status),
        "ended": bool(status.get("ended")),
        "ranks": [
            {
                **{k: r.get(k) for k in ("rank", "host", "local_rank", "step")},
                "state": shown_state(status, r),
                "phases": r.get("phases"),
            }
            for r in status.get("ranks", [])
        ],
        "straggler": status.get("straggler"),
        "verdict": status.get("verdict"),
        "earlier": status.get("earlier") or {},
    }

"""What the dashboard plots: the job's status, sampled about once a second by the launcher, kept
across restarts of an elastic job (no torch here)."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

from phalanx.observe import records

KEEP_POINTS = 3600  # an hour at one point a second; older points are dropped


class History:
    """Samples RUN_DIR/observe/status.json in a thread of its own; the server only reads it."""

    def __init__(self, run_dir: str, interval_s: float = 1.0):
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.points: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_POINTS)
        self.earlier: dict[str, dict[str, Any]] = {}  # attempt -> {"ranks": last rows, "verdict": ...}
        self.latest: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-dashboard-history", daemon=True)

    def start(self) -> "History":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        """Read the status once; add a point when rank 0 wrote a new one."""
        try:
            status = records.read_status(self.run_dir)
        except (OSError, ValueError):  # caught mid-replace on a file system without atomic rename
            return
        if status is None:
            return
        with self._lock:
            previous = self.latest
            if previous is not None and previous.get("attempt") != status.get("attempt"):
                # a rank still "running" in the last status of a replaced attempt was stopped with it
                rows = [
                    {**r, "state": "stopped" if r.get("state", "running") == "running" else r["state"]}
                    for r in previous.get("ranks", [])
                ]
                self.earlier[str(previous.get("attempt"))] = {"ranks": rows, "verdict": previous.get("verdict")}
            self.latest = status
            if previous is not None and previous.get("time") == status.get("time"):
                return
            metrics = status.get("metrics") or {}
            self.points.append(
                {
                    "time": status.get("time"),
                    "attempt": status.get("attempt"),
                    "step": status.get("step"),
                    "loss": metrics.get("loss"),
                    "loss_step": metrics.get("step"),
                    "steps_per_s": min(
                        (r["steps_per_s"] for r in status.get("ranks", []) if r.get("steps_per_s")), default=None
                    ),
                    "step_ms": {
                        str(r["rank"]): round(sum((r.get("phases") or {}).values()), 2)
                        for r in status.get("ranks", [])
                        if r.get("phases")
                    },
                }
            )

    def page(self) -> dict[str, Any]:
        """Everything the page shows: the latest status (running or not), the points, earlier attempts."""
        with self._lock:
            status = self.latest
            if status is not None:
                status = {**status, "age_s": max(0.0, time.time() - float(status.get("time", 0)))}
            earlier = {attempt: dict(past) for attempt, past in self.earlier.items()}
            # the watchdog's report may be written after the next attempt started (or by a surviving rank)
            for attempt, verdict in (status or {}).get("earlier", {}).items():
                earlier.setdefault(attempt, {"ranks": []})["verdict"] = verdict
            if status is not None:
                status = {
                    **status,
                    "ranks": [{**r, "state": records.shown_state(status, r)} for r in status.get("ranks", [])],
                }
            return {
                "status": status,
                "run": os.path.basename(os.path.normpath(self.run_dir)),
                "running": status is not None and records.is_running(status),
                "points": list(self.points),
                "earlier": earlier,
            }

"""Every rank publishes a small summary of its last steps about once a second; rank 0 reads them
all, judges stragglers and writes the job's status for `phalanx top` and the dashboard.

It rides on the watchdog's thread and store (one more `set` per heartbeat on every rank, one
`multi_get` on rank 0): no barrier, no collective, nothing on the training loop's path but the
anatomy's timing. In a world of one (no watchdog) the main thread writes the status itself, at
most once a second, at a step boundary.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from typing import Any, Callable

from phalanx import store_keys
from phalanx.logging.printable import printable
from phalanx.observe import records
from phalanx.observe.anatomy import NOT_MEASURED, SAMPLED, StepAnatomy, rank_order
from phalanx.observe.straggler import WINDOW, Judge, StragglerWatch

PUBLISHED_STEPS = SAMPLED  # steps in each summary: enough for rank 0 to miss a few heartbeats
SPAN_S = 3.0  # the published steps span at least this long: summaries published at different
# moments of a second still share steps. Faster jobs publish every S-th step (S a power of two
# from the step rate), the same steps on every rank.
SILENT_AFTER_S = 5.0  # a peer whose summary has not changed for this long shows as silent


def memory_bytes(device: Any) -> int | None:
    """Memory this rank holds now: the CUDA allocator's bytes on a GPU, else the process's RSS."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def stride(steps_per_s: float | None) -> int:
    """Publish every stride-th step: PUBLISHED_STEPS of them span at least SPAN_S seconds."""
    if not steps_per_s or steps_per_s * SPAN_S <= PUBLISHED_STEPS:
        return 1
    return 1 << math.ceil(math.log2(steps_per_s * SPAN_S / PUBLISHED_STEPS))


def summarise(steps: list[tuple[int, dict[str, float]]]) -> tuple[dict[str, float], float | None]:
    """Mean ms per step of each column over `steps`, and steps per second; ({}, None) for none."""
    if not steps:
        return {}, None
    names = rank_order({p for _, t in steps for p in t})
    phases = {p: round(1000 * sum(t.get(p, 0.0) for _, t in steps) / len(steps), 2) for p in names}
    total = sum(phases.values())
    return phases, (round(1000 / total, 3) if total > 0 else None)


class Exchange:
    """This rank's side of the exchange (and on rank 0, the collector and judge)."""

    def __init__(
        self,
        anatomy: StepAnatomy,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        attempt: str,
        run_dir: str,
        phase: Callable[[], str],
        device: Any = None,
        warn: Callable[[str], None] = print,
        last_metrics: Callable[[], Any] = lambda: None,
        job_step: Callable[[], int | None] = lambda: None,
    ):
        self.anatomy = anatomy
        self.rank, self.world_size, self.local_rank, self.attempt = rank, world_size, local_rank, attempt
        self.run_dir = run_dir
        self.host = socket.gethostname()
        self.phase = phase
        self.device = device
        self.warn = warn
        self.last_metrics = last_metrics
        self.job_step = job_step  # the job's optimizer steps, restored on resume (None: none counted)
        self.watch = StragglerWatch()
        self._beat = 0
        self._peers: list[dict[str, Any] | None] = [None] * world_size
        self._seen: list[tuple[int, float]] = [(-1, time.monotonic())] * world_size  # (beat, when it changed)
        self._moved: list[tuple[int, float]] = [(-2, time.monotonic())] * world_size  # (step, when it changed)
        self._steps: list[dict[int, dict[str, float]]] = [{} for _ in range(world_size)]
        self._judge = Judge(world_size)
        self.events: list[tuple[int, dict[str, float]]] = []  # (step, figures) for the trackers, rank 0
        self._last_local = 0.0
        self.ended = False

    # ---- every rank ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        self._beat += 1
        steps = list(self.anatomy.steps)[-PUBLISHED_STEPS:]
        phases, rate = summarise(steps)
        self.anatomy.stride = stride(rate)
        return {
            "rank": self.rank,
            "host": self.host,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "beat": self._beat,
            "step": self.step(),
            "batch": self.anatomy.step,
            "phase": str(self.phase()),
            "phases": phases,
            "steps_per_s": rate,
            "memory": memory_bytes(self.device),
            "num_steps": self.anatomy.num_steps,
            "eval_batches": self.anatomy.eval_batches,
            "totals": {p: round(s, 4) for p, s in self.anatomy.totals.items()},
            "steps": [[s, {p: round(v, 6) for p, v in t.items()}] for s, t in list(self.anatomy.sampled)],
        }

    def step(self) -> int:
        """The job's step: its optimizer steps as the checkpoints and logged metrics count them (a
        resumed job goes on from its checkpoint's), else this process's prepared batches."""
        step = self.job_step()
        return self.anatomy.step if step is None else step

    def tick(self, store: Any) -> None:
        """The watchdog's heartbeat: publish this rank's summary; rank 0 also collects and judges."""
        self.publish(store)
        if self.rank == 0:
            self.collect(store)
            self._judge_and_write()

    def publish(self, store: Any, final: bool = False) -> None:
        store.set(store_keys.observe_key(self.attempt, self.rank), json.dumps({**self.summary(), "final": final}))

    def collect(self, store: Any) -> bool:
        """Read every rank's latest summary; True when each one is its rank's last (at exit)."""
        keys = [store_keys.observe_key(self.attempt, r) for r in range(self.world_size)]
        present = keys if store.check(keys) else [k for k in keys if store.check([k])]  # all, once started
        final = len(present) == len(keys)
        for raw in store.multi_get(present) if present else []:
            summary = json.loads(raw)
            final = final and summary.get("final", False)
            self._receive(summary)
        return final

    def tick_alone(self, step: int, force: bool = False) -> None:
        """A world of one: write the status from the main thread, at most once a second."""
        now = time.monotonic()
        if force or now - self._last_local >= 1.0:
            self._last_local = now
            self._receive(self.summary())
            self._judge_and_write()

    # ---- rank 0 ---------------------------------------------------------------------------------
    def _receive(self, summary: dict[str, Any]) -> None:
        r = summary["rank"]
        now = time.monotonic()
        if summary["beat"] != self._seen[r][0]:
            self._seen[r] = (summary["beat"], now)
        moved = summary.get("batch", summary["step"])  # batches: a long accumulation cycle still moves
        if moved != self._moved[r][0]:
            self._moved[r] = (moved, now)
        self._peers[r] = summary
        merged = self._steps[r]
        for step, times in summary.pop("steps"):
            merged[step] = times
        for old in sorted(merged)[: -2 * WINDOW]:
            del merged[old]

    def _judge_and_write(self) -> None:
        where = [(p["host"], p["local_rank"]) if p else ("?", -1) for p in self._peers]
        self._judge.add(self._steps)
        for line in self.watch.update(self._judge.assess(), where):
            self.warn(line)
            named = self.watch.current
            self.events.append(
                (
                    self.anatomy.step,
                    {
                        "straggler/rank": named.rank if named else -1,
                        "straggler/ms_per_step": named.ms_per_step if named else 0.0,
                    },
                )
            )
            records.append_line(
                self.run_dir, records.STRAGGLERS, {"time": time.time(), "step": self.anatomy.step, "message": line}
            )
        self.write_status()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        ranks = []
        for r, peer in enumerate(self._peers):
            if peer is None:
                ranks.append(
                    {"rank": r, "host": None, "local_rank": None, "step": None, "phases": {}, "state": "waiting"}
                )
                continue
            silent_s, still_s = now - self._seen[r][1], now - self._moved[r][1]
            state = {"failed": "failed", "exit": "left"}.get(peer["phase"], "running")
            if state == "running" and self.ended:
                state = "ended"  # the job ended: no rank of it is running any more
            elif state == "running" and silent_s > SILENT_AFTER_S:
                state = "silent"  # no summary: the process died or hangs whole
            elif state == "running" and still_s > SILENT_AFTER_S and self.anatomy.num_steps:
                state = "no progress"  # alive, its step unchanged (stalled, or waiting for a rank that is)
            ranks.append(
                {
                    **{k: v for k, v in peer.items() if k not in ("beat", "pid", "final", "batch")},
                    "state": state,
                    "silent_s": round(silent_s, 1),
                    "still_s": round(still_s, 1),
                }
            )
        straggler = self.watch.current
        metrics = self.last_metrics()
        return {
            "time": time.time(),
            "attempt": self.attempt,
            "world_size": self.world_size,
            "step": self.step(),
            "ended": self.ended,
            "ranks": ranks,
            "steps_count": self.anatomy.counts,
            "not_measured": NOT_MEASURED.get(self.anatomy.counts),
            "straggler": None if straggler is None else straggler.as_status(),
            "straggler_message": None if straggler is None else straggler.message,
            "metrics": None if metrics is None else {"step": metrics[0], **metrics[1]},
        }

    def write_status(self) -> None:
        records.write_json(self.run_dir, records.STATUS, self.status())

    def finish(self) -> None:
        """At exit on rank 0: the status says the job ended (top and the page stop waiting)."""
        self.ended = True
        if self.world_size == 1:
            self._receive(self.summary())
        try:
            self.write_status()
        except OSError as error:  # the run dir went away first (a test's temporary folder)
            print(f"phalanx: could not write the job's last status: {error}", file=sys.stderr)

    def phase_table(self) -> str:
        """The exit summary: ms per step of each column on each rank, over the whole run."""
        rows = [p for p in self._peers if p is not None and p.get("num_steps")]
        if not rows:
            return ""
        names = rank_order({n for p in rows for n in p["totals"]})
        head = ["rank", "host", "steps", *map(printable, names)]
        body = [
            [
                str(p["rank"]),
                printable(p["host"]),
                str(p["num_steps"]),
                *(f"{1000 * p['totals'].get(n, 0.0) / p['num_steps']:.1f}" for n in names),
            ]
            for p in rows
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *body]]
        evaluated = sorted({p.get("eval_batches", 0) for p in rows})
        if evaluated != [0]:
            lines.append(
                f"(not steps: {' to '.join(map(str, evaluated[:: max(len(evaluated) - 1, 1)]))} evaluation batches "
                "per rank, read with no backward or optimizer step)"
            )
        return "step anatomy (ms per step):\n" + "\n".join(lines)

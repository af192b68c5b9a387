"""`--profile START:STOP`: torch.profiler traces of chosen optimizer steps, one file per rank.

Step n is the work between optimizer step n-1 and optimizer step n (forward, backward, the step and
whatever the loop does between them), counted like `px.global_step`, so it survives resumes and
accumulation (micro-steps belong to the optimizer step they lead to). Each traced step is marked
`ProfilerStep#n` in the trace. The trace is written when step STOP-1 ends, or at exit if training
stops inside the range, as Chrome/Perfetto JSON: RUN_DIR/profile/rank{N}.pt.trace.json.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable

from phalanx.logging.rank_log import get_logger
from phalanx.config.profile_steps import StepRange, parse

PROFILE_DIR = "profile"


def trace_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, PROFILE_DIR, f"rank{rank}.pt.trace.json")


class StepProfiler:
    """Starts torch.profiler when `current_step()` enters the range, stops and writes when it leaves."""

    def __init__(self, steps: StepRange | str, rank: int, run_dir: str, current_step: Callable[[], int]):
        self.steps = parse(steps) if isinstance(steps, str) else steps
        self.rank = rank
        self.path = trace_path(run_dir, rank)
        self.current_step = current_step
        self.written = False
        self._profiler: Any = None
        self._attached = False
        atexit.register(self._at_exit)

    def attach(self, optimizer: Any) -> None:
        """Follow this optimizer's steps (the one `px.global_step` counts); the first one only."""
        if self._attached:
            return
        self._attached = True
        optimizer.register_step_post_hook(lambda *_: self.on_step())
        self.on_step()  # the range may start at step 0, or at the step a resume restored

    def on_step(self) -> None:
        step = self.current_step()
        if self._profiler is not None:
            if step in self.steps:
                self._profiler.step()
            else:
                self.finish()
        elif not self.written and step in self.steps:
            self._start(step)

    def _start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD)
        self._profiler.step_num = step  # so the trace's ProfilerStep#n are global step numbers
        self._profiler.start()

    def _at_exit(self) -> None:
        self.finish()
        if not self.written:
            get_logger().warning(
                "profiler: no trace written: the run ended at optimizer step %d, before the profiled range %s",
                self.current_step(),
                self.steps.text,
            )

    def finish(self) -> None:
        """Stop and write the trace (idempotent; also called at exit)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)
        self.written = True
        get_logger().info(
            "profiler: trace of optimizer steps %s written to %s (one rank%s.pt.trace.json per rank; "
            "open in https://ui.perfetto.dev or chrome://tracing)",
            self.steps.text,
            self.path,
            "{N}",
        )

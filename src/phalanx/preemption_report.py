"""What a preempted worker tells its launcher, and the one line the user reads (no torch here).

Each preempted rank records its outcome in TORCHELASTIC_ERROR_FILE (torch's JSON layout, under a
key of phalanx's own), which torch's agent reads back when the worker exits; `phalanx run` then
prints the line once and exits 128 + the signal number. Without a phalanx launcher, rank 0 prints
the line itself. One module for both sides, so writer and reader cannot drift apart.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any

KEY = "phalanx_preemption"  # under the error file's message.extraInfo
RERUN = "run the same command to resume"


@dataclass(frozen=True)
class PreemptionOutcome:
    """How a preemption ended on one rank."""

    signal: str  # "SIGTERM"
    step: int | None = None  # the optimizer step every rank stopped after
    checkpoint: str | None = None  # the checkpoint of that step (saved, or meant to be)
    saved: bool = False
    why_not: str | None = None  # why nothing was saved (no checkpoint_dir, the save failed...)
    reason: str | None = None  # what sent the signal, when phalanx knows (the SLURM time limit)
    finished: bool = False  # the script had returned on every rank: the signal found them exiting
    running: str | None = None  # no rank had created Phalanx(): what the signal found running, unsaved

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process a signal ended."""
        return 128 + int(signal.Signals[self.signal])

    def line(self, after: str | None = None) -> str:
        """`phalanx: preempted by SIGTERM at step 17: checkpoint ckpt/step-00000017 saved; run the same
        command to resume`; `after` replaces the advice (e.g. the job was requeued)."""
        by = self.signal + (f" ({self.reason})" if self.reason else "")
        if self.finished:  # a timeout after the last step: no preemption, nothing lost
            return (
                f"phalanx: stopped by {by} after the script had finished on every rank (the signal found its "
                "processes exiting, not training): nothing to save, nothing lost"
            )
        if self.running:  # a script without Phalanx(): no step of its own phalanx could save
            return (
                f"phalanx: stopped by {by} {self.running}; no rank had created Phalanx(), so none could save its "
                "step: work since the script's own last checkpoint (if it keeps any) may be lost"
            )
        at = f" at step {self.step}" if self.step is not None else ""
        if self.saved:
            return f"phalanx: preempted by {by}{at}: checkpoint {self.checkpoint} saved; {after or RERUN}"
        return f"phalanx: preempted by {by}{at}: nothing was saved: {self.why_not}"

    def error_file_data(self) -> dict[str, Any]:
        """torch's error-file layout (what its ErrorHandler writes), with the outcome beside the message."""
        line = self.line()
        return {
            "message": {
                "message": line,
                "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time())), KEY: asdict(self)},
            }
        }


def from_error_file_data(data: Any) -> PreemptionOutcome | None:
    """The outcome a worker recorded, or None when its error file says something else."""
    try:
        found = data["message"]["extraInfo"][KEY]
        return PreemptionOutcome(**found)
    except (KeyError, TypeError):
        return None


def write(path: str, outcome: PreemptionOutcome) -> None:
    """Record `outcome` where torch's agent reads a worker's error (TORCHELASTIC_ERROR_FILE)."""
    with open(path, "w") as fp:
        json.dump(outcome.error_file_data(), fp)

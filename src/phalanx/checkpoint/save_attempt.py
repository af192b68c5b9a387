"""A save that fails anywhere fails everywhere, cleanly: no half-written checkpoint, one message.

Every phase of a save (staging, each rank's own files, the DCP shards, hashing, publishing) runs
through `SaveAttempt.run`: the phase runs on this rank, then one small gather tells every rank
whether it failed anywhere. On a failure rank 0 removes the staging directory, `latest` stays on
the previous checkpoint (it only moves after a complete publish), and every rank raises the same
`CheckpointWriteError` naming the path, the first error and the latest good step. Without the
gather a rank whose disk write failed would leave its peers waiting in the next collective.

At a URL the store itself may be what failed (gone mid-job): the message is then built from what
this job knows (the last checkpoint it wrote or loaded), the store is not asked again, and the
client library's traceback is not chained: its cause and the fix are in the one message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from phalanx.checkpoint import atomic, disk_full
from phalanx.checkpoint.object_path import ObjectPath, rmtree
from phalanx.checkpoint.storage_probe import diagnose, unreachable
from phalanx.runtime import collectives

T = TypeVar("T")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (no space, I/O error, permission). Nothing was published."""


@dataclass
class SaveAttempt:
    """One save of checkpoint `final` (staged in `staging`) at `step`, on the ranks of `group`."""

    final: Path
    staging: Path
    step: int
    group: Any = None  # the async save's own group, or None for the default one
    needed_bytes: Callable[[], int] = lambda: 0  # what the checkpoint needs, asked only when the disk is full
    written: dict = field(default_factory=dict)  # file name -> FileEntry, hashed while uploaded (at a URL)
    last_good: tuple[int, Path] | None = None  # the newest checkpoint this job wrote or loaded

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on this rank, agreed on by all: its result here, or the same error on every rank."""
        return self._agreed(fn, share=False)

    def run_shared(self, fn: Callable[[], T]) -> list[T]:
        """Like `run`, and every rank gets every rank's (picklable) result."""
        return self._agreed(fn, share=True)

    def _agreed(self, fn: Callable[[], Any], share: bool) -> Any:
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; shared below
            error = exc
        mine = (
            None if error is None else self._describe(error),
            isinstance(error, FileExistsError),
            result if share and error is None else None,
        )
        everyone = collectives.gather_object(mine, group=self.group)
        failed = [(rank, text, exists) for rank, (text, exists, _) in enumerate(everyone) if text is not None]
        if not failed:
            return [part[2] for part in everyone] if share else result
        if all(exists for _, _, exists in failed):  # saving onto an existing checkpoint: a user error
            if error is not None:
                raise error
            raise FileExistsError(failed[0][1])
        self.fail(failed, cause=error)
        raise AssertionError("unreachable")

    def _describe(self, error: BaseException) -> str:
        """This rank's error as one line; at a URL, the store's diagnosis with its fix (storage_probe)."""
        if not isinstance(self.final, ObjectPath) or isinstance(error, FileExistsError):
            return f"{type(error).__name__}: {error}"
        cause, fix = diagnose(self.final.parent, error)
        return f"{cause}. HINT: {fix}"

    def _latest(self) -> str:
        """The latest good checkpoint: read from a local disk, but at a URL from what this job knows
        (the store may be the thing that is gone: asking it would only fail again, slowly)."""
        if not isinstance(self.final, ObjectPath):
            try:
                return atomic.describe_latest(self.final.parent)
            except Exception as error:  # noqa: BLE001 - never hide the write error behind this one
                return f"the latest good checkpoint in {self.final.parent} could not be read ({error})"
        if self.last_good is None:
            return f"this job has written or loaded no checkpoint in {self.final.parent} yet"
        step, path = self.last_good
        return f"the latest good checkpoint is step {step} ({path}), the last this job wrote or loaded"

    def fail(self, failed: list[tuple[int, str, bool]], cause: BaseException | None = None) -> None:
        """Remove the staging directory (rank 0) and raise the one message on this rank."""
        gone = cause is not None and isinstance(self.final, ObjectPath) and unreachable(cause) is not None
        gone = gone or any("the storage endpoint cannot be reached" in text for _, text, _ in failed)
        if gone:  # never loaded without its manifest, and the next save at this root removes it
            removed = (
                f"the partial save at {self.staging} (no manifest: never loaded) is left for the next save to remove"
            )
        elif isinstance(self.staging, ObjectPath):
            if collectives.rank() == 0:
                rmtree(self.staging, ignore_errors=True)
            removed = f"the staging directory {self.staging} was removed"
        else:  # rank 0 removes it (a symbolic link not followed) and its words, true, are every rank's
            done = atomic.remove_staging(self.staging) if collectives.rank() == 0 else None
            removed = collectives.broadcast_object(done, group=self.group)
        rank, text, _ = failed[0]
        others = [r for r, _, _ in failed[1:]]
        also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        full = disk_full.note(self.final.parent, [t for _, t, _ in failed], self.needed_bytes)
        hint = disk_full.HINT if full else ""
        if " HINT: " in text:  # the store's fix goes last, where every phalanx message has it
            text, hint = text.split(" HINT: ", 1)
        error = CheckpointWriteError(
            f"saving checkpoint step {self.step} to {self.final} failed on rank {rank}{also}: {text.rstrip('.')}; "
            + (f"{full}; " if full else "")
            + f"{removed} and {atomic.LATEST_NAME} was left as it was; {self._latest()}; training state is unchanged"
            + (f". HINT: {hint}, then save again" if hint else "")
        )
        if isinstance(self.final, ObjectPath) or full:  # torch's or the client's frames say nothing the line does not
            raise error from None
        raise error from cause

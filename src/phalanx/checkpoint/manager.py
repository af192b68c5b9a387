"""`Checkpointer`: what `px.save_state` / `px.load_state` do, and the objects they cover.

Saving: stage -> every rank writes its DCP shard and its RNG file -> every rank hashes its own
files -> rank 0 writes the manifest, renames the staging directory into place, moves `latest`,
prunes. Loading: newest checkpoint that verifies (each rank checks a share of the files) ->
model/optimizer through DCP (resharded to this world size) -> everything else.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import hashlib
import io
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from phalanx.checkpoint import atomic, background, dcp_storage, disk_full, writer_process
from phalanx.checkpoint.object_path import ObjectPath, location
from phalanx.logging.rank_log import get_logger
from phalanx.runtime import collectives
from phalanx.data.loader import PreparedLoader
from phalanx.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointDamaged,
    FileEntry,
    Manifest,
    hash_files,
    read_manifest,
    write_manifest,
)
from phalanx.checkpoint.save_attempt import SaveAttempt
from phalanx.checkpoint.safe_io import SafeLoadPlanner, check_plain, file_problems, load_plain
from phalanx.checkpoint.state import base_optimizer, group_by_model, rng_state, seed_all, set_rng_state

COMMON_NAME = "common.pt"


class CheckpointFallbackWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older intact one."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class Checkpointer:
    """Holds what a checkpoint covers and writes/reads checkpoints of it.

    `directory`: a managed root of `step-XXXXXXXX/` checkpoints; `keep`: how many to keep there
    (0 keeps all); `async_save`: return to training while DCP writes the shards in a thread.
    """

    def __init__(
        self,
        *,
        strategy_name: str,
        seed: int = 0,
        directory: str | os.PathLike | None = None,
        keep: int = 3,
        async_save: bool = False,
    ):
        if keep < 0:
            raise ValueError(f"checkpoint keep={keep}: must be >= 0 (0 keeps every checkpoint)")
        self.strategy_name = strategy_name
        self.seed = seed
        self.directory = location(directory) if directory is not None else None
        if self.directory is not None:  # refused now, not at the first save hours later
            atomic.check_writable(self.directory)
        self.keep = keep
        self.async_save = async_save
        self.models: list[nn.Module] = []
        self._tied: dict[int, dict[str, str]] = {}  # id(model) -> its tied names (checkpoint/tied_names.py)
        self.optimizers: list[Any] = []
        self.loaders: list[Any] = []
        self.objects: list[Any] = []
        self.rank_objects: list[Any] = []  # state that differs per rank (e.g. PowerSGD's error feedback)
        self.global_step = 0
        self.step_listeners: list[Any] = []  # called after each counted optimizer step (preemption)
        self._counted: torch.optim.Optimizer | None = None
        self._not_counting = False  # while DCP reads/writes state: its zero-lr init step is no step
        self._pending: concurrent.futures.Future | None = None
        self._pending_step = 0  # the step of the save in flight
        self._damaged: set[Path] = set()  # skipped on load: a later save of that step moves it aside
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_group: Any = None
        self.last_good: tuple[int, Path] | None = None  # (step, path) this job last published or loaded

    # ---- what is covered ----------------------------------------------------------------------
    def track(self, obj: Any, tied: Mapping[str, str] | None = None) -> Any:
        """Cover a prepared model, optimizer, loader, or any object with state_dict/load_state_dict.
        `tied`: a model's tied names as `tied_names.tied_names` read them before prepare (a pipeline
        stage may hold one of them only): saved once, under the canonical name."""
        if isinstance(obj, nn.Module):
            self.models.append(obj)
            self._tied[id(obj)] = dict(tied or {})
        elif isinstance(obj, torch.optim.Optimizer) or (
            isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer) and hasattr(obj, "zero_grad")
        ):
            self.optimizers.append(obj)
            if self._counted is None:  # global_step counts the first optimizer's real steps
                self._counted = base_optimizer(obj)
                self._counted.register_step_post_hook(self._count_step)
        elif isinstance(obj, PreparedLoader):
            self.loaders.append(obj)
            if obj.stateful:  # e.g. torchdata's StatefulDataLoader: its own state, per rank
                self.register(obj.stateful_state(), per_rank=True)
        else:
            self.register(obj)
        return obj

    def register(self, obj: Any, per_rank: bool = False) -> None:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"cannot checkpoint a {type(obj).__name__}: it needs state_dict() and load_state_dict(). "
                "HINT: wrap it in a small class that provides both"
            )
        (self.rank_objects if per_rank else self.objects).append(obj)

    @property
    def counts_steps(self) -> bool:
        """Whether global_step counts anything: an optimizer was prepared (tracked)."""
        return self._counted is not None

    def _count_step(self, *_: Any) -> None:
        if self._not_counting:
            return
        self.global_step += 1
        self._raise_failed_upload()
        for listener in self.step_listeners:
            listener()

    def _raise_failed_upload(self) -> None:
        """A finished async save that failed raises its error here, at the first step after it ended:
        the failure was agreed by every rank's save thread (save_attempt.py), so each raises it."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self._pending = None
            raise pending.exception()  # type: ignore[misc]

    @contextlib.contextmanager
    def _dcp_steps_uncounted(self) -> Iterator[None]:
        """torch's get/set_optimizer_state_dict create the state of an optimizer that has none yet
        (plain SGD) with a `step()` at lr 0: not a training step, so global_step must not move."""
        self._not_counting = True
        try:
            yield
        finally:
            self._not_counting = False

    # ---- saving -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None, async_save: bool | None = None) -> Path:
        """Write a checkpoint (to `path`, or the next step directory of the managed root); return it.

        A failure on any rank (no space, I/O error, permission) raises the same CheckpointWriteError
        on every rank, with nothing published (see save_attempt.py). An async save still in
        flight is waited for first (and the log says so): two saves never interleave.
        """
        self._wait_for_previous()
        final, managed = self._save_target(path)
        step = self.global_step
        attempt = SaveAttempt(
            final, atomic.staging_path(final), step, needed_bytes=self._needed_bytes, last_good=self.last_good
        )
        staging = attempt.staging
        attempt.run(lambda: _prepare(final, final in self._damaged) if collectives.rank() == 0 else None)
        entries = group_by_model(self.models, self.optimizers, self._tied)
        common = {
            "global_step": step,
            "models": list(entries),
            # each model's tied names, stored once under the canonical one: `phalanx export` writes them all
            "tied": {name: dict(entry.tied) for name, entry in entries.items() if entry.tied},
            "loaders": [loader.state_dict() for loader in self.loaders],
            "objects": [obj.state_dict() for obj in self.objects],
        }
        own = rng_state()
        if self.rank_objects:  # saved in this rank's own file, beside its RNG state
            own["objects"] = [obj.state_dict() for obj in self.rank_objects]
        check_plain(common, "checkpoint state")
        check_plain(own, "rng state")

        def write_own() -> None:
            if collectives.rank() == 0:
                _save_durably(common, staging / COMMON_NAME, attempt.written)
            _save_durably(own, staging / rank_file(collectives.rank()), attempt.written)

        attempt.run(write_own)
        use_async = self.async_save if async_save is None else async_save
        if not use_async:

            def write_shards() -> None:
                with _quiet_alone(), self._dcp_steps_uncounted():
                    dcp.save(
                        entries,
                        storage_writer=dcp_storage.writer(staging, attempt.written),
                        no_dist=not collectives.is_distributed(),
                    )

            attempt.run(write_shards)
            self._finalize(attempt, managed)
            return final
        if not collectives.is_distributed():  # DCP warns from its writer thread, outside any catch_warnings block
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", module="torch")
        group = self._group_for_async()

        def start_upload() -> Any:
            with _quiet_alone(), background.threads_started_here_lowered(), self._dcp_steps_uncounted():
                return dcp.async_save(
                    entries,
                    storage_writer=dcp_storage.writer(staging, attempt.written, for_async=True),
                    process_group=group,
                    no_dist=not collectives.is_distributed(),
                )

        upload = attempt.run(start_upload)  # agreed on the default group: DCP's thread now uses `group`
        attempt.group = group  # from here on, only the thread below talks on it

        def finish() -> None:
            background.lower_this_thread()
            attempt.run(upload.result)
            self._finalize(attempt, managed)

        self._pending = self._executor_once().submit(finish)
        self._pending_step = step
        return final

    def wait(self) -> None:
        """Block until an async save is published (raising its error, if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _wait_for_previous(self) -> None:
        if self._pending is None or self._pending.done():
            self.wait()
            return
        get_logger("checkpoint").info(
            "checkpoint of step %d: waiting for the async save of step %d, still being written",
            self.global_step,
            self._pending_step,
        )
        started = time.monotonic()
        self.wait()
        get_logger("checkpoint").info(
            "checkpoint of step %d: the previous save finished after %.2f s more",
            self.global_step,
            time.monotonic() - started,
        )

    def _finalize(self, attempt: SaveAttempt, managed: bool) -> None:
        rank, staging, final = collectives.rank(), attempt.staging, attempt.final

        def hash_mine() -> dict:
            mine = [rank_file(rank)] + sorted(
                n for n in _names(staging) if n.startswith(f"__{rank}_") and n.endswith(".distcp")
            )
            return hash_files(staging, mine, known=attempt.written)

        gathered = attempt.run_shared(hash_mine)

        def publish() -> None:
            if rank != 0:
                return
            files = {name: entry for part in gathered for name, entry in part.items()}
            rest = [n for n in _names(staging) if n not in files and n != MANIFEST_NAME]
            files.update(hash_files(staging, rest))
            manifest = Manifest(
                step=attempt.step,
                world_size=collectives.world_size(),
                strategy=self.strategy_name,
                files=files,
                created_unix=time.time(),
            )
            write_manifest(staging, manifest)
            atomic.publish(staging, final)
            if managed:
                atomic.write_latest(final.parent, final.name)

        attempt.run(publish)
        self.last_good = (attempt.step, final)
        if managed and rank == 0:
            try:
                atomic.prune(final.parent, self.keep, protect=final)
            except OSError as error:  # the new checkpoint is safe; an old one just could not go
                warnings.warn(f"phalanx: could not remove old checkpoints under {final.parent}: {error}", stacklevel=2)

    def _needed_bytes(self) -> int:
        """About what a checkpoint takes (disk_full.estimate): the whole model's and optimizers'
        tensors (a DTensor counts its global size), as DCP writes each once, DCP's cost per state
        entry (each optimizer state value and param-group setting, per parameter) and each rank's own
        file; or the size of the last checkpoint this job wrote or loaded, when that is more."""
        seen: set[int] = set()
        total = 0
        tensors = [p for model in self.models for p in model.parameters()]
        entries = len(tensors)
        for opt in map(base_optimizer, self.optimizers):
            for group in opt.param_groups:
                entries += len(group["params"]) * (len(group) - 1)
            for state in opt.state.values():
                entries += len(state)
                tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        previous = self.last_good[1] if self.last_good is not None else None
        return disk_full.estimate(total, entries, collectives.world_size(), previous)

    def _save_target(self, path: str | os.PathLike | None) -> tuple[Path, bool]:
        if path is None:
            if self.directory is None:
                raise ValueError(
                    "save_state() without a path needs a checkpoint directory. "
                    "HINT: Phalanx(checkpoint_dir='ckpt'), or pass a path: px.save_state('ckpt/step-10')"
                )
            return self.directory / atomic.step_dir_name(self.global_step), True
        return location(path), False

    def _group_for_async(self) -> Any:
        # DCP's background thread must not share the training loop's group: interleaved collectives
        # on one gloo group abort the process (TORCH-CPU-FACTS).
        if self._async_group is None and collectives.is_distributed():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _executor_once(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="phalanx-ckpt")
            atexit.register(self._at_exit)  # runs before the process group is destroyed (LIFO)
        return self._executor

    def _at_exit(self) -> None:
        """The last async save is published before the script's exit, and the helper that wrote its
        bytes ends after it (not before: the save may not have reached its write yet)."""
        try:
            self.wait()
        finally:
            writer_process.close_helper()

    # ---- loading ------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None = None) -> bool:
        """Restore the latest good checkpoint (or `path`); False, changing nothing, if there is none."""
        self.wait()
        chosen = self._choose(path)
        if chosen is None:
            return False
        # Everything that can be refused is read and checked before anything is changed.
        manifest = read_manifest(chosen)
        common = load_plain(chosen / COMMON_NAME)
        rank = collectives.rank()
        rng = load_plain(chosen / rank_file(rank)) if rank < manifest.world_size else None
        entries = group_by_model(self.models, self.optimizers, self._tied)
        for entry in entries.values():  # format 1 holds torch's nested optimizer state
            entry.flat = manifest.format_version >= 2
        _check_matches(common, entries, self.loaders, self.objects, chosen)
        if entries:
            try:
                with _quiet_alone(), self._dcp_steps_uncounted():
                    dcp.load(
                        entries,
                        storage_reader=dcp_storage.reader(chosen),
                        planner=SafeLoadPlanner(),
                        no_dist=not collectives.is_distributed(),
                    )
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise
                raise RuntimeError(f"loading model/optimizer from {chosen} failed: {error}") from error
        for obj, state in zip(self.objects, common["objects"]):
            obj.load_state_dict(state)
        for loader, state in zip(self.loaders, common["loaders"]):
            loader.load_state_dict(state)
        self.global_step = int(common["global_step"])
        self.last_good = (self.global_step, chosen)
        if rng is not None:
            for obj, state in zip(self.rank_objects, rng.get("objects", [])):
                obj.load_state_dict(state)
            set_rng_state(rng)
        else:  # a rank the saved run did not have: a fresh stream, reproducible from seed and step
            seed_all(self.seed + 1_000_003 * self.global_step + rank)
        collectives.barrier()
        return True

    def _choose(self, path: str | os.PathLike | None) -> Path | None:
        if path is None and self.directory is None:
            raise ValueError(
                "load_state() without a path needs a checkpoint directory. "
                "HINT: Phalanx(checkpoint_dir='ckpt'), or pass a path: px.load_state('ckpt/step-10')"
            )
        target = location(path) if path is not None else self.directory
        assert target is not None
        if path is not None and not target.exists():
            raise FileNotFoundError(f"load_state({str(path)!r}): no such checkpoint or checkpoint directory")
        if path is not None and not atomic.is_managed_root(target):  # one checkpoint by name: no fallback
            problems = self._verify(target)
            if problems:
                raise CheckpointDamaged(f"refusing to load damaged checkpoint {target}: " + "; ".join(problems))
            return target
        skipped = []
        for candidate in atomic.candidates(target):
            problems = self._verify(candidate)
            if not problems:
                if skipped:
                    warnings.warn(
                        f"phalanx: skipped damaged checkpoint(s): {' | '.join(skipped)}; loading {candidate} instead",
                        CheckpointFallbackWarning,
                        stacklevel=3,
                    )
                return candidate
            skipped.append("; ".join(problems))
            self._damaged.add(candidate)
        if skipped:
            raise CheckpointDamaged(
                f"every checkpoint under {target} is damaged: {' | '.join(skipped)}. HINT: delete them to start afresh"
            )
        return None

    def _verify(self, directory: Path) -> list[str]:
        """Each rank checks its share of the files; every rank gets every problem."""
        try:
            manifest = read_manifest(directory)
        except CheckpointDamaged as error:
            problems = [str(error)]
        else:
            names = sorted(manifest.files)[collectives.rank() :: collectives.world_size()]
            problems = file_problems(directory, manifest, names)
        return sorted({p for part in collectives.gather_object(problems) for p in part})


@contextlib.contextmanager
def _quiet_alone() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process": in a world of one it is."""
    with warnings.catch_warnings():
        if not collectives.is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _prepare(final: Path, damaged: bool) -> None:
    """Stage `final`. A damaged checkpoint of the same step, skipped when this run resumed from an
    older one, is renamed `<name>.damaged` first (kept for inspection, never overwritten)."""
    if damaged and final.exists():
        aside = atomic.unused_name(final.with_name(final.name + ".damaged"))
        if isinstance(final, ObjectPath):
            final.move(aside)
        else:
            os.rename(final, aside)
        warnings.warn(
            f"phalanx: moved the damaged checkpoint {final} to {aside}; saving step {final.name} afresh",
            CheckpointFallbackWarning,
            stacklevel=2,
        )
    atomic.prepare_staging(final)


def _save_durably(obj: Any, path: Path | ObjectPath, written: dict[str, FileEntry]) -> None:
    """Write `obj` with torch.save, synced; an uploaded object is durable once its upload returns,
    and its size and sha256 are recorded in `written` on the way (no download to hash it later)."""
    if isinstance(path, ObjectPath):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        path.write_bytes(data)
        written[path.name] = FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        return
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _names(directory: Path | ObjectPath) -> list[str]:
    return [child.name for child in directory.iterdir()] if isinstance(directory, ObjectPath) else os.listdir(directory)


def _check_matches(common: dict, entries: dict, loaders: list, objects: list, where: Path) -> None:
    """Refuse, before changing anything, a checkpoint whose contents do not fit what is tracked."""
    saved = list(common["models"])
    if saved != list(entries):
        raise RuntimeError(
            f"{where} holds {len(saved)} model(s) ({saved}) but {len(entries)} are prepared ({list(entries)}). "
            "HINT: call px.load_state() after px.prepare(model, optimizer, ...), with the same objects as when saving"
        )
    for kind, ours, theirs in (
        ("data loader", loaders, common["loaders"]),
        ("registered object", objects, common["objects"]),
    ):
        if len(ours) != len(theirs):
            raise RuntimeError(
                f"{where} holds {len(theirs)} {kind}(s) but {len(ours)} are prepared/registered. "
                "HINT: prepare and register the same objects, in the same order, before px.load_state()"
            )

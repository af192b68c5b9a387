"""`prepare(loader)`: the user's DataLoader rebuilt to shard over ranks and feed the device."""

from __future__ import annotations

import enum
import itertools
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.data.batch_records import BatchInfo, BatchRecords, real_rows
from phalanx.data.equalize import agree_num_batches, agree_step, gather_ints, lend_batch
from phalanx.data.rank_sampler import TakenOverSampler
from phalanx.data.sample_seeds import SampleSeeded
from phalanx.data.sampler import BatchShardSampler, ShardedSampler
from phalanx.data.shard_choice import build, carried, is_stateful, shard_loader
from phalanx.data.split_batches import per_rank_batch_size
from phalanx.data.user_sampler import UserSampler, check_same_draw
from phalanx.data.worker_start import start_workers
from phalanx.runtime.collectives import move_to_device
from phalanx.runtime.context import DistContext
from phalanx.runtime.step_tracker import Phase, StepTracker
from phalanx.runtime.seeding import seed_worker_generator


class Equalising(enum.Enum):
    """How a prepared loader gives every rank the same number of batches."""

    FIXED = "fixed"  # by construction: DistributedSampler padding or drop_last, or a world of one
    COUNT = "count"  # ranks agree on a count at the start of each pass (pre-split data, shard=False)
    STEP = "step"  # ranks agree at every step whether anyone still has data (streams)


class PreparedLoader:
    """Iterates a rank's shard of the user's DataLoader, with batches moved to the device.

    Every rank yields the same number of batches per pass, whatever the dataset size, batch size
    or drop_last, so no rank ever waits in a collective that a peer will not reach:
    - a map-style dataset sharded by phalanx is equal by construction (DistributedSampler-style
      padding, or dropping with drop_last);
    - pre-sharded data (`shard=False`) or per-rank datasets of different lengths: the ranks agree
      on a batch count at the start of each pass; short ranks repeat batches (marked as padding,
      so gather_for_metrics skips them) or, with drop_last, long ranks stop early;
    - an IterableDataset (length unknown): the ranks agree at every step whether anyone still has
      data, padding or stopping the same way.

    Each new pass advances the sampler's epoch, so shuffling differs per epoch without the
    user calling `set_epoch`. `len()` is the number of batches on this rank, equal on all ranks.

    Data is split over the data-parallel ranks (`ctx.dp_size`, `ctx.dp_rank`; the ranks of one
    tensor-parallel group read the same batches). With `split_batches`, the loader's `batch_size` is
    the global batch and each data-parallel rank gets `batch_size / dp_size` (data/split_batches.py).
    """

    def __init__(
        self,
        loader: DataLoader,
        ctx: DistContext,
        *,
        seed: int = 0,
        device_placement: bool = True,
        batch_records: BatchRecords | None = None,
        shard: bool = True,
        progress: StepTracker | None = None,
        rank_aware_workers: bool = True,
        on_batch: Callable[[Any], None] | None = None,
        split_batches: bool = False,
        training: Callable[[], bool] | None = None,
        empty_padding: Callable[[], bool] | None = None,
    ):
        self.original = loader
        # whether a batch is read for training (a prepared model in train mode): only then is a short
        # last batch cut to its real rows and weighed; an eval pass keeps every rank's shapes equal,
        # as torch's DistributedSampler does, for a script's own all_gather of its outputs
        self._training = training or (lambda: True)
        # whether a training batch all padding is cut to no rows (not under pp: no empty microbatches)
        self._empty_padding = empty_padding or (lambda: True)
        self.ctx = ctx
        self.device_placement = device_placement
        self.batch_info = BatchInfo()  # this loader's own: loaders used together stay independent
        self.batch_records = batch_records if batch_records is not None else BatchRecords()
        self.progress = progress
        self.on_batch = on_batch  # sees each batch before it moves to the device (throughput counts)
        self.epoch = 0  # the epoch the next pass will use
        self.seed = seed
        self.rank_aware_workers = rank_aware_workers  # workers' seeds from (seed, rank, worker, epoch)
        # Rebuilt even in a world of one: the sample order is then the same global order that N
        # ranks share out, so results do not depend on the world size.
        batch_size = loader.batch_size
        if split_batches:  # refused here, before any data is read, when the global batch does not divide
            batch_size = per_rank_batch_size(loader.batch_size, ctx.dp_size, shard=shard)
        self.loader = shard_loader(loader, ctx, seed, rank_aware_workers, batch_size) if shard else loader
        # A loader with its own state_dict (torchdata's StatefulDataLoader): its state is what a
        # checkpoint stores, per rank, and it resumes itself mid-epoch.
        self.stateful = is_stateful(self.loader)
        # The generator that yields the workers' base seed at each iter(): phalanx's own, re-seeded
        # per pass (a loader kept as is gets one only if it has none and uses workers).
        self._worker_generator = self.loader.generator if self.loader is not loader else None
        if self._worker_generator is None and loader.generator is None and loader.num_workers > 0:
            self._worker_generator = loader.generator = torch.Generator()
        # Positions count per-rank batches when phalanx did not deal the data out by index.
        self.per_rank_positions = not shard or isinstance(loader.dataset, IterableDataset)
        if shard and ctx.is_distributed and (draw := self._draw()) is not None:
            check_same_draw(draw, gather_ints)  # the ranks deal out one draw: it must be the same everywhere
        self.drop = _drops_last(self.loader)
        self.mode = _equalising_mode(self.loader, ctx, shard)
        self._num_batches = agree_num_batches(len(self.loader), self.drop) if self.mode is Equalising.COUNT else None
        # Checkpointing: (epoch, batches yielded) of the pass in progress; batches to skip on resume.
        self._position: tuple[int, int] | None = None
        self._resume: tuple[int, int] | None = None
        self._step_reals: tuple[int, ...] | None = None  # every rank's real items of the next step, if agreed

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    @property
    def dataset(self):
        dataset = self.loader.dataset
        return dataset.dataset if isinstance(dataset, SampleSeeded) else dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        if self.mode is Equalising.COUNT:
            return self._num_batches  # type: ignore[return-value]
        return len(self.loader)  # an IterableDataset without __len__ raises TypeError, as torch's does

    def set_epoch(self, epoch: int) -> None:
        """For scripts that call it themselves (as with DistributedSampler): same effect."""
        self.epoch = epoch

    # ---- checkpointing: the data position as a global count, valid on any world size ----------
    def state_dict(self) -> dict[str, Any]:
        """Epoch and how much of it all ranks together consumed (a yielded batch counts as consumed)."""
        if self.mid_epoch():
            epoch, done = self._position  # type: ignore[misc]
        else:  # between passes, or the last batch was yielded: the next pass starts at its beginning
            epoch, done = self.epoch, 0
        per_rank = self.per_rank_positions or self.stateful
        unit, consumed = _global_count(self.loader, per_rank, done, self.ctx.dp_size)
        _, per_step = _global_count(self.loader, per_rank, 1, self.ctx.dp_size)
        state = {
            "epoch": epoch,
            "unit": unit,
            "consumed": consumed,
            "world_size": self.ctx.dp_size,
            "global_batch": per_step,
        }
        draw = self._draw()
        if draw is not None and (generator := draw.state(mid_epoch=done > 0)) is not None:
            state["draw"] = generator  # the user's sampler generator: the epoch's draw is reproduced
        return state

    def _draw(self) -> Any:
        """The EpochDraw of a sampler phalanx kept (it holds the user's generator state), if any."""
        for s in (self.loader.sampler, self.loader.batch_sampler):
            if isinstance(s, (UserSampler, BatchShardSampler)):
                return s.draw
        return None

    def mid_epoch(self) -> bool:
        """Whether a pass is in progress with batches still to come (a checkpoint resumes inside it)."""
        if self._position is None:  # between passes, or the script left the last one (break)
            return False
        try:
            total = len(self)
        except TypeError:  # a stream without __len__: the pass ends when the stream does
            return True
        return self._position[1] < total

    def stateful_state(self) -> "StatefulLoaderState":
        """The user loader's own state, as a per-rank checkpoint entry (stateful loaders only)."""
        return StatefulLoaderState(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position: the next pass starts `epoch` with the very next batch."""
        skip = _batches_to_skip(self.loader, self.per_rank_positions or self.stateful, state, self.ctx.dp_size)
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, skip) if skip else None
        draw = self._draw()
        if draw is not None:
            draw.restore(state.get("draw"))

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.loader.sampler, TakenOverSampler):  # the script's set_epoch decides
            self.epoch = self.loader.sampler.epoch_for_pass(self.epoch)
        epoch = self.epoch
        self.epoch += 1
        skip = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None
        self._position = (epoch, skip)
        for s in (self.loader.sampler, self.loader.batch_sampler, self.loader.dataset):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        if self._worker_generator is not None:
            # Our own generator, re-seeded per epoch: a DataLoader without one draws its workers' base
            # seed from the global torch RNG at every iter(), coupling the data to the model's
            # randomness. Seeded per rank too, or every rank's workers would draw the same numbers.
            if self.rank_aware_workers:
                seed_worker_generator(self._worker_generator, self.seed, self.ctx.dp_rank, epoch)
            else:
                self._worker_generator.manual_seed(self.seed + epoch)
        if self.mode is Equalising.FIXED:
            batches = self._one_pass(skip)
        elif self.mode is Equalising.COUNT:
            self._num_batches = agree_num_batches(len(self.loader), self.drop)
            batches = self._counted(self._num_batches, skip)
        else:
            batches = self._agreed_per_step(skip)
        progress = self.progress
        index = skip
        total = self._pass_length()
        batches = iter(batches)
        try:
            while True:
                if progress is not None:
                    progress.before_batch()  # before the read: a preemption stops exactly between steps
                item = next(batches, None)
                if item is None:
                    if progress is not None:
                        progress.mid_pass = False  # ran out: a rank that leaves now has no data left
                    break
                if progress is not None:
                    progress.mid_pass = True
                batch, real = item
                training = self._training()
                self.batch_info.left = None if total is None else total - index
                self.batch_info.step_reals, self._step_reals = (self._step_reals if training else None), None
                if training and self.batch_info.left == 1 and self.mode is Equalising.FIXED and self.ctx.is_distributed:
                    # the pass's last step, the one a short remainder pads: weigh it by every rank's real items
                    self.batch_info.step_reals = tuple(gather_ints(_batch_len(batch) if real is None else real))
                # a batch all padding is cut to no rows where the step is weighed (it weighs 0 there)
                empty = self.batch_info.step_reals is not None and self._empty_padding()
                batch, size = (
                    real_rows(batch, _batch_len(batch), real, empty) if training else (batch, _batch_len(batch))
                )
                self.batch_info.size, self.batch_info.num_real = size, real
                self.batch_records.yielded(self.batch_info)
                index += 1
                self._position = (epoch, index)
                if progress is not None:
                    progress.next_step()
                if self.on_batch is not None:
                    self.on_batch(batch)
                yield move_to_device(batch, self.ctx.device) if self.device_placement else batch
                if progress is not None:
                    progress.enter(Phase.DATA)
        finally:
            # The pass is complete, or the script left it (`break`: the loop dropped its iterator): a
            # checkpoint now starts the next epoch, not the rest of the abandoned one.
            self.batch_info.clear()
            self.batch_records.ended(self.batch_info)
            if self._position is not None and self._position[0] == epoch:
                self._position = None

    def _pass_length(self) -> int | None:
        """Batches a pass yields, when known before it ends (not for streams)."""
        if isinstance(self.loader.dataset, IterableDataset):
            return None
        try:
            return len(self)
        except TypeError:
            return None

    def _one_pass(self, skip: int = 0) -> Iterator[tuple[Any, int | None]]:
        """One pass over the underlying loader, minus its first `skip` batches (a resume):
        (batch, how many of its samples are not padding)."""
        real_left = _real_samples(self.loader)
        if real_left is not None and skip:
            real_left -= skip * (self.loader.batch_size or 0)
        pad_flags = None
        source = _skipping(self.loader, skip) if not self.stateful else self.loader
        read = start_workers(source, f"rank {self.ctx.rank}")  # a worker stuck in its fork is replaced
        if self.stateful:  # restored by its own load_state_dict: it starts at batch `skip` by itself
            batches: Iterator[tuple[int, Any]] = enumerate(read, start=skip)
        else:
            batches = (
                enumerate(read, start=skip)
                if source is not self.loader
                else itertools.islice(enumerate(read), skip, None)
            )  # can only skip by reading
        for index, batch in batches:
            if pad_flags is None and isinstance(self.loader.batch_sampler, BatchShardSampler):
                pad_flags = self.loader.batch_sampler.padding_flags
            size = _batch_len(batch)
            if pad_flags is not None:
                real = 0 if pad_flags[index] else size
            elif real_left is not None and size is not None:
                real = max(0, min(size, real_left))
                real_left -= size
            else:
                real = size
            yield batch, real

    def _counted(self, target: int, skip: int = 0) -> Iterator[tuple[Any, int | None]]:
        """Exactly `target` batches: this rank's own, then repeats of them marked as padding."""
        count = skip
        for item in self._one_pass(min(skip, len(self.loader))):
            if count == target:
                return
            yield item
            count += 1
        while count < target:
            for batch, _ in self._one_pass():
                if count == target:
                    return
                yield batch, 0
                count += 1

    def _agreed_per_step(self, skip: int = 0) -> Iterator[tuple[Any, int | None]]:
        """Length unknown: before each step, all ranks agree whether to go on (and who pads)."""
        it = self._one_pass(skip)
        last = None
        while True:
            item = next(it, None)
            decision = agree_step(
                item is not None, last is not None, self.drop, real=(item[1] or 0) if item is not None else 0
            )
            self._step_reals = decision.reals
            if not decision.proceed:
                return
            if decision.donor is not None:  # some rank has nothing to repeat yet: borrow a batch
                lent = lend_batch(item[0] if item is not None else None, decision.donor)
                if last is None and item is None:
                    last = (lent, 0)
            if item is None:
                yield last[0], 0  # type: ignore[index]
            else:
                last = item
                yield item


_FINISHED = "_iterator_finished"  # torchdata's key: the loader's iterator has ended its pass


class StatefulLoaderState:
    """A stateful loader's own state_dict, saved in each rank's checkpoint file (positions, worker
    and dataset states are per rank)."""

    def __init__(self, prepared: PreparedLoader):
        self.prepared = prepared

    def state_dict(self) -> dict[str, Any]:
        state = self.prepared.loader.state_dict()
        if not self.prepared.mid_epoch() and _FINISHED in state:
            # Saved on the epoch's last batch, or after leaving the epoch: the loader's own state still
            # holds the pass as unfinished and would resume with its (empty) rest, skipping an epoch.
            state[_FINISHED] = True
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prepared.loader.load_state_dict(state)


def _global_count(loader: DataLoader, per_rank: bool, done: int, world_size: int) -> tuple[str, int]:
    """`done` batches per rank as a count over all ranks, in the unit the global order is dealt in."""
    if per_rank:  # an IterableDataset or pre-split data (shard=False): only a per-rank count exists
        return "batches_per_rank", done
    size = _samples_per_batch(loader)
    if size is None:  # a batch sampler's whole batches, dealt round-robin, of sizes phalanx cannot know
        return "batches", done * world_size
    return "samples", done * size * world_size  # DistributedSampler's global order, or torch's BatchSampler's


def _samples_per_batch(loader: DataLoader) -> int | None:
    """The samples in each of this rank's batches (but an epoch's last): the loader's batch size, or that of
    a batch sampler dealt whole (torch's BatchSampler; None for one of unknown sizes)."""
    if isinstance(loader.batch_sampler, BatchShardSampler):
        return loader.batch_sampler.batch_size
    return int(loader.batch_size)


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _or(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _batches_to_skip(loader: DataLoader, per_rank: bool, state: dict[str, Any], world_size: int) -> int:
    unit, consumed, saved_world = state["unit"], int(state["consumed"]), int(state["world_size"])
    expected_unit, _ = _global_count(loader, per_rank, 0, world_size)
    if unit != expected_unit:
        raise ValueError(
            f"the checkpoint counts data in {unit}, this loader in {expected_unit}: "
            "HINT: resume with the same DataLoader setup (sampler, batch_size) as the saved run"
        )
    _, global_batch = _global_count(loader, per_rank, 1, world_size)
    saved_global = state.get("global_batch")
    if unit == "samples" and saved_global is not None and int(saved_global) != global_batch:
        saved_batch = int(saved_global) // max(saved_world, 1)
        raise ValueError(
            f"the global batch changed: the checkpoint took {saved_global} {unit} per step ({_ranks(saved_world)} x "
            f"{saved_batch}), this run takes {global_batch} ({_ranks(world_size)} x {global_batch // world_size}). "
            "Resuming would change the optimisation. HINT: keep the global batch: "
            f"batch_size = {saved_global} / world_size = {int(saved_global) / world_size:g}, or set "
            f"split_batches with batch_size = {saved_global} (the global batch, the same on any world size)"
        )
    if unit == "batches_per_rank":
        if saved_world != world_size:
            raise ValueError(
                f"a per-rank data position (IterableDataset, shard=False or a stateful loader) saved on {saved_world} "
                f"ranks cannot map to {world_size}. HINT: resume on {saved_world} ranks or use a "
                "map-style Dataset sharded by phalanx"
            )
        return consumed
    size = _samples_per_batch(loader) if unit == "samples" else None
    per_step = world_size * (size or 1)
    if consumed % per_step and unit == "batches":  # a batch sampler's batches go whole, one per rank a step
        worlds = [n for n in range(1, consumed + 1) if consumed % n == 0]
        raise ValueError(
            f"the checkpoint's data position ({consumed} batches of the batch sampler into epoch {state['epoch']}) "
            f"is not a whole number of steps of {per_step} batches (a step deals one whole batch to each of the "
            f"{_ranks(world_size)}). HINT: resume on {_or(worlds)} ranks, or save where the position divides "
            f"(it was {_ranks(saved_world)})"
        )
    if consumed % per_step:
        raise ValueError(
            f"the checkpoint's data position ({consumed} {unit} into epoch {state['epoch']}) is not a whole "
            f"number of steps of {per_step} {unit} (world_size={world_size} x this loader's batch). HINT: keep "
            f"the global batch: batch_size = global batch / world_size (it was {saved_world} ranks)"
        )
    return consumed // per_step


def _skipping(loader: DataLoader, skip: int) -> DataLoader:
    """`loader`, or a twin whose batch sampler skips the first `skip` batches without loading them."""
    if not skip or loader.batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        return loader  # the IterableDataset case skips by iterating (islice in __iter__)
    return DataLoader(
        loader.dataset,
        batch_sampler=_SkipFirst(loader.batch_sampler, skip),
        generator=loader.generator,
        **carried(loader),
    )


def scale_batch(loader: DataLoader, factor: int) -> DataLoader:
    """`loader` whose every batch holds what `factor` consecutive batches held, in the same order
    (`phalanx parity`'s one-process run takes the global batch of `factor` ranks: ranks share out
    a sampler's indices, or a batch sampler's whole batches, in exactly these groups)."""
    if factor == 1:
        return loader
    kwargs = carried(loader)
    if is_stateful(loader):
        kwargs["loader_class"] = type(loader)
    if loader.batch_size is None:
        if loader.batch_sampler is None:
            raise ValueError("phalanx parity cannot scale a DataLoader built with batch_size=None and no batch_sampler")
        return build(
            loader.dataset, batch_sampler=_Merged(loader.batch_sampler, factor), generator=loader.generator, **kwargs
        )
    if not isinstance(loader.dataset, IterableDataset):
        kwargs["sampler"] = loader.sampler
    return build(
        loader.dataset,
        batch_size=loader.batch_size * factor,
        drop_last=loader.drop_last,
        generator=loader.generator,
        **kwargs,
    )


class _Merged:
    """A batch sampler whose batches are `factor` consecutive batches of another, concatenated."""

    def __init__(self, batch_sampler: Any, factor: int):
        self.batch_sampler, self.factor = batch_sampler, factor

    def __iter__(self) -> Iterator[list[int]]:
        merged: list[int] = []
        for i, batch in enumerate(self.batch_sampler, start=1):
            merged.extend(batch)
            if i % self.factor == 0:
                yield merged
                merged = []
        if merged:
            yield merged

    def __len__(self) -> int:
        return -(-len(self.batch_sampler) // self.factor)


class _SkipFirst:
    """A batch sampler minus its first `skip` batches (indices only: no data is loaded for them)."""

    def __init__(self, batch_sampler: Any, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


def _real_samples(loader: DataLoader) -> int | None:
    sampler = loader.sampler
    if isinstance(sampler, (ShardedSampler, UserSampler, TakenOverSampler)):
        return sampler.num_real_samples
    return None


def _batch_len(batch: Any) -> int | None:
    """Length along dim 0 of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    if not isinstance(batch, (dict, list, tuple)) and hasattr(batch, "keys"):  # BatchEncoding
        values = [batch[k] for k in batch.keys()]
    for v in values:
        n = _batch_len(v)
        if n is not None:
            return n
    return None


def _drops_last(loader: DataLoader) -> bool:
    """Whether the user chose to drop rather than pad (DataLoader or batch sampler drop_last)."""
    if loader.batch_sampler is not None and hasattr(loader.batch_sampler, "drop_last"):
        return bool(loader.batch_sampler.drop_last)
    return bool(loader.drop_last)


def _equalising_mode(loader: DataLoader, ctx: DistContext, shard: bool) -> Equalising:
    """How this loader's equal step counts are ensured (see Equalising)."""
    if not ctx.is_distributed:
        return Equalising.FIXED
    if isinstance(loader.dataset, IterableDataset):
        return Equalising.STEP
    try:
        len(loader)
    except TypeError:  # a custom sampler without __len__
        return Equalising.STEP
    if not shard:
        return Equalising.COUNT
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return Equalising.COUNT
    lengths = gather_ints(length)
    if len(set(lengths)) > 1:
        warnings.warn(
            f"phalanx: the dataset passed to prepare() has a different length on each rank "
            f"(by rank: {lengths}): it looks already split per rank, and sharding it again drops "
            f"data (each rank keeps only 1/{ctx.dp_size} of its own part). HINT: pass "
            "prepare(loader, shard=False) to use each rank's data as is; step counts are equalised "
            "either way.",
            stacklevel=4,
        )
        return Equalising.COUNT
    return Equalising.FIXED

"""Uneven inputs that no loader can equalise: rank-dependent user loops, per-rank streams.

Two mechanisms behind one context manager, chosen by what the prepared objects support:
- "join": torch's `Join` (ddp, and ZeroRedundancyOptimizer for zero1): a rank that runs out early
  shadows its peers' gradient all-reduces until every rank is done, then DDP syncs the final model.
  Every batch of every rank is trained on.
- "shadow": FSDP2 models (zero2, zero3, hsdp, data-parallel with tp), which are not Joinable: a
  rank out of data is handed batches of no rows until every rank is out (data/shadow_batches.py),
  so its forward, backward and step meet its peers' collectives with zero gradients. Every batch
  of every rank is trained on, as under Join.
- "agree": a step-level agreement for what neither covers (pipeline stages of one replica, no
  model named, or `method="agree"`): before each step all ranks say whether they have a batch, and
  all stop together as soon as one has none. The longer ranks' extra batches are skipped.

Pipeline stages with several data-parallel replicas (pp x dp) are refused unless `method="agree"`
asks for that skipping: a replica out of data would have to keep meeting its peers' gradient
reductions, and Join shadows DDP's all-reduces only, not a stage's sends and receives.

    with px.uneven_inputs(model) as uneven:
        for batch in uneven.iter(my_rank_dependent_batches):
            ...
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

from torch import nn
from torch.optim import Optimizer
from torch.distributed.algorithms import Join, Joinable

from phalanx.data.equalize import agree_step
from phalanx.data.join_collectives import JoinCollectives
from phalanx.data.join_state import LastJoinerState
from phalanx.data.shadow_batches import Shadowing
from phalanx.runtime.context import DistContext
from phalanx.runtime.step_tracker import Phase, StepTracker

METHODS = ("auto", "join", "agree")
_ACTIVE: list["UnevenInputs"] = []  # the Join contexts this process is inside, innermost last


def current_join() -> JoinCollectives | None:
    """The verbs' collectives of the innermost Join context this process is in (None outside
    one): `px.reduce` / `px.gather` there talk over the ranks still stepping."""
    return _ACTIVE[-1].collectives if _ACTIVE else None


class UnevenInputs:
    """The context manager returned by `px.uneven_inputs` / `px.join`; `.iter()` wraps user iterables."""

    def __init__(
        self, method: str, joinables: Sequence[Joinable] = (), progress: StepTracker | None = None, group: Any = None
    ):
        self.method = method  # "join", "shadow", "agree" or "none" (a world of one)
        self._join = Join(list(joinables)) if method == "join" else None
        self._progress = progress
        self._shadow = Shadowing() if method == "shadow" else None
        # px.reduce / px.gather inside: over the ranks still stepping (under Join their own group,
        # answered by ranks that finished; among batches of no rows the data-parallel `group`)
        self.collectives = (
            JoinCollectives(joinables[0].join_process_group)
            if self._join is not None
            else JoinCollectives(group, idle=lambda: self._shadow.idle)
            if self._shadow
            else None
        )

    def __enter__(self) -> "UnevenInputs":
        if self._join is not None:
            self._join.__enter__()
        if self.collectives is not None:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> bool | None:
        if self.collectives is not None:
            _ACTIVE.remove(self)
        if self._join is None:
            return None
        if self._progress is not None:
            # A rank that finished early waits here, shadowing its peers' collectives.
            self._progress.enter(Phase.JOIN)
        if exc_info[0] is not None:
            return self._join.__exit__(*exc_info)
        assert self.collectives is not None
        self.collectives.start_answering()  # the others' px.reduce calls, until every rank is here
        try:
            return self._join.__exit__(*exc_info)
        finally:
            self.collectives.wait_answered()

    def iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield `iterable`'s items; under "agree", stop on every rank once any rank runs out; under
        "shadow", batches of no rows for a rank out of data until every rank is."""
        if self._shadow is not None:
            yield from self._shadow.iter(iterable, self._progress)
            return
        if self.method != "agree":
            yield from iterable
            return
        it = iter(iterable)
        while True:
            if self._progress is not None:
                self._progress.enter(Phase.AGREE)
            item = next(it, _END)
            if not agree_step(item is not _END, can_pad=False, drop=True).proceed:
                return
            yield item


_END = object()


_PIPELINE_REPLICAS = (
    "phalanx: px.uneven_inputs under pipeline parallel with {dp} data-parallel replicas{layout}: a replica "
    "that runs out of data would have to go on meeting the others' gradient reductions through all its "
    "stages, which torch's Join cannot do (it shadows DDP's all-reduces, not a stage's sends and receives) "
    "and phalanx does not do under pp. Agreeing step by step would stop every replica at the shortest "
    "one's data and silently leave the longer ones' extra batches untrained, unlike one process. "
    "HINT: give every data-parallel rank as many batches (px.prepare(loader) splits a dataset evenly, "
    "drop_last=True drops the remainder, or cut a stream into equal shards) and drop px.uneven_inputs; "
    'or pass method="agree" to stop at the shortest replica\'s data on purpose'
)


def choose_method(
    objects: Sequence[Any], ctx: DistContext, method: str = "auto", pipeline: bool = False, layout: str | None = None
) -> str:
    """'join' when every model among `objects` is Joinable (ddp), 'shadow' when one is not (FSDP2),
    'agree' when asked or no model is named; 'none' alone.
    Under pipeline parallel 'agree' for one replica (its stages read the same data); with several
    data-parallel replicas refused unless asked: a replica out of data cannot shadow its peers'
    reductions through its stages' point-to-point exchanges, which Join knows nothing of."""
    if method not in METHODS:
        raise ValueError(f"uneven_inputs method must be one of {METHODS}, got {method!r}")
    if not ctx.is_distributed:
        return "none"
    if pipeline:
        if method == "auto" and ctx.dp_size > 1:
            raise ValueError(_PIPELINE_REPLICAS.format(dp=ctx.dp_size, layout=f" ({layout})" if layout else ""))
        if method == "join":
            raise ValueError(
                "phalanx: torch's Join cannot run pipeline stages (pp > 1): a rank that ran out of data "
                "shadows its replicas' gradient all-reduces, not its neighbour stages' sends and receives. "
                "HINT: use px.uneven_inputs(model), which agrees step by step, and iterate your data through "
                "`uneven.iter(...)`"
            )
        return "agree"
    models = [o for o in objects if isinstance(o, nn.Module)]
    not_joinable = [type(m).__name__ for m in models if not isinstance(m, Joinable)]
    if method == "join":
        if not models or not_joinable:
            where = f" (this layout: {layout})" if layout else ""
            raise ValueError(
                f"phalanx: torch's Join needs Joinable models, got {not_joinable or 'no model'}{where}. Join "
                "covers DistributedDataParallel and zero1's optimizer, i.e. ddp and zero1 without tensor "
                "parallel; FSDP2 models (zero2, zero3, hsdp, and every data-parallel layout with tp > 1) are "
                "not Joinable. HINT: use px.uneven_inputs(model), which falls back to a step-level agreement, "
                "and iterate your data through `uneven.iter(...)`."
            )
        return "join"
    if method == "agree":
        return "agree"
    return "join" if models and not not_joinable else "shadow" if not_joinable else "agree"


def uneven_inputs(
    objects: Sequence[Any],
    ctx: DistContext,
    method: str = "auto",
    progress: StepTracker | None = None,
    pipeline: bool = False,
    prepared: Sequence[Any] = (),
    layout: str | None = None,
    group: Any = None,
) -> UnevenInputs:
    """Build the context for `objects` (prepared models and optimizers); `pipeline`: the layout
    has pipeline stages (pp > 1). `prepared`: everything px.prepare returned; under Join its
    Joinable optimizers (zero1's, whose step all-gathers) join too, also when the script named
    only the model (`px.uneven_inputs(model)`), else a rank out of data misses their collectives.
    `group`: the data-parallel ranks, over which px.reduce talks among batches of no rows."""
    chosen = choose_method(objects, ctx, method, pipeline, layout)
    joinables: list[Any] = []
    if chosen == "join":
        params = {id(p) for m in objects if isinstance(m, nn.Module) for p in m.parameters()}
        optimizers = [
            o
            for o in prepared
            if isinstance(o, Optimizer) and any(id(p) in params for g in o.param_groups for p in g["params"])
        ]
        for o in map(_unwrap, [*objects, *optimizers]):
            if isinstance(o, Joinable) and not any(o is j for j in joinables):
                joinables.append(o)
        if joinables:  # every rank leaves with the last joiner's optimizer, schedule and gradients
            plain = [o for o in map(_unwrap, optimizers) if not isinstance(o, Joinable)]  # zero1's keeps in step
            bound = {id(s): _stepped_optimizer(getattr(s, "scheduler", s)) for s in prepared}
            _refuse_schedules_of_joinable_optimizers([bound[id(s)] for s in prepared], layout)
            schedulers = [s for s in prepared if bound[id(s)] in plain]
            models = [m for m in objects if isinstance(m, nn.Module)]
            joinables.append(
                LastJoinerState(models, plain, schedulers, joinables[0].join_process_group, joinables[0].join_device)
            )
    return UnevenInputs(chosen, joinables, progress, group)


def _refuse_schedules_of_joinable_optimizers(scheduled: Sequence[Any], layout: str | None) -> None:
    """zero1's optimizer joins: a rank out of data keeps stepping its chunk with its own learning
    rate, which its scheduler, stepped in the loop that rank left, no longer moves (measured: its
    weights parted from one process's by 0.01 after 2 scheduled steps alone)."""
    if any(isinstance(o, Joinable) for o in scheduled):
        raise ValueError(
            f"phalanx: px.uneven_inputs under {layout or 'this layout'}: a rank that runs out of data keeps stepping "
            "its share of zero1's optimizer with its own learning rate, which the LR scheduler it steps in "
            "the loop it left no longer moves, so the weights would part from one process's. HINT: run the "
            "uneven loop under strategy ddp (every rank then leaves Join with the last rank's optimizer and "
            "schedule), or give every rank as many batches (px.prepare(loader) splits a dataset evenly) and "
            "drop px.uneven_inputs"
        )


def _stepped_optimizer(scheduler: Any) -> Any:
    """The optimizer a (prepared) LR scheduler steps, unwrapped; None for anything else."""
    optimizer = getattr(scheduler, "optimizer", None)
    return _unwrap(optimizer) if isinstance(optimizer, Optimizer) else None


def _unwrap(obj: Any) -> Any:
    """The optimizer inside a wrapper (an accumulation wrapper around zero1's Joinable optimizer)."""
    inner = getattr(obj, "optimizer", None)
    return inner if isinstance(obj, Optimizer) and isinstance(inner, Optimizer) else obj

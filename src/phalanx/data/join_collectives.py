"""`px.reduce` and `px.gather` inside torch's Join (`px.uneven_inputs` under ddp and zero1), or
among FSDP2's batches of no rows (data/shadow_batches.py): over the ranks still stepping.

A rank that ran out of data waits in Join's loop, shadowing DDP's gradient all-reduces on the
join group; a `px.reduce` on its peers would meet a gradient bucket there, and gloo aborts ("size
doesn't match"). So inside Join these verbs talk over a group of their own. Each call all-gathers
a small header (active, dtype, shape), then every rank's data padded to the longest; a rank that
finished answers from a thread, contributing an empty header and zeros, until every rank has
finished (a header with no active rank). Ranks still stepping read the active ranks' rows only:
a mean is over the ranks that contributed, as one process averages the batches it has.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.runtime import collectives

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # active, dtype index, ndim, shape
_GROUPS: dict[tuple[int, ...], Any] = {}  # join group's ranks -> the verbs' own group (built once)


class JoinCollectives:
    """Reduce and gather over the ranks of `join_group` that have not finished."""

    def __init__(self, join_group: Any, idle: Callable[[], bool] | None = None):
        """`idle`: given when every rank stays in the loop (FSDP2's batches of no rows): the calls
        then go over `join_group` itself, and a rank contributes nothing while `idle()` holds."""
        self._idle = idle
        if idle is not None:
            self.group, self.world = join_group, dist.get_world_size(join_group)
            return
        ranks = tuple(dist.get_process_group_ranks(join_group))
        if ranks not in _GROUPS:  # every rank builds it together, at px.uneven_inputs
            _GROUPS[ranks] = dist.new_group(list(ranks), backend=dist.get_backend(join_group))
        self.group = _GROUPS[ranks]
        self.world = len(ranks)
        self._thread: threading.Thread | None = None

    # ---- the ranks still stepping ------------------------------------------------------------
    def reduce(self, data: Any, reduction: str, device: torch.device | str) -> Any:
        if reduction not in collectives.REDUCTIONS:
            raise ValueError(f"reduction must be one of {collectives.REDUCTIONS}, got {reduction!r}")
        data, back = collectives.as_tensors(data, device, "reduce")

        def one(t: torch.Tensor) -> torch.Tensor:
            if reduction == "mean" and not t.is_floating_point():
                raise ValueError(f"reduce(..., 'mean') needs a floating-point tensor, got {t.dtype}")
            rows = torch.stack(self._exchange(t.detach()))
            if reduction == "max":
                return rows.amax(0)
            if reduction == "min":
                return rows.amin(0)
            total = rows.sum(0)
            return total / rows.shape[0] if reduction == "mean" else total

        return back(collectives.map_tensors(one, data))

    def gather(self, data: Any, device: torch.device | str) -> Any:
        data, back = collectives.as_tensors(data, device, "gather")
        return back(
            collectives.map_tensors(
                lambda t: torch.cat([p.reshape(1) if p.dim() == 0 else p for p in self._exchange(t.detach())]), data
            )
        )

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every active rank's `t`, in rank order."""
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(
                f"px.reduce/px.gather inside px.uneven_inputs take tensors of at most {_MAX_DIMS} "
                f"dims and dtype in {[str(d) for d in _DTYPES]}; got {tuple(t.shape)} {t.dtype}. "
                "HINT: reshape or cast it first"
            )
        if self._idle is not None and self._idle():
            return _answer(self.group, self.world, None, None, t.device)  # the peers' device (NCCL: theirs)
        header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
        header[:3] = torch.tensor([1, _DTYPES.index(t.dtype), t.dim()])
        header[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return _answer(self.group, self.world, header, t.contiguous().reshape(-1))

    # ---- a rank that finished ----------------------------------------------------------------
    def start_answering(self) -> None:
        """Answer the others' calls from a thread until every rank has finished."""
        self._thread = threading.Thread(
            target=self._answer_until_all_finished, name="phalanx-join-collectives", daemon=True
        )
        self._thread.start()

    def wait_answered(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _answer_until_all_finished(self) -> None:
        while _answer(self.group, self.world, None, None):
            pass


def _answer(
    group: Any, world: int, header: torch.Tensor | None, flat: torch.Tensor | None, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """One call: the header all-gathered, then the data; a finished rank passes None for both and
    gets [] once no rank is active."""
    mine = header if header is not None else torch.zeros(_HEADER, dtype=torch.int64, device=device)
    headers = torch.empty(world * _HEADER, dtype=torch.int64, device=mine.device)
    collectives.all_gather_single(headers, mine, group=group)
    rows = headers.reshape(world, _HEADER).tolist()
    active = [r for r in rows if r[0]]
    if not active:
        return []
    dtype = _DTYPES[active[0][1]]
    shapes = [tuple(r[3 : 3 + r[2]]) if r[0] else None for r in rows]
    longest = max(math.prod(s) for s in shapes if s is not None)
    padded = torch.zeros(longest, dtype=dtype, device=mine.device)
    if flat is not None:
        padded[: flat.numel()] = flat
    parts = torch.empty(world * longest, dtype=dtype, device=mine.device).reshape(world, longest)
    collectives.all_gather_single(parts.reshape(-1), padded, group=group)
    return [parts[i, : math.prod(s)].reshape(s) for i, s in enumerate(shapes) if s is not None]

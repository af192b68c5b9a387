"""Whole-tensor optimizers (Muon, Adafactor, trust ratios) in layouts that split tensors.

Each parameter is owned by one rank of the ranks that hold it (greedy by size, largest first to the
least-loaded rank, so no rank does most of the work). Every step:
1. each parameter's full gradient: already whole under zero1 (DDP all-reduced it); under FSDP2 and
   tensor parallel its DTensor shards are gathered (`full_tensor`);
2. the owner steps the user's optimizer class on the whole tensor, which only it holds state for;
   so Muon runs exactly one Newton-Schulz per matrix per step in the whole job;
3. one broadcast per owner (and dtype) of its updated parameters, flattened; every rank copies its part
   (its shard, its tensor-parallel block, or all of it) into the model's parameter.

Under zero1 (plain parameters) the owner steps the model's parameter itself. Under FSDP2 and tensor
parallel the owner keeps a whole copy, gathered at the first step, after a checkpoint is loaded, and
whenever a parameter changed outside the step (weights loaded, edited by hand): every rank compares
a fingerprint of its part with the one the last step left, and the ranks agree with one all-reduce.
(Version counters cannot tell: DCP and FSDP2 write loaded weights through `.data`, which has its own.)

Checkpoints: `state_dict()` gives every state tensor whole (broadcast from its owner) on every rank,
the layout a one-process or ddp optimizer saves, so a checkpoint resumes under any layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from phalanx.strategies.optimizers.shared_groups import keeping_groups, shared_groups


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective over its mesh), or `t`."""
    return t.full_tensor() if _is_dtensor(t) else t


def _local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `param` (a DTensor) cut from its whole value, without communication."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, param.placements).to_local()


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two sums of a tensor's values, one weighted by position: equal for the same values in the
    same places (the same kernels on the same data), different after any write that changed them."""
    x = t.detach().reshape(-1).float()
    ramp = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float32) / max(x.numel(), 1)
    return torch.stack([x.sum(), (x * ramp).sum()])


def balanced_owners(sizes: list[int], num_ranks: int) -> list[int]:
    """An owner rank for each size: largest first, each to the rank with the least so far (ties: the
    lower rank, then the earlier parameter), the same answer on every rank."""
    load = [0] * num_ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


class _Slot:
    """One parameter, its owner, and (on the owner) the whole tensor the user's optimizer steps."""

    def __init__(self, param: nn.Parameter, owner: int):
        self.param = param
        self.owner = owner
        self.sharded = _is_dtensor(param)
        self.whole: nn.Parameter | None = None  # owner only
        self.written: torch.Tensor | None = None  # fingerprint of this rank's part after the last write

    def local(self) -> torch.Tensor:
        return self.param._local_tensor if self.sharded else self.param


class WholeTensorOptimizer(torch.optim.Optimizer, Joinable):
    """`optimizer_class` stepped on whole parameters, each by its owner rank of `process_group`.

    `param_groups` hold the model's parameters and the hyperparameters (what LR schedulers and DCP
    read); `optim` (None on a rank that owns nothing) is the user's class over the owned ones.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        **defaults: Any,
    ):
        super().__init__(param_groups, defaults)
        Joinable.__init__(self)
        self.optimizer_class = optimizer_class
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.num_ranks = dist.get_world_size(process_group)
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears in more than one param group; each has one owner")
        owners = balanced_owners([p.numel() for p in params], self.num_ranks)
        self._slots = [_Slot(p, owner) for p, owner in zip(params, owners)]
        self._by_param = {id(s.param): s for s in self._slots}
        self._defaults = defaults
        self.optim: torch.optim.Optimizer | None = None
        self._inner_groups: list[int] = []  # outer group index of each inner group
        self._stepped = False

    # ---- which rank does what -------------------------------------------------------------
    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.process_group, rank) if self.process_group is not None else rank

    def owned(self) -> list[_Slot]:
        return [s for s in self._slots if s.owner == self.rank]

    def _build_inner(self) -> None:
        """The user's optimizer over the whole tensors this rank owns (after they exist)."""
        groups = []
        for index, group in enumerate(self.param_groups):
            mine = [self._by_param[id(p)] for p in group["params"] if self._by_param[id(p)].owner == self.rank]
            if mine:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [s.whole for s in mine]})
                self._inner_groups.append(index)
        if groups:
            self.optim = self.optimizer_class(groups, **self._defaults)

    def _sync_hyperparameters(self) -> None:
        if self.optim is None:
            return
        for inner, index in zip(self.optim.param_groups, self._inner_groups):
            inner.update({k: v for k, v in self.param_groups[index].items() if k != "params"})

    # ---- whole parameters on their owners -------------------------------------------------
    def _refresh_wholes(self, force: bool = False) -> None:
        """Gather the whole value of every sharded parameter onto its owner: at the first step, when
        `force`d, and when any rank's part changed since the last step wrote it (ranks agree)."""
        sharded = [s for s in self._slots if s.sharded]
        if self._stepped and not force:
            if not sharded:
                return  # zero1: the owners step the model's parameters themselves
            changed = any(not torch.equal(s.written, _fingerprint(s.local())) for s in sharded)
            flag = torch.tensor([int(changed)], device=self._device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            if not flag.item():
                return
        with torch.no_grad():
            for slot in self._slots:
                if not slot.sharded:
                    if slot.owner == self.rank:
                        slot.whole = slot.param  # zero1: the model's own parameter, whole on every rank
                    continue
                full = _full(slot.param.detach())  # every holder takes part in the gather
                if slot.owner != self.rank:
                    continue
                if slot.whole is None:
                    slot.whole = nn.Parameter(full.clone(), requires_grad=slot.param.requires_grad)
                else:
                    slot.whole.copy_(full)
        for slot in sharded:
            slot.written = _fingerprint(slot.local())
        if self.optim is None and self.owned():
            self._build_inner()

    def _device(self) -> torch.device:
        return self._slots[0].local().device if self._slots else torch.device("cpu")

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        Join.notify_join_context(self)
        self._refresh_wholes()
        self._stepped = True
        self._sync_hyperparameters()
        for slot in self._slots:  # the same order on every rank: each gather is a collective
            grad = slot.param.grad
            if grad is None:
                continue
            full = _full(grad)
            if slot.owner == self.rank:
                slot.whole.grad = full if slot.sharded else grad
        if self.optim is not None:
            self.optim.step()
            for slot in self.owned():
                if slot.sharded:
                    slot.whole.grad = None
        self._scatter()
        for slot in self._slots:
            if slot.param not in self.state:
                self.state[slot.param] = {}  # non-empty on every rank alike once stepped (DCP asks)
        return loss

    @torch.no_grad()
    def _scatter(self) -> None:
        """One broadcast per owner of its parameters' new values; every rank copies its part in."""
        device = self._device()
        batches: dict[tuple[int, torch.dtype], list[_Slot]] = {}  # one broadcast per owner and dtype
        for slot in self._slots:
            batches.setdefault((slot.owner, slot.param.dtype), []).append(slot)
        for (owner, dtype), slots in batches.items():
            numel = sum(s.param.numel() for s in slots)
            if owner == self.rank:
                flat = torch.cat([s.whole.detach().reshape(-1) for s in slots])
            else:
                flat = torch.empty(numel, dtype=dtype, device=device)
            dist.broadcast(flat, src=self._global(owner), group=self.process_group)
            offset = 0
            for slot in slots:
                full = flat[offset : offset + slot.param.numel()].view(slot.param.shape)
                offset += slot.param.numel()
                if slot.sharded:
                    slot.local().copy_(_local_part(slot.param, full))
                    slot.written = _fingerprint(slot.local())
                elif owner != self.rank:
                    slot.param.copy_(full)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_slots"):
            raise NotImplementedError(
                "phalanx assigns each parameter an owner once, at px.prepare; "
                "HINT: build the optimizer with every param group before prepare"
            )
        super().add_param_group(param_group)

    # ---- Join (zero1): a rank out of data still takes part in the owners' broadcasts -------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _BroadcastJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device()

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    # ---- checkpoints: every state tensor whole, on every rank ------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.state.clear()
        for owner in range(self.num_ranks):
            slots = [s for s in self._slots if s.owner == owner]
            box: list[Any] = [None]
            if owner == self.rank:
                box[0] = [self._owned_state(s) for s in slots]
            dist.broadcast_object_list(
                box,
                src=self._global(owner),
                group=self.process_group,
                device=self._device() if self._device().type != "cpu" else None,
            )
            for slot, state in zip(slots, box[0]):
                self.state[slot.param] = {
                    k: v.to(self._device()) if isinstance(v, torch.Tensor) else v for k, v in state.items()
                }
        return super().state_dict()

    def _owned_state(self, slot: _Slot) -> dict[str, Any]:
        if self.optim is None or slot.whole is None:
            return {}
        return {
            k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
            for k, v in self.optim.state.get(slot.whole, {}).items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with keeping_groups(self):
            super().load_state_dict(state_dict)
        self._refresh_wholes(force=True)  # the weights were loaded just before (and wholes exist for the state)
        for slot in self._slots:  # the same order on every rank: DTensor state is gathered
            loaded = self.state.get(slot.param) or {}
            whole = {k: _full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}
            if slot.owner == self.rank and self.optim is not None:
                self.optim.state[slot.whole] = whole
        for slot in self._slots:
            self.state[slot.param] = {}
        self._sync_hyperparameters()


class _BroadcastJoinHook(JoinHook):
    """A joined rank's part in a step: the broadcasts (its own parameters go out as they are, as
    zero1's sharded-state optimizer sends its unstepped chunks)."""

    def __init__(self, optimizer: WholeTensorOptimizer):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer._scatter()


def build(
    optimizer: torch.optim.Optimizer,
    holders: Any,
    plan: Any,
    constructor_defaults: Callable[[torch.optim.Optimizer], dict[str, Any]],
) -> WholeTensorOptimizer:
    """A WholeTensorOptimizer with `optimizer`'s class, groups and hyperparameters, over `holders`:
    the process group of the ranks that hold the same parameters (the layout's "stage_holders")."""
    groups = shared_groups(optimizer)  # a scheduler built on `optimizer` sets the lr it steps with
    defaults = constructor_defaults(optimizer)
    try:  # each owner rebuilds the class over its whole tensors: find out now, not at the first step
        type(optimizer)([nn.Parameter(torch.zeros(2, 2))], **defaults)
    except TypeError as error:
        name = type(optimizer).__name__
        raise ValueError(
            f"{plan.describe()} steps {name} on whole tensors, one owner rank per parameter, and rebuilds it on "
            f"each owner as {name}(param_groups, **defaults); that failed: {error}. HINT: keep {name}'s "
            "constructor arguments in its defaults (super().__init__(params, defaults)), or, if its step is "
            f"element-wise, declare it: phalanx.declare_optimizer({name}, elementwise=True)"
        ) from error
    return WholeTensorOptimizer(groups, type(optimizer), process_group=holders, **defaults)

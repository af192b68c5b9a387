"""DistributedDataParallel's options and gradient-compression hooks, for ddp and zero1.

The hooks are torch's own (torch.distributed.algorithms.ddp_comm_hooks). Their state is training
state: PowerSGD keeps per-rank error feedback and its low-rank memories, so `HookState` saves and
restores them with each rank's checkpoint file, and a resumed run compresses exactly as the
uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from phalanx import config, host_only


COMM_HOOKS: tuple[str, ...] = config.BY_NAME["comm_hook"].kind.choices()


def _default(name: str) -> Any:
    return config.BY_NAME[name].default  # one definition of each default: the settings schema


@dataclass
class DDPOptions:
    """DDP settings; each default is its `PhalanxConfig` row's."""

    find_unused_parameters: bool = _default("find_unused_parameters")
    static_graph: bool = _default("static_graph")
    bucket_cap_mb: float | None = _default("bucket_cap_mb")  # None: torch's default (25 MB)
    gradient_as_bucket_view: bool = _default("gradient_as_bucket_view")  # gradients live in the buckets
    comm_hook: str = _default("comm_hook")
    powersgd_rank: int = _default("powersgd_rank")
    powersgd_start_iter: int = _default("powersgd_start_iter")
    given: tuple[str, ...] = ()  # the settings given explicitly (argument or environment)

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.comm_hook!r} is not one of {', '.join(COMM_HOOKS)}")
        if self.comm_hook == "powersgd" and self.powersgd_start_iter < 2:
            # torch: error feedback conflicts with DDP's bucket rebuild at iteration 1.
            raise ValueError(
                f"powersgd_start_iter={self.powersgd_start_iter}: PowerSGD with error feedback "
                "needs at least 2 plain all-reduce steps first. HINT: powersgd_start_iter=2"
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs

    def asked(self) -> dict[str, Any]:
        """The explicitly given settings and their values."""
        return {name: getattr(self, name) for name in self.given}


def _bf16_compress_hook(state, bucket):  # type: ignore[no-untyped-def]
    """torch's `bf16_compress_hook`, called as is, under another name: DDP refuses that hook by its
    name unless CUDA+NCCL >= 2.10 (or XCCL) is present, though gloo all-reduces bf16 correctly.
    (No annotations: DDP checks them, and this module's are strings.)"""
    return default_hooks.bf16_compress_hook(state, bucket)


def _bf16_hook_for(group: Any) -> Callable[..., Any]:
    """torch's hook itself on NCCL (its own check applies), the same code under our name elsewhere."""
    backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
    return default_hooks.bf16_compress_hook if backend == "nccl" else _bf16_compress_hook


class HookState:
    """The registered hook's state as a per-rank checkpoint entry (state_dict/load_state_dict).

    PowerSGD keys its memories by bucket, and a bucket's layout changes: DDP rebuilds its buckets
    after a model's first iteration (first in registration order, then in gradient-ready order), so
    a resumed run's first two steps see two layouts where the saved run saw one. The checkpoint
    therefore holds each parameter's own slice of the error feedback and of the P/Q memories, and
    the hook re-cuts them for whatever layout a bucket has when it runs (also when DDP rebuilds).
    """

    def __init__(
        self,
        powersgd: powerSGD_hook.PowerSGDState | None = None,
        params: dict[int, tuple[str, torch.Size]] | None = None,
        one_bucket_at_a_time: bool = False,
    ):
        self.powersgd = powersgd
        # gloo: torch's hook blocks in future callbacks (`.wait()` on its P and Q all-reduces), and
        # those callbacks run on gloo's 2 worker threads; two buckets in flight block both threads
        # and their all-reduces never run. One bucket's chain at a time leaves a thread free.
        self.one_bucket_at_a_time = one_bucket_at_a_time
        self._in_flight: torch.futures.Future | None = None
        self.params = params or {}  # id(parameter) -> (name, shape)
        self.layout: dict[int, list[str]] = {}  # bucket index -> its parameters' names, in order
        self.restored: dict[str, dict[str, torch.Tensor]] = {}  # name -> slices not yet placed

    # ---- the hook -----------------------------------------------------------------------------
    def powersgd_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """torch's powerSGD_hook, after noting the bucket's layout and placing restored memories."""
        names = [self.params[id(p)][0] for p in bucket.parameters()]
        if self.layout.get(bucket.index(), names) != names:  # DDP rebuilt its buckets
            self.restored.update(self._per_parameter())
            self.powersgd.error_dict, self.powersgd.p_memory_dict, self.powersgd.q_memory_dict = {}, {}, {}
            self.layout = {}
        self.layout[bucket.index()] = names
        if self.restored and all(n in self.restored for n in names):
            self._place(bucket.index(), names, bucket.buffer())
        if not self.one_bucket_at_a_time:
            return powerSGD_hook.powerSGD_hook(state, bucket)
        if self._in_flight is not None:
            self._in_flight.wait()
        self._in_flight = powerSGD_hook.powerSGD_hook(state, bucket)
        return self._in_flight

    def _shapes(self) -> dict[str, torch.Size]:
        return dict(self.params.values())

    def _pq_sizes(self, shape: torch.Size) -> tuple[int, int]:
        """Lengths of a gradient's slices of P and Q (0, 0 when PowerSGD leaves it uncompressed)."""
        n = shape[0] if len(shape) else 1
        m = max(1, int(torch.Size(shape).numel()) // max(n, 1))
        r = min(n, m, self.powersgd.matrix_approximation_rank)
        compressed = (n + m) * r * self.powersgd.min_compression_rate < n * m
        return (n * r, m * r) if compressed else (0, 0)

    def _place(self, index: int, names: list[str], buffer: torch.Tensor) -> None:
        s, pieces = self.powersgd, [self.restored.pop(n) for n in names]
        to = {"device": buffer.device, "dtype": buffer.dtype}
        s.error_dict[index] = torch.cat([p["error"] for p in pieces]).to(**to)
        if any(p["p"].numel() for p in pieces):
            s.p_memory_dict[index] = torch.cat([p["p"] for p in pieces]).to(**to)
            s.q_memory_dict[index] = torch.cat([p["q"] for p in pieces]).to(**to)

    # ---- checkpointing ------------------------------------------------------------------------
    def _per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each parameter's slices of the error feedback and P/Q memories, cut from the buckets."""
        s, shapes, per_param = self.powersgd, self._shapes(), {}
        for index, names in self.layout.items():
            if index not in s.error_dict:
                continue
            sizes = [(shapes[n].numel(), *self._pq_sizes(shapes[n])) for n in names]
            errors = torch.split(s.error_dict[index], [e for e, _, _ in sizes])
            ps = torch.split(s.p_memory_dict.get(index, torch.empty(0)), [p for _, p, _ in sizes])
            qs = torch.split(s.q_memory_dict.get(index, torch.empty(0)), [q for _, _, q in sizes])
            for name, e, p, q in zip(names, errors, ps, qs):
                per_param[name] = {"error": e.detach().clone(), "p": p.detach().clone(), "q": q.detach().clone()}
        return per_param

    def state_dict(self) -> dict[str, Any]:
        s = self.powersgd
        if s is None:
            return {}
        per_param = {
            name: {k: t.cpu() for k, t in pieces.items()}
            for name, pieces in {**self.restored, **self._per_parameter()}.items()
        }
        kind, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "iter": int(s.iter),
            "params": per_param,
            "rng": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
            "total_numel_before_compression": int(s.total_numel_before_compression),
            "total_numel_after_compression": int(s.total_numel_after_compression),
            "next_stats_report": int(s.next_stats_report),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.powersgd
        if s is None or not state:
            return
        s.iter = int(state["iter"])
        s.error_dict, s.p_memory_dict, s.q_memory_dict = {}, {}, {}
        self.restored = dict(state["params"])
        kind, keys, pos, has_gauss, cached = state["rng"]
        s.rng.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        for name in ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report"):
            setattr(s, name, int(state[name]))


def hook_state_of(model: nn.Module) -> HookState | None:
    """The comm hook state DDPStrategy attached to a model it wrapped, if any."""
    return getattr(model, "phalanx_comm_hook_state", None)


def register_comm_hook(model: nn.parallel.DistributedDataParallel, options: DDPOptions) -> HookState | None:
    """Register the chosen hook on `model`; its state (to checkpoint per rank), or None for no hook."""
    if options.comm_hook == "none":
        return None
    group = model.process_group
    if options.comm_hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return HookState()
    if options.comm_hook == "bf16":
        model.register_comm_hook(group, _bf16_hook_for(group))
        return HookState()
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=options.powersgd_rank,
        start_powerSGD_iter=options.powersgd_start_iter,
    )
    params = {id(p): (name, p.shape) for name, p in model.module.named_parameters()}
    hook_state = HookState(state, params, one_bucket_at_a_time=host_only.engages(dist.get_backend(group)))

    def powersgd_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        return hook_state.powersgd_hook(state, bucket)

    # powerSGD_hook, not batched_powerSGD_hook: the batched one crashes on gloo (TORCH-CPU-FACTS).
    model.register_comm_hook(state, powersgd_hook)
    return hook_state

"""FSDP2 (`fully_shard`) over the data-parallel mesh dims: ZeRO-2/ZeRO-3 (parameters, gradients and
optimizer state sharded over `dp_shard`, one unit per block so only one block's full parameters exist
at a time), hsdp (a 2-D replicate x shard mesh), and every data-parallel layout composed with tensor
parallel (with `dp_shard` 1 it replicates, as DDP would).

zero3 frees each unit's gathered parameters after its forward (gathered again in backward);
zero2 keeps them from forward to backward (less communication, more memory during the step).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch import nn

from phalanx.loop.precision import Precision
from phalanx.model import meta_init
from phalanx.strategies import fsdp_copy, sharded_embedding
from phalanx.host_only.gloo_comms import use_gloo_collectives
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.plan.parallel_plan import ParallelPlan


def apply(
    model: nn.Module,
    units: list[nn.Module],
    plan: ParallelPlan,
    dp_mesh: Any,
    options: StrategyOptions,
    precision: Precision,
    device: torch.device,
    backend: str,
    roots: list[nn.Module] | None = None,
    init_order: list[nn.Module] | None = None,
    fills: dict[tuple[int, str], Any] | None = None,
) -> None:
    """`fully_shard` each unit, then the root, over `dp_mesh`; a meta model is allocated (this rank's
    shards only) and initialised afterwards. In place: the user's module is the model.

    `roots`: the modules that run, when not `model` itself (a pipeline rank's stages: the views of
    the model each stage runs); `init_order`: a pipeline stage's meta model, cut from the whole one
    (meta_init.materialize); `fills`: what init_replay recorded while it was built on meta."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    meta = meta_init.is_meta(model)
    # a plain copy sharded again is the model only where FSDP alone laid it out (no tp DTensors, no
    # row-sharded tables, one root): there deepcopy(model) works (fsdp_copy), elsewhere it is refused
    copyable = (roots is None or list(roots) == [model]) and not any(
        hasattr(p, "device_mesh") for p in model.parameters()
    )
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.cpu_offload else OffloadPolicy()
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": precision.fsdp_policy(), "offload_policy": offload}
    looked_up = _shard_embeddings(model, units, plan, dp_mesh, options, device)
    # what the model asks data parallel to leave alone (torch's DDP attribute; expert parallel's
    # experts, reduced over their own ranks) stays whole here too
    # (under pp, only this stage's: the layers of other stages were cut away here)
    here = dict(model.named_parameters())
    kept = {here[n] for n in getattr(model, "_ddp_params_and_buffers_to_ignore", ()) if n in here}
    if looked_up or kept:
        kwargs["ignored_params"] = {e.weight for e in looked_up} | kept
    nested = any(a is not b and any(m is b for m in a.modules()) for a in units for b in units)
    reshard = plan.reshard_after_forward
    for i, unit in reversed(list(enumerate(units))):  # inner units first when nested
        # The last unit runs first in backward: freeing it after forward only to gather it
        # again at once is wasted communication.
        last = i == len(units) - 1
        fully_shard(unit, reshard_after_forward=reshard and not last, **kwargs)
    staged = roots is not None
    roots = [model] if roots is None else roots
    for root in roots:
        fully_shard(root, reshard_after_forward=False, **kwargs)
    if staged:
        quiet_stage_views(roots)
    use_gloo_collectives(units, roots, backend)  # gloo: cheaper than its own reduce-scatter and all-gather
    if copyable and not looked_up and not kept:
        fsdp_copy.remember(
            model,
            units,
            [reshard and i < len(units) - 1 for i in range(len(units))],
            kwargs,
            lambda us, rs: use_gloo_collectives(us, rs, backend),
        )
    prefetch = options.forward_prefetch is not False  # default on (see StrategyOptions)
    if prefetch and not nested and len(units) > 1 and len(roots) == 1:  # one stage: the units run in order
        for i in range(len(units) - 1):
            units[i].set_modules_to_forward_prefetch([units[i + 1]])
        if reshard:  # zero2 has nothing to gather again in backward
            for i in range(1, len(units)):
                units[i].set_modules_to_backward_prefetch([units[i - 1]])
    if meta:
        meta_init.materialize(
            model,
            device,
            options.init_weights,
            param_device=torch.device("cpu") if plan.cpu_offload else None,
            order=init_order,
            roots=roots,
            fills=fills,
        )


def _shard_embeddings(
    model: nn.Module,
    units: list[nn.Module],
    plan: ParallelPlan,
    mesh: Any,
    options: StrategyOptions,
    device: torch.device,
) -> list[nn.Module]:
    """Root-level embedding tables kept sharded by rows, looked up where the rows live; FSDP2
    leaves them alone. Only where the plan allows it (one data-parallel dim, no offload, no tp)."""
    from phalanx.config.names import Needs

    if options.embedding_exchange != "auto" or not plan.has(Needs.ROW_SHARDED_EMBEDDINGS):
        return []
    tables = sharded_embedding.eligible(model, units)
    for table in tables:
        sharded_embedding.shard(table, mesh, device)
    return tables


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Accumulation micro-steps: FSDP2 keeps unreduced gradients until `enabled` again."""
    model.set_requires_gradient_sync(enabled)


def quiet_stage_views(roots: Any) -> None:
    """FSDP2 warns when a module it wraps returns a view: an in-place op on that view (`out += y`) would
    skip its pre-backward all-gather. A pipeline stage's output is torch's schedule's alone (sent to the
    next stage, or handed to the loss on the last), never changed in place; the last stage returns a view
    whenever the head is a Linear over 3-D input, and the run equals one process (tests/dist/
    test_pp_layouts.py), so the warning (twice per pp x zero3 run, once per last-stage rank) is noise
    here. Silenced for the stages' own classes only: a view returned to the script still warns."""
    for name in sorted({type(root).__name__ for root in roots}):
        warnings.filterwarnings(
            "ignore",
            message=rf"FSDP2-wrapped module \({re.escape(name)}\) returned a view tensor",
            category=UserWarning,
        )

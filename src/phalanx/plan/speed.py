"""`phalanx plan`'s step-time section: per layout row, the estimated step time, tokens/s and MFU
from the step-time model (plan/step_time.py) on a device profile (plan/device_profiles.py), each
collective's bytes per rank per step, and the fastest layout whose memory fits.

It needs a transformer phalanx can count (model/flops.py) and a sequence length (--input BxS);
without them the section says what is missing. torch is imported by the callers (the model is
read here, never built)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from phalanx.model import flops as model_flops
from phalanx.plan import device_profiles, step_time
from phalanx.strategies.plan.parallel_plan import ParallelPlan

DEFAULT_PROFILE = "cpu"
# Bytes each optimizer's step reads and writes per parameter (fp32): parameter and gradient read, the
# parameter written, and each state tensor read and written.
OPTIMIZER_BYTES = {"sgd": 12, "sgd-momentum": 20, "adagrad": 20, "rmsprop": 20, "adam": 28, "adamw": 28}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-profile",
        "--device_profile",
        default=None,
        metavar="NAME|FILE",
        help="device profile of the step-time estimate: h100, h200, a100, cpu (this kind of machine, "
        "measured), or a JSON file as --measure-profile writes (default: cpu)",
    )
    parser.add_argument(
        "--measure-profile",
        "--measure_profile",
        default=None,
        metavar="FILE",
        help="measure this machine (a matmul and a 2-rank gloo all-reduce, ~10 s), write its profile "
        "to FILE as JSON, and estimate with it",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse a --device-profile that is neither a built-in nor a profile file, before any planning."""
    if args.device_profile and not args.measure_profile:
        device_profiles.load(args.device_profile)


def profile(args: argparse.Namespace) -> device_profiles.DeviceProfile:
    """The profile --measure-profile measures (and writes) or --device-profile names; ValueError with the fix."""
    if args.measure_profile:
        from pathlib import Path

        from phalanx.plan import calibrate

        measured = calibrate.measure()
        Path(args.measure_profile).write_text(measured.to_json())
        return measured
    return device_profiles.load(args.device_profile or DEFAULT_PROFILE)


def shape_of(
    model: Any, full_sizes: list, batch: int, seq_len: int, dtype_bytes: int, optimizer: str = "adamw"
) -> step_time.Shape | None:
    """The step-time model's view of `model` (None when it is no transformer model/flops.py counts):
    `batch` rows of `seq_len` tokens per data-parallel rank."""
    counted = model_flops.transformer_shape(model)
    if counted is None:
        return None
    config = next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "hidden_size")), None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (counted.width // heads if heads else None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    experts = next(
        (getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(config, n, 0)),
        0,
    )
    return step_time.Shape(
        params=sum(s.numel for s in full_sizes),
        flops=counted,
        kv_width=kv_heads * head_dim if kv_heads and head_dim else counted.width,
        vocab=getattr(config, "vocab_size", 0) or 0,
        seq_len=seq_len,
        tokens=batch * seq_len,
        dtype_bytes=dtype_bytes,
        experts=experts,
        top_k=(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        expert_params=sum(s.numel for s in full_sizes if ".experts." in s.name) if experts else 0,
        optimizer_bytes=OPTIMIZER_BYTES.get(optimizer, 28),
    )


def fitting(sizes: list, rows: dict[str, ParallelPlan], optimizer: str, budget: int, extra: int, runtime: int):  # noqa: ANN201
    """Whether a row's largest rank (model state + `extra`, its activations) fits `budget`."""
    from phalanx.plan import sharding

    table = sharding.table(sizes, rows, optimizer, runtime=runtime)
    return lambda name: max(b.total + b.host for b in table[name]) + extra <= budget


def section(
    args: argparse.Namespace,
    model: Any,
    full_sizes: list,
    rows: dict[str, ParallelPlan],
    fits: Callable[[str], bool],
    fb: Callable[[float], str],
    optimizer: str = "adamw",
) -> str:
    """The report's step-time lines; `fits(row)`: whether the row's memory fits the budget. Nothing
    when neither --input nor a profile asks for them."""
    if args.input is None and not (args.device_profile or args.measure_profile):
        return ""
    prof = profile(args)
    if args.nproc_per_node:  # the user's nodes, not the profile's
        prof = dataclasses.replace(prof, ranks_per_node=args.nproc_per_node)
    shape = _shape(args, model, full_sizes, prof.dtype_bytes, optimizer)
    if isinstance(shape, str):
        return f"step time: not estimated: {shape}"
    pipeline = step_time.Pipeline(args.pp_schedule, args.pp_microbatches)
    from phalanx.plan.sharding import OFFLOAD  # imports torch: the launcher's CLI builds plan's flags without it

    plans = {name: plan for name, plan in _with_cp(args, rows).items() if not name.endswith(OFFLOAD)}
    estimates = {name: step_time.estimate(plan, shape, prof, pipeline) for name, plan in plans.items()}
    labels = {name: _label(name, plan) for name, plan in plans.items()}
    width = max(17, *(len(label) for label in labels.values()))
    lines = [
        f"step time per layout on {prof.name} ({prof.peak_flops / 1e12:.3g} TFLOP/s peak x "
        f"{prof.matmul_efficiency:.2f} matmul efficiency; {args.world_size} ranks, {prof.ranks_per_node} per node; "
        f"{shape.tokens:,} tokens of {shape.seq_len} per data-parallel rank per step; "
        f"{prof.dtype_bytes}-byte gradients and activations):",
        f"  {'strategy':{width}s} {'step':>10s} {'tokens/s':>12s} {'MFU':>6s} {'bubble':>6s} {'exposed':>10s} {'optimizer':>10s}  fits",
    ]
    for name, est in estimates.items():
        lines.append(
            f"  {labels[name]:{width}s} {_seconds(est.step):>10s} {est.tokens_per_second:12,.0f} {est.mfu:6.1%} "
            f"{est.bubble:6.1%} {_seconds(est.exposed):>10s} {_seconds(est.optimizer):>10s}  {'yes' if fits(name) else 'no'}"
        )
        for c in est.collectives:
            where = "within a node" if c.within_node else "across nodes"
            lines.append(f"      {c.name}: {fb(c.bytes)} over {c.group} ranks, {where}, {_seconds(c.seconds)}")
    lines.append(_fastest(estimates, labels, fits))
    return "\n".join(lines)


def _shape(
    args: argparse.Namespace, model: Any, full_sizes: list, dtype_bytes: int, optimizer: str
) -> step_time.Shape | str:
    if args.input is None:
        return "give --input BxS (one rank's batch of token ids) for the sequence length"
    dims = args.input.partition(":")[0].lower().split("x")
    if len(dims) != 2:
        return f"--input {args.input!r} is not a batch of token sequences (BxS)"
    batch, seq = int(dims[0]), int(dims[1]) * args.cp  # cp's cut (plan/context.py) gave one rank's part
    shape = shape_of(model, full_sizes, batch, seq, dtype_bytes, optimizer)
    return shape if shape is not None else "not a transformer phalanx counts FLOPs of (model/flops.py)"


def _label(name: str, plan: ParallelPlan) -> str:
    """The row's name as the memory table writes it: hsdp's replicas x shards, then tp, cp, pp."""
    if plan.dp_replicate > 1 and plan.dp_shard > 1:
        name = f"{name} {plan.dp_replicate}x{plan.dp_shard}"
    return name + "".join(f" x {d}{size}" for d, size in plan.degrees().items() if d in ("tp", "cp", "pp") and size > 1)


def _with_cp(args: argparse.Namespace, rows: dict[str, ParallelPlan]) -> dict[str, ParallelPlan]:
    """The rows with --cp among their degrees: the memory table's rows leave cp out (its ranks hold model
    state as data-parallel ranks do), but its traffic and its share of the tokens count here."""
    if args.cp == 1:
        return rows
    from phalanx.plan import sharding
    from phalanx.strategies.plan import presets

    settings = presets.asking(tp=args.tp, pp=args.pp, cp=args.cp)
    with_cp = sharding.layouts(
        settings, world_size=args.world_size, local_world_size=args.nproc_per_node or args.world_size
    )
    return {name: with_cp[name] for name in rows if name in with_cp}


def _fastest(estimates: dict[str, step_time.StepTime], labels: dict[str, str], fits: Callable[[str], bool]) -> str:
    fitting = {name: est for name, est in estimates.items() if fits(name)}
    if not fitting:
        return "fastest layout that fits: none fits the budget (see the memory table above)"
    name, est = min(fitting.items(), key=lambda item: item[1].step)
    return (
        f"fastest layout that fits: {labels[name]} (estimated {_seconds(est.step)} per step, "
        f"{est.tokens_per_second:,.0f} tokens/s, MFU {est.mfu:.1%}); the one recommended for speed"
    )


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} us"

"""`phalanx plan MODEL --world-size N`: per strategy, the bytes of parameters, gradients and
optimizer state each rank will hold, and the strategy `auto` would pick; with --tp and --pp, one
tensor-parallel rank's part of the largest pipeline rank's stages (plan/pipeline.py).

MODEL is `package.module:factory`, `path/to/file.py:factory`, or `path/to/file.py`: a training
script's top level stopped at its first px.prepare (phalanx/planning.py: no step, no run directory),
else one of make_model / build_model / get_model / create_model, else exactly one nn.Module subclass
that can be built with no arguments (a training script's model class). The model is built on the meta device, so
planning a model larger than this machine's memory costs nothing. No torch import at module level.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from phalanx import config, planning
from phalanx.plan import context
from phalanx.plan import optimizer as optimizer_choice
from phalanx.plan import speed
from phalanx.config.schema import BY_NAME
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import DEGREES, MESH_DIMS

# degrees that take their ranks from others (no mesh dim: ep): a flag each, their lines under the table
# from the dimension that applies them (strategies/dimensions.py)
BORROWED = tuple(degree for degree in DEGREES if degree not in MESH_DIMS)

_FACTORY_NAMES = ("make_model", "build_model", "get_model", "create_model")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="module:factory, file.py:factory, or file.py exposing make_model() "
        "or defining one nn.Module class that needs no arguments",
    )
    parser.add_argument(
        "--world-size",
        "--world_size",
        type=int,
        default=None,
        help="number of ranks (default: what `phalanx run` would start here: one per GPU, else 2)",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        help="optimizer whose state to count: adamw, adam, sgd, sgd-momentum, adagrad, rmsprop "
        "(default: the one MODEL's file builds, else adamw)",
    )
    parser.add_argument(
        "--budget",
        default=None,
        help="per-device bytes for auto's choice, e.g. 16GB (default: "
        "PHALANX_MEMORY_BUDGET, else 60%% of this machine's GPU memory or RAM/local ranks)",
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="ranks per node: hsdp's shard group, and the ranks sharing this machine's RAM "
        "(CPU default budget); default: world size",
    )
    parser.add_argument(
        "--input",
        default=None,
        metavar="SHAPE[:DTYPE]",
        help="one rank's batch, e.g. 16x32 (token ids) or 16x3x224x224:float32: also "
        "estimate activation bytes (a forward on the meta device)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        "--activation_checkpointing",
        action="store_true",
        help="count activations as with activation checkpointing of each block",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: figures are one tensor-parallel rank's, the data-parallel "
        "strategies span world size / tp ranks (default 1)",
    )
    parser.add_argument(
        "--tp-plan",
        "--tp_plan",
        default=None,
        metavar="PLAN",
        help="the tensor-parallel plan as JSON or pattern=style,... (default: the model's own "
        "transformers plan), as the tp_plan setting takes it",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel degree: per pipeline rank its stages' bytes (and with --input the "
        "activations in flight); the strategies span world size / (tp x pp) ranks (default 1)",
    )
    context.add_argument(parser)
    for degree in BORROWED:
        parser.add_argument(
            f"--{degree}",
            type=int,
            default=1,
            help=f"{BY_NAME[degree].help}; prints its bytes per rank under the table (default 1)",
        )
    _pipeline_arguments(parser)
    speed.add_arguments(parser)


def _pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pp-schedule",
        "--pp_schedule",
        default="1F1B",
        metavar="SCHEDULE",
        help="pipeline schedule, as the pp_schedule setting takes it (default 1F1B)",
    )
    parser.add_argument(
        "--pp-microbatches",
        "--pp_microbatches",
        type=int,
        default=None,
        metavar="N",
        help="microbatches of each rank's batch (default 2 x pp)",
    )
    parser.add_argument(
        "--pp-split",
        "--pp_split",
        default=None,
        metavar="NAMES",
        help="module names to cut stages before, comma-separated (default: even by parameters)",
    )


def load_factory(spec: str) -> Callable[[], Any]:
    """The model factory MODEL names (`read_model` without the words on where it came from)."""
    return read_model(spec)[0]


def read_model(spec: str) -> tuple[Callable[[], Any], str]:
    """The model factory MODEL names, and where it came from; ValueError with what to pass when there is none.

    For a file or module without `:factory`: the model the script's top level passes to its first
    `px.prepare` (phalanx/planning.py stops it there: a script without a `__main__` guard trains no
    step), else a function named make_model / build_model / get_model / create_model, else the one
    nn.Module subclass the file itself defines that can be built with no arguments (a training
    script's model class, e.g. examples/wine.py's SimpleNN). Importing a script runs its top level,
    not its `if __name__ == "__main__":` block.
    """
    target, _, attr = spec.partition(":")
    module, stop = _import(target)
    name = os.path.basename(target)
    if attr:
        if not hasattr(module, attr):
            raise ValueError(f"{target!r} has no {attr!r}. {_hint(target, module)}")
        return getattr(module, attr), f"{name}:{attr}()"
    if stop is not None and stop.model is not None:
        model = stop.model
        return (
            lambda: copy.deepcopy(model),
            f"{stop.where}, the model passed to px.prepare (phalanx plan stopped the script there: "
            "no step ran, nothing was written)",
        )
    stopped = f" (the script stopped at {stop.what}, {stop.where}, before any px.prepare)" if stop else ""
    names = [n for n in _FACTORY_NAMES if hasattr(module, n)]
    if names:
        return getattr(module, names[0]), f"{name}'s {names[0]}(){stopped}"
    classes = _model_classes(module)
    if len(classes) == 1:
        return classes[0], f"{name}'s class {classes[0].__name__}, built with no arguments{stopped}"
    if classes:
        listed = ", ".join(f"{target}:{c.__name__}" for c in classes)
        raise ValueError(f"{target!r} defines several models that need no arguments: pick one, e.g. {listed}")
    raise ValueError(
        f"{target!r} has no make_model / build_model / get_model / create_model and defines no "
        f"nn.Module that can be built without arguments{stopped}. {_hint(target, module)}"
    )


def _import(target: str) -> tuple[Any, Any]:
    """The module, and the PlanStop its top level raised at px.prepare (None when it ran to its end)."""
    if target.endswith(".py") or Path(target).is_file():
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_phalanx_plan_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        return module, _run_top_level(module_spec, module, path, target)
    try:
        with planning.reading_script():
            return importlib.import_module(target), None
    except planning.PlanStop as stop:
        return sys.modules[target], stop
    except ImportError as error:
        raise ValueError(
            f"cannot import module {target!r}: {error}. HINT: MODEL is module:factory or path/to/file.py[:factory]"
        ) from None


def _run_top_level(module_spec: Any, module: Any, path: Path, target: str) -> Any:
    """Run a script's top level as an import (its argv its own name only), up to its first px.prepare."""
    sys.path.insert(0, str(path.resolve().parent))
    argv, sys.argv = sys.argv, [str(path)]
    try:
        with planning.reading_script():
            module_spec.loader.exec_module(module)
    except planning.PlanStop as stop:
        return stop
    except SystemExit as exit_:
        raise ValueError(
            f"importing {target!r} ended the script (exit {exit_.code}) before any px.prepare. "
            f"HINT: pass {target}:NAME, where NAME() builds and returns the nn.Module"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's file: say which and why, no traceback
        meta = (
            ". HINT: while phalanx plan reads a script, tensors made after Phalanx() are on the meta device; "
            f"pass {target}:NAME, where NAME() builds and returns the nn.Module"
        )
        raise ValueError(
            f"importing {target!r} failed: {type(error).__name__}: {error}" + (meta if "meta" in str(error) else "")
        ) from None
    finally:
        sys.argv = argv
        sys.path.pop(0)
    return None


def _model_classes(module: Any) -> list[type]:
    """nn.Module subclasses defined in `module` itself whose constructor needs no argument."""
    import inspect

    import torch

    found = []
    for value in vars(module).values():
        if inspect.isclass(value) and issubclass(value, torch.nn.Module) and value.__module__ == module.__name__:
            try:
                parameters = list(inspect.signature(value).parameters.values())
            except (TypeError, ValueError):
                continue
            if all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
                found.append(value)
    return found


def _hint(target: str, module: Any) -> str:
    import inspect

    callables = sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == module.__name__
    )
    shown = f" (it defines: {', '.join(callables)})" if callables else ""
    return (
        f"HINT: pass {target}:NAME, where NAME() builds and returns the nn.Module{shown}, or add a "
        "make_model() function to the file."
    )


def render(
    sizes: list,
    rows: dict[str, Any],
    optimizer: str,
    budget: int,
    activations: Any = None,
    activation_checkpointing: bool = False,
    optimizer_why: str = "",
    full_sizes: list | None = None,
    suggestion: str = "",
    pipeline: str = "",
    runtime: int = 0,
) -> str:
    """The report over `rows` (plan/sharding.py's layouts: a ParallelPlan per row, every one of the
    same degrees). With tp > 1, `sizes` are one tensor-parallel rank's parameters (`full_sizes` the
    model's) and the rows span the data-parallel ranks tp leaves; with pp > 1, the largest pipeline
    rank's, after the `pipeline` section. `runtime`: the process's own bytes (memory.runtime_bytes),
    in every total."""
    from phalanx.model import memory
    from phalanx.plan import sharding
    from phalanx.strategies import memory_plan

    fb = memory.format_bytes
    degrees = next(iter(rows.values()))  # the rows differ in what they shard, not in their degrees
    world_size, tp, pp, dp_size = degrees.world_size, degrees.tp, degrees.pp, degrees.dp_size
    table = sharding.table(sizes, rows, optimizer, runtime=runtime)
    width = 17 + 6 * (tp > 1) + 6 * (pp > 1)
    whole = full_sizes if full_sizes is not None else sizes
    num_params = sum(s.numel for s in whole)
    lines = [
        f"model: {num_params:,} trainable parameters ({fb(sum(s.nbytes for s in whole))}), "
        f"optimizer {optimizer}{f' ({optimizer_why})' if optimizer_why else ''}, world_size {world_size}"
    ]
    if pipeline:
        lines.append(pipeline)
    if tp > 1:
        lines.append(
            f"tensor parallel tp={tp}: one rank holds {fb(sum(s.nbytes for s in sizes))} of the parameters "
            f"(the tp plan's layers split {tp} ways, the rest whole); the strategies below shard that "
            f"over the {dp_size} data-parallel ranks"
        )
    lines += [
        "per-rank model state (the largest rank; activations not included):"
        if not runtime
        else f"per-rank memory between steps (the largest rank; totals include {fb(runtime)} a CPU process's heap holds "
        "in every layout: torch's own caches; vs ddp: of the model state; activations not included):",
        f"  {'strategy':{width}s} {'params':>11s} {'grads':>11s} {'optimizer':>11s} {'buffers':>11s} "
        f"{'total':>11s}  {'vs ddp':>6s}",
    ]
    ddp_total = table[presets.AUTO_CHOOSES[0]][0].total - runtime  # vs ddp: the model state a layout changes
    for name, ranks in table.items():
        worst = max(ranks, key=lambda b: b.total + b.host)
        note = ""
        if worst.host:
            note = f"  (+{fb(worst.host)} in CPU memory)"
        ratio = (worst.total - worst.runtime) / ddp_total if ddp_total else 0.0
        if name in presets.PRESETS and presets.PRESETS[name].hybrid:  # replicas x shards
            name = f"{name} {rows[name].dp_replicate}x{rows[name].dp_shard}"
        if tp > 1:
            name = f"{name} x tp{tp}"
        if pp > 1:
            name = f"{name} x pp{pp}"
        lines.append(
            f"  {name:{width}s} {fb(worst.params):>11s} {fb(worst.grads):>11s} {fb(worst.optimizer):>11s} "
            f"{fb(worst.buffers):>11s} {fb(worst.total):>11s}  {ratio:6.2f}{note}"
        )
    lines.append(
        "  (at rest, between steps; zero1-persistent is zero1 with zero1_gather persistent: one all-gather per\n"
        "   step into a buffer kept for good, where zero1 gathers through transient buckets of 1/16 of the model;\n"
        "   during a step zero2 also holds every unit's gathered parameters\n"
        "   from its forward to its backward, up to ddp's params, while zero3 holds the root unit and one or two blocks';\n"
        "   root-level embedding tables are never gathered whole while a forward's tokens x ranks are fewer than their rows)"
    )
    if activations is not None:
        lines.append(activation_lines(activations, activation_checkpointing, fb))
    if degrees.is_distributed and degrees.dp_size == 1:  # as auto decides: the data-parallel preset over no ranks
        layout = " x ".join(f"{name}={size}" for name, size in (("pp", pp), ("tp", tp)) if size > 1)
        choice, why = presets.AUTO_CHOOSES[0], f"{layout} takes every rank: no data-parallel ranks"
    else:
        choice, why = memory_plan.recommend(sizes, degrees, budget, optimizer, one_tp_rank=True)
    lines.append(f"auto would pick: {choice} ({why})")
    if suggestion:
        lines.append(suggestion)
    return "\n".join(lines)


def launcher_budget() -> int | None:
    """memory_budget as `phalanx run` would hand it to the workers (PHALANX_MEMORY_BUDGET), if set."""
    return config.resolve(config.from_env(os.environ)).config.memory_budget


def activation_lines(acts: Any, checkpointing: bool, fb: Callable[[float], str]) -> str:
    """The activation estimate, the same under every strategy (each rank runs its own batch)."""
    end, peak = (
        (acts.outside + sum(acts.unit_inputs), acts.peak_checkpointed) if checkpointing else (acts.full, acts.peak)
    )
    other = acts.peak if checkpointing else acts.peak_checkpointed
    return (
        f"activations per rank, any strategy, {'with' if checkpointing else 'without'} activation "
        f"checkpointing of the {len(acts.unit_saved)} blocks: {fb(end)} after the forward, {fb(peak)} "
        f"at the backward's peak ({fb(other)} {'without' if checkpointing else 'with'} it)"
    )


def main(args: argparse.Namespace) -> int:
    import torch

    from phalanx.model import memory

    try:
        if args.world_size is None:  # what `phalanx run` would start on this machine
            from phalanx.launch import devices

            args.world_size = devices.count_visible_gpus() or devices.CPU_DEFAULT_NPROC
        if args.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
        presets.check_flags(args.world_size, args.tp, args.pp, args.cp)
        speed.check(args)
        tp_plan = config.BY_NAME["tp_plan"].kind.from_text(args.tp_plan) if args.tp_plan else None
        factory, source = read_model(args.model)
        model = _build(factory, args.model)
        full_sizes = memory.model_sizes(model)
        plan = _plan(args, args.tp)
        if plan.tp > 1:
            _shrink(model, tp_plan, plan)
    except ValueError as error:
        print(f"phalanx plan: error: {error}", file=sys.stderr)
        return 2
    budget = memory.parse_bytes(args.budget) if args.budget else launcher_budget()
    if budget is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        budget = memory.device_budget_bytes(device, args.nproc_per_node or args.world_size)
    from phalanx.plan import sharding

    try:
        cp_line = context.cut_input(args)  # before the activations: --input becomes one cp rank's part
        acts = _activations_of(args, model, plan)
        # cp's ranks hold model state as data-parallel ranks do (sharded over dp x cp): rows of tp and pp
        rows = sharding.layouts(
            presets.asking(tp=args.tp, pp=args.pp),
            world_size=args.world_size,
            local_world_size=args.nproc_per_node or args.world_size,
        )
        pipeline = _pipeline(args, model, plan) if plan.pp > 1 else None
    except ValueError as error:
        print(f"phalanx plan: error: {error}", file=sys.stderr)
        return 2
    choice = optimizer_choice.choose(args.optimizer, args.model)
    sizes = memory.model_sizes(model)
    try:
        expert_lines = _dimension_lines(args, model, sizes, choice.name, memory.format_bytes)
    except ValueError as error:
        print(f"phalanx plan: error: {error}", file=sys.stderr)
        return 2
    args.runtime = memory.runtime_bytes("cuda" if torch.cuda.is_available() else "cpu")
    if pipeline is not None:  # the largest pipeline rank's stages; activations per rank come with them
        sizes = [s for s in sizes if any(s.name == u or s.name.startswith(f"{u}.") for u in pipeline.units)]
        acts = None
    suggestion = suggest(factory, args, tp_plan, choice.name, budget, sizes, acts) if pipeline is None else ""
    print(f"model from: {source}")
    print(
        render(
            sizes,
            rows,
            choice.name,
            budget,
            acts,
            args.activation_checkpointing,
            choice.why,
            full_sizes=full_sizes,
            suggestion=suggestion,
            pipeline=pipeline.report if pipeline is not None else "",
            runtime=args.runtime,
        )
    )
    if expert_lines:
        print(expert_lines)
    print(_speed_lines(args, model, full_sizes, sizes, rows, choice.name, budget, acts), end="")
    if cp_line:
        print(cp_line)
        longest = context.longest_sequence(model, args, sizes, choice.name, budget) if pipeline is None else ""
        if longest:
            print(longest)
    return 0


def _speed_lines(
    args: argparse.Namespace,
    model: Any,
    full_sizes: list,
    sizes: list,
    rows: dict,
    optimizer: str,
    budget: int,
    acts: Any,
) -> str:
    """The step-time section (plan/speed.py): per row its estimated step time, and the fastest that fits."""
    from phalanx.model import memory

    extra = 0 if acts is None else (acts.peak_checkpointed if args.activation_checkpointing else acts.peak)
    fits = speed.fitting(sizes, rows, optimizer, budget, extra, args.runtime)
    lines = speed.section(args, model, full_sizes, rows, fits, memory.format_bytes, optimizer)
    return lines + "\n" if lines else ""


def _plan(args: argparse.Namespace, tp: int) -> Any:
    """The ddp plan of --world-size, --nproc-per-node, --pp and tensor-parallel degree `tp` (--tp, or
    a larger one the suggestion tries): the degrees every row shares."""
    return presets.build(
        presets.AUTO_CHOOSES[0],
        presets.asking(tp=tp, pp=args.pp),
        world_size=args.world_size,
        local_world_size=args.nproc_per_node or args.world_size,
    )


def _pipeline(args: argparse.Namespace, model: Any, plan: Any) -> Any:
    from phalanx.model import memory
    from phalanx.plan import activations
    from phalanx.plan.pipeline import plan_pipeline

    measure = None
    if args.input is not None:
        shape, dtype = activations.parse_input(args.input)
        measure = lambda units: activations.measure(model, [activations.meta_input(shape, dtype)], units)  # noqa: E731
    split = [n.strip() for n in args.pp_split.split(",") if n.strip()] if args.pp_split else None
    return plan_pipeline(model, plan, args.pp_schedule, args.pp_microbatches, split, measure, memory.format_bytes)


def _build(factory: Callable[[], Any], label: str) -> Any:
    """The model on the meta device (nothing allocated, any size)."""
    import torch

    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # noqa: BLE001 - the user's code: say which and why, no traceback
        raise ValueError(
            f"building the model with {label} failed: {type(error).__name__}: {error}. "
            "HINT: MODEL must be callable with no arguments"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"{label} returned {type(model).__name__}, not a torch.nn.Module. "
            "HINT: pass file.py:NAME, where NAME() returns the model"
        )
    return model


def _shrink(model: Any, tp_plan: Any, plan: Any) -> None:
    from phalanx.strategies import tensor_parallel

    tensor_parallel.shrink_to_one_rank(model, tp_plan, plan)


def preference() -> list[str]:
    """The layouts `suggest` tries, least traffic first: the presets of one sharding dim (not hybrid)."""
    return [name for name in presets.multi_process() if not presets.PRESETS[name].hybrid]


def suggest(
    factory: Callable[[], Any],
    args: argparse.Namespace,
    tp_plan: Any,
    optimizer: str,
    budget: int,
    sizes: list,
    acts: Any,
) -> str:
    """The layout with the least communication whose model state (+ activations with --input) fits
    the budget: the data-parallel presets at --tp, then larger tp within a node."""
    from phalanx.model import memory
    from phalanx.strategies import memory_plan

    nproc = args.nproc_per_node or args.world_size
    candidates = [args.tp] + [t for t in range(args.tp + 1, nproc + 1) if nproc % t == 0 and args.world_size % t == 0]
    order = preference()
    for tp in candidates:
        plan = _plan(args, tp)
        if tp != args.tp:
            try:
                model = _build(factory, args.model)
                _shrink(model, tp_plan, plan)
                acts = _activations(args, model) if args.input else None
            except ValueError:
                continue  # this model's layers (or heads) do not split that many ways, or it has no plan
            sizes = memory.model_sizes(model)
        extra = 0 if acts is None else (acts.peak_checkpointed if args.activation_checkpointing else acts.peak)
        for name in order:
            layout = presets.build(
                name, presets.asking(tp=plan.tp, pp=plan.pp), world_size=plan.world_size, local_world_size=nproc
            )
            need = (
                max(
                    b.total
                    for b in memory_plan.rank_bytes(sizes, layout, optimizer, runtime=getattr(args, "runtime", 0))
                )
                + extra
            )
            if need <= budget:
                layout = name + (f" x tp{tp}" if tp > 1 else "")
                what = (
                    "model state"
                    + (" + runtime" if getattr(args, "runtime", 0) else "")
                    + (" + activations" if acts is not None else "")
                )
                return (
                    f"suggested layout for {args.world_size} ranks: {layout} ({what} {memory.format_bytes(need)} "
                    f"per rank, within the {memory.format_bytes(budget)} budget)"
                )
    return (
        f"suggested layout: none fits {memory.format_bytes(budget)} per rank on {args.world_size} ranks; "
        "HINT: more ranks, activation checkpointing, a smaller batch, or CPU offload (zero3)"
    )


def _activations(args: argparse.Namespace, model: Any) -> Any:
    from phalanx.model.units import default_units
    from phalanx.plan import activations

    shape, dtype = activations.parse_input(args.input)
    try:
        return activations.measure(model, [activations.meta_input(shape, dtype)], default_units(model))
    except RuntimeError as error:  # e.g. a view over attention heads that tp does not divide
        raise ValueError(
            f"the forward on the meta device failed with the layers split for one tensor-parallel "
            f"rank: {error}. HINT: tp must divide the model's attention (and key/value) heads"
        ) from None


def _activations_of(args: argparse.Namespace, model: Any, plan: Any) -> Any:
    """The activation estimate when --input is given (None otherwise), once the nodes' processes are checked."""
    nproc = args.nproc_per_node or args.world_size
    if args.world_size % nproc:
        raise ValueError(f"--nproc-per-node {nproc} does not divide --world-size {args.world_size}")
    if not plan.tp_within(nproc):
        raise ValueError(
            f"--tp {args.tp} does not divide the {nproc} processes of a node: tensor parallel belongs inside a node"
        )
    if args.input is None:
        if args.activation_checkpointing:
            raise ValueError(
                "--activation-checkpointing changes the activation estimate, which needs --input "
                "SHAPE[:DTYPE], e.g. --input 16x512"
            )
        return None
    return _activations(args, model)


def _dimension_lines(args: argparse.Namespace, model: Any, sizes: list[Any], optimizer: str, fb: Any) -> str:
    """The per-model dimensions' lines under the table ('' when no --<degree> of BORROWED asks)."""
    if all(getattr(args, degree) == 1 for degree in BORROWED):
        return ""
    # torch-heavy: imported when a plan asks for one, so `phalanx --help` and the launcher never import torch
    from phalanx.strategies import dimensions

    return dimensions.plan_lines(args, model, sizes, optimizer, fb)

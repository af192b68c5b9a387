"""`phalanx plan MODEL --world-size N`: per strategy, the bytes of parameters, gradients and
optimizer state each rank will hold, and the strategy `auto` would pick.

MODEL is `package.module:factory`, `path/to/file.py:factory`, or `path/to/file.py` exposing one of
make_model / build_model / get_model / create_model, or defining exactly one nn.Module subclass that
can be built with no arguments (a training script's model class). The model is built on the meta device, so
planning a model larger than this machine's memory costs nothing. No torch import at module level.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from phalanx import config
from phalanx.plan import optimizer as optimizer_choice

_FACTORY_NAMES = ("make_model", "build_model", "get_model", "create_model")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="module:factory, file.py:factory, or file.py exposing make_model() "
                                      "or defining one nn.Module class that needs no arguments")
    parser.add_argument("--world-size", "--world_size", type=int, default=None,
                        help="number of ranks (default: what `phalanx run` would start here: one per GPU, else 2)")
    parser.add_argument("--optimizer", default=None,
                        help="optimizer whose state to count: adamw, adam, sgd, sgd-momentum, adagrad, rmsprop "
                             "(default: the one MODEL's file builds, else adamw)")
    parser.add_argument("--budget", default=None,
                        help="per-device bytes for auto's choice, e.g. 16GB (default: "
                             "PHALANX_MEMORY_BUDGET, else 60%% of this machine's GPU memory or RAM/local ranks)")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                        help="ranks per node: hsdp's shard group, and the ranks sharing this machine's RAM "
                             "(CPU default budget); default: world size")
    parser.add_argument("--input", default=None, metavar="SHAPE[:DTYPE]",
                        help="one rank's batch, e.g. 16x32 (token ids) or 16x3x224x224:float32: also "
                             "estimate activation bytes (a forward on the meta device)")
    parser.add_argument("--activation-checkpointing", "--activation_checkpointing", action="store_true",
                        help="count activations as with activation checkpointing of each block")


def load_factory(spec: str) -> Callable[[], Any]:
    """The model factory MODEL names; ValueError with what to pass when there is none.

    For a file or module without `:factory`: a function named make_model / build_model / get_model
    / create_model, else the one nn.Module subclass the file itself defines that can be built with
    no arguments (a training script's model class, e.g. examples/wine.py's SimpleNN). Importing a
    script runs its top level, not its `if __name__ == "__main__":` block.
    """
    target, _, attr = spec.partition(":")
    module = _import(target)
    if attr:
        if not hasattr(module, attr):
            raise ValueError(f"{target!r} has no {attr!r}. {_hint(target, module)}")
        return getattr(module, attr)
    names = [n for n in _FACTORY_NAMES if hasattr(module, n)]
    if names:
        return getattr(module, names[0])
    classes = _model_classes(module)
    if len(classes) == 1:
        return classes[0]
    if classes:
        listed = ", ".join(f"{target}:{c.__name__}" for c in classes)
        raise ValueError(f"{target!r} defines several models that need no arguments: pick one, e.g. {listed}")
    raise ValueError(f"{target!r} has no make_model / build_model / get_model / create_model and defines no "
                     f"nn.Module that can be built without arguments. {_hint(target, module)}")


def _import(target: str) -> Any:
    if target.endswith(".py") or Path(target).is_file():
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_phalanx_plan_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the user's file: say which and why, no traceback
            raise ValueError(f"importing {target!r} failed: {type(error).__name__}: {error}") from None
        finally:
            sys.path.pop(0)
        return module
    try:
        return importlib.import_module(target)
    except ImportError as error:
        raise ValueError(f"cannot import module {target!r}: {error}. HINT: MODEL is module:factory or "
                         "path/to/file.py[:factory]") from None


def _model_classes(module: Any) -> list[type]:
    """nn.Module subclasses defined in `module` itself whose constructor needs no argument."""
    import inspect

    import torch

    found = []
    for value in vars(module).values():
        if (inspect.isclass(value) and issubclass(value, torch.nn.Module)
                and value.__module__ == module.__name__):
            try:
                parameters = list(inspect.signature(value).parameters.values())
            except (TypeError, ValueError):
                continue
            if all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
                found.append(value)
    return found


def _hint(target: str, module: Any) -> str:
    import inspect

    callables = sorted(n for n, v in vars(module).items()
                       if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                       and getattr(v, "__module__", None) == module.__name__)
    shown = f" (it defines: {', '.join(callables)})" if callables else ""
    return (f"HINT: pass {target}:NAME, where NAME() builds and returns the nn.Module{shown}, or add a "
            "make_model() function to the file.")


def render(sizes: list, world_size: int, optimizer: str, budget: int, hsdp_shard_size: int | None = None,
           activations: Any = None, activation_checkpointing: bool = False, optimizer_why: str = "") -> str:
    from phalanx.model import memory

    fb = memory.format_bytes
    table = memory.plan(sizes, world_size, optimizer, hsdp_shard_size=hsdp_shard_size)
    num_params = sum(s.numel for s in sizes)
    lines = [f"model: {num_params:,} trainable parameters ({fb(sum(s.nbytes for s in sizes))}), "
             f"optimizer {optimizer}{f' ({optimizer_why})' if optimizer_why else ''}, world_size {world_size}",
             "per-rank model state (the largest rank; activations not included):",
             f"  {'strategy':14s} {'params':>11s} {'grads':>11s} {'optimizer':>11s} {'total':>11s}  "
             f"{'vs ddp':>6s}"]
    ddp_total = table["ddp"][0].total
    for name, ranks in table.items():
        worst = max(ranks, key=lambda b: b.total + b.host)
        note = ""
        if worst.host:
            note = f"  (+{fb(worst.host)} in CPU memory)"
        ratio = worst.total / ddp_total if ddp_total else 0.0
        if name == "hsdp":
            name = f"hsdp {world_size // hsdp_shard_size}x{hsdp_shard_size}"
        lines.append(f"  {name:14s} {fb(worst.params):>11s} {fb(worst.grads):>11s} {fb(worst.optimizer):>11s} "
                     f"{fb(worst.total):>11s}  {ratio:6.2f}{note}")
    lines.append("  (at rest, between steps; during a step zero2 also holds every unit's gathered parameters\n"
                 "   from its forward to its backward, up to ddp's params, while zero3 holds the root unit and one or two blocks';\n"
                 "   root-level embedding tables are never gathered whole while a forward's tokens x ranks are fewer than their rows)")
    if activations is not None:
        lines.append(activation_lines(activations, activation_checkpointing, fb))
    choice, why = memory.recommend(sizes, world_size, budget, optimizer=optimizer)
    lines.append(f"auto would pick: {choice} ({why})")
    return "\n".join(lines)


def launcher_budget() -> int | None:
    """memory_budget as `phalanx run` would hand it to the workers (PHALANX_MEMORY_BUDGET), if set."""
    return config.resolve(config.from_env(os.environ)).config.memory_budget


def activation_lines(acts: Any, checkpointing: bool, fb: Callable[[float], str]) -> str:
    """The activation estimate, the same under every strategy (each rank runs its own batch)."""
    end, peak = (acts.outside + sum(acts.unit_inputs), acts.peak_checkpointed) if checkpointing \
        else (acts.full, acts.peak)
    other = acts.peak if checkpointing else acts.peak_checkpointed
    return (f"activations per rank, any strategy, {'with' if checkpointing else 'without'} activation "
            f"checkpointing of the {len(acts.unit_saved)} blocks: {fb(end)} after the forward, {fb(peak)} "
            f"at the backward's peak ({fb(other)} {'without' if checkpointing else 'with'} it)")


def main(args: argparse.Namespace) -> int:
    import torch

    from phalanx.model import memory

    try:
        if args.world_size is None:  # what `phalanx run` would start on this machine
            from phalanx.launch import devices

            args.world_size = devices.count_visible_gpus() or devices.CPU_DEFAULT_NPROC
        if args.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
        factory = load_factory(args.model)
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as error:  # noqa: BLE001 - the user's code: say which and why, no traceback
            raise ValueError(f"building the model with {args.model} failed: {type(error).__name__}: {error}. "
                             "HINT: MODEL must be callable with no arguments") from None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"{args.model} returned {type(model).__name__}, not a torch.nn.Module. "
                             "HINT: pass file.py:NAME, where NAME() returns the model")
    except ValueError as error:
        print(f"phalanx plan: error: {error}", file=sys.stderr)
        return 2
    budget = memory.parse_bytes(args.budget) if args.budget else launcher_budget()
    if budget is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        budget = memory.device_budget_bytes(device, args.nproc_per_node or args.world_size)
    try:
        shard, acts = _shard_and_activations(args, model)
    except ValueError as error:
        print(f"phalanx plan: error: {error}", file=sys.stderr)
        return 2
    choice = optimizer_choice.choose(args.optimizer, args.model)
    print(render(memory.model_sizes(model), args.world_size, choice.name, budget, shard, acts,
                 args.activation_checkpointing, choice.why))
    return 0


def _shard_and_activations(args: argparse.Namespace, model: Any) -> tuple[int, Any]:
    """hsdp's shard size (the processes per node), and the activation estimate when --input is given."""
    shard = args.nproc_per_node or args.world_size
    if args.world_size % shard:
        raise ValueError(f"--nproc-per-node {shard} does not divide --world-size {args.world_size}")
    if args.input is None:
        if args.activation_checkpointing:
            raise ValueError("--activation-checkpointing changes the activation estimate, which needs --input "
                             "SHAPE[:DTYPE], e.g. --input 16x512")
        return shard, None
    from phalanx.plan import activations
    from phalanx.model.units import default_units

    shape, dtype = activations.parse_input(args.input)
    return shard, activations.measure(model, [activations.meta_input(shape, dtype)], default_units(model))

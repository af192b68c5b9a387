"""Which optimizers may be stepped on slices of a tensor, and which must see whole tensors.

An element-wise optimizer (SGD, Adam, AdamW, ...) updates each element from that element's gradient
and state alone, so stepping zero1's flat chunks, FSDP2's row shards or tensor parallel's blocks is
the same as stepping the whole tensor. Muon (Newton-Schulz orthogonalises the whole matrix),
Adafactor (row and column factors, the parameter's RMS) and a LAMB-style trust ratio (the whole
tensor's norm) are not: on slices they train silently differently. LBFGS reads every parameter at
once (one flat vector, a closure) and cannot be split by parameters either.

The kind of an optimizer, first match wins:
1. a declaration: `phalanx.declare_optimizer(MyOpt, elementwise=True)`, or a class attribute
   `phalanx_elementwise = True` / `False` on the class (inherited by subclasses);
2. torch's own optimizers, by class (the tables below);
3. anything else: whole-tensor, *undeclared* (a warning at prepare names the class and
   `phalanx parity` as the check).

docs/optimizers.md's table is generated from this module (`python -m tests.layouts.optimizers`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from phalanx.strategies.plan.parallel_plan import ParallelPlan


class StepKind(enum.Enum):
    """How an optimizer's step reads a parameter."""

    ELEMENTWISE = "element-wise"  # each element from its own gradient and state: slices are fine
    WHOLE_TENSOR = "whole-tensor"  # reads a parameter whole (a matrix function, a norm, factors)
    WHOLE_MODEL = "whole-model"  # reads every parameter at once (LBFGS): only where parameters stay whole


# torch.optim classes by name (looked up on torch.optim, so a torch without one just lacks the row)
TORCH_ELEMENTWISE: tuple[str, ...] = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "ASGD",
    "Rprop",
    "SparseAdam",
)
TORCH_WHOLE_TENSOR: tuple[str, ...] = ("Muon", "Adafactor")
TORCH_WHOLE_MODEL: tuple[str, ...] = ("LBFGS",)
ATTRIBUTE = "phalanx_elementwise"  # the class attribute a user optimizer declares itself with

_declared: dict[type, StepKind] = {}


@dataclass(frozen=True)
class Classified:
    kind: StepKind
    declared: bool  # False: phalanx guessed (an optimizer it does not know); warn once at prepare
    why: str


def declare_optimizer(optimizer_class: type, *, elementwise: bool) -> None:
    """Tell phalanx how `optimizer_class` reads its parameters. `elementwise=True`: each element
    from its own gradient and state (zero1/zero2/zero3/tp step it on slices, the fast path);
    False: it reads whole tensors (phalanx hands each parameter whole to one owner rank).
    For a class you can edit, a class attribute `phalanx_elementwise = True/False` says the same."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"declare_optimizer takes a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    _declared[optimizer_class] = StepKind.ELEMENTWISE if elementwise else StepKind.WHOLE_TENSOR


def _torch_classes(names: tuple[str, ...]) -> list[type]:
    return [getattr(torch.optim, n) for n in names if hasattr(torch.optim, n)]


def classify(optimizer: torch.optim.Optimizer | type) -> Classified:
    """The kind of `optimizer` (an instance or a class), and whether phalanx knows it or guessed."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for klass in cls.__mro__:
        if klass in _declared:
            return Classified(_declared[klass], True, f"declared with phalanx.declare_optimizer({klass.__name__})")
        own = klass.__dict__.get(ATTRIBUTE)
        if own is not None:
            kind = StepKind.ELEMENTWISE if own else StepKind.WHOLE_TENSOR
            return Classified(kind, True, f"{klass.__name__}.{ATTRIBUTE} = {bool(own)}")
    # torch's own classes, by exact class: a user subclass of Adam may change what its step reads
    for names, kind in (
        (TORCH_ELEMENTWISE, StepKind.ELEMENTWISE),
        (TORCH_WHOLE_TENSOR, StepKind.WHOLE_TENSOR),
        (TORCH_WHOLE_MODEL, StepKind.WHOLE_MODEL),
    ):
        if cls in _torch_classes(names):
            return Classified(kind, True, f"torch.optim.{cls.__name__}")
    return Classified(StepKind.WHOLE_TENSOR, False, f"{cls.__module__}.{cls.__qualname__} is not one phalanx knows")


def reads_its_loss(kind: Classified) -> bool:
    """Whether a step may read the closure's loss (LBFGS's line search and its tolerance on the loss,
    or an optimizer phalanx does not know): replicas must then read the same loss."""
    return kind.kind is StepKind.WHOLE_MODEL or not kind.declared


def undeclared_warning(optimizer: torch.optim.Optimizer, layout: str) -> str:
    """The one warning at prepare for an optimizer phalanx cannot classify."""
    name = type(optimizer).__name__
    return (
        f"phalanx does not know whether {name} (from {type(optimizer).__module__}) reads whole tensors or each element alone; under {layout} it "
        f"steps each parameter whole on one owner rank (correct for either, slower than slices if {name} is "
        f"element-wise). Check the run against one process with `phalanx parity`. HINT: declare it: "
        f"phalanx.declare_optimizer({name}, elementwise=True/False), or a class attribute "
        f"{ATTRIBUTE} = True/False"
    )


def splits_tensors(plan: ParallelPlan) -> bool:
    """Whether `plan` hands an optimizer slices of parameters (zero1's chunks, FSDP2's shards,
    tensor parallel's blocks) rather than whole ones."""
    return plan.shards_parameters or plan.shards_optimizer_only


class Route(enum.Enum):
    """How phalanx steps an optimizer in a layout."""

    AS_GIVEN = "as given"  # the user's optimizer over this rank's (whole) parameters
    SLICES = "on slices"  # element-wise: each rank steps its slices (zero1 chunks, FSDP2 shards, tp blocks)
    WHOLE_ON_OWNER = "whole, on an owner"  # each parameter gathered whole on one owner rank, stepped, scattered


def route(kind: StepKind, plan: ParallelPlan, name: str = "this optimizer", declared: bool = True) -> Route:
    """How an optimizer of `kind` steps under `plan`; ValueError, before any step, for a
    combination phalanx cannot make equal to one process, naming the optimizer (`name`), the layout
    and what to use instead. (docs/optimizers.md's table is this function over the presets.)

    Replicas (ddp) hold whole tensors already; a whole-tensor optimizer phalanx knows (`declared`)
    still steps each parameter on one owner, which sends the result to the others, so the job
    orthogonalises (Muon) or factors (Adafactor) each matrix once per step instead of once per
    replica. One phalanx only guessed at keeps torch's way there: every replica steps everything,
    right even if its step reads more than one tensor at a time."""
    layout = plan.describe()
    if kind is StepKind.WHOLE_MODEL and (splits_tensors(plan) or plan.pp > 1):
        raise ValueError(
            f"{name} reads every parameter of the model at once (one flat vector, a closure over the whole "
            f"model), but {layout} gives no rank the whole model. HINT: use strategy ddp without tp or pp "
            "(every rank holds every parameter), or an optimizer that steps parameter by parameter"
        )
    if kind is StepKind.WHOLE_MODEL and plan.cp > 1:
        raise ValueError(
            f"{name} calls the closure and reads its loss in its line search, but under {layout} each "
            "context-parallel rank computes the loss of its own part of every sequence: the ranks would read "
            "different losses, take different steps and hang. HINT: use strategy ddp without cp (each rank "
            "its share of the batch: phalanx averages the closure's loss over the replicas), or an optimizer "
            "that steps from the gradients alone"
        )
    if not splits_tensors(plan):
        replicas = plan.dp_size > 1
        return Route.WHOLE_ON_OWNER if kind is StepKind.WHOLE_TENSOR and declared and replicas else Route.AS_GIVEN
    if kind is StepKind.ELEMENTWISE:
        return Route.SLICES
    if plan.cpu_offload:
        raise ValueError(
            f"{name} reads whole tensors, which phalanx gathers on one owner rank per parameter; with "
            f"cpu_offload ({layout}) the shards live in CPU memory and that gather is not built. HINT: turn "
            "cpu_offload off, or use zero1 (optimizer state split by whole parameters)"
        )
    return Route.WHOLE_ON_OWNER

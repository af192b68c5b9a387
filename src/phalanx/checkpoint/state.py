"""What a checkpoint holds, collected from and restored into live training objects.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`'s get/set functions, so
one path serves every strategy (full replicas under DDP, DTensor shards under FSDP2, a pipeline
rank's own stages) and keys carry no wrapper prefixes (`module.`), which is what lets a checkpoint
load on another world size or layout. The rest is small and plain: counters, data positions, RNG
states.

The optimizer state is saved *flattened* (checkpoint format 2): one key per parameter,
`state.<name>.exp_avg` and `param_groups.<name>.lr`, as torchtitan saves under pipeline parallel.
torch's nested form (format 1) writes `param_groups` as one list per rank, of which DCP keeps one
copy; under pp each stage's list names its own parameters, so a checkpoint would not move between
layouts. Format 1 checkpoints are still read, with the nested form they were written in.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from phalanx.checkpoint import strided, tied_names


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The innermost torch optimizer inside wrappers that hold it as `.optimizer`.

    Wrappers may themselves subclass Optimizer (e.g. gradient accumulation, which skips the inner
    step on micro-steps): the step hook and the saved state belong to the optimizer that really steps.
    """
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a torch optimizer and wraps none as `.optimizer`")
    return optimizer


def _owns(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    params = {id(p) for p in model.parameters()}
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])


@dataclass
class ModelAndOptimizers(Stateful):
    """One model and the optimizers over its parameters, as DCP's Stateful. `flat`: the optimizer
    state's form, flattened (format 2, what is saved) or nested (format 1, read only). `tied`: the
    model's tied names (checkpoint/tied_names.py), each saved and loaded under its canonical name
    (format 2: a format 1 checkpoint holds every name)."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    flat: bool = True
    tied: Mapping[str, str] = field(default_factory=dict)
    _live_keys: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _strided: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # part -> key -> placements

    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=self.flat)

    def _tied(self) -> Mapping[str, str]:
        return self.tied if self.flat else {}

    def state_dict(self) -> dict[str, Any]:
        live: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizers:
            with _without_empty_groups(self.optimizers):
                live["optim"] = get_optimizer_state_dict(self.model, self.optimizers, options=self._options())
        # DCP asks for this dict on load too (the keys to read): remember what each part holds here
        self._live_keys = {part: list(values) for part, values in live.items()}
        saveable = {part: strided.to_saveable(values) for part, values in live.items()}
        self._strided = {part: kept for part, (_, kept) in saveable.items()}
        return {part: tied_names.to_saved(values, self._tied()) for part, (values, _) in saveable.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._live_keys:
            self.state_dict()
        live = {
            part: strided.from_saveable(
                tied_names.from_saved(values, self._live_keys[part], self._tied()), self._strided.get(part, {})
            )
            for part, values in state_dict.items()
        }
        set_model_state_dict(self.model, live["model"], options=StateDictOptions(strict=True))
        if self.optimizers:
            with _without_empty_groups(self.optimizers), _keeping_step_kind(self.optimizers):
                set_optimizer_state_dict(self.model, self.optimizers, live["optim"], options=self._options())


@contextlib.contextmanager
def _keeping_step_kind(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Keep each group's `foreach`/`fused` as this layout set it: how a step runs is not training
    state. A zero3 checkpoint's groups say foreach=True (every parameter a DTensor); loaded under ep
    with ddp, where experts are DTensors beside plain tensors, torch's multi-tensor step would fail."""
    kept = [[{k: g[k] for k in ("foreach", "fused") if k in g} for g in opt.param_groups] for opt in optimizers]
    try:
        yield
    finally:
        for opt, groups in zip(optimizers, kept):
            for group, kind in zip(opt.param_groups, groups):
                group.update(kind)


@contextlib.contextmanager
def _without_empty_groups(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Hide parameter groups that hold no parameter on this rank while the state is read or
    written, then put them back where they were (an LR scheduler counts on every group). A pipeline
    stage holds such groups (a group of the embedding alone, on the stages without it): torch names
    a group by its parameters, and has no name for one without."""
    hidden = [(opt, [(i, g) for i, g in enumerate(opt.param_groups) if not g["params"]]) for opt in optimizers]
    for opt, empty in hidden:
        if empty:
            opt.param_groups = [g for g in opt.param_groups if g["params"]]
    try:
        yield
    finally:
        for opt, empty in hidden:
            for i, group in empty:  # load_state_dict may have put new group dicts in place: insert into those
                opt.param_groups.insert(i, group)


def group_by_model(
    models: list[nn.Module], optimizers: list[Any], tied: Mapping[int, Mapping[str, str]] | None = None
) -> dict[str, ModelAndOptimizers]:
    """DCP entries `model`, `model_1`, ...: each model with the optimizers over its parameters;
    `tied`: id(model) -> its tied names."""
    entries = {}
    left = [base_optimizer(o) for o in optimizers]
    for i, model in enumerate(models):
        mine = [o for o in left if _owns(model, o)]
        left = [o for o in left if not any(o is m for m in mine)]
        entries["model" if i == 0 else f"model_{i}"] = ModelAndOptimizers(
            model, mine, tied=(tied or {}).get(id(model), {})
        )
    if left:
        raise ValueError(
            f"{len(left)} optimizer(s) act on parameters of no prepared model, so their state cannot be "
            "saved with one. HINT: prepare the model together with its optimizer: px.prepare(model, optimizer)"
        )
    return entries


# ---- RNG: every generator a training step may draw from, per rank ---------------------------
def rng_state() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": (version, list(mt_state), gauss),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:  # another GPU count: each visible device takes the saved state of the same index
            for i in range(min(len(states), torch.cuda.device_count())):
                torch.cuda.set_rng_state(states[i], i)


def seed_all(seed: int) -> None:
    """Seed every generator (for ranks that did not exist when the checkpoint was saved)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

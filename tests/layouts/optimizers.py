"""docs/optimizers.md, generated from the classification the code uses (strategies/optimizers/optimizer_kinds.py):
each optimizer's kind, and `route(kind, plan)` over the plans the presets build for the layouts of
tests/layouts/__init__.py, the one list.

    python -m tests.layouts.optimizers docs/optimizers.md    # regenerate (no path: print it)

tests/docs/test_optimizer_table.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import sys
import torch

from phalanx.config import generated_page
from phalanx.strategies.optimizers.optimizer_kinds import (
    ATTRIBUTE,
    TORCH_ELEMENTWISE,
    TORCH_WHOLE_MODEL,
    TORCH_WHOLE_TENSOR,
    Classified,
    Route,
    StepKind,
    reads_its_loss,
    route,
)
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from tests.layouts import Layout, layouts

COMMAND = "python -m tests.layouts.optimizers docs/optimizers.md"

LAYOUTS: tuple[Layout, ...] = layouts(
    "ddp", "zero1", "zero2", "zero3", "hsdp 2 x 2", "tp 2", "zero3 x tp 2", "pp 2", "zero3, cpu_offload"
)
TITLES = {"ddp": "ddp, one process"}  # the column's cells hold for one process too
LOSS_AVERAGED = "closure's loss averaged"
CELLS = {Route.AS_GIVEN: "as given", Route.SLICES: "slices", Route.WHOLE_ON_OWNER: "**whole, on an owner**"}

INTRO = f"""# Optimizers

<!-- Generated from src/phalanx/strategies/optimizers/optimizer_kinds.py by `{COMMAND}`; do not edit by hand. -->

Layouts that split tensors hand an optimizer slices: zero1 its flat chunks of each parameter, zero2,
zero3 and hsdp FSDP2's row shards, tensor parallel its column or row blocks. For an **element-wise**
optimizer (SGD, Adam, AdamW, ...: each element is updated from its own gradient and state) stepping the
slices is the same as stepping the whole tensor, and fast. For an optimizer that reads a **whole
tensor** it is not: Muon orthogonalises the whole matrix (Newton-Schulz), Adafactor factors rows and
columns and scales by the parameter's RMS, a LAMB-style trust ratio takes the whole tensor's norm. On
slices they would train silently differently, so phalanx gives each such parameter to one **owner**
rank (balanced by size), gathers its full gradient there, steps the whole tensor with your optimizer
class, and scatters the result back to the shards. Muon thus runs exactly one Newton-Schulz per matrix
per step in the whole job, split over the ranks. Under zero1 the state of a whole-tensor optimizer is
split by whole parameters (each on its owner) instead of by slices.

Cells: *as given*: your optimizer steps the parameters each rank holds whole (every ddp replica
steps everything; under pp alone each rank steps its own stages); *slices*: each rank steps its
slices (the fast sharded paths); **whole, on an owner**: as above; *refused*: prepare raises a
ValueError naming the optimizer, the layout and what to use, before any step.

*{LOSS_AVERAGED}*: an optimizer whose step calls the closure and may read its loss (LBFGS: the
strong-Wolfe line search and `tolerance_change` read it; one phalanx does not know might) would read
each replica's own loss and the replicas would take different steps, then hang. phalanx averages the
loss the closure returns over the data-parallel ranks (the gradients already are), so with each rank
on its share of the batch every replica takes one process's step on the whole batch. Write the loop
as torch's docs do: `def closure(): optimizer.zero_grad(); loss = loss_fn(model(x), y);
loss.backward(); return loss`, then `optimizer.step(closure)`; the step returns the averaged loss.
Under context parallel (cp) LBFGS is refused: each cp rank's loss is that of its part of the sequence.
"""

DECLARE = f"""
## Your own optimizer

phalanx cannot read an optimizer's step, so an optimizer it does not know is treated as
whole-tensor (always correct, slower than slices if it is in fact element-wise), and prepare warns
once, naming the class and `phalanx parity` as the check against one process. Declare it to choose
and to silence the warning, either on the class or, for a class you cannot edit, by registering it:

```python
class Lion(torch.optim.Optimizer):
    {ATTRIBUTE} = True   # each element from its own gradient and state: steps slices

import phalanx
phalanx.declare_optimizer(SomeonesLamb, elementwise=False)   # reads whole tensors
```

A subclass of a torch optimizer counts as your own (its step may read more than the parent's), unless
it or a parent declares itself. Several optimizers over one model (Muon on the matrices, AdamW on the
rest, as torch's Muon requires) are prepared together and each takes its own path:
`model, muon, adamw = px.prepare(model, muon, adamw)`.

The owners rebuild your class over their whole tensors as `YourClass(param_groups, **defaults)`,
so keep its constructor arguments in the defaults it passes to `torch.optim.Optimizer.__init__`
(prepare refuses a class that cannot be rebuilt so, naming it). Param groups are fixed at prepare.

## ddp, zero1 and the Newton-Schulz work

Under ddp every rank holds every parameter and DDP's all-reduce leaves the gradients whole. A
whole-tensor optimizer phalanx knows (Muon, Adafactor, yours declared) still steps each parameter on
one owner, which broadcasts the result: the job runs one Newton-Schulz per matrix per step where
torch's Muon under DDP runs it on every rank, and the optimizer state is split by whole parameters,
as under zero1. An optimizer phalanx only guessed at steps as given on every rank under ddp (its
step may read more than one tensor, which only the whole model on every rank makes right). With
Join (`px.uneven_inputs`), a rank out of data still takes part in the owners' broadcasts.

## Checkpoints

A whole-tensor optimizer saves its state whole (each owner's tensors, as one process would hold
them), so a checkpoint resumes under any layout: zero3 to ddp, zero1 on 2 ranks to 1 rank, and back.
Saving briefly holds every state tensor on every rank.

## Cost

Per step, over what the layout moves anyway: each sharded parameter's gradient gathered (under zero1
the gradients are whole already) and one broadcast per owner of its updated parameters.
`bench/optimizers.py` measures step time and bytes moved for Muon beside AdamW
([Benchmarks](benchmarks.md)).
"""


def _cell(kind: StepKind, plan: ParallelPlan, declared: bool) -> str:
    try:
        cell = CELLS[route(kind, plan, declared=declared)]
    except ValueError:
        return "refused"
    averaged = plan.dp_size > 1 and reads_its_loss(Classified(kind, declared, ""))
    return f"{cell}, {LOSS_AVERAGED}" if averaged and cell == CELLS[Route.AS_GIVEN] else cell


def rows() -> list[tuple[str, StepKind, bool]]:
    """(row title, kind, declared) for torch's optimizers and a user's, in the table's order."""
    out = [(f"`torch.optim.{n}`", StepKind.ELEMENTWISE, True) for n in TORCH_ELEMENTWISE if hasattr(torch.optim, n)]
    out += [(f"`torch.optim.{n}`", StepKind.WHOLE_TENSOR, True) for n in TORCH_WHOLE_TENSOR if hasattr(torch.optim, n)]
    out += [(f"`torch.optim.{n}`", StepKind.WHOLE_MODEL, True) for n in TORCH_WHOLE_MODEL if hasattr(torch.optim, n)]
    return out + [
        ("yours, declared element-wise", StepKind.ELEMENTWISE, True),
        ("yours, declared whole-tensor", StepKind.WHOLE_TENSOR, True),
        ("yours, undeclared (warns at prepare)", StepKind.WHOLE_TENSOR, False),
    ]


def table_text() -> str:
    """docs/optimizers.md as the classification says it should read."""
    plans = {TITLES.get(item.name, item.name): item.plan() for item in LAYOUTS}
    lines = [INTRO, "| optimizer | kind | " + " | ".join(plans) + " |", "|---|---|" + "---|" * len(plans)]
    for title, kind, declared in rows():
        lines.append(
            f"| {title} | {kind.value} | " + " | ".join(_cell(kind, p, declared) for p in plans.values()) + " |"
        )
    return "\n".join(lines) + "\n" + DECLARE


def main(argv: list[str] | None = None) -> int:
    return generated_page.main(argv, table_text, COMMAND)


if __name__ == "__main__":
    sys.exit(main())

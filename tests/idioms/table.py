"""The idiom x layout table: each script of tests.idioms.corpus under each layout, and what each cell
is declared to give: equal to the same loop in plain torch in one process, or refused at the call
with a phalanx message (a fragment of it is declared). tests/idioms/test_corpus.py runs every cell
and asserts it is what this table says; docs/compatibility.md shows this table (tests/idioms/page.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RTOL = 2e-4
WEIGHTS_ATOL = 1e-4


@dataclass(frozen=True)
class Layout:
    settings: dict[str, Any]
    """Phalanx(...) arguments."""
    processes: int


LAYOUTS: dict[str, Layout] = {
    "ddp": Layout({"strategy": "ddp"}, 2),
    "zero1": Layout({"strategy": "zero1"}, 2),
    "zero2": Layout({"strategy": "zero2"}, 2),
    "zero3": Layout({"strategy": "zero3"}, 2),
    "hsdp 2 x 2": Layout({"strategy": "hsdp"}, 4),
    "tp 2": Layout({"strategy": "ddp", "tp": 2}, 2),
    "pp 2": Layout({"strategy": "ddp", "pp": 2, "pp_microbatches": 2}, 2),
    "pp 2 x ddp 2": Layout({"strategy": "ddp", "pp": 2, "pp_microbatches": 2}, 4),
    "cp 2": Layout({"strategy": "ddp", "cp": 2}, 2),
    "cp 2 x dp 2": Layout({"strategy": "ddp", "cp": 2}, 4),
    "zero3 x tp 2": Layout({"strategy": "zero3", "tp": 2}, 4),
}

IDIOMS: dict[str, str] = {
    "labels": "transformers Llama, `model(input_ids=ids, labels=ids).loss`, `px.backward(loss)`, torch's "
    "`clip_grad_norm_`, `px.reduce(loss)` logged",
    "token-tensor": "a plain token tensor through `px.forward_backward(model, x, y, loss_fn)`, `loss_fn` reading "
    "`out.logits`",
    "grad-accumulation": "the token-tensor loop with `loss / 2` on each micro-batch, a step every 2nd (no `no_sync`)",
    "peft-lora": "the token-tensor loop on peft's LoRA (r 4 on q_proj, v_proj)",
    "tied-embeddings": "the token-tensor loop on a Llama with `tie_word_embeddings=True`",
    "moe": "the token-tensor loop on a mixture of experts: Qwen3-MoE, 4 experts, top 2, `output_router_logits=False`",
    "softcap": "the token-tensor loop on Gemma2 (attention softcap 1.0, sliding window 6)",
    "own-sampler": "an MLP with the script's own `DistributedSampler` (`set_epoch` each epoch) and torch's "
    "`loss.backward()`",
    "batch-sampler": "the MLP loop with the script's own `BatchSampler(RandomSampler(data, generator=...), 8 // "
    "dp_size)` as `batch_sampler=`, two epochs",
    "short-last-batch": "19 items, global batch 8, `drop_last=False`: the last step trains on 3",
    "split-by-node": "a `datasets` stream split by the script with `split_dataset_by_node`: item ids read over "
    "2 epochs",
    "ema": "torch's `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))` of the prepared model after "
    "each step (under pp each rank's copy holds its stages: their union is compared)",
    "generate": "2 token-tensor steps, then greedy `model.generate` on the prepared model",
    "save-pretrained": "2 token-tensor steps, then `px.unwrap_model(model).save_pretrained(d)` on every rank, "
    "loaded back with `from_pretrained`",
    "uneven-reduce": "unequal shares per rank inside `px.uneven_inputs(model)`, `px.reduce(loss)` logged; the "
    "reference is torch's Join, written in one process",
}


@dataclass(frozen=True)
class Refused:
    """Refused at the call: `says` is part of phalanx's message, `why` the table's short reason."""

    says: str
    why: str


@dataclass(frozen=True)
class Failing:
    """Neither equal nor refused: a known bug, with what was measured (the test expects it to fail,
    strictly: the day it passes, the table must say equal)."""

    measured: str


EQUAL = "equal"

_PP_CALL = Refused(
    "calling it runs only those stages' units",
    "under pp the model is one stage: the loop must call `px.forward_backward` (the HINT says so)",
)
_PP_REPLICAS = Refused(
    "px.uneven_inputs under pipeline parallel with 2 data-parallel replicas",
    "under pp x dp a replica out of data cannot meet the others' gradient reductions through its stages: "
    "`px.uneven_inputs` is refused at the call, where it stopped at the shortest replica's data (the HINT: "
    "even shards)",
)
_NO_TP_PLAN = Refused(
    "has no tensor-parallel plan", "an `nn.Sequential` MLP has no tensor-parallel plan (the HINT: give `tp_plan`)"
)
_TP = ("tp 2", "zero3 x tp 2")
_PP = ("pp 2", "pp 2 x ddp 2")
_MODEL_CALL = ("own-sampler", "batch-sampler", "short-last-batch", "uneven-reduce")
"""the scripts that call the MLP themselves (`model(x)`), as torch's docs write them."""
_CP_NO_SEQUENCE = Refused(
    "no attention of Sequential went across the cut",
    "cp cuts dim 1 of what `px.forward_backward` is given as the sequence: an MLP has none (the HINT: cp=1)",
)
EXPECTED: dict[tuple[str, str], Any] = {
    **{(idiom, layout): EQUAL for idiom in IDIOMS for layout in LAYOUTS},
    **{("labels", layout): _PP_CALL for layout in _PP},
    **{("generate", layout): _PP_CALL for layout in _PP},
    **{(idiom, layout): _PP_CALL for idiom in _MODEL_CALL for layout in _PP},
    ("uneven-reduce", "pp 2 x ddp 2"): _PP_REPLICAS,
    **{(idiom, layout): _NO_TP_PLAN for idiom in (*_MODEL_CALL, "ema") for layout in _TP},
    **{("ema", layout): _CP_NO_SEQUENCE for layout in ("cp 2", "cp 2 x dp 2")},
}
"""(idiom, layout) -> EQUAL, Refused(...) or Failing(...); test_corpus runs every pair and asserts it."""


def layouts_of(processes: int) -> list[str]:
    return [name for name, layout in LAYOUTS.items() if layout.processes == processes]


def table() -> str:
    """The idiom x layout table of docs/compatibility.md, with the refusals' and failures' reasons below."""
    rows = ["| idiom | " + " | ".join(LAYOUTS) + " |", "|" + "---|" * (len(LAYOUTS) + 1)]
    notes: list[str] = []
    for idiom in IDIOMS:
        entries = []
        for layout in LAYOUTS:
            state = EXPECTED[(idiom, layout)]
            if state == EQUAL:
                entries.append("equal")
                continue
            note = state.why if isinstance(state, Refused) else state.measured
            if note not in notes:
                notes.append(note)
            label = "refused" if isinstance(state, Refused) else "**fails**"
            entries.append(f"{label} ({notes.index(note) + 1})")
        rows.append(f"| `{idiom}` | " + " | ".join(entries) + " |")
    rows.append("")
    rows += [f"({i}) {note}." for i, note in enumerate(notes, 1)]
    return "\n".join(rows) + "\n"


def section() -> str:
    """The corpus's part of docs/compatibility.md."""
    idioms = "\n".join(f"- `{name}`: {what}" for name, what in IDIOMS.items())
    layouts = ", ".join(f"{name} ({layout.processes} processes)" for name, layout in LAYOUTS.items())
    return f"""
## Your idioms, in every layout

`tests/idioms/` holds training loops written the way torch's, transformers', peft's and datasets' docs
write them, each touching phalanx only where a user adds it (`px = Phalanx(...)`, `px.prepare`,
`px.backward` or torch's own `loss.backward()`, `px.forward_backward`). Each runs under every layout
({layouts}; tiny models, 3-4 steps) and is compared with **the same loop in plain torch/transformers in
one process, with no phalanx**. **equal**: every step's loss and gradient norm (torch's
`clip_grad_norm_`) within {RTOL:g} relative in fp32, the final weights allclose (rtol {RTOL:g}, atol
{WEIGHTS_ATOL:g}), the items trained on (and the ids read, the tokens generated) exactly one process's.
**refused**: phalanx stops the call with a message naming the way (reason below). **fails**: a known
bug, measured below; `tests/idioms/test_corpus.py` expects exactly these states, so this table cannot
claim what the test does not check.

Idioms:

{idioms}

{table()}"""

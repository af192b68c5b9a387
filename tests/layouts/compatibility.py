"""What works with what: every layout x model x feature cell phalanx is tested with and its outcome,
the one source of the composition matrix test (tests/dist/test_compatibility.py) and of the first part
of the docs page docs/compatibility.md (`python -m tests.idioms.page docs/compatibility.md` writes it,
with the idiom corpus's table from tests/idioms/table.py after it).

A cell is "equal" (per-step loss within {RTOL:g} relative of one process with the same settings on the
same global batches over 6 steps, final weights allclose) or refused at prepare with the reason given
here (the test checks the message holds it)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.layouts import Layout, layouts

LAYOUTS: tuple[Layout, ...] = layouts(
    "ddp", "zero1", "zero2", "zero3", "hsdp 2 x 2", "tp 2", "zero3 x tp 2", "pp 2", "pp 2 x ddp 2", "pp 2 x tp 2"
)

MODELS: dict[str, str] = {
    "llama": "transformers `LlamaForCausalLM` from a small config (2 layers, 4 heads, 2 key/value heads)",
    "llama-lora": "the same Llama wrapped in a peft LoRA (r 4 on q_proj, v_proj)",
    "cnn-bn": "a CNN with BatchNorm2d and BatchNorm1d (the layers before them without bias: a bias there gets no "
    "gradient), `sync_batchnorm=True`",
}

FEATURES: dict[str, str] = {
    "num_items": "token-weighted loss: `px.forward_backward(model, x, y, summed_loss, num_items=tokens)`, a third "
    "of the labels ignored",
    "clip": "gradient clipping: `px.clip_grad_norm_(model.parameters(), 1.0)`",
    "accum2": "`grad_accum_steps=2` with `px.accumulate(model)`",
    "bf16": '`mixed_precision="bf16"`',
    "resume": "saved at step 3 under the layout named, resumed here for steps 4-6",
    "preempt": "SIGTERM after step 3: checkpoint and exit 143, then the same layout resumes for steps 4-6",
    "ac": "`activation_checkpointing=True` (each transformer block recomputed in backward); the reference runs "
    "without it",
    "compile": '`compile={"backend": "aot_eager"}` (each transformer block\'s forward through `torch.compile`: '
    "dynamo's graphs and AOTAutograd's backward, run by torch's kernels); the reference runs eager. Not inductor: "
    "its C++ compile took 57 s of the 6 steps of one process here, against 10 s; inductor's losses equal eager "
    "under ddp and zero3 in tests/dist/test_zero3_meta.py",
}

COMPILE = {"backend": "aot_eager"}
"""the compile feature's torch.compile options: inductor's C++ compile took 57 s for one process's 6 steps
here against 10 s with aot_eager (2 shared CPU cores), and the matrix compiles once per cell and rank.
Inductor under ddp and zero3 is tested by tests/dist/test_zero3_meta.py (second tier)."""


RTOL = 2e-4
WEIGHTS_ATOL = 1e-4
"""final weights: rtol RTOL and this atol (1% of one AdamW step of lr 1e-2: an entry near 0 moves by
whole steps on gradients that differ in the last bits)."""
BF16_TOLERANCE = {"losses": 1e-2, "norms": 5e-2, "weights": 1e-1}
"""bf16 rounds every product to 8 bits of mantissa (relative steps of 2^-8 = 3.9e-3): a layout that
splits or reorders a sum (tp's partial matmuls, sharded reductions, zero3's bf16 parameters against
autocast) rounds differently from one process, and AdamW turns those differences in small gradient
entries into whole steps of lr. Measured over 6 steps: losses within 2.3e-3, norms within 3%, the
embedding (the tensor furthest off) within 1.6% under ddp and pp and 7% under the FSDP layouts and tp.
The weights are compared tensor by tensor: |w - w_ref| / |w_ref| (Frobenius norms) within "weights"."""


@dataclass(frozen=True)
class Cell:
    layout: str
    model: str
    features: tuple[str, ...]
    refused: str | None = None
    """what phalanx's refusal at prepare says; None: equal to one process."""
    resume_from: str | None = None
    """for "resume": the layout that trained steps 1-3 and saved."""

    @property
    def tolerance(self) -> dict[str, float]:
        """How close to one process each step's loss and norm (relative) and the final weights
        (relative and absolute) must be."""
        if "bf16" in self.features:
            return BF16_TOLERANCE
        return {"losses": RTOL, "norms": RTOL, "weights": RTOL, "weights_atol": WEIGHTS_ATOL}

    @property
    def name(self) -> str:
        extra = f" from {self.resume_from}" if self.resume_from else ""
        return f"{self.layout} / {self.model} / {'+'.join(self.features)}{extra}"


_RESUME_FROM = {
    "ddp": "zero3",
    "zero1": "ddp",
    "zero2": "zero1",
    "zero3": "tp 2",
    "tp 2": "pp 2",
    "pp 2": "ddp",
    "hsdp 2 x 2": "pp 2 x ddp 2",
    "zero3 x tp 2": "hsdp 2 x 2",
    "pp 2 x ddp 2": "zero3 x tp 2",
    "pp 2 x tp 2": "pp 2 x ddp 2",
}


_BN_PP = "sync_batchnorm with pp=2: a pipeline runs each microbatch through"
_BN_TP = "Sequential has no tensor-parallel plan: phalanx does not know which of its layers to split"
INSTEAD = {
    _BN_PP: "BatchNorm's statistics would cover one microbatch, not the global batch; train it under a "
    "data-parallel layout (ddp, zero1/2/3, hsdp), or use GroupNorm / LayerNorm to use pp",
    _BN_TP: "give `tp_plan` (module name pattern -> colwise / rowwise / ...), or use a data-parallel layout",
}
"""refusal -> what the page says to use instead (the message's own HINT says it too)."""


def _cells() -> tuple[tuple[Cell, ...], tuple[tuple[str, str, str], ...]]:
    cells: list[Cell] = []
    pending: list[tuple[str, str, str]] = []  # (layout, model or feature, why): none at present
    for layout in LAYOUTS:
        cells += [
            Cell(layout.name, "llama", ("num_items", "clip", "accum2")),
            Cell(layout.name, "llama", ("bf16", "clip")),
            Cell(layout.name, "llama-lora", ("clip",)),
            Cell(
                layout.name,
                "cnn-bn",
                ("clip",),
                refused=_BN_PP if "pp" in layout.settings else _BN_TP if "tp" in layout.settings else None,
            ),
            Cell(layout.name, "llama", ("clip", "resume"), resume_from=_RESUME_FROM[layout.name]),
            Cell(layout.name, "llama", ("clip", "preempt")),
            Cell(layout.name, "llama", ("ac", "clip")),
            Cell(layout.name, "llama-lora", ("ac", "clip")),
            Cell(layout.name, "llama", ("compile", "clip")),
        ]
    return tuple(cells), tuple(pending)


CELLS, PENDING = _cells()
"""PENDING: (layout, model or feature, why) combinations left out of the matrix while a known bug in
them is being fixed; the page says so in their cell."""


def cell(name: str) -> Cell:
    for item in CELLS:
        if item.name == name:
            return item
    raise ValueError(f"unknown cell {name!r}")


def table() -> str:
    """One row per layout; one column per model; each entry the feature sets tested and their outcome."""
    rows = ["| layout | processes | " + " | ".join(f"`{m}`" for m in MODELS) + " |", "|" + "---|" * (len(MODELS) + 2)]
    notes: list[str] = []
    pending: list[str] = []
    for item in LAYOUTS:
        entries = []
        for model in MODELS:
            parts = []
            for c in CELLS:
                if c.layout != item.name or c.model != model:
                    continue
                what = " + ".join(c.features) + (f" (from {c.resume_from})" if c.resume_from else "")
                if c.refused is None:
                    parts.append(f"{what}: equal")
                else:
                    if c.refused not in notes:
                        notes.append(c.refused)
                    parts.append(f"{what}: refused ({notes.index(c.refused) + 1})")
            for where, what, why in PENDING:
                if where == item.name and what in (model, *(FEATURES if model == "llama" else ())):
                    if why not in pending:
                        pending.append(why)
                    label = "" if what == model else f"{what}: "
                    parts.append(f"{label}not yet [{pending.index(why) + 1}]")
            entries.append("<br>".join(parts))
        rows.append(f"| {item.name} | {item.processes} | " + " | ".join(entries) + " |")
    rows.append("")
    rows += [f'({i}) refused at prepare: "{why}...": {INSTEAD[why]}.' for i, why in enumerate(notes, 1)]
    rows += [f"[{i}] not in the matrix yet: {why}." for i, why in enumerate(pending, 1)]
    return "\n".join(rows) + "\n"


COMMAND = "python -m tests.idioms.page docs/compatibility.md"
"""writes the page: this module's part, then the idiom corpus's (tests/idioms/table.py: kept with its
test, out of the runtime package)."""


def page_text(idioms: str = "") -> str:
    """docs/compatibility.md as this module says it should read, with `idioms` (the idiom corpus's
    section) at its end."""
    models = "\n".join(f"- `{name}`: {what}" for name, what in MODELS.items())
    features = "\n".join(f"- `{name}`: {what}" for name, what in FEATURES.items())
    return f"""# What works with what

<!-- generated from tests/layouts/compatibility.py and tests/idioms/table.py by `{COMMAND}`: edit those, not this page -->

Each layout below was run with each model and feature set listed in its row by
`tests/dist/test_compatibility.py` (one launch per process count). **equal**: every step's loss within
{RTOL:g} relative of the same loop in plain torch/transformers in one process, with no phalanx, on the same
global batches over 6 steps (phalanx's own world of one, `python train.py`, equals that loop bitwise; with
`num_items` to the last bits, as it rescales the summed gradients at the step), and the final weights allclose (rtol {RTOL:g}, atol {WEIGHTS_ATOL:g}). **refused**: prepare stops before the
first step with the reason quoted below the table. With bf16 a layout that splits or reorders a sum
rounds it differently from one process (bf16's step is 2^-8 = 3.9e-3), so those cells are held to
losses within {BF16_TOLERANCE["losses"]:g} and gradient norms within {BF16_TOLERANCE["norms"]:g} relative, each
weight tensor within {BF16_TOLERANCE["weights"]:g} relative (norm of the difference over the norm). Every cell comes from the list this page is
generated from, the list the test reads: the page cannot claim what the test does not check.

Models:

{models}

Features:

{features}

{table()}
Per-family results of transformers models (Qwen2, Mistral, Gemma3, GPT-2, tied embeddings) are on
[Models](models.md).
{idioms}"""

"""The transformers model families phalanx is tested with, and what each layout does with them: the
one source of the family sweep (tests/dist/test_families.py) and of the models table in the docs
(docs/models.md: `python -m tests.layouts.families docs/models.md` writes it). The layouts are
tests/layouts/__init__.py's, the one list.

Each family is built from a small config of its own class (the code paths of the pretrained
checkpoints users load, nothing downloaded): `build("llama-tied")`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from phalanx.config import generated_page
from tests.layouts import Layout, layout, layouts


@dataclass(frozen=True)
class Family:
    """A transformers causal-LM family as phalanx meets it."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    """the small config's own settings (on top of the shared sizes)."""
    refused: dict[str, str] = field(default_factory=dict)
    """layout -> what phalanx's refusal at prepare says (every other layout equals one process)."""


_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
_GPT2_SIZES = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32}
# what the refusal says (the sweep checks the message holds it; the docs table quotes it)
_NO_PP_PLAN = "GPT2LMHeadModel declares no pipeline layout"
_NO_TP_PLAN = "GPT2LMHeadModel has no tensor-parallel plan"

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    Family("llama-tied", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": 4}),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"tie_word_embeddings": True, "head_dim": 8, "sliding_window": 4},
    ),
    Family(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        {"tie_word_embeddings": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        refused={"tp 2": _NO_TP_PLAN, "zero3 x tp 2": _NO_TP_PLAN, "pp 2": _NO_PP_PLAN, "pp 2 x ddp 2": _NO_PP_PLAN},
    ),
)

LAYOUTS: dict[str, Layout] = {
    item.name: item for item in layouts("ddp", "zero3", "tp 2", "zero3 x tp 2", "pp 2", "pp 2 x ddp 2")
}
"""the sweep's columns: layout name -> the layout (its settings and processes)."""


@dataclass(frozen=True)
class MoeFamily:
    """A transformers mixture-of-experts family under expert parallel: each layout it equals one process
    in names the case of tests/dist/test_expert_parallel.py that checks it (tests/docs checks they exist)."""

    name: str
    model_class: str
    cases: dict[str, str]
    refused: dict[str, str] = field(default_factory=dict)
    """MOE_LAYOUTS column -> what prepare's refusal of this family there says (its test asserts it)."""
    """MOE_LAYOUTS column -> the case name in test_expert_parallel's CASES, MORE, COPIES or TENSOR ("pp ddp",
    "pp zero3": the strategies of its pp 2 x ep 2 test, ep_workloads.ep_pp_layouts)."""


MOE_LAYOUTS: dict[str, str] = {
    "ddp ep 2": "2 processes",
    "zero3 ep 2": "2 processes",
    "ddp ep 2, aux loss": "2 processes, coefficient 0.05",
    "ddp cp 2 x ep 2": "2 processes",
    "ddp ep 2, 2 copies": "4 processes",
    "zero3 ep 2, 2 copies": "4 processes",
    "ddp ep 4": "4 processes",
    "zero3 ep 4": "4 processes",
    "ddp pp 2 x ep 2": "4 processes",
    "zero3 pp 2 x ep 2": "4 processes",
    "ddp ep 2 x tp 2": "4 processes",
    "zero3 ep 2 x tp 2": "4 processes",
}
"""the expert-parallel table's columns: name -> its processes."""
MOE_REFUSED: dict[str, str] = {}
"""columns every MoE family is refused in at prepare: what the refusal says."""
MOE_FAMILIES: tuple[MoeFamily, ...] = (
    MoeFamily(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "ddp ep 2": "qwen3_moe",
            "zero3 ep 2": "qwen3_moe zero3",
            "ddp ep 2, aux loss": "qwen3_moe aux",
            "ddp cp 2 x ep 2": "qwen3_moe cp2",
            "ddp pp 2 x ep 2": "pp ddp",
            "zero3 pp 2 x ep 2": "pp zero3",
            "ddp ep 2 x tp 2": "qwen3_moe ep2 tp2",
            "zero3 ep 2 x tp 2": "qwen3_moe zero3 ep2 tp2",
        },
    ),
    MoeFamily(
        "mixtral",
        "MixtralForCausalLM",
        {
            "ddp ep 2": "mixtral",
            "ddp ep 2, 2 copies": "mixtral ddp",
            "zero3 ep 2, 2 copies": "mixtral zero3",
            "ddp ep 4": "mixtral ep4",
            "zero3 ep 4": "mixtral zero3 ep4",
            "ddp ep 2 x tp 2": "mixtral ep2 tp2",
            "zero3 ep 2 x tp 2": "mixtral zero3 ep2 tp2",
        },
    ),
    MoeFamily("olmoe", "OlmoeForCausalLM", {"ddp ep 2": "olmoe", "ddp ep 2 x tp 2": "olmoe ep2 tp2"}),
    MoeFamily(
        "gpt_oss",
        "GptOssForCausalLM",
        {"ddp ep 2": "gpt_oss"},
        # test_expert_parallel.py::test_ep2_x_tp2_refuses_gpt_oss_whose_tp_plan_leaves_its_experts_whole
        {
            "ddp ep 2 x tp 2": "GptOssForCausalLM's expert weight model.layers.0.mlp.experts.gate_up_proj is replicated by tensor parallel ..."
        },
    ),
    MoeFamily(
        "deepseek_v3", "DeepseekV3ForCausalLM", {"ddp ep 2": "deepseek_v3", "ddp ep 2 x tp 2": "deepseek_v3 ep2 tp2"}
    ),
)


def family(name: str) -> Family:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(f.name for f in FAMILIES)}")


def build(name: str, vocab_size: int = 64) -> nn.Module:
    """The family's model from its small config, initialised by transformers (seed it first)."""
    import transformers

    fam = family(name)
    sizes = _GPT2_SIZES if fam.config_class == "GPT2Config" else _SIZES
    config = getattr(transformers, fam.config_class)(
        vocab_size=vocab_size, attn_implementation="eager", **sizes, **fam.config
    )
    return getattr(transformers, fam.model_class)(config)


def processes(name: str) -> int:
    """How many processes the sweep runs layout `name` on."""
    return layout(name).processes


def table() -> str:
    """The models table of docs/models.md: each family x layout, equal to one process or refused."""
    head = "| model | tied embeddings | " + " | ".join(LAYOUTS) + " |"
    rows = [head, "|" + "---|" * (len(LAYOUTS) + 2)]
    notes: list[str] = []
    for fam in FAMILIES:
        cells = []
        for name in LAYOUTS:
            why = fam.refused.get(name)
            if why is None:
                cells.append("equal")
            else:
                if why not in notes:
                    notes.append(why)
                cells.append(f"refused ({notes.index(why) + 1})")
        tied = "yes" if fam.config.get("tie_word_embeddings") else "no"
        rows.append(f"| {fam.name} (`{fam.model_class}`) | {tied} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f'({i}) refused at prepare: "{why}".' for i, why in enumerate(notes, 1)]
    return "\n".join(rows) + "\n"


def moe_table() -> str:
    """The expert-parallel table of docs/models.md: each MoE family x ep layout, equal, refused or untested."""
    rows = [
        "| model | " + " | ".join(f"{name} ({procs})" if procs else name for name, procs in MOE_LAYOUTS.items()) + " |",
        "|" + "---|" * (len(MOE_LAYOUTS) + 1),
    ]
    refusals = [{**MOE_REFUSED, **fam.refused} for fam in MOE_FAMILIES]
    notes = list(dict.fromkeys(why for refused in refusals for why in refused.values()))
    for fam, refused in zip(MOE_FAMILIES, refusals):
        cells = [
            "equal"
            if name in fam.cases
            else f"refused ({notes.index(refused[name]) + 1})"
            if name in refused
            else "not tested"
            for name in MOE_LAYOUTS
        ]
        rows.append(f"| {fam.name} (`{fam.model_class}`) | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f'({i}) refused at prepare: "{why}".' for i, why in enumerate(notes, 1)]
    return "\n".join(rows) + "\n"


MOE_INTRO = """
## Mixture of experts under expert parallel

Each MoE family from a small config of its own class (4 experts, top 2, 2 layers, hidden 32), trained 5
AdamW steps with transformers' loop (`labels=`, torch's `clip_grad_norm_`) under `Phalanx(ep=2, ...)` by
`tests/dist/test_expert_parallel.py` against the same loop in one process ([mixture of experts](moe.md)).
**equal**: every step's loss and grad norm within 2e-4 relative, every final weight too. "2 copies":
4 processes, each expert on 2 of them. "ep 2 x tp 2": each ep rank's experts split over its 2 tp ranks as
transformers' MoE tp plan says. "aux loss": the router's load-balancing loss on
(`output_router_logits=True`, `router_aux_loss_coef=0.05`). **not tested**: no test runs it yet.

"""

COMMAND = "python -m tests.layouts.families docs/models.md"

INTRO = f"""# Models: what works with what

<!-- generated from tests/layouts/families.py by `{COMMAND}`: edit that, not this page -->

Models from transformers, as they come: each family below is built from a small config of its own
class (the code paths of the pretrained checkpoints users load) and trained for 6 steps in each
layout by `tests/dist/test_families.py`, through `px.forward_backward`, clipping with torch's own
`torch.nn.utils.clip_grad_norm_` (under pp too: its norm is the whole pipeline's). **equal**: every step's loss and
gradient norm equal one process on the same global batches (within 2e-4 relative). **refused**: prepare
stops before the first step with the reason quoted below.

- **Tied embeddings** (GPT-2, Gemma, Qwen2.5-0.5B, Llama-3.2-1B) stay one parameter with one gradient:
  under zero3 and hsdp it lives in one sharding unit; under tp the embedding is split by rows like the
  output projection beside it (both `Shard(0)`); under pp the first and last stage each hold it and
  their gradients are summed before the step (Megatron's way), and `px.load_model` reads it from the
  one tensor a checkpoint stores. `px.save_state` stores it once in every layout, under
  `model.embed_tokens.weight`, so checkpoints move between pp and the other layouts both ways.
- **Pipeline stages** are cut from the model's own `base_model_pp_plan` (embeddings on the first
  stage, decoder layers split, norm and head on the last), also inside a peft (LoRA) wrapper; a model
  without one is cut by tracing its forward, or refused with the reason.
- **Tensor parallel** follows the model's own plan and its styles (`colwise`, `rowwise`,
  `colwise_gather_output`, `embedding_rowwise`, `replicate`, `replicated_with_grad_allreduce`,
  `packed_colwise`, `moe_tp_experts`, ...);
  every parameter is then a DTensor on the tp mesh (`Replicate()` where the plan splits nothing), so
  torch's `clip_grad_norm_`, `clip_grad_value_` and foreach optimizers work on the prepared model.
- **Mixture of experts under tp 2**: Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral
  (`MixtralForCausalLM`), 4 experts, top 2, the router's load-balancing loss in the loss: **equal**
  under `tp 2` (transformers' `packed_colwise`, `rowwise` and `moe_tp_experts` styles on the fused
  3-D expert weights; tests/dist/test_moe_tp.py, transformers' own loop with `labels=`).
- **The router's load-balancing loss** (`output_router_logits=True`, `router_aux_loss_coef`) is a
  product of two means over the whole batch, so each rank's own would not average to one process's:
  while a prepared model trains, phalanx sums its statistics over the data-parallel and cp ranks
  (padding left out, as transformers does; under cp the cut's padding too), so every rank's
  `out.aux_loss` and the gradients are one process's under ddp, zero3, cp 2, zero3 x tp 2 and
  zero3 x cp 2 (tests/dist/test_moe_aux_loss.py; model/router_balance.py).

Layouts: {", ".join(f"`{name}`" for name in LAYOUTS)} (the ones with "x" on 4 processes, the others on 2;
pp with 2 microbatches).

"""


def page_text() -> str:
    """docs/models.md as this module says it should read."""
    return INTRO + table() + MOE_INTRO + moe_table()


def main(argv: list[str] | None = None) -> int:
    return generated_page.main(argv, page_text, COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())

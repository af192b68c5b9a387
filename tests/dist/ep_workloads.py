"""Training runs for the expert-parallel tests: tiny transformers MoE models (4 experts, top 2) trained
as transformers' docs write the loop (`labels=`, `loss.backward()`, torch's `clip_grad_norm_`, AdamW)
under `Phalanx(ep=2, ...)`, and the same loop in one process with no phalanx, computed in rank 0 on
the same global batches. The router's load-balancing loss is off (`output_router_logits=False`)
unless a case asks for it (`aux`: its coefficient; model/router_balance.py makes it the global batch's)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

VOCAB, SEQ, SAMPLES, STEPS, BATCH, LR, MAX_NORM = 64, 8, 48, 5, 8, 1e-3, 1.0
ACCUM = 2  # micro-batches per optimizer step in the accumulation cases


def make_model(family: str, experts: int = 4, aux: float = 0.0) -> nn.Module:
    """A tiny `family` model; `aux` > 0: its router's load-balancing loss added with that coefficient."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        output_router_logits=aux > 0,
        max_position_embeddings=2 * SEQ,
        attn_implementation="eager",
        **({"router_aux_loss_coef": aux} if aux else {}),
    )
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            num_experts=4, moe_intermediate_size=16, intermediate_size=64, head_dim=8, decoder_sparse_step=1, **common
        )
        return tf.Qwen3MoeForCausalLM(config)
    if family == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(num_experts=4, intermediate_size=16, **common))
    if family == "gpt_oss":
        config = tf.GptOssConfig(
            num_local_experts=4,
            intermediate_size=16,
            head_dim=8,
            sliding_window=SEQ,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
        return tf.GptOssForCausalLM(config)
    if family == "deepseek_v3":  # shared experts beside the routed ones
        config = tf.DeepseekV3Config(
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            intermediate_size=32,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            num_mtp_layers=0,
            **{**common, "num_key_value_heads": 4},
        )
        return tf.DeepseekV3ForCausalLM(config)
    if family == "llama4":  # its experts take every token pre-scaled by its router score, not the routing
        sizes = {"num_local_experts": 4, "intermediate_size": 16, "intermediate_size_mlp": 32, "head_dim": 8}
        common = {k: v for k, v in common.items() if k != "output_router_logits"}
        return tf.Llama4ForCausalLM(tf.Llama4TextConfig(interleave_moe_layer_step=1, **sizes, **common))
    if family == "dense":
        return tf.LlamaForCausalLM(
            tf.LlamaConfig(
                **{k: v for k, v in common.items() if "exp" not in k and k != "output_router_logits"},
                intermediate_size=32,
            )
        )
    return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=experts, intermediate_size=16, **common))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))


def _loop(model: nn.Module, optimizer: Any, batches: Any, steps: int = STEPS) -> dict[str, list[float]]:
    losses, norms = [], []
    for (batch,) in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == steps:
            break
    return {"losses": losses, "norms": norms}


def _moments(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Each expert weight's AdamW moments (exp_avg, exp_avg_sq), whole (every rank joins the gathers),
    by its one-process name: comparable between layouts that split the experts differently."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dim() == 3 and p in optimizer.state:
                state = optimizer.state[p]
                out[names[id(p)]] = {
                    k: getattr(state[k], "full_tensor", state[k].detach)().clone() for k in ("exp_avg", "exp_avg_sq")
                }
    return out


def _saved(px: Phalanx, model: nn.Module, optimizer: Any, path: str) -> dict[str, Any]:
    """Save under this layout and read it back in one process (no group: `phalanx export`'s reader)."""
    from phalanx.checkpoint import export

    saved = px.save_state(path)
    px.wait_for_everyone()
    return {
        "path": str(saved),
        "one_process": {k: v.float() for k, v in export.full_state_dict(saved).items()},
        "moments": _moments(px.unwrap_model(model), optimizer),
    }


def resume(px: Phalanx, family: str, path: str) -> dict[str, Any]:
    """A fresh model under this layout resumed from the checkpoint at `path`: its weights and optimizer state."""
    model = make_model(family)
    model, optimizer, loader = px.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH // px.dp_size)
    )
    px.load_state(path)
    out: dict[str, Any] = {
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "moments": _moments(px.unwrap_model(model), optimizer),
    }
    # one more step: the saving loop left its pass (`break`), so the loader resumes at the next
    # pass's first batch; one process does the same after its STEPS steps
    out["next"] = _loop(model, optimizer, loader, steps=1)
    out["next"]["losses"] = [float(px.reduce(torch.tensor(x), "mean")) for x in out["next"]["losses"]]
    if px.rank == 0:
        start = make_model(family)
        one = torch.optim.AdamW(start.parameters(), lr=LR)
        _loop(start, one, DataLoader(_data(), batch_size=BATCH))
        out["reference"] = _loop(start, one, DataLoader(_data(), batch_size=BATCH), steps=1)
    return out


def _accumulated(model: nn.Module, optimizer: Any, batches: Any, px: Phalanx | None = None) -> dict[str, list[float]]:
    """STEPS optimizer steps of ACCUM micro-batches each. `px` with grad_accum_steps=ACCUM: the loop
    phalanx's docs write (`px.accumulate`, `px.backward`, clipping on the syncing micro-step); None:
    torch's own (each micro-batch's loss divided by ACCUM, `loss.backward()`, then one step). The loss
    of a step is the mean of its micro-batches'."""
    losses, norms, micro = [], [], []
    for (batch,) in batches:
        if px is not None:
            with px.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                px.backward(loss)
                if px.sync_gradients:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
                optimizer.step()
                optimizer.zero_grad()
        else:
            loss = model(input_ids=batch, labels=batch).loss
            (loss / ACCUM).backward()
        micro.append(loss.item())
        if len(micro) < ACCUM:
            continue
        if px is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(sum(micro) / ACCUM)
        micro = []
        if len(losses) == STEPS:
            break
    return {"losses": losses, "norms": norms}


def load_pretrained(px: Phalanx, family: str, path: str) -> dict[str, Any]:
    """A model of other weights prepared under this layout, then `px.load_model` of the transformers
    directory at `path` (written by `save_pretrained`: one tensor per expert): its weights, gathered
    whole, and the bytes this rank read."""
    model = make_model(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model = px.prepare(model)
    result = px.load_model(model, path)
    return {
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "bytes_read": result.bytes_read,
        "local_experts": [
            tuple(p.to_local().shape) for n, p in px.unwrap_model(model).named_parameters() if ".experts.gate_up" in n
        ][:1],
    }


def train(
    px: Phalanx, family: str, experts: int = 4, checkpoint: str = "", aux: float = 0.0, accum: str = ""
) -> dict[str, Any]:
    """STEPS AdamW steps of `family` prepared by `px`, or what prepare refused; rank 0 adds one process's."""
    start = make_model(family, experts, aux)
    model = copy.deepcopy(start)
    try:
        model, optimizer, loader = px.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH // px.dp_size)
        )
    except ValueError as error:
        return {"refused": str(error)}
    if accum:  # ACCUM micro-batches a step: phalanx's px.accumulate, or torch's own accumulation
        out: dict[str, Any] = _accumulated(model, optimizer, loader, px if accum == "px" else None)
    else:
        out = _loop(model, optimizer, loader)
    out["losses"] = [float(px.reduce(torch.tensor(x), "mean")) for x in out["losses"]]
    named = list(px.unwrap_model(model).named_parameters())
    out["local_experts"] = [tuple(getattr(p, "to_local", p.detach)().shape) for n, p in named if ".experts." in n][:1]
    # FSDP2's DTensors under zero2/3 (the experts' are ep's: Shard(0) of the one-process shape)
    out["sharded"] = sorted(n for n, p in named if hasattr(p, "device_mesh") and ".experts." not in n)
    out["state"] = {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()}
    if checkpoint:
        out["checkpoint"] = _saved(px, model, optimizer, checkpoint)
    if px.rank == 0:
        one = torch.optim.AdamW(start.parameters(), lr=LR)
        whole = DataLoader(_data(), batch_size=BATCH)
        out["reference"] = _accumulated(start, one, whole) if accum else _loop(start, one, whole)
        out["reference"]["state"] = {k: v.detach().clone().float() for k, v in start.state_dict().items()}
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank (`settings` for Phalanx, `family`): one process group serves them all."""
    out = {}
    for name, case in cases.items():
        px = Phalanx(**case["settings"])
        if "resume" in case:
            out[name] = resume(px, case["family"], case["resume"])
            continue
        if "pretrained" in case:
            out[name] = load_pretrained(px, case["family"], case["pretrained"])
            continue
        if "save_pretrained" in case:
            out[name] = save_pretrained(px, case["family"], case["save_pretrained"])
            continue
        if "generate" in case:
            out[name] = generate(px, case["family"])
            continue
        if "lora" in case:  # the experts' fused weights named in case["lora"] get adapters too
            out[name] = lora(px, tuple(case["lora"]))
            continue
        options = case["settings"].get("strategy_options", {})
        factor = options.get("capacity_factor", options.get("ep_plan", {}).get("capacity_factor"))
        if factor:  # (0 is refused at prepare: train says so)
            out[name] = capacity(px, factor)
            continue
        out[name] = train(
            px,
            case["family"],
            case.get("experts", 4),
            case.get("checkpoint", ""),
            case.get("aux", 0.0),
            case.get("accum", ""),
        )
    return out


def _ce(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The causal LM loss as `labels=` computes it (next token, mean), for px.forward_backward under pp."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def ep_pp(steps: int = 4, strategy: str = "ddp") -> dict[str, Any]:
    """pp 2 x ep 2 on 4 ranks (px.forward_backward, the pipeline's loop): losses, torch's clip norms and
    this rank's part of an expert weight; rank 0 adds one process's."""
    px = Phalanx(strategy=strategy, pp=2, ep=2)
    start = make_model("qwen3_moe")
    model = copy.deepcopy(start)
    model, optimizer, loader = px.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH // px.dp_size)
    )
    losses, norms = [], []
    for (batch,) in loader:
        loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], _ce)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(px.reduce(loss.detach(), "mean")))
        if len(losses) == steps:
            break
    named = list(px.unwrap_model(model).named_parameters())
    out: dict[str, Any] = {
        "losses": losses,
        "norms": norms,
        "local_experts": [
            tuple(p.to_local().shape) for n, p in named if ".experts.gate_up" in n and hasattr(p, "to_local")
        ][:1],
    }
    if px.rank == 0:
        one = torch.optim.AdamW(start.parameters(), lr=LR)
        ref = {"losses": [], "norms": []}
        for (batch,) in DataLoader(_data(), batch_size=BATCH):
            loss = _ce(start(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            ref["norms"].append(float(torch.nn.utils.clip_grad_norm_(start.parameters(), MAX_NORM)))
            one.step()
            one.zero_grad()
            ref["losses"].append(loss.item())
            if len(ref["losses"]) == steps:
                break
        out["reference"] = ref
    return out


def ep_pp_layouts() -> dict[str, dict[str, Any]]:
    """`ep_pp` under ddp and zero3, one process group for both."""
    return {strategy: ep_pp(strategy=strategy) for strategy in ("ddp", "zero3")}


def _capped(experts: nn.Module, factor: float, drops: dict[str, int], name: str) -> None:
    """`experts` (one process's, whole) computing only the choices a capacity keeps, written plainly:
    each expert takes its first ceil(factor x choices / experts) choices, token by token, each token's
    in top-k order (the global batch is the ranks' rows in rank order); the others get weight 0.
    Their count per layer is added to `drops`."""
    forward = experts.forward

    def capped(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1)
        count = experts.gate_up_proj.shape[0]
        capacity = math.ceil(factor * flat.numel() / count)
        kept = torch.zeros_like(flat, dtype=torch.bool)
        for expert in range(count):
            kept[(flat == expert).nonzero().squeeze(1)[:capacity]] = True
        drops[name] = drops.get(name, 0) + int((~kept).sum())
        return forward(hidden, index, weights * kept.view_as(weights))

    experts.forward = capped


def capacity(px: Phalanx, factor: float) -> dict[str, Any]:
    """STEPS steps of tiny Qwen3-MoE under ep with a capacity `factor`: losses, norms, final weights and
    `px.moe_dropped_tokens` after each step; rank 0 adds one process's on the ranks' rows in rank order,
    its experts capped by `_capped` (drops counted there)."""
    import logging

    start = make_model("qwen3_moe")
    model = copy.deepcopy(start)
    model, optimizer, loader = px.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH // px.dp_size)
    )
    said: list[str] = []  # what the main process logs after each step
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("phalanx.expert_parallel").addHandler(handler)
    out: dict[str, Any] = {"losses": [], "norms": [], "drops": [], "batches": [], "said": said}
    for (batch,) in loader:
        out["batches"].append(px.gather(batch))  # the global batch, the ranks' rows in rank order
        step = _loop(model, optimizer, [(batch,)], steps=1)
        out["losses"].append(float(px.reduce(torch.tensor(step["losses"][0]), "mean")))
        out["norms"] += step["norms"]
        out["drops"].append(px.moe_dropped_tokens)
        if len(out["losses"]) == STEPS:
            break
    logging.getLogger("phalanx.expert_parallel").removeHandler(handler)
    out["state"] = {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()}
    if px.rank == 0:
        drops: dict[str, int] = {}
        for name, module in start.named_modules():
            if name.endswith("mlp.experts"):
                _capped(module, factor, drops, name)
        one = torch.optim.AdamW(start.parameters(), lr=LR)
        ref: dict[str, Any] = {"losses": [], "norms": [], "drops": []}
        for batch in out["batches"]:
            step = _loop(start, one, [(batch,)], steps=1)
            ref["losses"] += step["losses"]
            ref["norms"] += step["norms"]
            ref["drops"].append(dict(drops))
            drops.clear()
        ref["state"] = {k: v.detach().clone().float() for k, v in start.state_dict().items()}
        out["reference"] = ref
    del out["batches"]
    return out


def lora(px: Phalanx, target_parameters: tuple[str, ...] = ()) -> dict[str, Any]:
    """STEPS steps of a peft LoRA (q_proj, v_proj; `target_parameters`: on the experts' fused weights
    too) of tiny Qwen3-MoE prepared by `px`, or what prepare refused; rank 0 adds the same peft model's
    steps in one process. `state`: the adapter weights."""
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=list(target_parameters)
    )
    start = peft.get_peft_model(make_model("qwen3_moe"), config)
    for name, p in start.named_parameters():  # B nonzero: the adapters change the loss from the first step
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    model = copy.deepcopy(start)
    try:
        model, optimizer, loader = px.prepare(
            model,
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
            DataLoader(_data(), batch_size=BATCH // px.dp_size),
        )
    except ValueError as error:
        return {"refused": str(error)}
    out: dict[str, Any] = _loop(model, optimizer, loader)
    out["losses"] = [float(px.reduce(torch.tensor(x), "mean")) for x in out["losses"]]
    out["state"] = {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items() if "lora_" in k}
    if px.rank == 0:
        one = torch.optim.AdamW([p for p in start.parameters() if p.requires_grad], lr=LR)
        out["reference"] = _loop(start, one, DataLoader(_data(), batch_size=BATCH))
        out["reference"]["state"] = {
            k: v.detach().clone().float() for k, v in start.state_dict().items() if "lora_" in k
        }
    return out


def save_pretrained(px: Phalanx, family: str, path: str) -> dict[str, Any]:
    """STEPS steps of `family` prepared by `px`, then `model.save_pretrained(path)` on the main
    process alone (refused: `refused`), then on every rank (transformers' convention,
    docs/checkpoints.md); the main process reads the directory back with
    `from_pretrained` in this process (no phalanx in the way) and gives both: the trained full weights
    and the ones read."""
    start = make_model(family)
    model = copy.deepcopy(start)
    model, optimizer, loader = px.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH // px.dp_size)
    )
    _loop(model, optimizer, loader)
    trained = {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()}
    out: dict[str, Any] = {"keys": sorted(start.state_dict()), "refused": None}
    from phalanx.checkpoint import save_pretrained as saving

    saving.AGREE_SECONDS, agree = 3.0, saving.AGREE_SECONDS  # the main process alone first: refused after 3 s
    if px.is_main_process:
        try:
            model.save_pretrained(path)
        except ValueError as error:
            out["refused"] = str(error)
    px.wait_for_everyone()
    saving.AGREE_SECONDS = agree
    model.save_pretrained(path)  # then every rank, as transformers' convention asks
    if px.rank == 0:
        read = type(start).from_pretrained(path)
        out["trained"], out["read"] = trained, {k: v.detach().clone().float() for k, v in read.state_dict().items()}
    return out


PROMPTS = torch.tensor([[5, 9, 2, 17, 33, 8], [41, 3, 12, 60, 7, 22]])
NEW_TOKENS = 8


def generate(px: Phalanx, family: str) -> dict[str, Any]:
    """Greedy `model.generate` of each rank's own prompt on the prepared model, with an EOS token
    that ends rank 0's early (the second token one process generates for it) while rank 1's goes on:
    the tokens each rank got, and one process's for both prompts (no phalanx, the same model)."""
    start = make_model(family)
    start.generation_config.pad_token_id = 0
    model = px.prepare(copy.deepcopy(start))
    first = start.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, do_sample=False)
    eos = int(first[0, PROMPTS.shape[1] + 1])
    reference = [
        start.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)[0].tolist()
        for prompt in PROMPTS
    ]
    mine = model.generate(PROMPTS[px.rank : px.rank + 1], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)
    return {"tokens": mine[0].tolist(), "eos": eos, "reference": reference}

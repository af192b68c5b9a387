"""The router's load-balancing loss of a transformers mixture-of-experts model, over the whole global
batch: what one process computes, in every data-parallel layout.

transformers' MoE families (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...) add
`router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`
to the loss in their ForCausalLM forward. That loss is num_experts x Σ_e (share of the tokens routed
to e) x (mean router probability of e), both over every token of the batch: a product of two means,
so the average of each rank's value on its own rows is not the value on the whole batch (zero3 x
tp 2, Qwen3-MoE: grad norm 1.3077 against one process's 1.2608).

So while a prepared model runs forward with gradients on, the family's module-level function is
answered by `_global_loss`: the same sums transformers takes (tokens per expert, router probability
per expert, rows, each under the attention mask), all-reduced over the ranks that read different
data (`group`: data-parallel x cp), the probabilities through torch.distributed.nn's autograd
all-reduce. Every rank's aux term is then one process's value; its gradient reaches each rank's
router logits summed over the ranks, so after the strategies' gradient average each rank holds
one process's gradient (a rank weighing its loss, as the short last batch does, still adds up: the
backward all-reduce sums every rank's weight). Outside a prepared forward, or without gradients
(evaluation, `generate`, whose ranks may take different numbers of steps), transformers' own
function runs, unchanged. The first global call checks the sums against the family's own function
on this rank's rows, and refuses a family whose function computes something else.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn

_NAME = "load_balancing_loss_func"
_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")
_UNSET = object()
# (the group, the cut's padding) of the prepared forward now running (group None: every rank), _UNSET outside one
_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("phalanx_router_group", default=_UNSET)


def family_modules(model: nn.Module) -> list[Any]:
    """The Python modules of `model`'s classes (its submodules' included, as in a peft wrapper) that
    define transformers' `load_balancing_loss_func` with Mixtral's parameters."""
    found: dict[str, Any] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            python_module = sys.modules.get(cls.__module__)
            fn = getattr(python_module, _NAME, None)
            if callable(fn) and tuple(inspect.signature(_original(fn)).parameters) == _PARAMETERS:
                found[python_module.__name__] = python_module
    return list(found.values())


def pipeline_refusal(model: nn.Module, pp: int) -> str | None:
    """Why `model`'s router load-balancing loss cannot train under `pp` > 1 stages, or None: each stage
    sees only its own layers' router logits and the last stage's output carries no `aux_loss`, so a
    loss_fn adding `out.aux_loss * router_aux_loss_coef` (transformers' formula) would drop the term
    and the router would get no balancing gradient, silently (Mixtral under pp 2: step-0 loss 5.5737
    against one process's 5.6137)."""
    config = getattr(model, "config", None)
    if pp <= 1 or not getattr(config, "output_router_logits", False) or not family_modules(model):
        return None
    return (
        f"the router's load-balancing loss (output_router_logits=True) cannot train under pp={pp}: each "
        "pipeline stage sees only its own layers' router logits and the last stage's output has no aux_loss, "
        "so the term would be dropped without a word. HINT: train the router loss in a layout without pp "
        "(ddp, zero1/2/3, hsdp, tp, cp or ep: there it equals one process's), or set "
        "config.output_router_logits=False to train without it under pp"
    )


def globalise(
    model: nn.Module,
    group: Any,
    cut_padding: Callable[[], torch.Tensor | None] | None = None,
    refusal: Callable[[], str | None] = lambda: None,
) -> bool:
    """Make `model`'s load-balancing loss the global batch's over `group` (None: every rank) while
    `model` runs forward with gradients on; False when its family has none. `cut_padding` (cp):
    the padding of this rank's part of the rows, which the model gets no attention_mask for.
    `refusal()`: why the collectives cannot run now (raised as a ValueError), or None."""
    python_modules = family_modules(model)
    if not python_modules:
        return False
    for python_module in python_modules:
        _install(python_module)

    def enter(module: nn.Module, args: Any) -> None:
        module._phalanx_router_token = _GROUP.set((group, cut_padding, refusal))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        token = module.__dict__.pop("_phalanx_router_token", None)
        if token is not None:
            _GROUP.reset(token)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return True


def _original(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__phalanx_original__", fn)


def _install(python_module: Any) -> None:
    """Answer `python_module.load_balancing_loss_func` globally inside a prepared forward (once)."""
    fn = getattr(python_module, _NAME)
    if hasattr(fn, "__phalanx_original__"):
        return
    signature = inspect.signature(fn)
    checked: list[bool] = []

    @functools.wraps(fn)
    def answer(*args: Any, **kwargs: Any) -> Any:
        running = _GROUP.get()
        if running is _UNSET or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        gate_logits, num_experts, top_k, attention_mask = (bound.arguments[p] for p in _PARAMETERS)
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return fn(*args, **kwargs)
        group, cut_padding, refusal = running
        why = refusal()
        if why is not None:
            raise ValueError(why)
        if attention_mask is None and cut_padding is not None:  # cp: the padding the cut took from the model
            attention_mask = _matching(cut_padding(), gate_logits[0])
        if not checked:
            _check(fn, python_module.__name__, gate_logits, num_experts, top_k, attention_mask)
            checked.append(True)
        return _global_loss(gate_logits, num_experts, top_k, attention_mask, group)

    answer.__phalanx_original__ = fn  # type: ignore[attr-defined]
    setattr(python_module, _NAME, answer)


def _matching(mask: torch.Tensor | None, layer: torch.Tensor) -> torch.Tensor | None:
    """`mask` when it holds one entry per row of a layer's router logits."""
    return mask if mask is not None and mask.numel() == layer.shape[0] else None


def _sums(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens routed to each expert, router probability summed per expert, rows), every layer's,
    the padding left out: the sums transformers' function divides."""
    device = gate_logits[0].device
    routed = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:
        layer = layer.full_tensor() if hasattr(layer, "full_tensor") else layer  # tp: the router's DTensor
        weights = torch.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        keep = torch.ones(weights.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        routed = routed.scatter_add(0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        probs = probs + (weights.float() * keep.unsqueeze(-1)).sum(dim=0)
        rows = rows + keep.sum()
    return routed, probs, rows


def _loss(routed: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.sum((routed / rows) * (probs / rows)) * num_experts


def _global_loss(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None, group: Any
) -> torch.Tensor:
    """transformers' load-balancing loss over every rank of `group`'s rows."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_autograd

    routed, probs, rows = _sums(gate_logits, num_experts, top_k, attention_mask)
    counts = torch.cat([routed, rows.unsqueeze(0)])  # no gradient: the routing choice and the rows
    dist.all_reduce(counts, group=group)
    probs = dist_autograd.all_reduce(probs, group=group)  # its backward sums every rank's gradient
    return _loss(counts[:-1], probs, counts[-1], num_experts)


def _check(
    fn: Callable[..., Any],
    where: str,
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
) -> None:
    """The sums above, on this rank's rows, give the family's own value (once per family)."""
    with torch.no_grad():
        theirs = torch.as_tensor(fn(gate_logits, num_experts, top_k, attention_mask)).float()
        theirs = theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs
        ours = _loss(*_sums(gate_logits, num_experts, top_k, attention_mask), num_experts)
    if not torch.allclose(ours.to(theirs.device), theirs, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"{where}.{_NAME} gives {float(theirs):.6g} on this rank's batch, where phalanx's global "
            f"load-balancing loss (Mixtral's formula) gives {float(ours):.6g}: phalanx cannot make this "
            "family's router loss the whole batch's. HINT: train without it (output_router_logits=False, "
            "or router_aux_loss_coef=0), or on one data-parallel rank."
        )

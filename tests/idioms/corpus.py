"""The idiom corpus: training loops written the way torch's, transformers', peft's and datasets' docs
write them, each touching phalanx only where a user adds it (`px.prepare`, `px.backward` or torch's
own `loss.backward()`, `px.forward_backward`, `px.unwrap_model`, `px.reduce`, `px.uneven_inputs`,
`px.get_state_dict` for the full weights).

Each script is `script(px, scratch) -> result`; `px` is a `Phalanx` under a layout, or
`tests.idioms.plain.Plain()` for the reference: the same loop in plain torch in one process. A result
holds what the script logs per step (`losses`, `norms`: torch's clip_grad_norm_), the `items` this rank
trained on (with its `dp_rank`), the final `state` (rank 0), `exact` values every rank must give as one
process does (generated tokens) and `ids`, the item ids read per epoch (their union over the
data-parallel ranks is one process's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from tests.idioms import models
from tests.idioms.models import BATCH, SEQ

STEPS, LR, MAX_NORM = 3, 1e-2, 1.0
PROMPT = torch.tensor([[3, 17, 42, 5], [9, 1, 60, 33]])


def _norm(value: Any) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().float().clone()


def _result(px: Any, model: nn.Module, losses: list, norms: list, items: int, **extra: Any) -> dict[str, Any]:
    state = px.get_state_dict(model)
    out = {"losses": losses, "norms": norms, "items": items, "dp_rank": px.dp_rank, **extra}
    if px.rank == 0:
        out["state"] = {k: v.detach().float().clone() for k, v in state.items()}
    return out


def _logits_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """A loss reading `out.logits`, as transformers loops write it."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _token_loader(px: Any, rows_per_step: int = BATCH) -> DataLoader:
    return DataLoader(models.tokens(), batch_size=rows_per_step // px.dp_size)


def _labels_loop(px: Any, model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """transformers' loop: `model(input_ids=..., labels=...).loss`, `px.backward`, torch's clip."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = px.prepare(model, optimizer, _token_loader(px))
    losses, norms, items = [], [], 0
    for (rows,) in loader:
        ids = rows[:, :SEQ]
        loss = model(input_ids=ids, labels=ids).loss
        px.backward(loss)
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(px.reduce(loss.detach(), "mean")))
        items += len(rows)
        if len(losses) == STEPS:
            break
    return model, {"losses": losses, "norms": norms, "items": items}


def labels(px: Any, scratch: str) -> dict[str, Any]:
    """A transformers causal LM given `labels=` (the model shifts them)."""
    model, out = _labels_loop(px, models.llama())
    return _result(px, model, **out)


def _tensor_loop(px: Any, model: nn.Module, accum: int = 1, steps: int = STEPS) -> tuple[nn.Module, dict[str, Any]]:
    """A plain token tensor through `px.forward_backward(model, x, y, loss_fn)` with `loss_fn` reading
    `out.logits`; `accum` micro-batches per optimizer step, each loss divided by `accum` (no no_sync)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optimizer, loader = px.prepare(model, optimizer, _token_loader(px, BATCH // accum))
    losses, norms, items, micro = [], [], 0, 0.0
    for i, (rows,) in enumerate(loader, 1):
        loss = px.forward_backward(model, rows[:, :-1], rows[:, 1:], lambda out, y: _logits_loss(out, y) / accum)
        micro += float(px.reduce(loss, "mean"))
        items += len(rows)
        if i % accum:
            continue
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(micro)
        micro = 0.0
        if len(losses) == steps:
            break
    return model, {"losses": losses, "norms": norms, "items": items}


def _tensor_script(build: Callable[[], nn.Module], doc: str, accum: int = 1) -> Callable[[Any, str], dict[str, Any]]:
    """The token-tensor loop (`_tensor_loop`) on the model `build` makes."""

    def script(px: Any, scratch: str) -> dict[str, Any]:
        model, out = _tensor_loop(px, build(), accum)
        return _result(px, model, **out)

    script.__doc__ = doc
    return script


token_tensor = _tensor_script(models.llama, "A plain token tensor (the model numbers the positions itself).")
peft_lora = _tensor_script(models.lora, "peft's LoRA on the Llama: the optimizer gets the adapters (requires_grad).")
grad_accumulation = _tensor_script(
    models.llama,
    "Gradient accumulation as torch's docs write it: loss / 2, backward every micro-batch, a step every 2nd.",
    accum=2,
)
tied_embeddings = _tensor_script(lambda: models.llama(tied=True), "A Llama whose output layer is its input embedding.")
moe = _tensor_script(models.qwen3_moe, "A mixture of experts (Qwen3-MoE, no router loss).")
softcap = _tensor_script(models.gemma2, "Gemma2 (attention logits soft-capped, a sliding window).")


def _mlp_epochs(
    px: Any,
    make_loader: Callable[[TensorDataset], DataLoader],
    new_epoch: Callable[[DataLoader, int], None] = lambda loader, epoch: None,
) -> dict[str, Any]:
    """The MLP, AdamW, two epochs of the loader `make_loader` builds on 16 pairs (`new_epoch(loader,
    epoch)` first), torch's `loss.backward()` and clip_grad_norm_."""
    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    user_loader = make_loader(models.pairs(16))
    model, optimizer, loader = px.prepare(model, optimizer, user_loader)
    losses, norms, items = [], [], 0
    for epoch in range(2):
        new_epoch(user_loader, epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(px.reduce(loss.detach(), "mean")))
            items += len(x)
    return _result(px, model, losses, norms, items)


def own_sampler(px: Any, scratch: str) -> dict[str, Any]:
    """The script's own DistributedSampler (set_epoch each epoch) and torch's `loss.backward()`."""

    def loader(data: TensorDataset) -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=px.dp_size, rank=px.dp_rank, shuffle=True, seed=0)
        return DataLoader(data, batch_size=BATCH // px.dp_size, sampler=sampler)

    return _mlp_epochs(px, loader, lambda user_loader, epoch: user_loader.sampler.set_epoch(epoch))


def batch_sampler(px: Any, scratch: str) -> dict[str, Any]:
    """The script's own batch sampler: `DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data,
    generator=...), BATCH // px.dp_size, drop_last=False))`, two epochs, torch's `loss.backward()`."""

    def loader(data: TensorDataset) -> DataLoader:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(4))
        return DataLoader(data, batch_sampler=BatchSampler(sampler, BATCH // px.dp_size, drop_last=False))

    return _mlp_epochs(px, loader)


def short_last_batch(px: Any, scratch: str) -> dict[str, Any]:
    """19 items, global batch 8, DataLoader's default drop_last=False: the last step has 3 items."""
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(models.pairs(19), batch_size=BATCH // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    norms, items = [], 0
    for x, y in loader:
        px.backward(nn.functional.mse_loss(model(x), y))
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        items += len(x)
    return _result(px, model, [], norms, items)


def ema(px: Any, scratch: str) -> dict[str, Any]:
    """torch's EMA: `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))` of the prepared model,
    updated after each step (the batches through px.forward_backward, which every layout runs)."""
    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(models.pairs(32), batch_size=BATCH // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    norms, items = [], 0
    for x, y in loader:
        px.forward_backward(model, x, y, nn.functional.mse_loss)
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        averaged.update_parameters(model)
        items += len(x)
    # every rank's averaged copy: under pp each holds its own stages (the check takes their union)
    state = {k.removeprefix("module."): _full(v) for k, v in averaged.module.state_dict().items()}
    return {"losses": [], "norms": norms, "items": items, "dp_rank": px.dp_rank, "state": state}


def generate(px: Any, scratch: str) -> dict[str, Any]:
    """Two token-tensor steps, then greedy `model.generate` on the prepared model."""
    model, out = _tensor_loop(px, models.llama(), steps=2)
    model.eval()
    with torch.no_grad():
        tokens = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    return {**out, "dp_rank": px.dp_rank, "exact": tokens.tolist()}


def save_pretrained(px: Any, scratch: str) -> dict[str, Any]:
    """Two token-tensor steps, then `px.unwrap_model(model).save_pretrained(d)` on every rank
    (transformers' convention); the state is what `from_pretrained(d)` loads back."""
    from transformers import LlamaForCausalLM

    model, out = _tensor_loop(px, models.llama(), steps=2)
    directory = os.path.join(scratch, "saved")
    px.unwrap_model(model).save_pretrained(directory)
    px.wait_for_everyone()
    result = {**out, "dp_rank": px.dp_rank}
    if px.rank == 0:
        result["state"] = {k: v.float() for k, v in LlamaForCausalLM.from_pretrained(directory).state_dict().items()}
    return result


def split_by_node(px: Any, scratch: str) -> dict[str, Any]:
    """A `datasets` stream the script splits itself with `split_dataset_by_node`, read for two epochs:
    the item ids each rank reads (one process reads each once per epoch)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    shards = sorted(str(p) for p in Path(scratch).parent.joinpath("shards").glob("*.jsonl"))
    stream = datasets.load_dataset(
        "json", data_files=shards, split="train", streaming=True, cache_dir=os.path.join(scratch, f"cache{px.rank}")
    )
    mine = split_dataset_by_node(stream, rank=px.dp_rank, world_size=px.dp_size)
    loader = px.prepare(DataLoader(mine.select_columns(["i"]), batch_size=4))
    read = [sorted(int(i) for batch in loader for i in batch["i"]) for _ in range(2)]
    return {"losses": [], "norms": [], "items": sum(map(len, read)), "dp_rank": px.dp_rank, "ids": read}


def write_shards(root: str) -> None:
    """4 json shards of 6 items each under `root`/shards, read by `split_by_node` (every cell's
    scratch folder is in `root`)."""
    folder = Path(root) / "shards"
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(4):
        (folder / f"part{s}.jsonl").write_text("".join(json.dumps({"i": 6 * s + k}) + "\n" for k in range(6)))


UNEVEN_BATCHES = (3, 2, 2, 1)
"""batches of each data-parallel rank in `uneven_reduce` (its own rank arithmetic: unequal shards)."""


def _uneven_data(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = models.pairs(4 * sum(UNEVEN_BATCHES)).tensors
    start = 4 * sum(UNEVEN_BATCHES[:dp_rank])
    return [
        (x[start + 4 * b : start + 4 * b + 4], y[start + 4 * b : start + 4 * b + 4])
        for b in range(UNEVEN_BATCHES[dp_rank])
    ]


def uneven_reduce(px: Any, scratch: str) -> dict[str, Any]:
    """Each data-parallel rank reads its own, unequal share of the data inside `px.uneven_inputs(model)`
    (`uneven.iter(...)`, as phalanx's docs write it) and logs `px.reduce(loss)` (the README's pattern)."""
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    losses, items = [], 0
    with px.uneven_inputs(model) as uneven:
        for x, y in uneven.iter(_uneven_data(px.dp_rank)):
            loss = nn.functional.mse_loss(model(x), y)
            px.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(px.reduce(loss.detach(), "mean")))  # over the ranks still reading
            items += len(x)
    return _result(px, model, [], [], items)


def uneven_reference(dp_size: int) -> dict[str, Any]:
    """`uneven_reduce` as torch's Join runs it on `dp_size` ranks, in one process with no phalanx: each
    step's gradient the sum over the ranks still reading, divided by the ranks that started (a joined
    rank all-reduces zeros)."""
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shares = [_uneven_data(r) for r in range(dp_size)]
    for step in range(max(len(s) for s in shares)):
        loss = sum(nn.functional.mse_loss(model(x), y) for s in shares if step < len(s) for x, y in [s[step]]) / dp_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": [],
        "norms": [],
        "items": 4 * sum(UNEVEN_BATCHES[:dp_size]),
        "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
    }


SCRIPTS: dict[str, Callable[[Any, str], dict[str, Any]]] = {
    "labels": labels,
    "token-tensor": token_tensor,
    "grad-accumulation": grad_accumulation,
    "peft-lora": peft_lora,
    "tied-embeddings": tied_embeddings,
    "moe": moe,
    "softcap": softcap,
    "own-sampler": own_sampler,
    "batch-sampler": batch_sampler,
    "short-last-batch": short_last_batch,
    "split-by-node": split_by_node,
    "ema": ema,
    "generate": generate,
    "save-pretrained": save_pretrained,
    "uneven-reduce": uneven_reduce,
}

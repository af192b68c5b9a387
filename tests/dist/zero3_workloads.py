"""Rank functions for tests/dist/test_zero3_big.py: meta-device models, px.load_model, activation
checkpointing and compile on 2 CPU ranks. Each function groups many checks into one launch."""

from __future__ import annotations

import gc
import os
import resource
from typing import Any

import torch
from torch import nn

from phalanx import Phalanx
from tests.dist.strategy_workloads import TinyNet

# ---- a model of ~1.6 GB of fp32 parameters -----------------------------------------------------
BIG_DIM, BIG_BLOCKS = 4096, 12


class BigBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class BigNet(nn.Module):
    def __init__(self, dim: int = BIG_DIM, blocks: int = BIG_BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(BigBlock(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _shard_stats(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Statistics of this rank's shard of each tensor (never the gathered full tensor)."""
    stats = {}
    for name, p in model.named_parameters():
        local = p.to_local().detach().double()
        stats[name] = {
            "numel": local.numel(),
            "zeros": int((local == 0).sum()),
            "min": float(local.min()),
            "max": float(local.max()),
            "mean": float(local.mean()),
            "std": float(local.std()),
            "finite": bool(torch.isfinite(local).all()),
            "sum": float(local.sum()),
            "head": local.flatten()[:8].tolist(),
        }
    return stats


def _build_and_prepare(how: str, train_steps: int) -> dict[str, Any]:
    px = Phalanx(strategy="zero3", seed=0)
    px.prepare(TinyNet())  # loads FSDP2/DTensor's modules: the baseline is torch ready to shard
    gc.collect()
    out: dict[str, Any] = {"baseline": peak_rss_bytes()}
    torch.manual_seed(1234)
    with px.init_module() if how == "init_module" else torch.device("meta"):
        model = BigNet()
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["largest_module_bytes"] = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = px.prepare(model, optimizer)
    out["peak_after_prepare"] = peak_rss_bytes()
    out["stats"] = _shard_stats(model)
    out["losses"] = []
    g = torch.Generator().manual_seed(7)
    for _ in range(train_steps):
        x = torch.randn(2, BIG_DIM, generator=g)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        px.backward(loss)
        optimizer.step()
        out["losses"].append(float(px.reduce(loss.detach())))
    return out


def big_meta() -> dict[str, Any]:
    """Build BigNet under px.init_module() and prepare it under zero3 (peak RSS measured), then
    again under a plain `with torch.device('meta')` with the same seed, and train that one."""
    first = _build_and_prepare("init_module", train_steps=0)
    gc.collect()
    second = _build_and_prepare("meta", train_steps=2)
    return {"init_module": first, "meta": second}


# ---- small models: meta init equals normal construction; load_model; activation checkpointing ----
def _normal(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyNet(num_blocks=4)


def _meta_equals_normal(strategy: str, how: str) -> bool | None:
    px = Phalanx(strategy=strategy)
    reference = _normal(5).state_dict()
    torch.manual_seed(5)
    with px.init_module() if how == "init_module" else torch.device("meta"):
        model = TinyNet(num_blocks=4)
    model = px.prepare(model)
    full = px.get_state_dict(model)
    if not px.is_main_process and strategy != "ddp":
        return None
    return sorted(full) == sorted(reference) and all(torch.equal(full[k], reference[k]) for k in reference)


def _local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    own = nn.Module.state_dict(model)  # this rank's shards (the prepared model's state_dict() is the full one)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in own.items()}


def _save_file_checkpoint(path: str, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    weights = {k: v.contiguous() for k, v in _normal(seed).state_dict().items()}
    if int(os.environ["RANK"]) == 0:
        save_file(weights, path)
    torch.distributed.barrier()
    return weights


def _loaded_equals(px: Phalanx, model: nn.Module, weights: dict[str, torch.Tensor]) -> bool | None:
    full = px.get_state_dict(model)
    if not full:
        return None
    return sorted(full) == sorted(weights) and all(torch.equal(full[k], weights[k]) for k in weights)


def _try(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


class _ReadSpy:
    """Stands in for safetensors.safe_open and records every tensor read: (key, index or 'whole')."""

    reads: list[tuple[str, Any]] = []

    def __init__(self, path: str, framework: str, **kwargs: Any):
        self._file = _ReadSpy.real(path, framework=framework, **kwargs)

    def __enter__(self) -> "_ReadSpy":
        self._file.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._file.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        _ReadSpy.reads.append((key, "whole"))
        return self._file.get_tensor(key)

    def get_slice(self, key: str) -> Any:
        view, reads = self._file.get_slice(key), _ReadSpy.reads

        class Slice:
            def get_shape(self) -> list[int]:
                return view.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                reads.append((key, tuple((i.start, i.stop) for i in index)))
                return view[index]

        return Slice()


def load_checks(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("zero3", "ddp"):
        for how in ("init_module", "meta"):
            out[f"meta_equal_{strategy}_{how}"] = _meta_equals_normal(strategy, how)

    # safetensors into zero3 (each rank reads its slices) and into ddp (plain load)
    path = os.path.join(tmp, "weights.safetensors")
    weights = _save_file_checkpoint(path, seed=11)
    file_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    out["file_bytes"] = file_bytes
    for strategy in ("zero3", "ddp"):
        px = Phalanx(strategy=strategy)
        with px.init_module():
            model = TinyNet(num_blocks=4)
        model = px.prepare(model)
        import safetensors

        _ReadSpy.real, _ReadSpy.reads, real = safetensors.safe_open, [], safetensors.safe_open
        safetensors.safe_open = _ReadSpy
        try:
            report = px.load_model(model, path)
        finally:
            safetensors.safe_open = real
        out[f"st_{strategy}_reads"] = list(_ReadSpy.reads)
        out[f"st_{strategy}_equal"] = _loaded_equals(px, model, weights)
        out[f"st_{strategy}_bytes_read"] = report.bytes_read
        out[f"st_{strategy}_local_bytes"] = sum(v.numel() * v.element_size() for v in _local_params(model).values())

    # into zero3 with activation checkpointing: the wrappers' names do not show
    px = Phalanx(strategy="zero3", activation_checkpointing=True)
    with px.init_module():
        model = TinyNet(num_blocks=4)
    model = px.prepare(model)
    px.load_model(model, path)
    out["st_zero3_ac_equal"] = _loaded_equals(px, model, weights)

    # a torch file into zero3: rank 0 reads, broadcast_from_rank0 sends
    torch_path = os.path.join(tmp, "weights.pt")
    if int(os.environ["RANK"]) == 0:
        torch.save(_normal(12).state_dict(), torch_path)
    torch.distributed.barrier()
    px = Phalanx(strategy="zero3")
    with px.init_module():
        model = TinyNet(num_blocks=4)
    model = px.prepare(model)
    px.load_model(model, torch_path if px.rank == 0 else None)
    out["pt_zero3_equal"] = _loaded_equals(px, model, _normal(12).state_dict())

    # bad input: nothing loaded, every problem named; strict=False loads what matches
    before = _local_params(model)
    bad = dict(_normal(13).state_dict())
    bad.pop("head.bias")
    bad["extra.weight"] = torch.zeros(3)
    bad["blocks.0.fc1.weight"] = torch.zeros(5, 5)
    bad_path = os.path.join(tmp, "bad.safetensors")
    if px.rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in bad.items()}, bad_path)
    torch.distributed.barrier()
    out["bad_st_error"] = _try(lambda: px.load_model(model, bad_path))
    out["bad_dict_error"] = _try(lambda: px.load_model(model, bad if px.rank == 0 else None))
    after = _local_params(model)
    out["bad_loaded_nothing"] = all(torch.equal(before[k], after[k]) for k in before)
    report = px.load_model(model, bad_path, strict=False)
    out["lenient"] = {
        "missing": report.missing,
        "unexpected": report.unexpected,
        "mismatched": report.mismatched,
        "loaded": len(report.loaded),
    }
    full = px.get_state_dict(model)
    if full:
        out["lenient_fc2_loaded"] = torch.equal(full["blocks.0.fc2.weight"], bad["blocks.0.fc2.weight"])
        out["lenient_head_bias_kept"] = torch.equal(full["head.bias"], _normal(12).state_dict()["head.bias"])
    return out


# ---- activation checkpointing: same gradients ---------------------------------------------------
def _grads(strategy: str, activation_checkpointing: Any) -> dict[str, torch.Tensor]:
    px = Phalanx(strategy=strategy, activation_checkpointing=activation_checkpointing)
    model = px.prepare(_normal(21))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (4, 6), generator=g)
    loss = model(tokens).pow(2).mean()
    px.backward(loss)
    inner = px.unwrap_model(model)
    return {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for n, p in inner.named_parameters()
    }


def checkpointing_grads() -> dict[str, Any]:
    out = {}
    for strategy in ("ddp", "zero3"):
        plain = _grads(strategy, None)
        ckpt = _grads(strategy, True)
        by_class = _grads(strategy, ["Block"])
        clean = lambda d: {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in d.items()}  # noqa: E731
        out[strategy] = {"plain": plain, "ckpt": clean(ckpt), "by_class": clean(by_class)}
    return out


def both(tmp: str) -> dict[str, Any]:
    return {"load": load_checks(tmp), "ac": checkpointing_grads()}


# ---- compile: losses equal eager ---------------------------------------------------------------
def compiled_losses() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from tests.dist.strategy_workloads import make_data

    out = {}
    data = make_data(4)
    for strategy in ("ddp", "zero3"):
        for compile_ in (False, True):
            px = Phalanx(strategy=strategy, compile=compile_)
            model = _normal(31)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            model, optimizer = px.prepare(model, optimizer)
            losses = []
            for step in range(20):
                tokens, labels = (
                    data.tensors[0][step % 8 * 8 : (step % 8 + 1) * 8],
                    data.tensors[1][step % 8 * 8 : (step % 8 + 1) * 8],
                )
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(tokens), labels)
                px.backward(loss)
                optimizer.step()
                losses.append(float(loss.detach()))
            inner = px.unwrap_model(model)
            compiled = [type(getattr(b, "forward", None)).__name__ for b in inner.blocks]
            frames = counters["frames"]["ok"]  # frames dynamo compiled so far in this process
            out[f"{strategy}_{'compiled' if compile_ else 'eager'}"] = {
                "losses": losses,
                "forward_types": compiled,
                "frames_compiled": frames,
            }
    return out

"""`px.load_model`: a full (unsharded) checkpoint into any prepared model, without any rank holding
the whole model when it is sharded.

- safetensors (one file, or shards with their `*.index.json`): every rank reads the header, then
  only its own slices of each tensor (safetensors' lazy slicing over a memory map), and hands them
  to torch's `set_model_state_dict` as DTensors: nothing is broadcast, nothing read twice.
- a torch file or an in-memory state dict: rank 0 holds it (a torch file is memory-mapped) and
  `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` sends one tensor at a
  time; each rank keeps its slice.

Keys and shapes are checked on every rank before anything is loaded: missing, unexpected and
mismatched names fail together in one message; `strict=False` loads the matches and reports the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from phalanx.logging.rank_log import get_logger
from phalanx.model import hf_layout


@dataclass
class LoadResult:
    """What `load_model` did: keys loaded, and the ones it left alone (strict=False)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: file (a, b) vs model (c, d)"
    bytes_read: int = 0  # tensor bytes this rank read from safetensors files


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ---- what the source holds ---------------------------------------------------------------------
def _safetensors_files(path: str) -> dict[str, str] | None:
    """key -> file for a safetensors checkpoint (file, index file, or folder with one), else None."""
    if os.path.isdir(path):
        indexes = [f for f in os.listdir(path) if f.endswith(".safetensors.index.json")]
        singles = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        if len(indexes) == 1:
            path = os.path.join(path, indexes[0])
        elif len(singles) == 1:
            path = os.path.join(path, singles[0])
        else:
            raise ValueError(
                f"{path!r} holds {len(indexes)} safetensors index file(s) and {len(singles)} "
                "safetensors file(s); pass the file or the index to load"
            )
    if path.endswith(".index.json"):
        with open(path, encoding="utf-8") as fp:
            weight_map = json.load(fp)["weight_map"]
        base = os.path.dirname(path)
        return {k: os.path.join(base, f) for k, f in weight_map.items()}
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    return None


def _safetensors_shapes(files: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if files.get(key) == path:
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


# ---- checking ----------------------------------------------------------------------------------
def compare(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> LoadResult:
    """Keys/shapes of the model (`expected`) against the checkpoint's (`found`)."""
    result = LoadResult(missing=sorted(set(expected) - set(found)), unexpected=sorted(set(found) - set(expected)))
    for key in sorted(set(expected) & set(found)):
        if tuple(expected[key]) != tuple(found[key]):
            result.mismatched.append(f"{key}: checkpoint {tuple(found[key])} vs model {tuple(expected[key])}")
        else:
            result.loaded.append(key)
    return result


def _refuse_or_warn(result: LoadResult, strict: bool, what: str) -> None:
    problems = [
        f"{label} ({len(keys)}): {', '.join(keys)}"
        for label, keys in (
            ("missing in the checkpoint", result.missing),
            ("unexpected in the checkpoint", result.unexpected),
            ("shape mismatch", result.mismatched),
        )
        if keys
    ]
    if not problems:
        return
    if strict:
        per_expert = [k for k in result.unexpected if _PER_EXPERT.search(k)]
        hint = (
            f"the checkpoint stores each expert apart ({per_expert[0]}, ...) where the model holds fused "
            "experts, and transformers has no conversion mapping that fuses them for this model (px.load_model "
            "applies the model's own, as from_pretrained does). HINT: load the checkpoint with the model's "
            "from_pretrained before px.prepare, or fuse the experts into the model's names yourself"
            if per_expert and result.missing
            else "HINT: fix the checkpoint or the model, or pass strict=False to load the keys that match"
        )
        raise ValueError(f"px.load_model({what}): nothing loaded; " + "; ".join(problems) + f". {hint}.")
    get_logger().warning(
        "px.load_model(%s) with strict=False: loaded %d tensor(s), left %s",
        what,
        len(result.loaded),
        "; ".join(problems),
    )


# ---- loading -----------------------------------------------------------------------------------
def _read_local(f: Any, key: str, target: torch.Tensor, result: LoadResult) -> torch.Tensor:
    """`key`'s part this rank holds, read from an open safetensors file: a DTensor's own slice
    (rows of the memory-mapped file, nothing else touched), a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    from phalanx.model.meta_init import local_index

    if not isinstance(target, DTensor) or not _blocks(target):
        tensor = f.get_tensor(key)
        result.bytes_read += tensor.numel() * tensor.element_size()
        return hf_layout.part(tensor, target)
    index = local_index(target)
    local = f.get_slice(key)[index] if index else f.get_tensor(key)
    result.bytes_read += local.numel() * local.element_size()
    local = local.to(device=target.to_local().device, dtype=target.dtype)
    return DTensor.from_local(
        local, target.device_mesh, target.placements, shape=target.shape, stride=target.stride(), run_check=False
    )


def _blocks(target: Any) -> bool:
    """Each rank's part of the DTensor `target` is one block of the full tensor (`local_index`): not
    so for tp's `packed_colwise` experts (`_StridedShard`: gate rows r and up rows r, two blocks)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return not any(isinstance(p, _StridedShard) for p in target.placements)


def _load_safetensors(
    model: nn.Module,
    files: Mapping[str, str],
    keys: list[str],
    model_sd: Mapping[str, Any],
    result: LoadResult,
    model_key: Mapping[str, str],
    alias: Mapping[str, str],
    fused: Mapping[str, hf_layout.Fused],
) -> None:
    """One tensor at a time through set_model_state_dict: a rank holds its shards plus one slice.
    `alias`: checkpoint name -> the name the file stores it under (a tied weight, stored once, or a
    name transformers renames on load); `fused`: names built from several of the file's tensors."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=not _is_sharded(model), strict=False)
    if fused:
        with contextlib.ExitStack() as stack:
            opened: dict[str, Any] = {}

            def read(key: str) -> torch.Tensor:
                if files[key] not in opened:
                    opened[files[key]] = stack.enter_context(safe_open(files[key], framework="pt"))
                return opened[files[key]].get_tensor(key)

            for key in [k for k in keys if k in fused]:
                tensor, read_bytes = hf_layout.read_part(fused[key], read, model, key, model_sd[key])
                result.bytes_read += read_bytes
                set_model_state_dict(model, {model_key[key]: tensor}, options=options)
    by_file: dict[str, list[str]] = {}
    for key in keys:
        if key not in fused:
            by_file.setdefault(files[alias.get(key, key)], []).append(key)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key in names:
                tensor = _read_local(f, alias.get(key, key), model_sd[key], result)
                set_model_state_dict(model, {model_key[key]: tensor}, options=options)


def _full_on_rank0(source: Any) -> Mapping[str, torch.Tensor] | None:
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source
    return torch.load(os.fspath(source), map_location="cpu", mmap=True, weights_only=True)


# one expert's tensor (transformers' files: experts.3.gate_proj.weight)
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")
_ADAPTER = re.compile(r"\.lora_[A-Za-z_]+\.")  # peft's LoRA tensors (lora_A, lora_B, lora_magnitude_vector...)


def checkpoint_names(model: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """Model key -> the name it has in a checkpoint. A peft (LoRA) model loads its base model's
    checkpoint: peft's `base_model.model.` prefix and `.base_layer` are not in those names, and
    the adapters' own tensors are not looked for there (they are absent from the model's map)."""
    if not hasattr(model, "peft_config"):
        return {k: k for k in keys}
    return {k: k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in keys if not _ADAPTER.search(k)}


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Checkpoint name -> the name of the weight it is tied to, which a checkpoint stores alone
    (transformers' `_tied_weights_keys` where the config ties them: `lm_head.weight` ->
    `model.embed_tokens.weight`), for names as `checkpoint_names` gives them."""
    for name, module in model.named_modules():
        keys = getattr(type(module), "_tied_weights_keys", None)
        if isinstance(keys, Mapping) and getattr(getattr(module, "config", None), "tie_word_embeddings", False):
            prefix = "" if not name or (hasattr(model, "peft_config") and name == "base_model.model") else f"{name}."
            return {f"{prefix}{target}": f"{prefix}{source}" for target, source in keys.items()}
    return {}


def _model_state(model: nn.Module) -> dict[str, Any]:
    """The prepared model's state dict by the user's names (no wrapper prefixes), tensors not gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


def load_model(
    model: nn.Module, source: Any, *, strict: bool = True, rank: int = 0, elsewhere: Callable[[str], bool] | None = None
) -> LoadResult:
    """Load a full checkpoint into a prepared model (`model`: the user's module, unwrapped).

    `source`: a .safetensors file, a sharded safetensors index (or a folder holding one), a torch
    file, or a state dict (needed on rank 0 only; other ranks may pass None). A peft (LoRA) model
    loads its base model's checkpoint (see `checkpoint_names`). `elsewhere(key)`: the key belongs to
    another pipeline stage (pp > 1): not this rank's, and not unexpected."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model_sd = _model_state(model)
    names = checkpoint_names(model, model_sd)  # the checkpoint's name of each model tensor
    model_key = {name: key for key, name in names.items()}
    expected = {names[k]: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor) and k in names}
    files = _safetensors_files(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None
    what = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "state dict"
    if elsewhere is not None and files is None:
        raise ValueError(
            f"px.load_model({what}) under pipeline parallel reads safetensors only: each rank reads its own "
            "stages' tensors from the file, where a torch file or state dict would be broadcast whole from rank "
            "0 to ranks that hold other stages. HINT: save the weights with safetensors.torch.save_file (or "
            "`phalanx export`) and load that file"
        )
    if files is not None:  # every rank reads headers, then its own slices
        found = _safetensors_shapes(files)
        matched = hf_layout.match(model, found, expected)  # transformers' per-expert files: its own mapping
        found = hf_layout.shapes(matched, found, model)
        alias = {
            target: source
            for target, source in tied_keys(model).items()
            if target in expected and target not in found and source in found
        }
        found.update({target: found[source] for target, source in alias.items()})
        alias.update(matched.renamed)
        if elsewhere is not None:  # asked by the model's names (a peft model's carry its prefix)
            prefix = "base_model.model." if hasattr(model, "peft_config") else ""
            found = {k: v for k, v in found.items() if k in expected or not elsewhere(prefix + k)}
        result = compare(expected, found)
        _refuse_or_warn(result, strict, what)
        _load_safetensors(
            model,
            files,
            result.loaded,
            {n: model_sd[model_key[n]] for n in result.loaded},
            result,
            model_key,
            alias,
            matched.fused,
        )
        return result
    # torch file / state dict: rank 0 reads it, checks it and broadcasts tensor by tensor
    broadcast = _distributed()
    state = _full_on_rank0(source) if rank == 0 or not broadcast else None
    if state is not None:  # transformers' per-expert tensors fused as the model holds them
        state = hf_layout.convert(state, expected, model)
    if not broadcast and state is None:
        raise ValueError("px.load_model: no state dict given (None)")
    shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)} if state is not None else None
    if broadcast:
        holder = [shapes]
        dist.broadcast_object_list(holder, src=0)
        shapes = holder[0]
        if shapes is None:
            raise ValueError(
                "px.load_model: rank 0 was given no state dict (None). HINT: pass the state dict "
                "(or a file path) on rank 0 at least"
            )
    result = compare(expected, shapes)
    _refuse_or_warn(result, strict, what)
    if state is not None:
        state = {model_key[k]: state[k] for k in result.loaded}
    set_model_state_dict(
        model,
        state if state is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False),
    )
    return result

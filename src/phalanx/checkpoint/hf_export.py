"""`phalanx export --format hf`: a Hugging Face model directory from full weights.

The weights go through torch's own `HuggingFaceStorageWriter` (torch.distributed.checkpoint), which
writes `model-0000i-of-0000N.safetensors` shards and `model.safetensors.index.json`; phalanx only
decides which tensor goes to which shard (in order, each shard at most `max_shard_size` unless one
tensor alone is larger, as `transformers`' `save_pretrained` does). `from_pretrained` also needs
`config.json`: `config_from` names a directory (e.g. one written by `model.config.save_pretrained`
and `tokenizer.save_pretrained`) whose config and tokenizer files are copied next to the weights.

With that config, the tensors are written in the layout the model's own `save_pretrained` writes:
transformers 5 holds a mixture-of-experts layer's experts fused (`mlp.experts.gate_up_proj`
[E, 2I, H]) and saves them one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`) through its conversion mapping reversed; the same code
(`revert_weight_conversion`) runs here, so the directory is the one-process model's, whatever layout
(ep, tp, zero3) saved the checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def parse_size(text: str | int) -> int:
    """'5GB' -> 5 * 10**9, '500MiB' -> 500 * 2**20, '1000' -> 1000 (Hugging Face's convention)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(
            f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB, 2GiB or a number of bytes (at least 1)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def shard_plan(state: dict[str, Any], max_bytes: int) -> dict[str, int]:
    """Tensor name -> shard index (1..N), filling shards in order up to `max_bytes` each."""
    plan: dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += size
    return plan


def check_config_dir(config_from: str | Path) -> Path:
    source = Path(config_from)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"--config-from {source}: no config.json there. HINT: write it with "
            "model.config.save_pretrained(DIR) (and tokenizer.save_pretrained(DIR)), or point "
            "at the pretrained model's directory"
        )
    return source


def copy_config(config_from: str | Path, out: Path) -> list[str]:
    """Copy config.json and the other non-weight files (tokenizer, generation config) of a directory."""
    source = check_config_dir(config_from)
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != INDEX_NAME and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    return copied


def write(
    state: dict[str, Any],
    out: str | Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    config_from: str | Path | None = None,
) -> Path:
    """Write `state` (full CPU tensors) as a Hugging Face model directory; return it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    max_bytes = parse_size(max_shard_size)
    if config_from is not None:
        check_config_dir(config_from)  # before writing anything
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.glob("*.safetensors"))):
        raise FileExistsError(
            f"{out}: already exists and is not a directory free of .safetensors files. "
            "HINT: export to a new directory (stale shards would mix with the new ones)"
        )
    out.mkdir(parents=True, exist_ok=True)
    if config_from is not None:
        state = transformers_layout(state, config_from)
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=shard_plan(state, max_bytes))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    if config_from is not None:
        copy_config(config_from, out)
    return out


def transformers_layout(state: dict[str, Any], config_from: str | Path) -> dict[str, Any]:
    """`state` (the model's own names) as the model of `config_from`'s config.json saves it with
    `save_pretrained` (transformers' conversion mapping reversed: the experts one tensor each);
    `state` unchanged where transformers is absent or knows no such model."""
    try:
        import transformers
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # no transformers: the model's own names are all there is
        return state
    import torch

    try:
        config = transformers.AutoConfig.from_pretrained(str(config_from))
    except (ValueError, KeyError, OSError):  # a model_type transformers does not know (remote code)
        return state
    arch = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    with torch.device("meta"):  # only its module tree and config: which mapping applies
        try:
            model = arch(config) if arch is not None else transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM class for this config: its names as they are
            return state
    return revert_weight_conversion(model, state)

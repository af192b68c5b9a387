"""`phalanx export CKPT OUT`: full weights from a sharded checkpoint of any strategy and world size.

Formats: `safetensors` (the default: one OUT.safetensors file), `hf` (a Hugging Face model directory
of sharded safetensors with `model.safetensors.index.json`, see `hf_export`), `torch` (one
`torch.save` file of the state dict).

Runs in a single process with no process group: DCP reassembles every shard into full tensors
(read through the safe reader: no code from the checkpoint runs). Keys are the model's own
parameter names, without wrapper prefixes, ready for `model.load_state_dict(load_file(OUT))`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from phalanx.checkpoint import hf_export
from phalanx.checkpoint.manifest import CheckpointDamaged
from phalanx.checkpoint.hf_export import DEFAULT_MAX_SHARD_SIZE

FORMATS = ("safetensors", "hf", "torch")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", metavar="CKPT", help="a checkpoint directory, or a checkpoint root (uses its latest intact one)"
    )
    parser.add_argument("output", metavar="OUT", help="file to write (a directory for --format hf)")
    parser.add_argument(
        "--format",
        default="safetensors",
        choices=FORMATS,
        help="safetensors: one OUT.safetensors file (default); hf: a Hugging Face model directory "
        "(sharded safetensors + model.safetensors.index.json); torch: one torch.save file",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help=f"--format hf: largest shard, e.g. 5GB, 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--config-from",
        default=None,
        metavar="DIR",
        help="--format hf: copy config.json and tokenizer files from DIR (e.g. written by "
        "model.config.save_pretrained) so from_pretrained(OUT) works",
    )
    parser.add_argument(
        "--model", default="model", help="which model entry to export (model, model_1, ...; default: model)"
    )
    parser.add_argument(
        "--dtype", default=None, choices=("float32", "float16", "bfloat16"), help="cast floating tensors on export"
    )


def main(args: argparse.Namespace) -> int:
    if args.format != "hf" and (args.max_shard_size is not None or args.config_from is not None):
        print("phalanx export: error: --max-shard-size and --config-from apply to --format hf only", file=sys.stderr)
        return 2
    try:
        path = export(
            args.checkpoint,
            args.output,
            model=args.model,
            dtype=args.dtype,
            format=args.format,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
            config_from=args.config_from,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"phalanx export: error: {error}", file=sys.stderr)
        return 2
    except CheckpointDamaged as error:  # damaged, or a file the safe readers refuse: nothing was written
        print(f"phalanx export: error: {error}", file=sys.stderr)
        return 1
    print(f"phalanx export: wrote {path}")
    return 0


def resolve(checkpoint: str | Path) -> Path:
    """A checkpoint directory, or the newest intact one under a checkpoint root (verified)."""
    from phalanx.checkpoint import atomic
    from phalanx.checkpoint.safe_io import verify
    from phalanx.checkpoint.object_path import location

    path = location(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    if not atomic.is_managed_root(path):
        verify(path)
        return path
    problems = []
    for candidate in atomic.candidates(path):
        try:
            verify(candidate)
            return candidate
        except CheckpointDamaged as error:
            problems.append(str(error))
    raise CheckpointDamaged(f"no intact checkpoint under {path}" + (": " + " | ".join(problems) if problems else ""))


def full_state_dict(checkpoint: str | Path, model: str = "model") -> dict[str, Any]:
    """Full (unsharded) tensors of one model entry, on CPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from phalanx.checkpoint import dcp_storage
    from phalanx.checkpoint.safe_io import SafeLoadPlanner

    path = resolve(checkpoint)
    metadata = dcp_storage.reader(path).read_metadata()
    prefix = f"{model}.model."
    tensors = {
        fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not tensors:
        entries = sorted({fqn.split(".")[0] for fqn in metadata.state_dict_metadata})
        raise ValueError(f"{path} has no model entry {model!r}; entries: {', '.join(entries)}")
    dcp.load(tensors, storage_reader=dcp_storage.reader(path), planner=SafeLoadPlanner(), no_dist=True)
    state = {fqn[len(prefix) :]: tensor for fqn, tensor in tensors.items()}
    # a tied parameter is stored once (checkpoint/tied_names.py): its other names as the model's state_dict has them
    for alias, canonical in tied_in(path, model).items():
        if canonical in state and alias not in state:
            state[alias] = state[canonical].clone()  # its own storage: safetensors refuses shared tensors
    return state


def tied_in(path: Path, model: str = "model") -> dict[str, str]:
    """A model entry's tied names (other name -> the canonical one it is stored under); {} for a
    checkpoint written before they were stored once."""
    from phalanx.checkpoint.manager import COMMON_NAME
    from phalanx.checkpoint.safe_io import load_plain

    return dict(load_plain(path / COMMON_NAME).get("tied", {}).get(model, {}))


def export(
    checkpoint: str | Path,
    output: str | Path,
    model: str = "model",
    dtype: str | None = None,
    format: str = "safetensors",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    config_from: str | Path | None = None,
) -> Path:
    """Write one model entry's full weights in `format` (safetensors, hf or torch); return the path."""
    import warnings

    if format not in FORMATS:
        raise ValueError(f"export format {format!r}: valid formats are {', '.join(FORMATS)}")
    if format == "hf":  # bad options fail before the (possibly long) read of the checkpoint
        hf_export.parse_size(max_shard_size)
        if config_from is not None:
            hf_export.check_config_dir(config_from)

    import torch
    from safetensors.torch import save_file

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        state = full_state_dict(checkpoint, model)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    if format == "hf":
        return hf_export.write(state, output, max_shard_size, config_from)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if format == "torch":
        torch.save(state, output)
        return output
    save_file({k: v.contiguous() for k, v in state.items()}, str(output), metadata={"source": str(resolve(checkpoint))})
    return output

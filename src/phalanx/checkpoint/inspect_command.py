"""`phalanx inspect CKPT`: print a checkpoint's manifest (and, with --verify, check every file)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", metavar="CKPT", help="a checkpoint directory, or a checkpoint root (shows its latest)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also check every file's size and sha256, and read .metadata and the side files with the safe readers",
    )
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")


def main(args: argparse.Namespace) -> int:
    from phalanx.checkpoint import atomic
    from phalanx.checkpoint.manifest import CheckpointDamaged, read_manifest
    from phalanx.checkpoint.object_path import location

    path = location(args.checkpoint)
    if atomic.is_managed_root(path):
        found = atomic.candidates(path)
        if not found:
            print(f"phalanx inspect: no checkpoint under {path}")
            return 1
        print(f"root {path}: latest -> {atomic.read_latest(path)}; published: {', '.join(p.name for p in found)}")
        path = found[0]
    try:
        manifest = read_manifest(path)
    except CheckpointDamaged as error:
        print(f"phalanx inspect: {error}")
        return 1
    if args.json:
        print(manifest.to_json())
    else:
        total = sum(entry.size for entry in manifest.files.values())
        print(
            f"checkpoint {path}\n  step {manifest.step}, saved by {manifest.world_size} rank(s), "
            f"strategy {manifest.strategy}, format {manifest.format_version}\n  {len(manifest.files)} files, {total} bytes"
        )
        for name, entry in sorted(manifest.files.items()):
            print(f"    {name:<24} {entry.size:>12}  sha256 {entry.sha256[:16]}")
    if args.verify:
        from phalanx.checkpoint.safe_io import file_problems  # imports torch: only when asked

        problems = file_problems(path, manifest)
        print("  verify: " + ("OK" if not problems else "DAMAGED: " + "; ".join(problems)))
        return 1 if problems else 0
    return 0

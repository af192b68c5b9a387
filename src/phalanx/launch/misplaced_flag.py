"""Hints for two common mistakes that otherwise end in someone else's error, on every rank:

- a `phalanx run` flag written after the script (`phalanx run train.py --nproc-per-node 2`): what
  follows the script is the script's, so its argparse rejects the flag ("unrecognized arguments");
- `init_process_group("nccl")` on a machine without a GPU: torch says "NCCL not built in" or "no
  GPUs found", with no word of gloo.

Used by the worker wrapper (launch/worker.py), only once the script has failed: a script that
accepts a flag of the same name never sees a hint. No torch at import.
"""

from __future__ import annotations

import argparse
import functools
from typing import Sequence

from phalanx.launch import flag_spelling


@functools.lru_cache(maxsize=1)
def launcher_flags() -> frozenset[str]:
    """Every `--flag` of `phalanx run` (both spellings)."""
    from phalanx.launch import run_flags

    parser = argparse.ArgumentParser()
    run_flags.configure(parser)
    return frozenset(flag for flag in parser._option_string_actions if flag.startswith("--"))


def hint_for_misplaced_flag(message: str, script: str, args: Sequence[str]) -> str | None:
    """A hint when argparse's error `message` rejects `phalanx run` flags given after `script` (or a
    peer launcher's spelling of one, Accelerate's --num_processes: said as phalanx run's)."""
    if "unrecognized arguments:" not in message:
        return None
    rejected = message.split("unrecognized arguments:", 1)[1].split()
    spelled = {word: _as_ours(word) for word in rejected}
    ours = [spelled[word] for word in rejected if spelled[word].split("=", 1)[0] in launcher_flags()]
    if not ours:
        return None
    peer = next((word for word in rejected if spelled[word] != word), None)
    args = [spelled.get(arg, arg) for arg in args]
    taken: list[int] = []
    for word in ours:
        at = args.index(word) if word in args else -1
        if at < 0:
            continue
        taken.append(at)
        if "=" not in word and at < len(args) - 1 and not args[at + 1].startswith("-"):
            taken.append(at + 1)  # the flag's value
    moved = [args[i] for i in sorted(taken)] or ours
    rest = [a for i, a in enumerate(args) if i not in taken]
    name = ours[0].split("=", 1)[0]
    what = f"{name} is a `phalanx run` flag,"
    if peer is not None:
        whose = flag_spelling.PEER_FLAGS[_peer_key(peer)][1]
        what = f"{peer.split('=', 1)[0]} ({whose}) means `phalanx run`'s {name}, a launcher flag"
    return (
        f"{what} written after the script: what follows the script goes to the "
        f"script, and {script}'s argparse rejected it. HINT: put launcher flags before the script: "
        f"phalanx run {' '.join(moved)} {' '.join([script, *rest])}"
    )


def _peer_key(word: str) -> str:
    return "--" + word.split("=", 1)[0][2:].replace("-", "_")


def _as_ours(word: str) -> str:
    """A peer launcher's flag in phalanx run's spelling (`--num_processes=2` -> `--nproc-per-node=2`)."""
    flag, sep, value = word.partition("=")
    if not flag.startswith("--") or _peer_key(flag) not in flag_spelling.PEER_FLAGS:
        return word
    return flag_spelling.PEER_FLAGS[_peer_key(flag)][0] + sep + value


def nccl_without_gpu_message(backend: object, rank: int) -> str | None:
    """The phalanx message for init_process_group(backend) asking for NCCL where no GPU is, or None."""
    if not isinstance(backend, str) or "nccl" not in backend.lower() or "gloo" in backend.lower():
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"init_process_group({backend!r}) on rank {rank}: NCCL needs GPUs, and this machine has none "
        "(or none visible). HINT: on CPU use the 'gloo' backend (init_process_group('gloo')), or "
        "pick by device: backend='cuda:nccl,cpu:gloo' or 'nccl' if torch.cuda.is_available() else 'gloo'; "
        "Phalanx() chooses for you."
    )

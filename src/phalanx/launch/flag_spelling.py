"""What an unknown flag most likely meant: a peer launcher's spelling (Accelerate, the DeepSpeed
launcher, Lightning Fabric's `fabric run`), or a typo of one of ours (difflib). Used by `phalanx
run`'s parser (run_flags.py) and by every other subcommand's (cli.py). Pure text, no torch.
"""

from __future__ import annotations

import difflib
from typing import Iterable

# a peer's flag -> (phalanx run's, whose spelling it is and what differs)
PEER_FLAGS: dict[str, tuple[str, str]] = {
    "--num_processes": (
        "--nproc-per-node",
        "Accelerate's spelling, counting the processes of every machine; phalanx run counts one machine's",
    ),
    "--num_machines": ("--nnodes", "Accelerate's spelling"),
    "--machine_rank": ("--node-rank", "Accelerate's spelling"),
    "--main_process_ip": ("--master-addr", "Accelerate's spelling"),
    "--main_process_port": ("--master-port", "Accelerate's spelling"),
    "--gpu_ids": ("--gpus", "Accelerate's spelling"),
    "--gradient_accumulation_steps": ("--grad-accum-steps", "Accelerate's spelling"),
    "--num_gpus": ("--nproc-per-node", "the DeepSpeed launcher's spelling"),
    "--num_nodes": ("--nnodes", "the DeepSpeed launcher's and Fabric's spelling"),
    "--devices": ("--nproc-per-node", "Lightning Fabric's spelling"),
    "--precision": ("--mixed-precision", "Lightning Fabric's spelling"),
    "--nproc": ("--nproc-per-node", "short for it: phalanx run takes no abbreviations, which could mean two flags"),
}


def _peer(flag: str) -> tuple[str, str] | None:
    return PEER_FLAGS.get(flag.replace("-", "_").replace("__", "--", 1))


def suggestion(word: str, known: Iterable[str]) -> str:
    """' (did you mean --x? ...)' for an unknown `word` (`--flag` or `--flag=value`), or ''."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("--"):
        return ""
    known = sorted(known)
    peer = _peer(flag)
    if peer is not None and peer[0] in known:
        return f"did you mean {peer[0]}? ({flag} is {peer[1]})"
    # the names without their '--', which every flag shares and which would make short names look alike
    close = difflib.get_close_matches(flag[2:], [k[2:] for k in known if k.startswith("--")], n=1, cutoff=0.8)
    return f"did you mean --{close[0]}?" if close else ""


def unrecognized(extras: Iterable[str], known: Iterable[str]) -> tuple[str, bool]:
    """argparse's 'unrecognized arguments: ...' with what each flag likely meant, and whether any was matched."""
    known = list(known)
    extras = list(extras)
    hints = [hint for hint in (suggestion(word, known) for word in extras) if hint]
    text = f"unrecognized arguments: {' '.join(extras)}"
    return (f"{text}. {' '.join(hints)}" if hints else text), bool(hints)

"""Context parallel on CPU/gloo: one long row through a small Llama, cut over cp processes.

    python bench/context_parallel.py [--seqs 2048 4096 8192] [--steps 2] [--cps 1 2]

Each (sequence, cp) runs in fresh processes (one thread each): cp 1 is one process with the whole
row, cp N is N processes each holding 1/N of it (load-balanced cut, attention across the cut by
phalanx: Ulysses here, the key/value heads divide over cp). Measured per rank: forward+backward
tokens/s of the row (the median step), and the step's peak memory above the model's (the resident
set's high-water mark minus the resident set before the first step: activations, gradients and
the attention's temporaries). Printed side by side with the ratios cp N / cp 1.

    python bench/context_parallel.py --fake-world [--device cuda]

runs one rank of each cp world alone (torch's fake backend: collectives do no work), on the GPU when
asked: a cp N rank's compute and memory (the CUDA allocator's peak) from one device, without the
all-to-all's time, which only N devices can measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist

from _spawn import in_process_group, spawn


def llama(seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
        )
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(seq: int, steps: int, out: str, device: str = "cpu") -> None:
    from phalanx.host_only.host_memory import fix_mmap_threshold
    from phalanx.strategies.context.step import ContextParallel

    fix_mmap_threshold(2**20)  # as Phalanx() on CPU: freed activations go back, the high-water mark is the step's

    cp_size = dist.get_world_size() if dist.is_initialized() else 1
    cp = ContextParallel(cp_size, dist.get_rank() if cp_size > 1 else 0, None)
    model = llama(seq).to(device)
    cp.prepare(model)
    tokens = torch.randint(0, 1024, (1, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    cuda = device == "cuda"
    step(model, cp, tokens[:, : 2 * cp_size * 8 + 1])  # first-use costs (threads, buffers) before measuring
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else rss_bytes()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(model, cp, tokens)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) - before
    rank = dist.get_rank() if cp_size > 1 else 0
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"tokens_per_s": seq / statistics.median(times), "peak_bytes": peak}, f)


def step(model: torch.nn.Module, cp: Any, tokens: torch.Tensor) -> None:
    """Forward and backward of one row, cut over the cp ranks."""
    inputs, targets, layout = cp.shard({"input_ids": tokens[:, :-1], "use_cache": False}, tokens[:, 1:])
    with cp.forward(model, layout) if cp.size > 1 else contextlib.nullcontext():
        logits = model(**inputs).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    model.zero_grad(set_to_none=True)
    if cp.size > 1:
        dist.barrier()


def in_fake_group(world_size: int, fn: Any, *args: Any) -> None:
    """Rank 0 of a world whose collectives do no work (torch's fake backend), alone in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def measure(seq: int, cp: int, steps: int, fake_world: bool = False, device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        if cp == 1:
            spawn(run, 1, seq, steps, out, device)
        elif fake_world:  # the load-balanced cut gives every rank the same work: rank 0 stands for all
            spawn(in_fake_group, 1, cp, run, seq, steps, out, device)
        else:
            spawn(in_process_group, cp, run, seq, steps, out, device)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(1 if fake_world else cp)]
    return {"tokens_per_s": min(r["tokens_per_s"] for r in ranks), "peak_bytes": max(r["peak_bytes"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--fake-world",
        action="store_true",
        help="one rank of each cp world alone, collectives doing no work (compute and memory only)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: with --fake-world, on one GPU")
    args = parser.parse_args()
    if args.device == "cuda" and not args.fake_world:
        parser.error("--device cuda needs --fake-world (several ranks on one GPU cannot share NCCL)")
    print(f"{'seq':>6} {'cp':>3} {'tokens/s':>10} {'peak MiB/rank':>14} {'tokens/s vs cp1':>16} {'memory vs cp1':>14}")
    for seq in args.seqs:
        base = None
        for cp in args.cps:
            got = measure(seq, cp, args.steps, args.fake_world, args.device)
            base = base or got
            print(
                f"{seq:>6} {cp:>3} {got['tokens_per_s']:>10.0f} {got['peak_bytes'] / 2**20:>14.1f} "
                f"{got['tokens_per_s'] / base['tokens_per_s']:>15.2f}x {got['peak_bytes'] / base['peak_bytes']:>13.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()

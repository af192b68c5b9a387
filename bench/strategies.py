"""Strategies side by side: steps/s and per-rank model-state bytes, phalanx next to raw torch.

    python bench/strategies.py [--model mlp encoder] [--world-size 2] [--rounds 7] [--steps 6] [--only zero3 ...]
    BENCH_DIM=512 python bench/strategies.py --only "raw ddp" "tp"      # the same at another model width
    python bench/strategies.py --only "raw ddp" "pp"                   # pipeline parallel next to ddp

Two workloads (a large embedding + 4 residual MLP blocks or 4 nn.TransformerEncoderLayers + head,
AdamW), each in one process group with alternating rounds. For each strategy: phalanx, and the same thing written by hand with raw torch
(DDP, DDP + ZeroRedundancyOptimizer, fully_shard); tensor parallel over all ranks (and zero3 x tp2
from 4 ranks) and pipeline parallel (pp over all ranks, and pp2 x ddp2 / zero3 from 4 ranks), on the
same global batch per step. Every phalanx variant steps through px.forward_backward. Prints median
steps/s, the ratio to raw DDP, the largest rank's bytes of parameters + gradients + optimizer
state, and for pipelines the bubble their schedule implies. CPU/gloo figures: tensor parallel
all-reduces activations twice per block, which gloo on CPU does slowly; pipeline stages share the
same cores, so a stage's idle time in the bubble is not lost as it is on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist
from torch import nn

from _spawn import spawn

VOCAB, DIM, BLOCKS, SEQ, BATCH, CLASSES = (
    int(os.environ.get("BENCH_VOCAB", 16384)),
    int(os.environ.get("BENCH_DIM", 256)),
    int(os.environ.get("BENCH_BLOCKS", 4)),
    32,
    16,
    16,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    """Mean over the sequence, then a linear classifier (a module, so the forward is a plain chain
    that pipeline parallel can cut)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, CLASSES)

    def forward(self, h):
        return self.proj(h.mean(1))


class Net(nn.Module):
    vocab = VOCAB

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = Head()

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class Encoder(Net):
    """The transformer-encoder workload: Net with 4 nn.TransformerEncoderLayers as its blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(BLOCKS)
        )


class SmallVocabEncoder(Encoder):
    """The encoder with a 4096-token vocabulary: its embedding is 25% of its parameters (the
    encoder's, with 16384 tokens, 57%), so the blocks zero3 gathers one at a time dominate."""

    vocab = 4096


MODELS = {"mlp": Net, "encoder": Encoder, "small-vocab-encoder": SmallVocabEncoder}
MODEL = os.environ.get("BENCH_MODEL", "mlp")  # set by --model before the ranks start


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return MODELS[MODEL]()


def batches(n: int, replica: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: BATCH per process, so every variant steps on the same global batch; the
    `replica` ranks that hold one model replica together (tp x pp) read the same, that much larger, batch."""
    g = torch.Generator().manual_seed(dist.get_rank() // replica)
    size = BATCH * replica
    vocab = MODELS[MODEL].vocab
    return [
        (torch.randint(0, vocab, (size, SEQ), generator=g), torch.randint(0, CLASSES, (size,), generator=g))
        for _ in range(n)
    ]


def loss_fn(output, y):
    return nn.functional.cross_entropy(output, y)


def plain_step(model):
    """forward, loss and backward, written by hand."""
    return lambda x, y: loss_fn(model(x), y).backward()


# ---- raw torch, written by hand -------------------------------------------------------------
def raw_ddp(gradient_as_bucket_view: bool = True):
    """DDP by hand; `gradient_as_bucket_view=False` is the loop as torch's tutorial writes it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), gradient_as_bucket_view=gradient_as_bucket_view)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), plain_step(model)


def raw_zero1():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    return model, opt, plain_step(model)


def _raw_fsdp(reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for block in model.blocks:  # the textbook recipe: each block, then the root
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), plain_step(model)


# ---- phalanx --------------------------------------------------------------------------------
HOST_MMAP_THRESHOLD = [0]  # what the phalanx variants ran under; printed with the figures


def with_phalanx(
    strategy: str,
    tp: int = 1,
    pp: int = 1,
    schedule: str = "1F1B",
    microbatches: int | None = None,
    settings: dict | None = None,
    **options,
) -> Callable:
    def build():
        from phalanx import Phalanx
        from phalanx.host_only import host_memory

        chosen = dict(settings or {}, **({"tp": tp, "tp_plan": TP_PLANS[MODEL]} if tp > 1 else {}))
        if pp > 1:
            chosen.update(pp=pp, pp_schedule=schedule, pp_microbatches=microbatches)
        px = Phalanx(strategy=strategy, strategy_options=options or None, **chosen)
        # mallopt's threshold, once fixed, holds for the rest of the process: the largest one applied
        threshold = host_memory.threshold_for(px.config.host_mmap_threshold, px.plan.frees_gathered_blocks)
        HOST_MMAP_THRESHOLD[0] = max(HOST_MMAP_THRESHOLD[0], threshold)
        model = make_model()
        model, opt = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, opt, lambda x, y: px.forward_backward(model, x, y, loss_fn)

    return build


def with_pipeline(strategy: str, pp: Callable[[], int], schedule: str = "1F1B", per_rank: int = 2):
    """A pipeline variant: `pp()` ranks per replica (known once the ranks run), `per_rank` x pp microbatches."""

    def build():
        return with_phalanx(strategy, pp=pp(), schedule=schedule, microbatches=per_rank * pp())()

    build.pipeline = (pp, schedule, per_rank)
    return build


# Tensor parallel splits each block's feed-forward pair (column-wise, then row-wise); the encoder's
# nn.MultiheadAttention keeps its fused in_proj weight, which no Linear-based style can split, whole.
TP_PLANS = {
    "mlp": {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
    "encoder": {"blocks.*.linear1": "colwise", "blocks.*.linear2": "rowwise"},
}
TP_PLANS["small-vocab-encoder"] = TP_PLANS["encoder"]


VARIANTS: dict[str, Callable] = {
    "raw ddp": raw_ddp,
    "phalanx ddp": with_phalanx("ddp"),
    "raw zero1 (DDP+ZeRO optimizer)": raw_zero1,
    "phalanx zero1": with_phalanx("zero1"),
    "raw zero2 (fully_shard, no reshard)": lambda: _raw_fsdp(False),
    "phalanx zero2": with_phalanx("zero2"),
    "raw zero3 (fully_shard per block)": lambda: _raw_fsdp(True),
    "phalanx zero3": with_phalanx("zero3"),
    "phalanx zero3, table gathered (embedding_exchange=params)": with_phalanx("zero3", embedding_exchange="params"),
    "phalanx zero3, no prefetch": with_phalanx("zero3", forward_prefetch=False),
    "phalanx zero3, embedding+head own units": with_phalanx(
        "zero3",
        shard_modules=lambda name, m: name in ("embed", "head") or isinstance(m, (Block, nn.TransformerEncoderLayer)),
    ),
    "phalanx tp (all ranks, same global batch)": lambda: with_phalanx("ddp", tp=dist.get_world_size())(),
    "phalanx zero3 x tp2 (4+ ranks)": lambda: with_phalanx("zero3", tp=2)(),
    "phalanx pp 1F1B, 2 x pp microbatches (all ranks)": with_pipeline("ddp", dist.get_world_size),
    "phalanx pp 1F1B, 4 x pp microbatches (all ranks)": with_pipeline("ddp", dist.get_world_size, per_rank=4),
    "phalanx pp GPipe, 2 x pp microbatches (all ranks)": with_pipeline("ddp", dist.get_world_size, "GPipe"),
    "phalanx pp2 x ddp2 (4+ ranks)": with_pipeline("ddp", lambda: 2),
    "phalanx pp2 x zero3 (4+ ranks)": with_pipeline("zero3", lambda: 2),
}
REPLICA_OF = {
    "phalanx tp (all ranks, same global batch)": lambda: dist.get_world_size(),
    "phalanx zero3 x tp2 (4+ ranks)": lambda: 2,
    **{name: build.pipeline[0] for name, build in VARIANTS.items() if hasattr(build, "pipeline")},
}


def bubble(name: str) -> str:
    """The idle fraction the variant's schedule implies (strategies/pipeline/arithmetic.py)."""
    from phalanx.strategies.pipeline import arithmetic

    if not hasattr(VARIANTS[name], "pipeline"):
        return ""
    pp_of, schedule, per_rank = VARIANTS[name].pipeline
    pp = pp_of()
    fraction = arithmetic.bubble_fraction(schedule, pp, per_rank * pp)
    return f"{fraction:.2f}" if fraction is not None else "?"


def run_variant(build: Callable, data, steps: int, warmup: int = 3) -> tuple[float, float, int, float]:
    """(steps/s, CPU ms per step, the largest rank's state bytes, CPU ms of the optimizer step alone)."""
    from phalanx.model import memory

    model, opt, step = build()
    start = None
    optimizer_s = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        step(x, y)
        before = time.process_time()
        opt.step()
        if i >= warmup:
            optimizer_s += time.process_time() - before
    cpu_ms = (time.process_time() - cpu_start) / steps * 1000  # this process, all its threads
    dist.barrier()
    rate = steps / (time.perf_counter() - start)
    held = memory.measure(model, opt)
    most = torch.tensor([held.total], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return rate, cpu_ms, int(most.item()), optimizer_s / steps * 1000


def worker(rounds: int, steps: int, only: list[str] | None) -> None:
    names = [n for n in VARIANTS if not only or any(o in n for o in only)]
    if dist.get_world_size() < 4:
        names = [n for n in names if "4+ ranks" not in n]
    data = {n: batches(8, REPLICA_OF[n]() if n in REPLICA_OF else 1) for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    optimizer: dict[str, list[float]] = {n: [] for n in names}
    held: dict[str, int] = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            rate, cpu_ms, held[name], optimizer_ms = run_variant(VARIANTS[name], data[name], steps)
            rates[name].append(rate)
            cpu[name].append(cpu_ms)
            optimizer[name].append(optimizer_ms)
    floor = None
    if "phalanx ddp" in names and "phalanx zero3" in names:  # every rank takes part in the timing
        import _zero3_floor

        zero3_ms, ddp_ms = _zero3_floor.comm_ms(make_model(), BATCH, SEQ)
        whole_alone, sharded_alone = _zero3_floor.optimizer_ms(make_model())
        whole_step = sorted(optimizer["phalanx ddp"])[rounds // 2]  # ddp's, inside its step
        sharded_step = whole_step * sharded_alone / whole_alone  # the same step over this rank's shards
        floor = sorted(cpu["phalanx ddp"])[rounds // 2] + zero3_ms - ddp_ms - whole_step + sharded_step
    if dist.get_rank() == 0:
        model = make_model()
        params = sum(p.numel() for p in model.parameters())
        embedding = model.embed.weight.numel() / params
        print(
            f"CPU/gloo figures: {dist.get_world_size()} ranks (1 thread each), {MODEL} model {params / 1e6:.1f}M "
            f"params (embedding {model.vocab}x{DIM}, {embedding:.0%} of them, {BLOCKS} blocks), global batch {BATCH * dist.get_world_size()}x{SEQ}; "
            f"{rounds} alternating rounds of {steps} steps, median; host_mmap_threshold {HOST_MMAP_THRESHOLD[0]} bytes "
            f"(0: glibc's own; auto fixes 1MiB for zero2/zero3/hsdp, and every variant after the first of them "
            f"runs under it: PHALANX_HOST_MMAP_THRESHOLD sets one for all)"
        )
        base_name = "raw ddp" if "raw ddp" in names else names[0]
        base = sorted(rates[base_name])[rounds // 2]
        base_bytes = held[base_name]
        base_cpu = sorted(cpu[base_name])[rounds // 2]
        print(
            f"  {'variant':56s} {'steps/s':>8s} {'vs ' + base_name:>11s} {'CPU ms/step':>12s} {'vs':>6s} "
            f"{'vs, per round: min-max':>22s} {'state/rank':>11s} {'vs':>5s} {'bubble':>6s}"
        )
        for name in names:
            med, c = sorted(rates[name])[rounds // 2], sorted(cpu[name])[rounds // 2]
            per_round = [b / x for b, x in zip(cpu[base_name], cpu[name])]  # same round, side by side
            print(
                f"  {name:56s} {med:8.2f} {med / base:11.3f} {c:12.1f} {base_cpu / c:6.3f} "
                f"{min(per_round):10.3f}-{max(per_round):.3f}      "
                f"{held[name] / 2**20:7.1f} MiB {held[name] / base_bytes:5.2f} {bubble(name):>6s}"
            )
        if floor is not None:
            zero3, ddp = sorted(cpu["phalanx zero3"])[rounds // 2], sorted(cpu["phalanx ddp"])[rounds // 2]
            print(
                f"  zero3's floor: {floor:.1f} CPU ms/step (phalanx ddp's, plus zero3's gathers, gradient reductions, "
                f"copies and per-use buffers, less ddp's all-reduce, with ddp's optimizer step ({whole_step:.1f} ms) "
                f"scaled to this rank's shards ({sharded_step:.1f} ms: AdamW over the shards took "
                f"{sharded_alone / whole_alone:.2f} of its time over the whole model, timed alone), the collectives "
                f"timed alone: bench/_zero3_floor.py);\n"
                f"  phalanx zero3 runs at {floor / zero3:.2f} of that floor's speed and {ddp / zero3:.2f}x phalanx ddp's"
            )
        print(
            f"  (CPU ms/step: rank 0's own CPU time, all threads; 'vs' = {base_name}'s CPU time / this one's,\n"
            "   a throughput ratio that ignores time stolen by other processes on a shared machine;\n"
            "   state/rank: the largest rank's parameters + gradients + optimizer state after a step;\n"
            "   bubble: the idle fraction of a step the pipeline schedule implies, (pp - 1) / (microbatches + pp - 1))"
        )


def _run(rounds: int, steps: int, only: list[str] | None) -> None:
    dist.init_process_group("gloo")
    try:
        worker(rounds, steps, only)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of variant names to run")
    parser.add_argument(
        "--model",
        nargs="+",
        choices=sorted(MODELS),
        default=["mlp"],
        help="mlp: residual MLP blocks; encoder: nn.TransformerEncoderLayer blocks; "
        "small-vocab-encoder: the same with a 4096-token embedding (25%% of the parameters); "
        "several: one table each, one after the other",
    )
    args = parser.parse_args()
    for model in args.model:
        os.environ["BENCH_MODEL"] = model  # read by each spawned rank when it imports this file
        spawn(_run, args.world_size, args.rounds, args.steps, args.only)


if __name__ == "__main__":
    main()

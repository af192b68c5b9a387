"""Per-rank memory of each layout, measured beside what the plan predicts, as ratios to ddp.

A transformers Llama built from a small config (8.3M parameters by default, untied embeddings),
AdamW, trains on 2 CPU processes under `phalanx run` for each layout in turn, each in fresh
processes. Every rank reads its resident anonymous memory (RssAnon: the heap and mmapped tensors,
not the pages of torch's libraries, whose resident share depends on the page cache: a freshly
installed venv's libraries read 6-20 MiB more) after `Phalanx()` and before building the model
(the baseline: torch, transformers and the process group loaded), then:
- at rest: after 4 steps, with glibc's free memory returned to the system (malloc_trim), minus the
  baseline: what the layout keeps between steps. Python's garbage collector runs after each step
  (`gc.collect()`), so every run frees its reference cycles at the same points: left to itself it
  runs when allocations reach a count that other threads' allocations move, and a run where it
  came late (2052 objects collected instead of 277) held 4.0 MiB more resident at rest, with the
  same bytes in malloc's hands (82.8 MiB): the same tensors placed across more pages;
- peak: the high-water mark (VmHWM, reset through /proc/self/clear_refs) over one more step, less
  the library and shared pages resident after it (RssFile + RssShmem), minus the baseline: what a
  step needs on top.
The plan's figure is `px.memory_report` (parameters, gradients, optimizer state and kept buffers,
measured from the tensors, and the runtime's own bytes a CPU process holds in every layout) and
`phalanx plan`'s byte model (plan/sharding.py) for the same model; hsdp is one node's (shards over its
2 processes), tp2 is tensor parallel over both processes (the model's transformers tp plan).

Usage: python bench/memory.py [--layouts ddp zero1 zero1-persistent zero2 zero3 hsdp tp2] [--rounds 1]
                              [--hidden 256] [--layers 5] [--vocab 8192] [--batch 2] [--seq 64] [--markdown]
                              [--json FILE] [--fake-world]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero1-persistent": {"strategy": "zero1", "zero1_gather": "persistent"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "hsdp": {"strategy": "hsdp"},
    "tp2": {"strategy": "ddp", "tp": 2},
}

WORKER = """\
import ctypes, gc, json, sys
import torch
from phalanx import Phalanx
from transformers import LlamaConfig, LlamaForCausalLM

def status(key):
    with open("/proc/self/status") as fp:
        lines = fp.readlines()
    for line in lines:
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

libc = ctypes.CDLL("libc.so.6")

def trim():
    libc.malloc_trim(0)

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2

def in_use():  # bytes malloc handed out and did not get back: heap chunks in use + mmapped blocks
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

out, hidden, layers, vocab, batch, seq = sys.argv[1], *map(int, sys.argv[2:7])
options = json.loads(sys.argv[7])
fake_rank = int(sys.argv[8]) if len(sys.argv) > 8 else None
if fake_rank is not None:  # one rank of a world of 2 whose collectives do no work (torch's fake backend)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=2)
    options = dict(options, watchdog_timeout=0)  # no peers' heartbeats to read
px = Phalanx(seed=0, **options)
cuda = px.device.type == "cuda"
if cuda:  # the caching allocator's figures: what tensors hold, not what the driver or NCCL keep
    def status(key):
        return torch.cuda.max_memory_allocated() if key == "VmHWM" else 0 if key in ("RssFile", "RssShmem") else torch.cuda.memory_allocated()
    def trim():
        torch.cuda.synchronize()
    def in_use():
        return torch.cuda.memory_reserved()
trim()
baseline, baseline_used = status("RssAnon"), in_use()
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                     num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                     max_position_embeddings=256, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
params = sum(p.numel() for p in model.parameters())
model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
if fake_rank is not None and hasattr(model, "register_comm_hook"):
    # DDP's built-in all-reduce cannot read the fake backend's result (None): hand the bucket back,
    # as the in-place all-reduce does, so the buffers are those of a real run
    def passthrough(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    model.register_comm_hook(None, passthrough)
g = torch.Generator().manual_seed(px.rank // options.get("tp", 1))  # tensor-parallel ranks share a batch

def step():
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(px.device)
    optimizer.zero_grad(set_to_none=False)
    px.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    gc.collect()  # cycles freed at the same point in every run (see the module's doc)

for _ in range(4):
    step()
trim()
at_rest, used = status("RssAnon") - baseline, in_use() - baseline_used
if cuda:
    torch.cuda.reset_peak_memory_stats()
else:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current RSS
step()
trim()
peak = status("VmHWM") - status("RssFile") - status("RssShmem") - baseline
report = px.memory_report(model, optimizer)
with open(f"{out}/rank{px.rank}.json", "w") as f:
    json.dump({"params": params, "at_rest": at_rest, "in_use": used, "peak": peak, "report": report.total}, f)
"""


def measure(layout: str, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / layout
    out.mkdir(parents=True, exist_ok=True)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PHALANX_PROGRESS="off", PHALANX_RUN_DIR=str(tmp / "runs"))
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        str(script),
        str(out),
        str(args.hidden),
        str(args.layers),
        str(args.vocab),
        str(args.batch),
        str(args.seq),
        json.dumps(LAYOUTS[layout]),
    ]
    if args.fake_world:  # each rank alone in its own process, in turn: a world of 2 on one device
        env = {
            k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        commands = [[sys.executable, *cmd[cmd.index(str(script)) :], str(rank)] for rank in range(2)]
    else:
        commands = [cmd]
    for command in commands:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{layout} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return max(ranks, key=lambda r: r["at_rest"])  # the larger rank


def planned(args: argparse.Namespace) -> dict[str, int]:
    """phalanx plan's bytes for the same model (the largest rank), per layout, with the runtime a CPU
    process holds in every layout: hsdp's shard group is the node's 2 processes; tp2 is one
    tensor-parallel rank's part of the model (as `phalanx plan --tp 2`), over no other data-parallel rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.model import memory
    from phalanx.plan import sharding
    from phalanx.strategies import memory_plan, tensor_parallel
    from phalanx.strategies.plan import presets

    def build():
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=int(args.hidden * 2.75),
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        with torch.device("meta"):
            return LlamaForCausalLM(config)

    runtime = memory.runtime_bytes(args.device)
    rows = sharding.layouts(presets.asking(), world_size=2, local_world_size=2)
    table = sharding.table(memory.model_sizes(build()), rows, runtime=runtime)
    out = {name: max(b.total for b in table[name]) for name in LAYOUTS if name in table}
    split = build()
    tp2 = presets.build("ddp", presets.asking(tp=2), world_size=2, local_world_size=2)
    tensor_parallel.shrink_to_one_rank(split, None, tp2)
    out["tp2"] = max(b.total for b in memory_plan.rank_bytes(memory.model_sizes(split), tp2, runtime=runtime))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every layout (median reported)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--fake-world",
        action="store_true",
        help="run each rank of the 2 alone, in turn, in a world whose collectives do no work "
        "(torch's fake backend): per-rank memory of a 2-GPU layout on one GPU (its allocator's "
        "figures), on the CPU a check against the real 2-process figures",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write each layout's figures (bytes) and the plan's there")
    args = parser.parse_args()
    import torch

    args.device = "cuda" if args.fake_world and torch.cuda.is_available() else "cpu"
    layouts = ["ddp"] + [name for name in args.layouts if name != "ddp"]
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-memory-") as tmp:
        for round_ in range(args.rounds):
            for name in layouts:
                runs[name].append(measure(name, args, Path(tmp) / f"r{round_}"))
    plan = planned(args)
    mib = 2**20
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "plan": plan}))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name]) / mib

    world = (
        f"2 ranks of a fake world, one process at a time on {args.device} ("
        + (
            "the CUDA allocator's allocated bytes; 'malloc in use' is its reserved bytes)"
            if args.device == "cuda"
            else "RssAnon)"
        )
        if args.fake_world
        else "2 CPU processes"
    )
    print(
        f"Llama {runs['ddp'][0]['params'] / 1e6:.1f}M parameters, AdamW, {world}, "
        f"per-rank MiB above the baseline (the larger rank), median of {args.rounds} round(s)"
    )
    header = [
        "layout",
        "at rest",
        "vs ddp",
        "malloc in use",
        "peak",
        "vs ddp",
        "memory_report",
        "plan",
        "plan vs ddp",
        "measured / plan",
    ]
    rows = []
    for name in layouts:
        rest, peak, report = med(name, "at_rest"), med(name, "peak"), med(name, "report")
        rows.append(
            [
                name,
                f"{rest:.1f}",
                f"{rest / med('ddp', 'at_rest'):.2f}",
                f"{med(name, 'in_use'):.1f}",
                f"{peak:.1f}",
                f"{peak / med('ddp', 'peak'):.2f}",
                f"{report:.1f}",
                f"{plan[name] / mib:.1f}",
                f"{plan[name] / plan['ddp']:.2f}",
                f"{rest / (plan[name] / mib):.2f}",
            ]
        )
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for row in [header] + rows:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    main()

"""Expert parallel side by side with ddp and zero3: memory at rest, tokens/s, bytes sent, load balance.

    python bench/experts.py [--steps 6] [--experts 8] [--hidden 128] [--layers 2] [--seq 64] [--batch 8]

A transformers Qwen3-MoE built from a small config (8 experts, top 2, hidden 128, 2 layers, vocab
1024), AdamW, trains on 2 CPU ranks (gloo, one process group, the layouts in turn on the same
batches: 8 rows of 64 tokens per rank) under `Phalanx(strategy="ddp")`, `"zero3"` and
`"ddp", ep=2`. For each it prints, for the larger rank:
- at rest: the parameters, gradients and optimizer state this rank holds (`px.memory_report`, from
  the tensors), the experts' part of them, and the bytes malloc handed out and did not get back
  after the steps (bench/memory.py's live bytes, mallinfo2), less those before the model was built;
- tokens per second over the global batch (median step time, after one warm-up step);
- bytes this rank sends per step through the collectives phalanx calls from Python, wrapped here:
  ep's all-to-all (the tokens there and back; its backward sends as many again, counted as such),
  FSDP2's all-gathers and reduce-scatters; DDP's gradient all-reduce runs in torch's C++ reducer and
  is given from the gradients' size (a ring all-reduce sends 2 (n-1)/n of them);
- the load balance: tokens each ep rank's experts computed per step (ep 2: experts 0-3 and 4-7),
  and the busiest expert's share against the even share (1/experts of the routed tokens).
Ratios are printed, never asserted: CPU/gloo figures, the ranks sharing the same cores.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist

from _spawn import in_process_group, spawn

LAYOUTS = {"ddp": {"strategy": "ddp"}, "zero3": {"strategy": "zero3"}, "ep 2": {"strategy": "ddp", "ep": 2}}
SENT: Counter = Counter()  # bytes this rank sent per collective kind, since the last reset
_libc = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc.mallinfo2.restype = _MallInfo2


def live_bytes() -> int:
    """Bytes malloc handed out and did not get back (bench/memory.py's in_use), after gc and a trim."""
    gc.collect()
    _libc.malloc_trim(0)
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wrap_collectives() -> None:
    """Count the bytes each wrapped collective sends from this rank to the others."""
    from phalanx.strategies.expert_parallel import dispatch

    exchange = dispatch.all_to_all_single_autograd

    def all_to_all(rows, receive, send, group):
        me = dist.get_rank(group)
        row = _nbytes(rows) // max(rows.shape[0], 1)
        SENT["all-to-all"] += 2 * (sum(send) - send[me]) * row  # forward, and as much again in backward
        return exchange(rows, receive, send, group)

    dispatch.all_to_all_single_autograd = all_to_all
    # FSDP2's (torch 2.13 calls the *_single names; older torch the *_tensor ones): an all-gather sends this
    # rank's shard to the n - 1 others, a reduce-scatter (n - 1)/n of its input
    for name, kind, share in (
        ("all_gather_single", "all-gather", lambda n: n - 1),
        ("all_gather_into_tensor", "all-gather", lambda n: n - 1),
        ("reduce_scatter_single", "reduce-scatter", lambda n: (n - 1) / n),
        ("reduce_scatter_tensor", "reduce-scatter", lambda n: (n - 1) / n),
    ):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _kind=kind, _share=share, **kwargs):
            source = kwargs["input"] if "input" in kwargs else args[1]
            group = kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)
            SENT[_kind] += int(_nbytes(source) * _share(dist.get_world_size(group)))
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    # on gloo phalanx hands FSDP2 its own all-gather (sends into place) and reduce-scatter (an all-to-all)
    from phalanx.host_only import gloo_comms

    for cls, kind, share in (
        (getattr(gloo_comms, "PeerAllGather", None), "all-gather", lambda n: n - 1),
        (getattr(gloo_comms, "AllToAllReduceScatter", None), "reduce-scatter", lambda n: (n - 1) / n),
    ):
        if cls is None:
            continue

        def call(self, *args, _original=cls.__call__, _kind=kind, _share=share, **kwargs):
            source = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
            group = kwargs["group"] if "group" in kwargs else args[2]
            SENT[_kind] += int(_nbytes(source) * _share(dist.get_world_size(group)))
            return _original(self, *args, **kwargs)

        cls.__call__ = call


def make_model(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=1024,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=args.hidden // 4,
            num_experts=args.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=args.hidden,
            intermediate_size=2 * args.hidden,
            max_position_embeddings=args.seq,
        )
    )


def count_routes(model, experts: int, routed: Counter) -> None:
    """Tokens per expert, from the router's choices each experts module receives (before any dispatch)."""

    def hook(module, args, kwargs):
        chosen = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        routed.update(dict(enumerate(torch.bincount(chosen.flatten(), minlength=experts).tolist())))

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(hook, with_kwargs=True)


def run(layout: str, args: argparse.Namespace) -> dict:
    from phalanx import Phalanx

    before = live_bytes()
    px = Phalanx(seed=0, **LAYOUTS[layout])
    model = make_model(args)
    routed: Counter = Counter()
    count_routes(model, args.experts, routed)
    experts_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(px.rank)
    times = []
    for step in range(args.steps + 1):
        ids = torch.randint(0, 1024, (args.batch, args.seq), generator=g)
        if step == 1:
            SENT.clear()
            routed.clear()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    report = px.memory_report(model, optimizer)
    unwrapped = px.unwrap_model(model)
    expert_bytes = sum(
        _nbytes(p.to_local() if hasattr(p, "to_local") else p)
        for n, p in unwrapped.named_parameters()
        if ".experts." in n
    )
    # DDP all-reduces every gradient but ep's experts (which it is told to leave alone)
    grads = sum(_nbytes(p) for n, p in unwrapped.named_parameters() if "ep" not in layout or ".experts." not in n)
    sent = {k: v / args.steps for k, v in SENT.items()}
    if layout.startswith("ddp") or layout.startswith("ep"):  # DDP's C++ all-reduce of the non-ep gradients
        sent["all-reduce (ddp)"] = 2 * grads * (px.world_size - 1) / px.world_size
    live = live_bytes() - before
    out = {
        "tensors": report.total,
        "experts": 4 * expert_bytes,  # weights, grads, AdamW's two moments
        "live": live,
        "tokens_per_s": args.batch * args.seq * px.world_size / statistics.median(times[1:]),
        "sent": sent,
        "routed": [routed[e] / args.steps for e in range(args.experts)],
        "experts_numel": experts_numel,
    }
    del model, optimizer
    return out


def bench(args: argparse.Namespace) -> None:
    wrap_collectives()
    run("ddp", argparse.Namespace(**{**vars(args), "steps": 1}))  # warm-up: the libraries' first allocations
    results = {layout: run(layout, args) for layout in LAYOUTS}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank():
        return
    mib = 2**20
    print(
        f"Qwen3-MoE {args.experts} experts (top 2), hidden {args.hidden}, {args.layers} layers, "
        f"{args.batch} x {args.seq} tokens per rank, {dist.get_world_size()} ranks, AdamW, {args.steps} steps"
    )
    ddp = max(r["ddp"]["tensors"] for r in gathered)
    for layout in LAYOUTS:
        top = max(gathered, key=lambda r: r[layout]["tensors"])[layout]
        sent = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in sorted(top["sent"].items())) or "none"
        print(
            f"{layout:>6}: at rest {top['tensors'] / mib:.2f} MiB of tensors ({top['tensors'] / ddp:.2f}x ddp's; "
            f"experts {top['experts'] / mib:.2f} MiB), live {top['live'] / mib:.2f} MiB; "
            f"{top['tokens_per_s']:.0f} tokens/s; sent per step: {sent}"
        )
    routed = [sum(r["ep 2"]["routed"][e] for r in gathered) for e in range(args.experts)]
    half = args.experts // 2
    total = sum(routed)
    print(
        f"load balance under ep 2, per step: tokens per expert {', '.join(f'{x:.0f}' for x in routed)}; "
        f"rank 0 (experts 0-{half - 1}) {sum(routed[:half]):.0f}, rank 1 (experts {half}-{args.experts - 1}) "
        f"{sum(routed[half:]):.0f} of {total:.0f} routed; busiest expert {max(routed) / (total / args.experts):.2f}x the even share"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("PHALANX_PROGRESS", "off")
    with tempfile.TemporaryDirectory() as runs:  # phalanx's run directories, gone after
        os.environ.setdefault("PHALANX_RUN_DIR", runs)
        spawn(in_process_group, 2, bench, args)


if __name__ == "__main__":
    main()

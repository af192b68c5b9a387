"""The step-time model of `phalanx plan` (plan/step_time.py, issue 55 item 2): the ring formulas, the
bytes each collective moves for ddp, zero3 and tp on a small shape against hand arithmetic, and the
Llama 3 paper's Table 4 runs reproduced within 25 % in MFU with one profile and one set of constants."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phalanx.model.flops import TransformerShape
from phalanx.plan import device_profiles, step_time
from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding

ONE_NODE = device_profiles.DeviceProfile("test", 1e12, 0.5, 1e9, 1e8, 1e-4, 1e-3, 8, 0.0)


def test_ring_formulas():
    assert step_time.all_reduce_bytes(1000, 4) == 1500  # 2 (n-1)/n S
    assert step_time.all_gather_bytes(1000, 4) == 750  # (n-1)/n S
    assert step_time.reduce_scatter_bytes(1000, 4) == 750
    assert step_time.all_reduce_bytes(1000, 1) == 0


def _small(tokens: int = 8) -> step_time.Shape:
    # 1,000 parameters (no embeddings), 2 layers of width 16, kv width 8, fp32
    return step_time.Shape(1000, TransformerShape(1000, 1000, 2, 16), 8, 50, 4, tokens, dtype_bytes=4)


def _named(plan: ParallelPlan, shape: step_time.Shape) -> dict[str, float]:
    return {c.name: c.bytes for c in step_time.estimate(plan, shape, ONE_NODE).collectives}


def test_ddp_zero3_and_tp_bytes_by_hand():
    shape = _small()
    # ddp over 2 ranks: the 4,000 gradient bytes all-reduced: 2 x 1/2 x 4000
    assert _named(ParallelPlan("ddp", dp_replicate=2), shape) == {"ddp gradient all-reduce": 4000}
    # zero3 over 4 ranks: the parameters gathered in the forward and the backward, 2 x 3/4 x 4000,
    # the gradients reduce-scattered, 3/4 x 4000
    assert _named(ParallelPlan("zero3", dp_shard=4, sharding=Sharding.PARAMETERS), shape) == {
        "zero3 parameter all-gather (fwd + bwd)": 6000,
        "zero3 gradient reduce-scatter": 3000,
    }
    # tp 2 (one replica): 2 layers x 4 all-reduces of the 8 x 16 x 4 = 512 activation bytes, 2 x 1/2 x 512 each
    assert _named(ParallelPlan("ddp", tp=2), shape) == {"tp all-reduce (2 fwd + 2 bwd per layer)": 4096}
    # cp 2: 2 layers x (all-gather fwd, all-gather + reduce-scatter bwd) of the whole rows' K and V,
    # 8 tokens x 2 x 8 x 4 = 512 bytes, 1/2 of it each; pp 2 (1F1B): an activation forward and a gradient
    # back, 512 bytes in all over the microbatches, from each pipeline rank
    assert _named(ParallelPlan("ddp", cp=2), _small()) == {
        "ddp gradient all-reduce": 4000,
        "cp K/V all-gather (fwd + bwd) + reduce-scatter (bwd)": 1536,
    }
    assert _named(ParallelPlan("ddp", pp=2), shape) == {"pp send/recv (activation fwd + gradient bwd)": 1024}
    # hsdp 2 x 2: zero3 within the shard group, and the replicas all-reduce one shard (2000 bytes)
    assert _named(ParallelPlan("hsdp", dp_replicate=2, dp_shard=2, sharding=Sharding.PARAMETERS), shape) == {
        "hsdp parameter all-gather (fwd + bwd)": 4000,
        "hsdp gradient reduce-scatter": 2000,
        "hsdp replicas' all-reduce of a shard": 2000,
    }


def test_time_is_compute_plus_exposed_traffic_on_the_link_it_crosses():
    shape = _small()
    flops = shape.flops_per_step()
    assert flops == (6 * 1000 + 12 * 2 * 16 * 4) * 8  # model/flops.py per token x tokens
    # 16 ranks, 8 per node: ddp's group spans nodes (1e8 B/s, 1 ms a call), tp 2's stays in one (1e9, 0.1 ms)
    ddp = step_time.estimate(ParallelPlan("ddp", dp_replicate=16), shape, ONE_NODE)
    (c,) = ddp.collectives
    assert not c.within_node and c.seconds == pytest.approx(2 * 15 / 16 * 4000 / 1e8 + 2 * 1e-3)
    assert ddp.step == pytest.approx(flops / 0.5e12 + c.seconds)  # overlap 0: all exposed
    assert ddp.mfu == pytest.approx(flops / (ddp.step * 1e12))
    assert ddp.tokens_per_second == pytest.approx(8 * 16 / ddp.step)
    tp = step_time.estimate(ParallelPlan("ddp", dp_replicate=8, tp=2), shape, ONE_NODE)
    assert [c.within_node for c in tp.collectives] == [False, True]  # dp 8 x tp 2 spans 2 nodes
    # pp 2, 1F1B, 4 microbatches: bubble 1/5 of the step
    pp = step_time.estimate(ParallelPlan("ddp", pp=2), shape, ONE_NODE, step_time.Pipeline("1F1B", 4))
    assert pp.bubble == pytest.approx(1 / 5)
    assert pp.step == pytest.approx(flops / 2 / 0.5e12 / (1 - 1 / 5) + pp.exposed)


def test_the_optimizer_step_is_its_bytes_over_the_memory_bandwidth_on_the_parameters_a_rank_steps():
    profile = dataclasses.replace(ONE_NODE, memory_bandwidth=1e9)
    shape = _small()  # 1,000 parameters; AdamW touches 28 bytes of each

    def optimizer(plan: ParallelPlan) -> float:
        return step_time.estimate(plan, shape, profile).optimizer

    assert optimizer(ParallelPlan("ddp", dp_replicate=2)) == pytest.approx(1000 * 28 / 1e9)
    assert optimizer(ParallelPlan("zero1", dp_replicate=4, sharding=Sharding.OPTIMIZER)) == pytest.approx(
        250 * 28 / 1e9
    )
    assert optimizer(ParallelPlan("zero3", dp_shard=4, sharding=Sharding.PARAMETERS)) == pytest.approx(250 * 28 / 1e9)
    hsdp = ParallelPlan("hsdp", dp_replicate=2, dp_shard=2, sharding=Sharding.PARAMETERS)
    assert optimizer(hsdp) == pytest.approx(500 * 28 / 1e9)  # its shard group's slice, on every replica
    assert optimizer(ParallelPlan("ddp", tp=2, pp=2)) == pytest.approx(250 * 28 / 1e9)
    ddp = step_time.estimate(ParallelPlan("ddp", dp_replicate=2), shape, profile)
    assert ddp.step == pytest.approx(ddp.compute + ddp.exposed + ddp.optimizer)
    assert step_time.estimate(ParallelPlan("ddp", dp_replicate=2), shape, ONE_NODE).optimizer == 0  # not measured


# Llama 3 405B (Llama 3 paper, Table 3 and section 3.3): 126 layers, width 16,384, FFN 53,248, 128
# heads, 8 KV heads of 128, vocab 128,256; bf16 on H100s, 16M tokens per batch.
LAYERS, WIDTH, FFN, VOCAB, KV = 126, 16384, 53248, 128256, 8 * 128
LAYER = 2 * WIDTH * WIDTH + 2 * WIDTH * KV + 3 * WIDTH * FFN + 2 * WIDTH  # q, o; k, v; gate, up, down; 2 norms
OUTSIDE_EMBEDDING = LAYERS * LAYER + VOCAB * WIDTH + WIDTH  # + the output layer and the final norm


@pytest.mark.parametrize(
    ("dp", "cp", "seq", "rows_per_dp_rank", "published"),
    [(64, 1, 8192, 32, 0.43), (128, 1, 8192, 16, 0.41), (8, 16, 131072, 16, 0.38)],
)
def test_llama3_405b_table4_mfu_within_25_percent(dp, cp, seq, rows_per_dp_rank, published):
    """The paper's interleaved schedule, as phalanx runs Interleaved1F1B: 2 stages per pipeline rank,
    a microbatch of one row; FSDP without resharding after the forward (zero2) over dp x cp."""
    plan = ParallelPlan("zero2", dp_shard=dp, tp=8, pp=16, cp=cp, sharding=Sharding.GRADIENTS)
    assert plan.world_size == (8192 if dp == 64 else 16384)
    assert plan.dp_size * rows_per_dp_rank * seq == 16 * 2**20  # 16M tokens per batch
    shape = step_time.Shape(
        OUTSIDE_EMBEDDING + VOCAB * WIDTH,
        TransformerShape(OUTSIDE_EMBEDDING, OUTSIDE_EMBEDDING, LAYERS, WIDTH),
        KV,
        VOCAB,
        seq,
        rows_per_dp_rank * seq,
    )
    result = step_time.estimate(
        plan, shape, device_profiles.load("h100"), step_time.Pipeline("Interleaved1F1B", rows_per_dp_rank)
    )
    assert result.mfu == pytest.approx(published, rel=0.25), f"{result.mfu:.3f} against {published}"


def test_profiles_by_name_or_file_and_a_clear_error(tmp_path):
    h100 = device_profiles.load("H100")
    assert h100.peak_flops == 989.4e12 and h100.intra_bandwidth == 450e9 and h100.inter_bandwidth == 50e9
    assert device_profiles.load("a100").peak_flops == 312e12
    path = tmp_path / "mine.json"
    path.write_text(h100.to_json())
    assert device_profiles.load(str(path)) == h100
    path.write_text(json.dumps({"name": "x", "peak_flops": 1}))
    with pytest.raises(ValueError, match="missing inter_bandwidth, inter_latency"):
        device_profiles.load(str(path))
    with pytest.raises(ValueError, match="HINT: one of h100, h200, a100, cpu"):
        device_profiles.load("tpu")


def test_phalanx_plan_prints_the_step_time_section_for_a_tiny_transformer(capsys, tmp_path):
    from phalanx import cli

    tiny = ["plan", "tests/dist/tp_workloads.py:tiny_llama", "--world-size", "4", "--nproc-per-node", "2"]
    assert cli.main([*tiny, "--input", "4x8", "--budget", "1GB", "--device-profile", "h100", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "step time per layout on H100 SXM (989 TFLOP/s peak x 0.60 matmul efficiency; 4 ranks, 2 per node; " in out
    assert "32 tokens of 8 per data-parallel rank per step" in out
    # 22,688 bf16 gradients all-reduced over 4 ranks, 2 per node: 2 x 3/4 x 45,376 bytes = 66.5 KiB, across nodes
    assert "      ddp gradient all-reduce: 66.5 KiB over 4 ranks, across nodes, " in out
    assert "      zero3 parameter all-gather (fwd + bwd): 66.5 KiB over 4 ranks, across nodes" in out
    # hsdp 2x2: zero3 within a node's 2 ranks, and a shard (45,376 / 2 bytes) all-reduced by the 2 replicas
    assert "  hsdp 2x2 " in out
    assert "      hsdp parameter all-gather (fwd + bwd): 44.3 KiB over 2 ranks, within a node" in out
    assert "      hsdp replicas' all-reduce of a shard: 22.2 KiB over 2 ranks, across nodes" in out
    assert "\nfastest layout that fits: " in out and "; the one recommended for speed" in out
    # a user's own profile file; without a sequence length the section says what it needs
    # --cp 2: the rows' data-parallel ranks are 2, each pair of cp ranks reading 4 rows of 8 tokens
    assert cli.main([*tiny, "--cp", "2", "--input", "4x8", "--budget", "1GB", "--device-profile", "h100"]) == 0
    out = capsys.readouterr().out
    assert (
        "  ddp x cp2 " in out
        and "      cp K/V all-gather (fwd + bwd) + reduce-scatter (bwd): 6.0 KiB over 2 ranks" in out
    )
    mine = tmp_path / "mine.json"
    mine.write_text(device_profiles.load("a100").to_json())
    assert cli.main([*tiny, "--budget", "1GB", "--device-profile", str(mine)]) == 0
    assert "step time: not estimated: give --input BxS (one rank's batch of token ids)" in capsys.readouterr().out
    assert cli.main([*tiny, "--input", "4x8", "--device-profile", "tpu"]) == 2
    assert "HINT: one of h100, h200, a100, cpu" in capsys.readouterr().err

"""torch's EMA idiom on the prepared model in every layout (issue 40): `AveragedModel(model,
multi_avg_fn=get_ema_multi_avg_fn(0.9))`, `update_parameters(model)` after each AdamW step; its
weights and its output equal the same loop in one process, no phalanx. zero2/zero3 refused the
deepcopy before ("FSDP does not support deepcopy")."""

import pytest

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LAYOUTS = [
    {"strategy": "ddp"},
    {"strategy": "zero1"},
    {"strategy": "zero2"},
    {"strategy": "zero3"},
    {"strategy": "ddp", "tp": 2, "tp_plan": {"0": "colwise", "2": "rowwise"}},
]


def test_torch_averaged_model_equals_one_process_in_every_layout():
    results = run_ranks("tests.dist.ema_workloads:ema_in_layouts", 2, args=(LAYOUTS,), timeout=240)
    for rank in results:
        assert len(rank) == len(LAYOUTS)
        for layout, r in rank.items():
            assert "error" not in r, (layout, r)
            assert r["keys"], layout
            assert r["weights"] < 2e-4 and r["output"] < 2e-4, (layout, r)


def test_averaged_model_under_zero2_with_tp_is_refused_naming_the_way():
    """4 ranks: zero2 x tp 2 shards by FSDP and tp at once; the copy is refused, not mis-laid."""
    settings = {"strategy": "zero2", "tp": 2, "tp_plan": {"0": "colwise", "2": "rowwise"}}
    message = run_ranks("tests.dist.ema_workloads:refused_under", 4, args=(settings,), timeout=240)[0]
    assert "AveragedModel" in message and "HINT" in message and "tensor parallel" in message


def test_torch_averaged_model_equals_one_process_under_hsdp_2x2():
    """4 ranks as 2 "nodes" of 2: hsdp's 2 replicas x 2 shards (FSDP2 over a 2-D mesh), the EMA copied
    from the prepared model."""
    results = run_ranks(
        "tests.dist.ema_workloads:ema_in_layouts", 4, args=([{"strategy": "hsdp"}],), timeout=240, local_world_size=2
    )
    for rank in results:
        ((layout, r),) = rank.items()
        assert "error" not in r, (layout, r)
        assert "dp_replicate 2 x dp_shard 2" in r["plan"], r["plan"]
        assert r["keys"], layout
        assert r["weights"] < 2e-4 and r["output"] < 2e-4, (layout, r)

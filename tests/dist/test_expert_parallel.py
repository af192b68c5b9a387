"""Expert parallel (`Phalanx(ep=2)`, `--ep 2`): transformers MoE models as they come, their experts
split over 2 gloo ranks (2 of 4 each) and tokens sent to them by all-to-all, train equal to one
process with no phalanx: per-step loss and grad norm (torch's clip_grad_norm_) within 2e-4, final
weights gathered to their one-process names and shapes; the non-expert parameters data parallel
(ddp) or sharded (zero3) over the same ranks; on 4 ranks, 2 copies of each expert. A checkpoint
saved under ep 2 reads in one process with one-process names and resumes under ep 2 or zero3 (and
zero3's under ep 2), the next step equal to one process. Under pp 2 x ep 2 (4 ranks) each stage's
data-parallel ranks split its experts, and under ep 2 x tp 2 (4 ranks) each ep rank's experts are
split over its tp ranks, equal to one process. What ep cannot
lay out is refused at prepare."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

EP2 = {"strategy": "ddp", "ep": 2}
CASES = {
    "qwen3_moe": {"family": "qwen3_moe", "settings": EP2},
    "qwen3_moe zero3": {"family": "qwen3_moe", "settings": {"strategy": "zero3", "ep": 2}},
    "qwen3_moe aux": {"family": "qwen3_moe", "settings": EP2, "aux": 0.05},  # the router's load-balancing loss
    "zero1": {"family": "qwen3_moe", "settings": {"strategy": "zero1", "ep": 2}},
    "dense model": {"family": "dense", "settings": EP2},
    "3 experts": {"family": "mixtral", "experts": 3, "settings": EP2},
}
MORE = {
    "mixtral": {"family": "mixtral", "settings": EP2},
    "olmoe": {"family": "olmoe", "settings": EP2},
    "gpt_oss": {"family": "gpt_oss", "settings": EP2},
    "deepseek_v3": {"family": "deepseek_v3", "settings": EP2},  # shared experts beside the routed ones
    "qwen3_moe cp2": {"family": "qwen3_moe", "settings": {**EP2, "cp": 2}},  # ep's ranks are the cp ranks
    "user ep_plan": {
        "family": "qwen3_moe",
        "settings": {
            **EP2,
            "strategy_options": {
                "ep_plan": {  # layer 0 only
                    "model.layers.0.mlp.experts": "ep_dispatch_experts",
                    "model.layers.0.mlp.experts.*": "grouped_gemm",
                }
            },
        },
    },
}
COPIES = {
    "mixtral ddp": {"family": "mixtral", "settings": EP2},  # on 4 ranks: 2 copies of each expert
    "mixtral zero3": {"family": "mixtral", "settings": {"strategy": "zero3", "ep": 2}},
    "mixtral ep4": {"family": "mixtral", "settings": {"strategy": "ddp", "ep": 4}},  # one expert per rank
    "mixtral zero3 ep4": {"family": "mixtral", "settings": {"strategy": "zero3", "ep": 4}},
}

EP_TP = {"strategy": "ddp", "ep": 2, "tp": 2}
TENSOR = {  # ep 2 x tp 2 on 4 ranks: each ep rank's experts split over its 2 tp ranks (transformers' MoE tp plan)
    "qwen3_moe ep2 tp2": {"family": "qwen3_moe", "settings": EP_TP},
    "mixtral ep2 tp2": {"family": "mixtral", "settings": EP_TP},
    "qwen3_moe zero3 ep2 tp2": {"family": "qwen3_moe", "settings": {**EP_TP, "strategy": "zero3"}},
    "mixtral zero3 ep2 tp2": {"family": "mixtral", "settings": {**EP_TP, "strategy": "zero3"}},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    saved = str(tmp_path_factory.mktemp("ep") / "checkpoint")
    cases = {
        **CASES,
        "qwen3_moe": {**CASES["qwen3_moe"], "checkpoint": saved},
        "resumed": {"family": "qwen3_moe", "settings": EP2, "resume": saved},
    }
    return run_ranks("tests.dist.ep_workloads:matrix", 2, args=(cases,), timeout=400)


def _equal_to_one_process(ranks: list[dict], name: str) -> None:
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        assert "refused" not in run, run.get("refused")
        held = 4 // {**CASES, **MORE, **COPIES}[name]["settings"]["ep"]  # of 4 experts: 2 a rank at ep 2, 1 at ep 4
        assert run["local_experts"] == [(held, *run["local_experts"][0][1:])]
        assert not any(".experts." in n for n in run["sharded"])  # the experts are ep's, not FSDP2's
        assert bool(run["sharded"]) == ("zero3" in name)  # the rest sharded under zero3
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)
    state = ranks[0][name]["state"]  # the main process's (zero3 gives the others {})
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():  # every expert back in its one-process place
        torch.testing.assert_close(state[key], value, rtol=2e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe zero3", "qwen3_moe aux"])
def test_ep2_equals_one_process(ranks, name):
    _equal_to_one_process(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE))
def test_ep2_equals_one_process_more_families(name):
    _equal_to_one_process(_spawned(MORE), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COPIES))
def test_ep_on_4_ranks_equals_one_process(name):
    """ep 2 (2 copies of each expert, averaged) and ep 4 (one expert per rank) on 4 ranks."""
    _equal_to_one_process(_spawned(COPIES, 4), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TENSOR))
def test_ep2_x_tp2_equals_one_process(name):
    """ep 2 x tp 2 on 4 ranks, ddp and zero3: tokens go by all-to-all to the ep ranks sharing their tp
    coordinate; each expert held there is split over tp as transformers' MoE tp plan says
    (`packed_colwise` gate_up_proj, `rowwise` down_proj, `moe_tp_experts`: partial outputs summed over tp)."""
    ranks = _spawned(TENSOR, 4)
    assert "refused" not in ranks[0][name], ranks[0][name]["refused"]  # before: "not composed with tensor parallel yet"
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        assert "refused" not in run, run.get("refused")
        # 2 of the 4 experts, each with its tp rank's half of the 2 x 16 gate/up rows: [4, 32, 32] -> [2, 16, 32]
        assert run["local_experts"] == [(2, 16, 32)], run["local_experts"]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)
    state = ranks[0][name]["state"]
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():  # every expert whole again, under its one-process name
        torch.testing.assert_close(state[key], value, rtol=2e-4, atol=1e-5, msg=key)


_spawns: dict[int, list[dict]] = {}


def _spawned(cases: dict, world: int = 2) -> list[dict]:
    """One spawn of ranks per case table, shared by its tests."""
    if id(cases) not in _spawns:
        _spawns[id(cases)] = run_ranks("tests.dist.ep_workloads:matrix", world, args=(cases,), timeout=500)
    return _spawns[id(cases)]


def test_a_checkpoint_saved_under_ep2_loads_in_one_process_and_resumes(ranks):
    trained = ranks[0]["qwen3_moe"]["state"]
    for rank in ranks:
        saved = rank["qwen3_moe"]["checkpoint"]
        one = saved["one_process"]  # read with no process group: every expert whole, its one-process name
        assert one.keys() == trained.keys()
        assert one["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
        for key, value in trained.items():
            assert torch.equal(one[key], value), key
        resumed = rank["resumed"]
        assert len(resumed["exp_avg"]) == len(saved["exp_avg"]) == 4  # each rank's part of the 4 expert weights
        for before, after in zip(saved["exp_avg"], resumed["exp_avg"]):
            assert torch.equal(before, after)
    for key, value in trained.items():
        assert torch.equal(ranks[0]["resumed"]["state"][key], value), key
    _resumed_as_saved(ranks, "qwen3_moe", "resumed")


def _resumed_as_saved(ranks: list[dict], saved: str, resumed: str) -> None:
    """`resumed` holds `saved`'s weights and AdamW moments (bitwise, or 1e-6) and its next step is one process's."""
    for key, value in ranks[0][saved]["state"].items():
        torch.testing.assert_close(ranks[0][resumed]["state"][key], value, rtol=1e-6, atol=1e-6, msg=key)
    ref = ranks[0][resumed]["reference"]  # one process's step after its STEPS
    for rank in ranks:
        for moment in ("exp_avg", "exp_avg_sq"):  # each rank's 2 of the 4 experts, under both layouts
            before, after = rank[saved]["checkpoint"][moment], rank[resumed][moment]
            assert len(before) == len(after) == 4, (moment, len(before), len(after))
            for b, a in zip(before, after):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        nxt = rank[resumed]["next"]
        torch.testing.assert_close(torch.tensor(nxt["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(nxt["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)


@pytest.mark.slow
def test_a_checkpoint_moves_between_ep2_and_zero3(tmp_path):
    """Saved under ddp ep 2, resumed under zero3 without ep; saved under zero3, resumed under ep 2."""
    zero3 = {"strategy": "zero3"}
    cases = {
        "ep2 saved": {"family": "qwen3_moe", "settings": EP2, "checkpoint": str(tmp_path / "ep2")},
        "zero3 saved": {"family": "qwen3_moe", "settings": zero3, "checkpoint": str(tmp_path / "zero3")},
        "zero3 from ep2": {"family": "qwen3_moe", "settings": zero3, "resume": str(tmp_path / "ep2")},
        "ep2 from zero3": {"family": "qwen3_moe", "settings": EP2, "resume": str(tmp_path / "zero3")},
    }
    ranks = run_ranks("tests.dist.ep_workloads:matrix", 2, args=(cases,), timeout=500)
    _resumed_as_saved(ranks, "ep2 saved", "zero3 from ep2")
    _resumed_as_saved(ranks, "zero3 saved", "ep2 from zero3")


@pytest.mark.slow
def test_ep2_under_pp2_equals_one_process():
    """pp 2 x ep 2 on 4 ranks, ddp and zero3: each stage's 2 data-parallel ranks split its layers' experts."""
    spawned = run_ranks("tests.dist.ep_workloads:ep_pp_layouts", 4, timeout=400)
    for ranks in ([rank["ddp"] for rank in spawned], [rank["zero3"] for rank in spawned]):
        _pp_equals_one_process(ranks)


def _pp_equals_one_process(ranks: list[dict]) -> None:
    ref = ranks[0]["reference"]
    for rank in ranks:
        assert rank["local_experts"] == [(2, 32, 32)], rank["local_experts"]  # 2 of the 4 experts, on each stage
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(rank["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)


def test_what_ep_cannot_lay_out_is_refused_at_prepare(ranks):
    for rank in ranks:
        dense = rank["dense model"]["refused"]
        assert "ep=2" in dense and "LlamaForCausalLM has no mixture-of-experts layer" in dense and "HINT" in dense
        odd = rank["3 experts"]["refused"]
        assert "hold 3 experts each" in odd and "model.layers.0.mlp.experts" in odd and "HINT: choose ep among" in odd
        zero1 = rank["zero1"]["refused"]
        assert "ep=2" in zero1 and "zero1 splits" in zero1 and "HINT: use strategy ddp, zero2 or zero3 with ep" in zero1

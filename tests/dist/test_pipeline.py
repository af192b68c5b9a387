"""Pipeline parallelism equals one process on the same global batches (AdamW, clipping by the global
norm active every step), under torch's schedules, with DDP and FSDP2 per stage, and its checkpoints
move between layouts by parameter name (tests/dist/pipeline_workloads.py)."""

from __future__ import annotations

import pytest
import torch

from tests.dist import pipeline_workloads as w
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist]

STEPS = 5
LOSS_TOL = dict(rtol=1e-4, atol=1e-4)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


def assert_equal_to_one_process(result: dict) -> None:
    torch.testing.assert_close(result["losses"], result["ref_losses"], **LOSS_TOL)
    torch.testing.assert_close(result["norms"], result["ref_norms"], **LOSS_TOL)
    assert min(result["ref_norms"]) > w.MAX_NORM, "clipping must act on every step for the norms to be checked"
    assert result["params"], "a stage must hold parameters"
    for name, value in result["params"].items():
        torch.testing.assert_close(value, result["ref_params"][name], **PARAM_TOL, msg=name)
    if "eval" in result:  # PipelineRunner.forward half-way through training
        torch.testing.assert_close(result["eval"], result["ref_eval"], **PARAM_TOL)


def assert_layout_equals_one_process(results: list[dict], key: str) -> None:
    """Every rank equals the reference, and the stages together hold the whole model."""
    names = set()
    for r in results:
        assert_equal_to_one_process(r[key])
        names |= set(r[key]["params"])
    assert names == set(results[0][key]["model_names"])


# ---- pp2 on 2 processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pp2():
    return run_ranks("tests.dist.pipeline_workloads:pp_only", 2, args=(STEPS,), timeout=420)


@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    "schedule", ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_pp2_equals_one_process(pp2, schedule):
    assert_layout_equals_one_process(pp2, schedule)


@pytest.mark.timeout(480)
def test_stages_keep_the_models_parameter_names(pp2):
    r0, r1 = (r["1F1B"]["params"] for r in pp2)
    assert set(r0) == {"embed.weight"} | {
        f"layers.{i}.{p}"
        for i in (0, 1)
        for p in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    }
    assert "layers.3.fc2.weight" in r1 and "head.weight" in r1 and "embed.weight" not in r1


@pytest.mark.timeout(480)
def test_placements(pp2):
    assert [r["Interleaved1F1B"]["stage_indices"] for r in pp2] == [(0, 2), (1, 3)]
    assert [r["ZBVZeroBubble"]["stage_indices"] for r in pp2] == [(0, 3), (1, 2)]
    assert [r["DualPipeV"]["stage_indices"] for r in pp2] == [(0, 3), (1, 2)]


@pytest.mark.timeout(480)
def test_accumulation_and_a_changed_batch_shape(pp2):
    """One whole step, then steps of two pipeline steps on half the batch (loss_scale 1/2)."""
    for r in pp2:
        assert_equal_to_one_process(r["accumulate"])


@pytest.mark.timeout(480)
def test_forward_returns_the_last_stages_output_on_every_rank(pp2):
    """12 samples in 4 microbatches; under accumulation (2 microbatches) in 2, not the step's 4 x 1."""
    for r in pp2:
        for case in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "accumulate"):
            assert r[case]["eval"].shape == (12, w.SEQ, w.VOCAB)
            torch.testing.assert_close(r[case]["eval"], r[case]["ref_eval"], **PARAM_TOL)


@pytest.mark.timeout(480)
def test_bf16_autocast_per_stage(pp2):
    """Each stage's forward under autocast(bf16) (phalanx's Precision.wrap_forward): the blocks compute
    in bf16 and training follows the fp32 reference within bf16's precision."""
    for r in pp2:
        result = r["autocast"]
        assert result["fc1_dtypes"] == ["torch.bfloat16"]
        torch.testing.assert_close(result["losses"], result["ref_losses"], rtol=0, atol=3e-2)
        assert result["losses"] != result["ref_losses"], "bf16 compute must differ from fp32 somewhere"


@pytest.mark.timeout(480)
def test_calling_a_stage_model_directly_is_refused(pp2):
    for rank, r in enumerate(pp2):
        assert r["direct_call"].startswith(
            f"this model is pipeline stage(s) [{rank}] of 2 (pipeline rank {rank} of "
            "2): calling it runs only those stages' units, not the whole model. HINT:"
        )


@pytest.mark.timeout(480)
def test_forward_under_a_v_schedule_is_refused_with_the_reason(pp2):
    for r in pp2:
        assert "pp_schedule=ZBVZeroBubble cannot run forward-only" in r["v_forward"]
        assert "steal_bwd_input" in r["v_forward"]


# ---- pp2 x ddp2, pp2 x zero3 on 4 processes; the checkpoint moves --------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline-ckpt")


@pytest.fixture(scope="module")
def pp2_dp2(checkpoints):
    return run_ranks("tests.dist.pipeline_workloads:pp_dp", 4, args=(STEPS, str(checkpoints)), timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "zero3", "zero3_interleaved", "pp4", "pp4_interleaved"])
def test_pp2_with_data_parallel_equals_one_process(pp2_dp2, layout):
    assert_layout_equals_one_process(pp2_dp2, layout)


@pytest.mark.timeout(600)
def test_replicas_of_a_stage_hold_equal_parameters(pp2_dp2):
    for layout in ("ddp", "zero3"):
        for a, b in ((0, 1), (2, 3)):  # ranks (pp, dp) = (0, 0), (0, 1) and (1, 0), (1, 1)
            for name, value in pp2_dp2[a][layout]["params"].items():
                assert torch.equal(value, pp2_dp2[b][layout]["params"][name]), name


@pytest.mark.timeout(600)
def test_bf16_parameters_per_stage(pp2_dp2):
    """FSDP2's MixedPrecisionPolicy(bf16 params, fp32 reduce) per stage: stage 0 sends bf16
    activations, and training follows the fp32 reference within bf16's precision."""
    assert pp2_dp2[0]["zero3_bf16"]["sent_dtypes"] == ["torch.bfloat16"]
    assert pp2_dp2[0]["zero3"]["sent_dtypes"] == ["torch.float32"]
    for r in pp2_dp2:
        result = r["zero3_bf16"]
        torch.testing.assert_close(result["losses"], result["ref_losses"], rtol=0, atol=3e-2)
        assert result["losses"] != result["ref_losses"], "bf16 compute must differ from fp32 somewhere"


@pytest.fixture(scope="module")
def reference():
    """One process after STEPS steps, as the first two cases of pp2_dp2 trained (the ddp case with
    accumulation: the same gradients)."""
    return w.reference_run(STEPS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "zero3_interleaved"])
def test_full_weights_gathered_from_the_stages(pp2_dp2, reference, layout):
    _, ref_params, _ = reference
    for rank in (0, 1):  # pipeline rank 0 of each data-parallel replica
        full = pp2_dp2[rank][layout]["full"]
        assert set(full) == set(ref_params)
        for name, value in full.items():
            torch.testing.assert_close(value, ref_params[name], **PARAM_TOL, msg=name)
    assert pp2_dp2[2][layout]["full"] == {} and pp2_dp2[3][layout]["full"] == {}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "zero3_interleaved"])
def test_each_stage_saves_only_its_own_names(pp2_dp2, layout):
    first, last = pp2_dp2[0][layout]["saved_keys"], pp2_dp2[2][layout]["saved_keys"]
    assert "embed.weight" in first and "head.weight" not in first
    assert "head.weight" in last and "embed.weight" not in last


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "zero3_interleaved"])
def test_pp_checkpoint_loads_into_the_whole_model_in_one_process(pp2_dp2, checkpoints, layout):
    _, ref_params, ref = w.reference_run(STEPS)  # fresh: its optimizer state is compared
    whole = w.load_whole(str(checkpoints / f"pp2x{layout}"))
    for name, value in whole["params"].items():
        torch.testing.assert_close(value, ref_params[name], **PARAM_TOL, msg=name)
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(whole["exp_avg"][name], ref.optimizer.state[p]["exp_avg"], **PARAM_TOL, msg=name)


@pytest.mark.timeout(600)
def test_pp2_ddp2_checkpoint_resumes_under_zero3_and_back_under_pp2(pp2_dp2, checkpoints):
    more = 2
    results = run_ranks(
        "tests.dist.pipeline_workloads:resume_moves", 2, args=(str(checkpoints), STEPS, more), timeout=420
    )
    losses, params, _ = w.reference_run(STEPS + 2 * more)
    for r in results:
        torch.testing.assert_close(r["zero3_losses"], losses[STEPS : STEPS + more], **LOSS_TOL)
        torch.testing.assert_close(r["pp_losses"], losses[STEPS + more :], **LOSS_TOL)
        for name, value in r["pp_params"].items():
            torch.testing.assert_close(value, params[name], **PARAM_TOL, msg=name)
    assert set(results[0]["pp_params"]) | set(results[1]["pp_params"]) == set(params)

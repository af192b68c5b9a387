"""torch's own calls on what px.prepare returned, in the layouts where ranks hold parts of the model
(issue 51): `torch.save(model.state_dict())` and `optimizer.state_dict()` write what one process
writes, a script in one process resumes from them, `load_state_dict` takes one process's full state,
`with model.no_sync():` accumulates; under pp state_dict() is refused with the way and torch's clip
gives the whole model's norm. Each compared with the same loop in plain torch in one process."""

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "settings",
    [{"strategy": "zero3"}, {"strategy": "ddp", "tp": 2}, {"strategy": "zero1"}],
    ids=["zero3", "tp2", "zero1"],
)
def test_torch_save_of_state_dicts_resumes_in_one_process_and_no_sync_accumulates(settings, tmp_path):
    results = run_ranks("tests.dist.surface_workloads:save_and_resume", 2, args=(settings, str(tmp_path)), timeout=240)
    for r in results:
        assert r["types"] == ["Tensor"] and r["optimizer_types"] == ["Tensor"], r  # no DTensor part in a file
        assert r["keys_equal"]
        assert r["after_step0"] < 1e-5, r  # no_sync accumulation equals one process
        assert r["resumed_step1"] < 1e-5, r  # one process resumed from the files and stepped
        assert r["loaded_back"] == 0.0 and r["optimizer_loaded_back"] == 0.0, r
        assert r["after_step2"] < 1e-5, r  # and training goes on from one process's state


def test_pipeline_state_dict_is_refused_with_the_way_and_torch_clip_is_global():
    results = run_ranks("tests.dist.surface_workloads:pipeline_state", 2, args=({"strategy": "ddp", "pp": 2},))
    for r in results:
        assert "px.get_state_dict" in r["model_refused"] and "stage" in r["model_refused"], r
        assert "px.save_state" in r["optimizer_refused"], r
        assert 0 < r["stage_keys"] < 21 and r["stage_loaded"] == 0.0, r
        assert abs(r["clip_norm"] - r["one_process_norm"]) <= 1e-5 * r["one_process_norm"], r
        assert r["hand_norm"] < r["clip_norm"] - 1e-3, r  # by hand over p.grad: this stage's only


COMPILED = {"zero3": {"strategy": "zero3"}, "tp2": {"strategy": "ddp", "tp": 2}, "pp2": {"strategy": "ddp", "pp": 2}}


def test_a_model_compiled_before_prepare_trains_as_one_process_compiled():
    """`model = torch.compile(model)` before px.prepare (a KeyError under zero3 and pp, 'OptimizedModule
    has no tensor-parallel plan' under tp): the layout applies to the module inside, compiled again
    unit by unit; 2 steps equal one process's compiled model."""
    from tests.dist import surface_workloads as w

    r0 = run_ranks("tests.dist.surface_workloads:compiled_before_prepare", 2, args=(COMPILED,), timeout=280)[0]
    expected = w.compiled_reference()
    for layout in COMPILED:
        assert isinstance(r0[layout], dict), f"{layout}: {r0[layout]}"
        assert sorted(r0[layout]) == sorted(expected), layout
        for key, value in expected.items():
            torch.testing.assert_close(r0[layout][key], value, rtol=1e-5, atol=1e-6, msg=f"{layout} {key}")


SHORT = {"ddp": {"strategy": "ddp"}, "zero3": {"strategy": "zero3"}}


def test_a_rank_left_no_rows_by_the_short_last_batch_runs_a_transformers_model_as_one_process():
    """5 rows on 2 ranks of 2: the last step gives rank 1 no rows, which transformers' attention could
    not reshape ('cannot reshape tensor of 0 elements'); its forward now runs a shadow row weighed 0."""
    from tests.dist import surface_workloads as w

    ranks = run_ranks("tests.dist.surface_workloads:short_last_batch", 2, args=(SHORT,), timeout=240)
    expected = w.short_last_batch_reference()
    for layout in SHORT:
        assert [r[layout]["rows"] for r in ranks] == [[2, 1], [2, 0]], layout
        assert ranks[0][layout]["items"] == expected["items"], layout
        got = ranks[0][layout]["state"]
        assert sorted(got) == sorted(expected["state"]), layout
        for key, value in expected["state"].items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{layout} {key}")

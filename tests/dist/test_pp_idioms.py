"""A transformers loop as transformers' and torch's docs write it, under pp 2, equals the same loop in
one process with no phalanx (tests/dist/pp_idiom_workloads.py): `loss_fn` reads `out.logits`, torch's
own `clip_grad_norm_` gives and applies the global norm, and `save_pretrained` on every rank writes the
whole model (on one rank only it is refused, naming px.get_state_dict); peft's `save_pretrained` of a
LoRA model writes every stage's adapters, as one process does."""

from __future__ import annotations

import pytest
import torch

from tests.dist import pp_idiom_workloads as w
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict, str]:
    root = tmp_path_factory.mktemp("pp_idioms")
    ranks = run_ranks("tests.dist.pp_idiom_workloads:idioms", 2, args=(str(root),), timeout=500)
    return ranks, w.reference(), str(root)


def test_loss_fn_gets_the_models_output_object_and_the_losses_equal_one_process(runs):
    """Was AttributeError: 'Tensor' object has no attribute 'logits' (loss_fn got the last stage's tensor)."""
    ranks, ref, _ = runs
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), **TOL)
        torch.testing.assert_close(rank["eval"], ref["eval"], **TOL)  # px.forward(...).logits after the steps


def test_torch_clip_grad_norm_gives_and_applies_the_global_norm(runs):
    """Was stage 0's norm on rank 0 (0.785 against one process's 1.088 at step 1), rank 1 its own."""
    ranks, ref, _ = runs
    assert min(ref["norms"]) > w.MAX_NORM, "clipping must act on every step"
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["norms"]), torch.tensor(ref["norms"]), **TOL)


def test_save_pretrained_on_every_rank_writes_one_process_model(runs):
    """Was stage 0's 10 of 21 tensors, exit 0. The weights are also those of one process after the
    same steps (torch's clip applied the global norm)."""
    from transformers import LlamaForCausalLM

    _, ref, root = runs
    saved = LlamaForCausalLM.from_pretrained(f"{root}/every_rank").state_dict()
    assert saved.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(saved[key], value, **TOL, msg=key)


def test_save_pretrained_on_one_rank_is_refused_naming_get_state_dict(runs):
    ranks, _, _ = runs
    message = ranks[0]["one_rank"]["refused"]
    assert message.startswith(
        "save_pretrained on rank 0: under ddp: pp 2 (2 process(es)) each rank holds its own pipeline stages only"
    ), message
    assert "rank(s) [1] did not call save_pretrained" in message and "px.get_state_dict(model)" in message
    assert ranks[1]["one_rank"] == {}


def test_peft_save_pretrained_writes_every_stage_s_adapters_as_one_process(runs, tmp_path):
    """Was stage 0's 4 of 8 adapter tensors, written by both ranks into the same file, exit 0."""
    from peft import PeftModel
    from safetensors.torch import load_file

    ranks, _, root = runs
    expected_losses = w.lora_reference(str(tmp_path / "one"))
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["lora"]), torch.tensor(expected_losses), **TOL)
    saved = load_file(f"{root}/lora/adapter_model.safetensors")
    expected = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    assert saved.keys() == expected.keys() and len(expected) == 8
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, **TOL, msg=key)
    loaded = PeftModel.from_pretrained(w.make_model(), f"{root}/lora")  # peft loads it as it loads its own
    assert sum("lora_A" in name for name, _ in loaded.named_parameters()) == 4


def test_torch_clip_grad_norm_measures_the_unscaled_gradients_under_fp16(runs):
    """phalanx holds fp16's loss scale, so a script cannot unscale before torch's clip: the prepared
    model's clip unscales first, as px.clip_grad_norm_ does (pp 2 and ddp)."""
    ranks, _, _ = runs
    for rank in ranks:
        for layout, norms in rank["fp16"].items():
            # a step whose scaled gradients overflow is nan for both (the scaler skips it)
            assert any(n == n for n in norms["torch"]), f"{layout}: no step's gradients were finite {norms}"
            assert all(n < 1e3 for n in norms["torch"] if n == n), (
                f"{layout}: torch's clip measured the scaled gradients {norms}"
            )
            torch.testing.assert_close(
                torch.tensor(norms["torch"]),
                torch.tensor(norms["px"]),
                rtol=2e-4,
                atol=0,
                equal_nan=True,
                msg=lambda m, layout=layout: f"{layout}: {m}",
            )

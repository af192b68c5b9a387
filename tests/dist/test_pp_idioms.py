"""A transformers loop as transformers' and torch's docs write it, under pp 2, equals the same loop in
one process with no phalanx (tests/dist/pp_idiom_workloads.py): `loss_fn` reads `out.logits`, torch's
own `clip_grad_norm_` gives and applies the global norm, and `save_pretrained` on every rank writes the
whole model (on one rank only it is refused, naming px.get_state_dict)."""
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

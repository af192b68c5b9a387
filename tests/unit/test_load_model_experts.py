"""`px.load_model` of a transformers mixture-of-experts checkpoint as `save_pretrained` writes it: one
tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`)
where the model holds them fused (`mlp.experts.gate_up_proj`). The model's own transformers conversion
mapping fuses them, so the model holds what `from_pretrained` gives, from the safetensors file and
from a state dict alike; a model transformers has no mapping for is refused, naming the cause
(the distributed case, under `ep=2`: tests/dist/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.model.load_model import load_model
from tests.dist.ep_workloads import make_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_per_expert_checkpoint_loads_as_from_pretrained(family, tmp_path):
    make_model(family).save_pretrained(tmp_path)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for source in (str(tmp_path), "state dict"):
        model = make_model(family)
        with torch.no_grad():
            for p in model.parameters():  # other weights than the file's
                p.normal_()
        if source == "state dict":
            from safetensors.torch import load_file

            source = load_file(tmp_path / "model.safetensors")
            assert any(".experts.0." in k for k in source)  # the file's layout: each expert apart
        result = load_model(model, source)
        assert not result.missing and not result.unexpected
        state = model.state_dict()
        assert state.keys() == pretrained.keys()
        for key, value in pretrained.items():
            assert torch.equal(state[key], value), key


def test_per_expert_tensors_with_no_conversion_mapping_are_refused():
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.Module()
            self.experts.down_proj = nn.Parameter(torch.zeros(2, 4, 3))

    given = {f"experts.{i}.down_proj.weight": torch.zeros(4, 3) for i in range(2)}
    with pytest.raises(ValueError) as refused:
        load_model(Experts(), given)
    message = str(refused.value)
    assert "experts.0.down_proj.weight" in message and "stores each expert apart" in message
    assert (
        "no conversion mapping" in message and "HINT: load the checkpoint with the model's from_pretrained" in message
    )

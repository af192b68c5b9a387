"""The answered `state_dict`/`load_state_dict` of a prepared object (strategies/user_state.py), in one
process: the script's call reaches the answer, while torch's DCP, a parent module's state_dict, a
pickle and a deep copy see the class's own. Pins the one torch internal it relies on."""

import copy
import gc
import io

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from phalanx.strategies import user_state
from phalanx.strategies.module_attr import answer_module_attribute


def _answered() -> nn.Linear:
    model = answer_module_attribute(nn.Linear(3, 2), "zero3 (test)", holds_part=True)
    user_state.answer(
        model,
        lambda m, *a, **k: {"answered": torch.ones(1)} if not (a or k) else user_state.own(m, "state_dict", *a, **k),
        lambda m, state, strict=True, assign=False: ("loaded", sorted(state)),
    )
    return model


def test_torch_still_has_the_set_dcp_consults_to_bypass_a_patched_state_dict():
    """torch's `_patch_model_state_dict` registers its instance attributes there, and DCP's
    `_state_dict_fn` then calls the class's method: user_state relies on both."""
    assert isinstance(dcp_state_dict._patched_state_dict, set)
    model = _answered()
    assert dcp_state_dict._state_dict_fn(model, "state_dict")().keys() == {"weight", "bias"}


def test_the_scripts_call_is_answered_and_dcp_reads_the_class_s_own():
    model = _answered()
    assert list(model.state_dict()) == ["answered"]
    assert model.load_state_dict({"weight": torch.zeros(2, 3)}) == ("loaded", ["weight"])
    assert sorted(get_model_state_dict(model)) == ["bias", "weight"]
    assert sorted(nn.Sequential(model).state_dict()) == ["0.bias", "0.weight"]  # a parent recursing


def test_a_pickled_or_copied_model_keeps_its_class_s_own_state_dict():
    model = _answered()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    for other in (loaded, copied):
        assert type(other) is nn.Linear and not set(user_state.ANSWERS) & set(vars(other))
        assert sorted(other.state_dict()) == ["bias", "weight"]


def test_the_set_forgets_an_answered_object_once_it_is_gone():
    gc.collect()
    before = len(dcp_state_dict._patched_state_dict)
    model = _answered()
    assert len(dcp_state_dict._patched_state_dict) == before + 2
    del model
    gc.collect()
    assert len(dcp_state_dict._patched_state_dict) == before

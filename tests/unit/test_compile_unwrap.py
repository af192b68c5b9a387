"""`model = torch.compile(model)` before px.prepare: the module inside is laid out and compiled again
unit by unit with the script's own backend (model/compile.py), read where torch keeps it."""

import torch
from torch import nn

from phalanx.model import compile as compile_units


def test_a_compiled_model_gives_the_module_inside_and_its_backend():
    model = nn.Linear(3, 2)
    inner, options = compile_units.unwrap_compiled(torch.compile(model, backend="aot_eager", mode=None))
    assert inner is model
    assert getattr(options["backend"], "compiler_name", None) == "aot_eager"  # torch's wrapper, options inside
    recompiled = torch.compile(inner, **options)
    x = torch.randn(4, 3)
    torch.testing.assert_close(recompiled(x), model(x))


def test_a_model_not_compiled_is_given_back_as_it_is():
    model = nn.Linear(3, 2)
    assert compile_units.unwrap_compiled(model) == (model, None)

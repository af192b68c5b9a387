"""Meta-device models, activation checkpointing, compile and load_model in a world of one (no
processes): initialisation, refusals, saved-activation bytes, the no-compiler path, settings."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from phalanx import Phalanx, config
from phalanx.model import compile as compile_units
from phalanx.strategies.choice import choose
from tests.dist.strategy_workloads import TinyNet


@pytest.fixture(autouse=True)
def _run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "run"))  # phalanx's logs stay out of the repo


class Scale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = Scale(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.fc(x))


def test_meta_model_equals_a_normal_construction_with_the_same_seed():
    torch.manual_seed(3)
    reference = TinyNet(num_blocks=4).state_dict()
    torch.manual_seed(3)
    with torch.device("meta"):
        model = TinyNet(num_blocks=4)
    model = Phalanx().prepare(model)
    assert not any(t.is_meta for t in model.state_dict().values())
    for key, value in reference.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_init_module_builds_on_the_device_in_a_world_of_one():
    px = Phalanx()
    with px.init_module():
        model = nn.Linear(2, 2)
    assert model.weight.device == px.device


def test_meta_module_without_reset_parameters_is_refused_with_its_name():
    with torch.device("meta"):
        model = WithScale()
    with pytest.raises(ValueError, match=r"no reset_parameters\(\) to initialise them: scale \(Scale\)"):
        Phalanx().prepare(model)


def test_init_weights_initialises_every_module_with_its_own_tensors():
    def init_weights(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    with torch.device("meta"):
        model = WithScale()
    model = Phalanx(strategy_options={"init_weights": init_weights}).prepare(model)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_a_partly_meta_model_keeps_its_real_tensors():
    torch.manual_seed(0)
    model = WithScale()
    real = model.fc.weight.detach().clone()
    with torch.device("meta"):
        model.fc2 = nn.Linear(4, 4)
    model.scale.reset_parameters = lambda: nn.init.ones_(model.scale.gain)
    model = Phalanx().prepare(model)
    assert torch.equal(model.fc.weight, real) and not model.fc2.weight.is_meta


def _saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).pow(2).mean()
    loss.backward()
    return total


def test_activation_checkpointing_halves_the_bytes_saved_for_backward_with_equal_gradients():
    tokens = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    runs = {}
    for ac in (None, True):
        torch.manual_seed(4)
        model = Phalanx(activation_checkpointing=ac).prepare(TinyNet(num_blocks=4))
        runs[ac] = (
            _saved_bytes(model, tokens),
            {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()},
        )
    (plain_bytes, plain_grads), (ckpt_bytes, ckpt_grads) = runs[None], runs[True]
    assert ckpt_bytes <= plain_bytes / 2, (ckpt_bytes, plain_bytes)
    assert sorted(plain_grads) == sorted(ckpt_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-6, atol=1e-7)


def test_activation_checkpointing_keeps_parameter_names_in_state_dicts():
    model = Phalanx(activation_checkpointing=["Block"]).prepare(TinyNet(num_blocks=2))
    assert type(model.blocks[0]).__name__ == "CheckpointWrapper"
    assert sorted(model.state_dict()) == sorted(TinyNet(num_blocks=2).state_dict())


def test_activation_checkpointing_names_that_match_nothing_are_an_error():
    px = Phalanx(activation_checkpointing=["Blok"])
    with pytest.raises(
        ValueError,
        match=r"activation_checkpointing: Blok matches no module of the model\. "
        r"Module classes present: Block, Embedding, LayerNorm, Linear, ModuleList, TinyNet$",
    ):
        px.prepare(TinyNet())


@pytest.fixture
def phalanx_warnings():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("phalanx")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_compile_without_a_cxx_compiler_warns_once_and_runs_eager(monkeypatch, phalanx_warnings):
    monkeypatch.setattr(compile_units, "find_cxx_compiler", lambda: None)
    torch.manual_seed(0)
    eager = TinyNet(num_blocks=2)
    model = Phalanx(compile=True).prepare(TinyNet(num_blocks=2))
    model.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 32, (4, 6))
    assert torch.equal(model(tokens), eager(tokens))
    assert all(b.forward.__func__ is type(b).forward for b in model.blocks)  # not compiled
    messages = [r.getMessage() for r in phalanx_warnings]
    assert messages == [
        "compile=True needs a C/C++ compiler for torch.compile on CPU and none was found "
        "(set CXX or install g++); running eager instead"
    ]


def test_compile_replaces_each_unit_forward_and_rejects_bad_values():
    model = Phalanx(compile={"dynamic": False}).prepare(TinyNet(num_blocks=2))
    assert all(not hasattr(b.forward, "__func__") for b in model.blocks)  # torch.compile's wrapper
    assert not hasattr(model.forward, "_torchdynamo_orig_callable")  # the root stays eager
    with pytest.raises(ValueError, match=r"Phalanx\(compile='fast'\): expected true or false"):
        Phalanx(compile="fast")  # refused before any group is joined


class _AsyncOutput(torch.autograd.Function):
    """What tensor parallel's embedding hands a block: RowwiseParallel's async all-reduce, taken
    local before it is waited (an AsyncCollectiveTensor that requires grad)."""

    @staticmethod
    def forward(ctx, x):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_compiled_unit_passes_the_gradient_to_an_async_collective_input():
    """torch 2.13's compile unwraps such an input without its requires_grad: the gradient behind it
    came back zero here (under tp 2, a plain tensor in DTensor's Redistribute backward)."""
    torch.manual_seed(0)
    unit, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    unit(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    compile_units.apply([unit], {"backend": "aot_eager"}, torch.device("cpu"))
    unit(_AsyncOutput.apply(x)).square().sum().backward()
    torch.testing.assert_close(x.grad, want)


def _choice(env=None, **kwargs):
    return choose(config.resolve(config.from_env(env or {}), config.from_kwargs(kwargs)))


def test_settings_schema_rows_and_environment():
    ac, comp = config.BY_NAME["activation_checkpointing"], config.BY_NAME["compile"]
    assert (ac.env, ac.flag, comp.env, comp.flag) == (
        "PHALANX_ACTIVATION_CHECKPOINTING",
        "--activation-checkpointing",
        "PHALANX_COMPILE",
        "--compile",
    )
    assert ac.kind.from_text("true") is True and ac.kind.from_text("false") is False
    assert ac.kind.from_text("Block, Attention") == ["Block", "Attention"]
    assert ac.kind.from_object(["Block"]) == ["Block"] and comp.kind.from_text("yes") is True
    with pytest.raises(config.ConfigError, match="--compile maybe: expected true or false"):
        config.from_flags({"compile": "maybe"})
    options = _choice({"PHALANX_ACTIVATION_CHECKPOINTING": "Block,Head", "PHALANX_COMPILE": "1"}).options
    assert options.activation_checkpointing == ["Block", "Head"] and options.compile is True
    options = _choice({"PHALANX_COMPILE": "1"}, activation_checkpointing=False, compile=False).options
    assert options.compile is False and options.activation_checkpointing is False
    with pytest.raises(config.ConfigError, match="PHALANX_COMPILE=maybe: expected true or false"):
        _choice({"PHALANX_COMPILE": "maybe"})


def test_load_model_in_a_world_of_one_from_a_torch_file_and_a_state_dict(tmp_path):
    torch.manual_seed(8)
    source = TinyNet().state_dict()
    torch.save(source, tmp_path / "w.pt")
    px = Phalanx()
    for given in (tmp_path / "w.pt", source):
        model = px.prepare(TinyNet())
        result = px.load_model(model, given)
        assert sorted(result.loaded) == sorted(source) and not (result.missing or result.unexpected)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
    with pytest.raises(ValueError, match=r"missing in the checkpoint \(1\): head.bias"):
        px.load_model(TinyNet(), {k: v for k, v in source.items() if k != "head.bias"})


class WithTable(nn.Module):
    """reset_parameters() forgets the buffer computed in __init__ (a common bug on meta)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.freqs = Freqs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.freqs.table


class Freqs(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(2.0))

    def reset_parameters(self) -> None:
        pass


def test_an_init_that_leaves_a_tensor_unset_is_an_error_naming_it():
    with torch.device("meta"):
        model = WithTable()
    with pytest.raises(
        ValueError, match=r"Freqs.reset_parameters\(\) left table of this Freqs \(wholly or partly\) unset"
    ):
        Phalanx().prepare(model)


def test_load_model_from_sharded_safetensors_by_index_or_folder(tmp_path):
    import json

    from safetensors.torch import save_file

    torch.manual_seed(9)
    source = {k: v.contiguous() for k, v in TinyNet().state_dict().items()}
    keys = sorted(source)
    parts = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    for name, part in parts.items():
        save_file({k: source[k] for k in part}, tmp_path / name)
    index = {"metadata": {}, "weight_map": {k: name for name, part in parts.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    px = Phalanx()
    for given in (tmp_path / "model.safetensors.index.json", tmp_path):
        model = px.prepare(TinyNet())
        result = px.load_model(model, given)
        assert sorted(result.loaded) == keys and result.bytes_read == sum(v.nbytes for v in source.values())
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())


def test_compile_wraps_the_checkpointed_unit():
    torch.manual_seed(2)
    eager = TinyNet(num_blocks=2)
    model = Phalanx(activation_checkpointing=True, compile=True).prepare(TinyNet(num_blocks=2))
    model.load_state_dict(eager.state_dict())
    assert type(model.blocks[0]).__name__ == "CheckpointWrapper"
    assert not hasattr(model.blocks[0].forward, "__func__")  # the wrapper's forward is the compiled one
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    out, ref = model(tokens), eager(tokens)
    out.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)

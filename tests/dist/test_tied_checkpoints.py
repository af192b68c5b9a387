"""A tied embedding (LlamaForCausalLM with tie_word_embeddings) is stored once in a checkpoint, under
the one-process model's canonical name `model.embed_tokens.weight` (weights and optimizer state),
in every layout: under pp 2 the last stage, which holds it as `lm_head.weight` only, saves it under
that name too and loads it back from there. So a checkpoint moves between pp 2 and the layouts
where the parameter is one, both ways, and the 3 steps after the resume equal one process's steps
4-6. `phalanx export` writes both names, as the model's own state_dict holds them."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.dist.harness import run_ranks
from tests.dist.test_families import _check

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

LAYOUTS = {  # name -> (processes, Phalanx settings)
    "one process": (1, {}),
    "ddp": (2, {"strategy": "ddp"}),
    "zero3": (2, {"strategy": "zero3"}),
    "tp 2": (2, {"strategy": "ddp", "tp": 2}),
    "pp 2": (2, {"strategy": "ddp", "pp": 2}),
}
CANONICAL, ALIAS = "model.embed_tokens.weight", "lm_head.weight"


def _train(layout: str, save: str | None = None, resume: str | None = None) -> list[dict]:
    processes, settings = LAYOUTS[layout]
    return run_ranks(
        "tests.dist.family_workloads:train",
        processes,
        args=("llama-tied", 8, 3, 1e-2, save, resume),
        env=_env(settings),
        timeout=400,
    )


def _env(settings: dict) -> dict[str, str]:
    return {f"PHALANX_{key.upper()}": str(value) for key, value in settings.items()}


def _names(checkpoint: Path) -> list[str]:
    """The checkpoint's keys naming the tied weight (model weights and optimizer state)."""
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return sorted(k for k in keys if CANONICAL in k or ALIAS in k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints after 3 steps of pp 2 and of ddp."""
    root = tmp_path_factory.mktemp("tied")
    for layout in ("pp 2", "ddp"):
        _train(layout, save=str(root / layout.replace(" ", "")))
    return {layout: root / layout.replace(" ", "") for layout in ("pp 2", "ddp")}


@pytest.mark.parametrize("layout", ["pp 2", "ddp"])
def test_the_tied_weight_is_stored_once_under_the_canonical_name(saved, layout):
    names = _names(saved[layout])
    assert names and not [n for n in names if ALIAS in n], names
    assert "model.model.model.embed_tokens.weight" in names
    assert "model.optim.state.model.embed_tokens.weight.exp_avg" in names


def test_export_writes_both_names_of_the_tied_weight(saved, tmp_path):
    import torch
    from safetensors.torch import load_file

    from phalanx.checkpoint.export import export
    from tests.layouts.families import build
    from tests.dist.tp_workloads import VOCAB

    state = load_file(str(export(saved["pp 2"], tmp_path / "out.safetensors")))
    torch.testing.assert_close(state[ALIAS], state[CANONICAL])
    model = build("llama-tied", vocab_size=VOCAB)
    model.load_state_dict(state)  # strict: every name the model's state_dict has
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("source,target", [("pp 2", "one process"), ("ddp", "pp 2")])
def test_a_tied_checkpoint_moves_between_pp_and_one_parameter_layouts(saved, source, target):
    resumed = _train(target, resume=str(saved[source]))
    _check([{"llama-tied / resume": r} for r in resumed], "llama-tied / resume", steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3", "tp 2", "one process"])
def test_every_layout_stores_the_tied_weight_once(tmp_path, layout):
    _train(layout, save=str(tmp_path / "ckpt"))
    names = _names(tmp_path / "ckpt")
    assert names and not [n for n in names if ALIAS in n], names


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,target", [("pp 2", "ddp"), ("pp 2", "zero3"), ("pp 2", "tp 2"), ("pp 2", "pp 2"), ("ddp", "one process")]
)
def test_a_tied_checkpoint_resumes_in_every_layout(saved, source, target):
    resumed = _train(target, resume=str(saved[source]))
    _check([{"llama-tied / resume": r} for r in resumed], "llama-tied / resume", steps=3)

"""examples/finetune_llm.py --tiny --tie-embeddings (a Llama whose output projection shares the input
embedding, as Llama-3.2-1B and Qwen2.5 do) under zero3, tp 2 and pp 2 on 2 processes: every step's
logged loss and the final held-out loss equal one process on the same global batch. And --pp 2 --lora 8:
the stages are cut from the base model's layers inside the peft wrapper, and it trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_llm.py"
ARGS = ["--tiny", "--limit", "200", "--seq-len", "64", "--log-every", "1", "--steps", "6"]
GLOBAL_BATCH = 4
LAYOUTS = {
    "one process": ["--nproc-per-node", "1"],
    "zero3": ["--nproc-per-node", "2", "--strategy", "zero3"],
    "tp 2": ["--nproc-per-node", "2", "--tp", "2"],
    "pp 2": ["--nproc-per-node", "2", "--pp", "2"],
}


def launch(root: Path, name: str, flags: list[str], *extra: str) -> str:
    per_process = GLOBAL_BATCH // 2 if name == "zero3" else GLOBAL_BATCH  # tp and pp ranks share their batch
    run_dir = root / name.replace(" ", "-")
    result = run_cli(
        ["run", *flags, "--run-dir", str(run_dir), str(EXAMPLE), *ARGS, "--batch-size", str(per_process), *extra],
        cwd=root,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def figures(stdout: str) -> tuple[list[str], str]:
    """The logged per-step losses and the final held-out loss, as printed."""
    steps = re.findall(r"step (\d+) \| loss (\S+)", stdout)
    after = re.search(r"after \d+ steps: eval loss (\S+)", stdout).group(1)
    return [loss for _, loss in steps], after


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tied")
    return {name: launch(root, name, flags, "--tie-embeddings") for name, flags in LAYOUTS.items()}


@pytest.mark.parametrize("layout", ["zero3", "tp 2", "pp 2"])
def test_tied_embeddings_train_as_one_process_does(tied, layout):
    losses, after = figures(tied[layout])
    assert len(losses) == 6
    assert (losses, after) == figures(tied["one process"])


def test_untied_under_tp_clips_through_the_num_items_path_as_one_process_does(tmp_path):
    # every parameter a DTensor under tp: clip_grad_norm_ after px.backward(num_items=...) crashed with
    # "aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor"
    one, tp = (launch(tmp_path, name, LAYOUTS[name]) for name in ("one process", "tp 2"))
    assert figures(tp) == figures(one) and len(figures(tp)[0]) == 6


def test_lora_under_pp_cuts_the_stages_from_the_base_models_layers_and_trains(tmp_path):
    out = launch(tmp_path, "pp 2", LAYOUTS["pp 2"], "--lora", "8")
    assert "training LoRA adapters" in out
    before, after = (float(x) for x in re.search(r"eval loss (\S+), perplexity \S+ \(was (\S+),", out).groups()[::-1])
    assert after < before

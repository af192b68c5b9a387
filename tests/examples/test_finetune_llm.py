"""examples/finetune_llm.py --tiny --lora 8 on 2 CPU processes under zero3, ddp and hsdp: each saves a
directory `from_pretrained` loads and `generate` runs on (zero3 and ddp with the adapters merged, hsdp's
adapters kept separately after a checkpoint and a resume); zero3 and the resumed hsdp train the same model."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_llm.py"
ARGS = ["--tiny", "--lora", "8", "--limit", "200", "--seq-len", "64", "--batch-size", "4", "--log-every", "1"]
STEPS = 4


def launch(root: Path, strategy: str, *extra: str, checkpoint: bool = False) -> str:
    flags = ["--checkpoint-dir", str(root / "ckpt")] if checkpoint else []
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--strategy",
            strategy,
            "--run-dir",
            str(root / "run"),
            *flags,
            str(EXAMPLE),
            *ARGS,
            *extra,
        ],
        cwd=root,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("finetune")
    out = {
        "zero3": launch(root, "zero3", "--steps", str(STEPS), "--save", str(root / "zero3")),
        "ddp": launch(root, "ddp", "--steps", str(STEPS), "--save", str(root / "ddp")),
    }
    # hsdp: 2 steps and a checkpoint, then a second launch resumes and takes the other 2
    out["hsdp_first"] = launch(root, "hsdp", "--steps", "2", "--checkpoint-every", "2", checkpoint=True)
    out["hsdp"] = launch(
        root,
        "hsdp",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "2",
        "--keep-adapters",
        "--save",
        str(root / "hsdp"),
        checkpoint=True,
    )
    return {"root": root, "stdout": out}


def load(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("strategy", ["zero3", "ddp", "hsdp"])
def test_saved_directory_loads_with_from_pretrained_and_generates(runs, strategy):
    model, tokenizer = load(runs["root"] / strategy)
    inputs = tokenizer("The for statement", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 6)
    stdout = runs["stdout"][strategy]
    assert f"strategy {strategy}, 2 process(es); training LoRA adapters (16,384 parameters)" in stdout
    before, after = (
        float(x) for x in re.search(r"eval loss (\S+), perplexity \S+ \(was (\S+),", stdout).groups()[::-1]
    )
    assert after < before  # a few steps on the corpus lower the held-out loss


def test_merged_lora_is_in_the_weights_and_adapters_stay_separate_when_kept(runs):
    root = runs["root"]
    assert (root / "zero3" / "model.safetensors").exists() and not (root / "zero3" / "adapter_config.json").exists()
    assert (root / "hsdp" / "adapter_config.json").exists() and (root / "hsdp" / "adapter_model.safetensors").exists()
    assert not (root / "hsdp" / "model.safetensors").exists()


def test_zero3_and_resumed_hsdp_train_the_same_model_and_ddp_trains_too(runs):
    # zero3 and hsdp build the model on the meta device and initialise it at prepare with the numbers
    # one process draws; ddp builds it normally: the same seed, the same adapters, the same model.
    root = runs["root"]
    assert "resumed at step 2" in runs["stdout"]["hsdp"]
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    logits = {}
    for strategy in ("zero3", "ddp", "hsdp"):
        model, _ = load(root / strategy)
        with torch.no_grad():
            logits[strategy] = model(input_ids=ids).logits
    base, _ = load(root / "run" / "tiny-llama")
    with torch.no_grad():
        untrained = base(input_ids=ids).logits
    assert not torch.allclose(logits["zero3"], untrained, atol=1e-4)  # LoRA changed the model
    assert not torch.allclose(logits["ddp"], untrained, atol=1e-4)
    torch.testing.assert_close(logits["hsdp"], logits["zero3"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits["ddp"], logits["zero3"], rtol=1e-4, atol=1e-4)  # differed before (LoRA's A)


def test_lora_on_a_model_without_the_projections_names_what_it_looked_for():
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = importlib.util.spec_from_file_location("finetune_llm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    with pytest.raises(ValueError) as error:
        example.add_lora(model, 8)
    assert str(error.value).startswith(
        "--lora 8: the model has no attention or MLP projection among the Linear layers looked for (q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj); its Linear layers are named: lm_head."
    )


def test_metrics_rows_carry_samples_and_tokens_per_second(runs):
    import json

    rows = [json.loads(line) for line in (runs["root"] / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * STEPS  # zero3, ddp, hsdp (2 + 2 steps): one row per step
    for row in rows:
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > row["samples_per_s"]  # several tokens a sample
        assert "mfu" not in row  # no GPU peak on CPU: no MFU, not a guess


def test_muon_fine_tunes_the_adapters_under_zero3(tmp_path):
    """--optimizer muon: Muon on the decoder layers' matrices, here the LoRA adapters (each stepped
    whole on its owner rank under zero3); the held-out loss goes down."""
    stdout = launch(tmp_path, "zero3", "--optimizer", "muon", "--steps", str(STEPS))
    assert "strategy zero3, 2 process(es); training LoRA adapters (16,384 parameters) with Muon" in stdout
    before, after = (
        float(x) for x in re.search(r"eval loss (\S+), perplexity \S+ \(was (\S+),", stdout).groups()[::-1]
    )
    assert after < before


def test_tp_2_with_lora_runs_exactly_the_steps_asked_for(tmp_path):
    """`--tp 2 --lora 8` stopped at prepare ("tp_plan pattern 'model.layers.*.self_attn.q_proj' matches no module
    of PeftModelForCausalLM"); the issue also saw 26 steps reported for --steps 20."""
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--tp",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            str(EXAMPLE),
            *ARGS,
            "--steps",
            "3",
        ],
        cwd=tmp_path,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "training LoRA adapters" in result.stdout
    assert [int(s) for s in re.findall(r"^step (\d+) \|", result.stdout, re.M)] == [1, 2, 3]
    assert "after 3 steps" in result.stdout

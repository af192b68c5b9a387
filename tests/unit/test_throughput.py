"""Throughput: what a batch counts, rates over a faked clock, the FLOPs of a transformer stack, the
peak table by (faked) GPU name, and samples/s, tokens/s and MFU reaching the metrics rows and the bar."""

import json
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from phalanx.logging import throughput as tp
from phalanx.model.flops import TransformerShape, transformer_shape
from phalanx.runtime import device_peaks


def test_batch_counts_token_ids_with_and_without_a_mask():
    ids = torch.ones(3, 5, dtype=torch.long)
    mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    assert tp.batch_counts({"input_ids": ids, "attention_mask": mask, "labels": ids}) == (3, 10, 5)
    assert tp.batch_counts((ids, torch.zeros(3))) == (3, 15, 5)  # nanoGPT-style (x, y): x is token ids
    assert tp.batch_counts((torch.randn(4, 6), torch.zeros(4, dtype=torch.long))) == (4, None, None)  # features
    assert tp.batch_counts(torch.randn(2, 3, 4)) == (2, None, None)
    assert tp.batch_counts({"pixels": torch.randn(7, 3)}) == (7, None, None)


def test_rates_over_the_interval_since_the_last_row_times_the_world_size():
    now = [100.0]
    meter = tp.Throughput(world_size=4, clock=lambda: now[0])
    meter.set_model(lambda seq_len: 1000.0 + seq_len, peak=1e6)
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    meter.count_batch(batch)
    meter.count_batch(batch)  # an evaluation batch before: never committed, not counted
    meter.commit()
    meter.commit()  # a second backward on the same batch counts it once
    now[0] = 102.0
    meter.count_batch(batch)
    meter.commit()
    now[0] = 104.0
    rates = meter.snapshot()
    assert rates == {tp.SAMPLES: 4 * 4 / 4.0, tp.TOKENS: 32 * 4 / 4.0, tp.MFU: 32 * 1008.0 / 4.0 / 1e6}
    assert meter.snapshot() == {}  # nothing trained since
    meter.count_batch(batch)
    meter.commit()
    now[0] = 105.0
    assert meter.snapshot(logged_tokens=500)[tp.TOKENS] == 500.0  # the script's exact count wins


def test_transformer_flops_per_token_counts_weights_outside_embeddings_and_attention():
    shape = TransformerShape(num_params=1000, num_trainable=1000, num_layers=2, width=8)
    assert shape.flops_per_token(seq_len=16) == 6 * 1000 + 12 * 2 * 8 * 16
    frozen = TransformerShape(num_params=1000, num_trainable=10, num_layers=2, width=8)  # LoRA: ~4N
    assert frozen.flops_per_token(16) == 4 * 1000 + 2 * 10 + 12 * 2 * 8 * 16

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(50, 16),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), num_layers=3, enable_nested_tensor=False
        ),
        nn.Linear(16, 50),
    )
    found = transformer_shape(model)
    assert (found.num_layers, found.width) == (3, 16)
    assert found.num_params == sum(p.numel() for p in model.parameters()) - 50 * 16
    assert transformer_shape(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) is None  # not a transformer: no guess


def test_transformers_llama_shape_from_its_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    found = transformer_shape(model)
    assert (found.num_layers, found.width) == (3, 32)
    assert found.num_params == sum(p.numel() for p in model.parameters()) - 64 * 32


@pytest.mark.parametrize(
    "name,precision,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA A10", "tf32", 62.5),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-SXM2-32GB", "bf16", None),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA GeForce RTX 3060", "bf16", None),
    ],
)
def test_peak_table_by_device_name(name, precision, tflops):
    peak = device_peaks.peak_flops(name, precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_device_peak_of_a_faked_gpu_follows_mixed_precision_and_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert device_peaks.device_peak(gpu, "bf16") == pytest.approx(989.4e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert device_peaks.device_peak(gpu, "no") == pytest.approx(66.9e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peaks.device_peak(gpu, "no") == pytest.approx(494.7e12)
    assert device_peaks.device_peak(torch.device("cpu"), "bf16") is None


class TokenTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.blocks = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), num_layers=2, enable_nested_tensor=False
        )
        self.head = nn.Linear(16, 40)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def test_samples_tokens_and_mfu_reach_the_metrics_rows_and_the_progress_bar(tmp_path, monkeypatch, capsys):
    peak = 1e9  # a faked GPU peak: the FLOPs arithmetic is checked, not a device
    monkeypatch.setenv("COLUMNS", "200")  # the bar's width: the whole postfix fits
    monkeypatch.setattr(device_peaks, "device_peak", lambda device, precision: peak)
    px = Phalanx(run_dir=str(tmp_path), log_sinks=["jsonl"], progress="on", seed=0)
    torch.manual_seed(0)
    model = TokenTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 40, (24, 12))
    loader = DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=4)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(px.progress(loader), start=1):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        px.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 3 == 0:
            px.log({"loss": loss}, step=step)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    flops = transformer_shape(TokenTransformer()).flops_per_token(11)
    for row in rows:
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 11)
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops / peak)
    bar = capsys.readouterr().out
    assert re.search(r"loss=[\d.]+, samples/s=[\d.e+]+, tokens/s=[\d.e+]+, MFU=[\d.]+%", bar), bar[-500:]

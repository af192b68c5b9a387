"""cp's reading of transformers models, without a process group: which attention arguments a family
hands its attention (hf_arguments.py) and labels= shifted over the whole row (labels.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from phalanx.strategies.context import hf_arguments, labels


def _layer(family: str, name: str) -> type:
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


@pytest.mark.parametrize(
    "family,layer",
    [
        ("llama", "LlamaAttention"),
        ("mistral", "MistralAttention"),
        ("gemma2", "Gemma2Attention"),
        ("qwen2", "Qwen2Attention"),
        ("modernbert", "ModernBertAttention"),
    ],
)
def test_families_whose_attention_arguments_the_cut_applies(family: str, layer: str) -> None:
    keywords = hf_arguments._attention_call_keywords(_layer(family, layer))
    assert keywords and keywords <= hf_arguments.APPLIED | hf_arguments.NO_EFFECT


def test_gpt_oss_sinks_are_an_argument_the_cut_does_not_apply() -> None:
    assert "s_aux" in hf_arguments._attention_call_keywords(_layer("gpt_oss", "GptOssAttention"))


def test_labels_are_shifted_over_the_whole_row_with_the_row_count_per_cp_rank() -> None:
    ids = torch.arange(8).reshape(1, 8)
    row = ids.clone()
    row[0, 3] = -100
    fields = labels.shift_before_cut({"input_ids": ids, "labels": row}, 2)
    assert fields["shift_labels"].tolist() == [[1, 2, -100, 4, 5, 6, 7, -100]]
    assert fields["labels"] is fields["shift_labels"]
    assert float(fields["num_items_in_batch"]) == 6 / 2  # 6 targets in the row, 2 cp ranks share it
    assert labels.shift_before_cut({"input_ids": ids}, 2) == {"input_ids": ids}


def test_a_sink_reaching_the_cut_attention_is_refused_not_dropped() -> None:
    from phalanx.strategies.context import hf
    from phalanx.strategies.context.layout import SequenceLayout, using_layout

    q = torch.zeros(1, 4, 4, 8)
    with using_layout(SequenceLayout(2, 0, None, 8)), pytest.raises(ValueError, match="s_aux.*HINT: run this model"):
        hf._attention(torch.nn.Linear(1, 1), q, q, q, None, s_aux=torch.zeros(4))

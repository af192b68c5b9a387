"""What strategies/token_mean.py counts: the targets a causal LM's loss averages over (labels shifted by one
inside the model, or shift_labels as given; -100 ignored), and which models it applies to."""

import torch

from phalanx.strategies import token_mean
from tests.idioms import models


def test_the_targets_a_causal_lm_averages_over():
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
    assert int(token_mean.target_count({"labels": labels})) == 2  # the first position of a row is no target
    assert int(token_mean.target_count({"labels": labels, "shift_labels": labels})) == 4
    assert token_mean.target_count({"input_ids": labels}) is None


def test_it_applies_to_transformers_causal_lms_only():
    assert token_mean.applies(models.llama())
    assert not token_mean.applies(models.mlp())

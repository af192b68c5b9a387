"""Tied weights (one parameter held by several modules) as the layouts see them, in one process:
zero3's sharding units never split a tie, and tensor parallel gives the holders placements that
keep them one parameter."""

from __future__ import annotations

from torch import nn

from tests.layouts.families import build
from phalanx.model.units import default_units, shard_units
from phalanx.strategies import tied


def test_a_causal_lm_shards_one_unit_per_decoder_layer_and_leaves_the_tied_pair_to_the_root():
    model = build("llama-tied")
    assert default_units(model) == list(model.model.layers)
    assert shard_units(model, None) == list(model.model.layers)


def test_units_that_would_split_a_tie_are_left_to_the_enclosing_unit():
    model = build("llama-tied")  # a predicate picking both tied modules as units of their own
    chosen = shard_units(model, lambda name, m: name in ("model.embed_tokens", "lm_head", "model.layers.0"))
    assert chosen == [model.model.layers[0]]
    untied = build("llama")
    assert len(shard_units(untied, lambda name, m: name in ("model.embed_tokens", "lm_head"))) == 2


def test_tied_holders_are_found_and_a_colwise_head_splits_its_embedding_by_rows_too():
    model = build("llama-tied")
    groups = tied.tied_groups(model)
    assert groups == [[("model.embed_tokens", "weight"), ("lm_head", "weight")]]
    styles = tied.compatible_styles(model, {"lm_head": "colwise_gather_output"}, groups)
    assert styles == {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"}


def test_a_tie_no_row_split_can_keep_is_replicated_on_both_sides():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 8)
            self.proj = nn.Linear(8, 8, bias=False)
            self.proj.weight = self.embed.weight

    model = Tied()
    styles = tied.compatible_styles(model, {"proj": "rowwise"}, tied.tied_groups(model))
    assert styles == {"proj": "replicate", "embed": "replicate"}
    assert tied.compatible_styles(build("llama"), {"lm_head": "colwise"}, tied.tied_groups(build("llama"))) == {
        "lm_head": "colwise"
    }  # untied: nothing changes

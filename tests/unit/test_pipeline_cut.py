"""Cutting a model into pipeline stages (strategies/pipeline: chain, split, cut), the schedule rules
and the layout arithmetic, in one process: the stages run one after another equal the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.strategies import pipeline as pipe
from tests.dist.pipeline_workloads import StackLM, new_model
from tests.dist.strategy_workloads import Block


def _x() -> torch.Tensor:
    return torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(0))


def _cut(pp: int, indices, pp_split=None, num_blocks: int = 4):
    torch.manual_seed(0)
    model = StackLM(num_blocks)
    whole = StackLM(num_blocks)
    whole.load_state_dict(model.state_dict())
    chain = pipe.find_chain(model)
    stages = pipe.split_stages(chain, pp, pp_split)
    return whole, pipe.cut_model(model, chain, stages, indices), stages


# ---- the chain ------------------------------------------------------------------------------------
def test_chain_is_the_units_in_call_order_with_their_sizes():
    chain = pipe.find_chain(new_model())
    assert chain.blocks == "layers"
    assert chain.names == ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head")
    assert [u.is_block for u in chain.units] == [False, True, True, True, True, False, False]
    assert chain.units[0].num_params == 32 * 16 and chain.units[-1].num_params == 16 * 32 + 32
    assert chain.describe() == "embed, layers.0, layers.1, layers.2, layers.3, norm, head"


def test_a_sequential_model_and_a_nested_block_list():
    seq = nn.Sequential(nn.Embedding(8, 4), *[Block(4) for _ in range(3)], nn.Linear(4, 8))
    assert pipe.find_chain(seq).names == ("0", "1", "2", "3", "4")

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(8, 4)
            self.h = nn.ModuleList(Block(4) for _ in range(6))

    class GPTish(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = Inner()
            self.lm_head = nn.Linear(4, 8)

        def forward(self, idx, labels=None):
            x = self.transformer.wte(idx)
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(x)

    chain = pipe.find_chain(GPTish())
    assert chain.blocks == "transformer.h"
    assert chain.names[0] == "transformer.wte" and chain.names[-1] == "lm_head" and chain.num_blocks == 6
    assert "transformer.h.0 ... transformer.h.5" in chain.describe()


# ---- the split ------------------------------------------------------------------------------------
def test_default_split_is_even_by_parameter_count_with_embedding_first_and_head_last():
    chain = pipe.find_chain(new_model())
    stages = pipe.split_stages(chain, 2)
    assert stages == (("embed", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "head"))
    assert pipe.stage_params(chain, stages) == [512 + 2 * 1104, 2 * 1104 + 32 + 544]
    assert pipe.split_stages(chain, 4) == (
        ("embed", "layers.0"),
        ("layers.1",),
        ("layers.2",),
        ("layers.3", "norm", "head"),
    )
    assert pipe.split_stages(chain, 1) == (chain.names,)


def test_default_split_gives_a_heavy_embedding_fewer_blocks():
    class BigVocab(StackLM):
        def __init__(self):
            super().__init__(6)
            self.embed = nn.Embedding(400, 16)  # 6400 parameters, as much as 5-6 blocks

    chain = pipe.find_chain(BigVocab())
    first, second = pipe.split_stages(chain, 2)
    assert first == ("embed", "layers.0")
    sizes = pipe.stage_params(chain, (first, second))
    assert max(sizes) == min(max(pipe.stage_params(chain, ((chain.names[:k]), chain.names[k:]))) for k in range(2, 7))


def test_pp_split_names_the_units_to_cut_before():
    chain = pipe.find_chain(new_model())
    assert pipe.split_stages(chain, 2, ["layers.3"]) == (chain.names[:4], chain.names[4:])
    assert pipe.split_stages(chain, 3, ["layers.1", "norm"]) == (
        ("embed", "layers.0"),
        ("layers.1", "layers.2", "layers.3"),
        ("norm", "head"),
    )


@pytest.mark.parametrize(
    "pp, split, message",
    [
        (
            5,
            None,
            "pp=5 needs at least 5 blocks to give each stage one, but layers holds 4. HINT: lower pp to at most 4",
        ),
        (
            2,
            ["layers.9"],
            "pp_split names 'layers.9', which is not a unit the pipeline can cut before. The units, in "
            "the order forward calls them, are: embed, layers.0, layers.1, layers.2, layers.3, norm, head",
        ),
        (2, ["layers.1.fc1"], "pp_split names 'layers.1.fc1', which is not a unit"),
        (3, ["layers.1"], "pp_split names 1 cut point(s) ['layers.1'], which makes 2 stage(s), but pp=3"),
        (3, ["layers.3", "layers.1"], "pp_split ['layers.3', 'layers.1'] is not in the order forward calls the units"),
        (3, ["layers.1", "layers.1"], "is not in the order forward calls the units"),
        (2, ["embed"], "pp_split cannot cut before 'embed', the first unit"),
        (0, None, "pp must be a positive integer, got 0"),
    ],
)
def test_bad_splits_are_refused_with_the_values_and_the_fix(pp, split, message):
    with pytest.raises(ValueError) as err:
        pipe.split_stages(pipe.find_chain(new_model()), pp, split)
    assert message in str(err.value)


# ---- the cut ------------------------------------------------------------------------------------
def test_stages_keep_the_models_names_and_chain_to_the_whole_model():
    whole, first, _ = _cut(2, [0])
    _, second, _ = _cut(2, [1])
    assert list(first.model.state_dict()) == [
        k for k in whole.state_dict() if k.startswith(("embed", "layers.0", "layers.1"))
    ]
    assert "layers.2.fc1.weight" in second.model.state_dict() and "layers.0.fc1.weight" not in second.model.state_dict()
    assert isinstance(first.model.layers[2], pipe.PassThrough) and len(first.model.layers) == 4
    assert isinstance(second.model.embed, pipe.PassThrough) and first.units == ("embed", "layers.0", "layers.1")
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name])
    x = _x()
    torch.testing.assert_close(second.model(first.model(x)), whole(x))
    assert first.stages == (first.model,)


def test_several_stages_per_rank_share_the_rank_models_parameters():
    whole, rank0, _ = _cut(4, [0, 2], num_blocks=8)
    _, rank1, _ = _cut(4, [1, 3], num_blocks=8)
    assert len(rank0.stages) == 2 and rank0.stages[0] is not rank0.model
    shared = {id(p) for p in rank0.model.parameters()}
    assert all(id(p) in shared for stage in rank0.stages for p in stage.parameters())
    assert set(rank0.model.state_dict()) == set(rank0.stages[0].state_dict()) | set(rank0.stages[1].state_dict())
    x = _x()
    h = x
    for stage in (rank0.stages[0], rank1.stages[0], rank0.stages[1], rank1.stages[1]):
        h = stage(h)
    torch.testing.assert_close(h, whole(x))


def test_a_cut_on_the_meta_device_allocates_nothing():
    with torch.device("meta"):
        model = StackLM()
    chain = pipe.find_chain(model)
    rank = pipe.cut_model(model, chain, pipe.split_stages(chain, 2), [1])
    assert all(p.is_meta for p in rank.model.parameters()) and "head.weight" in rank.model.state_dict()


def test_tied_weights_across_stages_are_held_by_both_ranks_and_found_for_the_gradient_sum():
    from phalanx.strategies.plan.parallel_plan import ParallelPlan
    from phalanx.strategies.pipeline.tied import find_tied

    model = new_model()
    model.head.weight = model.embed.weight
    chain = pipe.find_chain(model)
    stages = pipe.split_stages(chain, 2)
    (tied,) = find_tied(model, chain, stages, "1F1B", ParallelPlan(preset="ddp", pp=2))
    assert (tied.holders, tied.pp_ranks) == (("embed.weight", "head.weight"), (0, 1)) and tied.name in tied.holders
    assert (
        find_tied(model, chain, pipe.split_stages(chain, 1), "1F1B", ParallelPlan(preset="single")) == []
    )  # one stage holds both
    first = pipe.cut_model(model, chain, stages, [0]).model
    assert "embed.weight" in dict(first.named_parameters()) and "head.weight" not in dict(first.named_parameters())


def test_a_stage_ending_in_a_tuple_is_refused_when_it_runs():
    class TupleBlock(Block):
        def forward(self, x):
            x = x[0] if isinstance(x, tuple) else x
            return super().forward(x), None

    model = StackLM()
    model.layers[1] = TupleBlock(16)
    chain = pipe.find_chain(model)  # x = layer(x) passes a tuple on: the chain holds
    rank = pipe.cut_model(model, chain, pipe.split_stages(chain, 2, ["layers.2"]), [0])
    with pytest.raises(ValueError, match="pipeline stage 0 returned a tuple, but the pipeline sends one tensor"):
        rank.model(_x())


# ---- what the cut refuses -------------------------------------------------------------------------
class Scaled(StackLM):
    def forward(self, tokens):
        x = self.embed(tokens) * 4.0
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Unpacking(StackLM):
    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(self.norm(x))


class Branching(StackLM):
    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        if x.sum() > 0:
            x = -x
        return self.head(self.norm(x))


class TwoInputs(StackLM):
    def forward(self, tokens, mask):
        return super().forward(tokens)


class Skip(StackLM):
    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x + self.embed(tokens)))


class Unused(StackLM):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(4, 4)


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "cls, message",
    [
        (
            Scaled,
            "its forward computes call_function `mul` after `embed`, which is not a call of one of its units on "
            "the previous output",
        ),
        (Unpacking, "its forward computes call_function `getitem` after `layers.0`"),
        (Unpacking, "the pipeline sends one tensor between stages, so the blocks must return the hidden state alone"),
        (Branching, "its forward could not be traced to check that it calls its modules as a plain chain (TraceError"),
        (TwoInputs, "its forward needs more than one input (tokens, mask)"),
        (Skip, "its forward calls `embed` more than once"),
        (Unused, "extra hold(s) parameters but the forward never calls them"),
        (Flat, "it has no nn.ModuleList or nn.Sequential of blocks, and pp_split cannot help"),  # it named pp_split
    ],
)
def test_models_the_cut_cannot_handle_are_refused_with_the_reason(cls, message):
    with pytest.raises(ValueError) as err:
        pipe.find_chain(cls())
    assert f"cannot cut {cls.__name__} into pipeline stages: " in str(err.value)
    assert message in str(err.value)


def test_defaults_of_other_arguments_are_fine():
    class WithOptions(StackLM):
        def forward(self, tokens, mask=None, scale=1.0):
            return super().forward(tokens)

    assert pipe.find_chain(WithOptions()).num_blocks == 4


# ---- schedules and microbatches ---------------------------------------------------------------------
def test_schedule_names_and_placements():
    assert pipe.schedule_name("1f1b") == "1F1B" and pipe.schedule_name("interleaved1f1b") == "Interleaved1F1B"
    with pytest.raises(ValueError, match="pp_schedule must be one of 1F1B, GPipe, Interleaved1F1B"):
        pipe.schedule_name("PipeDream")
    assert pipe.stages_per_rank("1F1B") == 1 and pipe.stages_per_rank("ZBVZeroBubble") == 2
    assert pipe.stages_per_rank("Interleaved1F1B") == 2 and pipe.stages_per_rank("LoopedBFS", 3) == 3
    with pytest.raises(ValueError, match="pp_schedule=GPipe runs 1 stage"):
        pipe.stages_per_rank("GPipe", 2)
    assert pipe.stage_indices("Interleaved1F1B", 1, 4, 2) == (1, 5)
    assert pipe.stage_indices("DualPipeV", 1, 4, 2) == (1, 6)
    assert pipe.last_stage_rank("1F1B", 4) == 3 and pipe.last_stage_rank("ZBVZeroBubble", 4) == 0


@pytest.mark.parametrize(
    "schedule, pp, m, batch, message",
    [
        (
            "1F1B",
            4,
            2,
            None,
            "pp_microbatches=2 is smaller than pp=4: the pipeline would never fill. HINT: set "
            "pp_microbatches to at least 4 (default 2 x pp = 8)",
        ),
        (
            "1F1B",
            2,
            4,
            6,
            "the batch of 6 samples does not split into pp_microbatches=4 equal microbatches. HINT: make "
            "the per-rank batch size a multiple of 4, or set pp_microbatches to a divisor of 6",
        ),
        (
            "Interleaved1F1B",
            2,
            5,
            None,
            "pp_microbatches=5 does not split into 2 equal rounds. HINT: use a multiple of pp, e.g. 4",
        ),
        ("DualPipeV", 2, 3, None, "pp_schedule=DualPipeV needs pp_microbatches >= its 4 stages"),
    ],
)
def test_microbatch_counts_that_cannot_run_are_refused(schedule, pp, m, batch, message):
    with pytest.raises(ValueError) as err:
        pipe.check_microbatches(schedule, pp, m, batch)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "schedule, pp, m, batch, count",
    [
        ("1F1B", 2, 4, 8, 4),
        ("1F1B", 2, 4, 6, 3),
        ("1F1B", 2, 4, 2, 2),
        ("1F1B", 2, 4, 7, 7),
        ("1F1B", 2, 3, 8, 2),
        ("Interleaved1F1B", 2, 4, 6, 3),
        ("DualPipeV", 2, 4, 6, 6),
    ],
)
def test_a_batch_the_microbatches_do_not_divide_is_cut_into_equal_ones_that_run(schedule, pp, m, batch, count):
    assert pipe.microbatches_for(schedule, pp, m, batch) == count


def test_a_batch_smaller_than_pp_is_refused_with_drop_last():
    with pytest.raises(ValueError, match=r"a training batch of 1 sample\(s\) cannot be cut .* drop_last=True"):
        pipe.microbatches_for("1F1B", 2, 4, 1)


def test_microbatch_counts_that_run():
    pipe.check_microbatches("1F1B", 2, 4, 8)
    pipe.check_microbatches("Interleaved1F1B", 4, 6)  # one round of 6
    assert pipe.default_microbatches(4) == 8


# ---- arithmetic for `phalanx plan` ----------------------------------------------------------------
def test_bubble_and_microbatches_in_flight():
    assert pipe.bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert pipe.bubble_fraction("GPipe", 2, 4) == pytest.approx(1 / 5)
    assert pipe.bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert pipe.bubble_fraction("ZBVZeroBubble", 4, 8, 2) is None
    assert pipe.in_flight("1F1B", 4, 8) == (4, 3, 2, 1)
    assert pipe.in_flight("1F1B", 4, 2) == (2, 2, 2, 1)
    assert pipe.in_flight("GPipe", 4, 8) == (8, 8, 8, 8)
    assert pipe.in_flight("Interleaved1F1B", 2, 4, 2) == (5, 3)


def test_pipeline_figures_per_stage_and_rank():
    figures = pipe.pipeline_figures(
        [10, 20, 30, 40], "Interleaved1F1B", 2, 4, bytes_per_param=2, activation_bytes_per_stage_microbatch=100
    )
    assert figures.stage_param_bytes == (20, 40, 60, 80)
    assert figures.rank_param_bytes == (80, 120)  # stages (0, 2) and (1, 3)
    assert figures.rank_activation_bytes == (500, 300)
    assert figures.bubble == pytest.approx(1 / 9)
    one = pipe.pipeline_figures([10, 20], "1F1B", 2)
    assert one.microbatches == 4 and one.rank_param_bytes == (40, 80) and one.in_flight == (2, 1)
    with pytest.raises(ValueError, match="pp_schedule=1F1B with pp=2 does not run 4 stages"):
        pipe.pipeline_figures([1, 2, 3, 4], "1F1B", 2)


def test_a_unit_called_on_something_else_than_the_previous_output_is_refused():
    class Residual(StackLM):
        def forward(self, tokens):
            e = self.embed(tokens)
            x = self.layers[0](e)
            for layer in self.layers[1:]:
                x = layer(x)
            return self.head(self.norm(e))

    with pytest.raises(
        ValueError,
        match=r"its forward calls `norm` on \(embed\), not on the previous unit's output "
        r"`layers_3` alone",
    ):
        pipe.find_chain(Residual())

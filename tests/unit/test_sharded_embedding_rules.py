"""Which embeddings zero2/zero3 look up where their rows live, and how rows are split."""

from torch import nn

from phalanx.strategies.sharded_embedding import RowLayout, eligible


class Model(nn.Module):
    def __init__(self, tie: bool = False, **embedding_options):
        super().__init__()
        self.embed = nn.Embedding(10, 4, **embedding_options)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4))])
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_root_level_plain_embeddings_are_taken_and_the_rest_left_to_fsdp():
    model = Model()
    assert eligible(model, list(model.blocks)) == [model.embed]  # the unit's own embedding stays with FSDP2
    tied = Model(tie=True)  # the table is also the head's weight: both must see one full tensor
    assert eligible(tied, list(tied.blocks)) == []
    for options in ({"max_norm": 1.0}, {"sparse": True}, {"scale_grad_by_freq": True}):
        odd = Model(**options)
        assert eligible(odd, list(odd.blocks)) == [], options


def test_rows_split_as_torch_chunk_and_dtensor_shard_0():
    assert [(RowLayout(5, r, 2).start, RowLayout(5, r, 2).stop) for r in range(2)] == [(0, 3), (3, 5)]
    assert [(RowLayout(101, r, 2).start, RowLayout(101, r, 2).stop) for r in range(2)] == [(0, 51), (51, 101)]
    assert [(RowLayout(1, r, 2).start, RowLayout(1, r, 2).stop) for r in range(2)] == [(0, 1), (1, 1)]

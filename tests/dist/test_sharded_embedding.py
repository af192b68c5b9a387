"""zero2/zero3 embeddings looked up where their rows live: equal to one process in both exchanges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist.embedding_workloads import Tagger, batches
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def one_process(vocab: int, seqs: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The same steps in one process: each step's loss is the mean of the ranks' batch losses."""
    torch.manual_seed(0)
    model = Tagger(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in batches(vocab, seqs):
        optimizer.zero_grad()
        loss = sum(nn.functional.cross_entropy(model(t), y) for t, y in step) / len(step)
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    return run_ranks(
        "tests.dist.embedding_workloads:exchanges",
        2,
        args=(str(directory),),
        timeout=300,
        env={"PHALANX_RUN_DIR": str(tmp_path_factory.mktemp("run"))},
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
@pytest.mark.parametrize("vocab,seqs,expected", [(101, (3, 5), "rows"), (5, (4, 4), "table")])
def test_looked_up_table_trains_like_one_process(ranks, strategy, vocab, seqs, expected):
    reference = one_process(vocab, seqs)
    r0, r1 = (r[(strategy, vocab, "auto")] for r in ranks)
    gathered = ranks[0][(strategy, vocab, "params")]
    assert r0["class"] == "ShardedLookupEmbedding" and gathered["class"] == "Embedding"
    assert r0["used"] == r1["used"] == [expected] * 3
    # Each rank holds its rows only: torch.chunk's split (101 -> 51 + 50, 5 -> 3 + 2).
    assert (r0["local_rows"], r1["local_rows"]) == ((51, 50) if vocab == 101 else (3, 2))
    assert r0["losses"] == pytest.approx(gathered["losses"], abs=1e-6)
    for key, value in reference.items():
        torch.testing.assert_close(r0["state"][key], value, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(gathered["state"][key], value, atol=1e-6, rtol=1e-5)
    assert torch.equal(r0["state"]["embed.weight"][1], reference["embed.weight"][1])  # the padding row never trains


@pytest.mark.timeout(400)
def test_checkpoint_moves_between_exchanges_and_bad_ids_raise_on_every_rank(ranks):
    assert [r["resumed_loaded"] for r in ranks] == [True, True]
    assert ranks[0]["resumed_equal"] is True
    for r in ranks:
        assert r["out_of_range"] == (
            "index out of range in self: token ids must lie in [0, 101) for this embedding, got rank 1: 3..101"
        )

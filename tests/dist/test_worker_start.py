"""A DataLoader worker stuck in its fork (CPython gh-112275, before 3.11.10) is replaced, not waited on
forever: 2 ranks, rank 1's chosen forks never start; every rank still reads what it reads without them."""

import re

import pytest

from tests.dist.harness import run_ranks
from tests.dist.worker_start_workloads import EPOCHS, N

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TIMEOUT_S = 5.0  # the guard's wait here; a healthy worker starts in milliseconds
HANG = {"global_rng": [0, 1], "own_generator": [1, 2]}  # (epoch, n-th fork of its pass): worker 0, worker 1


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stuck-fork")
    return run_ranks(
        "tests.dist.worker_start_workloads:stuck_fork", 2, args=(HANG, TIMEOUT_S, str(folder)), timeout=200
    )


def test_each_stuck_worker_is_named_and_replaced(ranks):
    r0, r1 = ranks
    assert r0["hung"] == [] and r0["replaced"] == []
    assert len(r1["hung"]) == 2
    named = [int(pid) for message in r1["replaced"] for pid in re.findall(r"pid (\d+)", message)]
    assert named == r1["hung"]
    assert "worker 0 (pid" in r1["replaced"][0] and "worker 1 (pid" in r1["replaced"][1]
    for message in r1["replaced"]:
        assert message.startswith("phalanx: rank 1: DataLoader worker")
        assert "CPython gh-112275" in message and "multiprocessing_context='forkserver'" in message
    assert r1["seconds"] >= 2 * TIMEOUT_S  # it waited for each one, then went on


@pytest.mark.parametrize("name", list(HANG))
def test_the_replaced_pass_reads_what_an_unstuck_one_does(ranks, name):
    for rank in ranks:
        assert rank["guarded"][name] == rank["reference"][name]  # same items, same order: the draws were put back
    for epoch in range(EPOCHS):
        items = sorted(i for rank in ranks for i in rank["guarded"][name][epoch])
        if name == "own_generator":  # a permutation: every item once over the two ranks
            assert items == list(range(N))
        else:
            assert len(items) == N

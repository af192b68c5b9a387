"""What the launcher says and agrees on when an elastic job shrinks or grows (launch/membership.py),
and the workers' store address published in every c10d round (launch/bound_store.py). No processes:
the round's store is an in-memory torch HashStore."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx import envvars
from phalanx.launch import bound_store, membership
from phalanx.launch.membership import Membership, resize_line
from phalanx.runtime.context import AgentEnv


@pytest.mark.parametrize(
    "before, after, line",
    [
        (
            Membership(4, ("a", "b")),
            Membership(2, ("a",)),
            "phalanx: restarting with 2 processes (was 4) after node b left",
        ),
        (
            Membership(2, ("a",)),
            Membership(4, ("a", "b")),
            "phalanx: restarting with 4 processes (was 2): node b joined",
        ),
        (
            Membership(6, ("a", "b", "c")),
            Membership(2, ("a",)),
            "phalanx: restarting with 2 processes (was 6) after nodes b, c left",
        ),
        (
            Membership(4, ("a", "b")),
            Membership(4, ("a", "c")),
            "phalanx: restarting with 4 processes (was 4): node c joined, node b left",
        ),
        (Membership(2, ()), Membership(1, ()), "phalanx: restarting with 1 process (was 2)"),
        (Membership(4, ("a", "b")), Membership(4, ("b", "a")), None),  # the same nodes: a restart, not a resize
    ],
)
def test_resize_line_names_the_old_and_new_size_and_the_nodes(before, after, line):
    assert resize_line(before, after) == line


def round_store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return store


def test_nodes_with_rounds_agree_on_one_attempt_name_whatever_their_restart_counts():
    store = round_store()
    names = {
        membership.agree_attempt(store, count, has_rounds=True) for count in (1, 0, 1)
    }  # a node that joined counts 0
    assert len(names) == 1
    assert membership.agree_attempt(round_store(), 1, has_rounds=True) not in names  # a new round, a new name


def test_a_static_rendezvous_names_the_attempt_by_its_restart_count():
    assert membership.agree_attempt(round_store(), 2, has_rounds=False) == "2"


def test_node_names_are_exchanged_in_group_rank_order():
    store = round_store()
    store.set(membership.NODE_KEY.format(1), "10.0.0.2")  # the other node wrote its name first
    assert membership.exchange_nodes(store, 0, 2, "10.0.0.1") == ("10.0.0.1", "10.0.0.2")


def test_a_node_that_never_writes_its_name_costs_the_names_not_the_restart(caplog):
    store = round_store()
    store.set_timeout(timedelta(milliseconds=200))
    assert membership.exchange_nodes(store, 0, 2, "10.0.0.1") is None
    assert "could not exchange node names" in caplog.text


def test_workers_take_the_agreed_attempt_name_over_their_own_restart_count():
    env = {envvars.TORCHELASTIC_RESTART_COUNT: "0", envvars.PHALANX_ATTEMPT: "1-5e2a9c01"}
    assert AgentEnv.from_env(env).attempt == "1-5e2a9c01"
    assert AgentEnv.from_env({envvars.TORCHELASTIC_RESTART_COUNT: "3"}).attempt == "3"  # plain torchrun


class CachingHandler:
    """torch's c10d handler as far as the wrapper cares: it caches the workers' store address."""

    def __init__(self):
        self._bootstrap_store_info = "address of round 0"
        self._create_tcp_store_server = None
        self.seen = []

    def next_rendezvous(self):
        self.seen.append(self._bootstrap_store_info)
        self._bootstrap_store_info = f"address of round {len(self.seen)}"
        return self._bootstrap_store_info


def test_every_c10d_round_publishes_the_workers_store_again():
    handler = bound_store._bind_workers_store(CachingHandler())
    handler.next_rendezvous()
    handler.next_rendezvous()
    assert handler.seen == [None, None]  # never the cached address of an earlier round

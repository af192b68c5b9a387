"""Interface choice, store ownership, rendezvous settings and failure reports (no traffic sent)."""

import pytest

from phalanx.cluster import network
from phalanx.launch import rendezvous
from phalanx.cluster.network import NetworkError
from phalanx.launch.rendezvous import describe_rendezvous_failure, parse_nnodes, setup_node, rendezvous_configs


def test_loopback_route():
    route = network.route_to("127.0.0.1")
    assert (route.address, route.local_addr, route.ifname, route.is_local) == ("127.0.0.1", "127.0.0.1", "lo", True)


def test_unresolvable_host_names_the_fix():
    with pytest.raises(
        NetworkError, match=r"cannot resolve 'no-such-host\.invalid'.*getent hosts no-such-host\.invalid"
    ):
        network.resolve("no-such-host.invalid")


def test_interface_table_has_loopback():
    table = network.interface_addresses()
    assert "127.0.0.1" in table["lo"]
    assert network.interface_of("127.0.0.1", table) == "lo"


def _external():
    table = network.interface_addresses()
    external = network.non_loopback_interfaces(table)
    if not external:
        pytest.skip("this machine has no non-loopback interface")
    name, addresses = next(iter(external.items()))
    return table, name, next(a for a in addresses if ":" not in a)


def test_own_address_makes_this_node_the_host():
    table, name, addr = _external()
    plan = setup_node(addr, 29500, {}, table)
    assert (plan.ifname, plan.local_addr, plan.is_host) == (name, addr, True)
    assert plan.env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    assert plan.describe() == (
        f"phalanx: this node ({addr} on {name}) hosts the store at {addr}:29500 ({addr}); "
        f"GLOO_SOCKET_IFNAME={name}, NCCL_SOCKET_IFNAME={name}"
    )


def test_user_interface_variables_are_kept():
    table, name, addr = _external()
    plan = setup_node(addr, 1, {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": "ib0"}, table)
    assert plan.env == {} and plan.ifname == name


def test_user_interface_that_does_not_exist_is_refused():
    table, _, addr = _external()
    with pytest.raises(NetworkError, match=r"GLOO_SOCKET_IFNAME='nope0' names no interface"):
        setup_node(addr, 1, {"GLOO_SOCKET_IFNAME": "nope0"}, table)


def test_hostname_resolving_to_loopback_on_node0_uses_the_only_external_interface(monkeypatch):
    monkeypatch.setattr(network, "resolve", lambda host: ("127.0.1.1",))
    table = {"lo": ("127.0.0.1", "::1"), "ens5": ("10.1.2.3",)}
    plan = setup_node("node0", 29500, {}, table)
    assert (plan.ifname, plan.local_addr, plan.is_host) == ("ens5", "10.1.2.3", True)


def test_hostname_resolving_to_loopback_with_several_interfaces_asks_the_user(monkeypatch):
    monkeypatch.setattr(network, "resolve", lambda host: ("127.0.1.1",))
    table = {"lo": ("127.0.0.1",), "ens5": ("10.1.2.3",), "ib0": ("192.168.7.3",)}
    with pytest.raises(NetworkError) as info:
        setup_node("node0", 29500, {}, table)
    assert "2 external interface(s) (ens5 (10.1.2.3), ib0 (192.168.7.3))" in str(info.value)
    assert "set GLOO_SOCKET_IFNAME" in str(info.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_store_address_is_refused_for_several_nodes(host):
    with pytest.raises(NetworkError, match="loopback address: other nodes cannot reach it"):
        setup_node(host, 1, {})


@pytest.mark.parametrize("value, expected", [("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3))])
def test_parse_nnodes(value, expected):
    assert parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["0", "4:1", "a", "1:2:3", "", "2:"])
def test_parse_nnodes_refuses(value):
    with pytest.raises(ValueError, match="--nnodes must be N or MIN:MAX"):
        parse_nnodes(value)


def test_split_endpoint():
    assert rendezvous.split_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert rendezvous.split_endpoint("[fd00::1]:29400") == ("fd00::1", 29400)
    assert rendezvous.split_endpoint("node0") == ("node0", None)


def _plan(is_host):
    route = network.Route("10.250.0.1", ("10.250.0.1",), "10.250.0.1", "10.250.0.2", "veth1", is_host)
    return rendezvous.NodeSetup("10.250.0.1", 29400, route, "veth1", "10.250.0.2", is_host, {})


def test_rendezvous_configs():
    assert rendezvous_configs("static", 20, None) == {"timeout": 20}
    assert rendezvous_configs("c10d", 20, _plan(False)) == {"join_timeout": 20, "read_timeout": 10, "is_host": False}
    assert rendezvous_configs("c10d", 900, _plan(True))["read_timeout"] == 60


def test_failure_report_for_a_node_that_cannot_reach_the_store():
    text = describe_rendezvous_failure(
        TimeoutError("connect timed out\nmore"),
        backend="c10d",
        host="10.250.0.1",
        port=29400,
        nnodes=(2, 2),
        node_rank=None,
        timeout_s=15,
        setup=_plan(False),
    )
    assert text.splitlines()[:2] == [
        "phalanx: the rendezvous did not complete within 15 s (c10d, 2 node(s) expected).",
        "  missing: the store at 10.250.0.1:29400. This node tried 10.250.0.1 from 10.250.0.2 on veth1; either the "
        "host node has not started, or the address/port is wrong, or a firewall drops the connection.",
    ]
    assert "  torch said: TimeoutError: connect timed out" in text


def test_failure_report_for_the_host_left_alone_with_an_elastic_range():
    text = describe_rendezvous_failure(
        RuntimeError("x"),
        backend="c10d",
        host="10.250.0.1",
        port=29400,
        nnodes=(2, 4),
        node_rank=None,
        timeout_s=30,
        setup=_plan(True),
    )
    assert "(c10d, 2 to 4 node(s) expected)" in text
    assert "hosts the store at 10.250.0.1:29400, but fewer than 2 node(s) joined" in text

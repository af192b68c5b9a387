"""SLURM hostlist and task-count expressions, checked against what `scontrol show hostnames` prints."""

import pytest

from phalanx.cluster.hostlist import expand_hostlist, expand_tasks_per_node


@pytest.mark.parametrize(
    "expression, hosts",
    [
        ("gpu07", ["gpu07"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("node-a,node-b", ["node-a", "node-b"]),
        ("jwb[0001,0003],jwc0002", ["jwb0001", "jwb0003", "jwc0002"]),
        ("nid[001234-001236]", ["nid001234", "nid001235", "nid001236"]),
        ("login1.cluster.org", ["login1.cluster.org"]),
    ],
)
def test_expand_hostlist(expression, hosts):
    assert expand_hostlist(expression) == hosts


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("gpu[01-", "unmatched '['"),
        ("gpu01]", "unmatched ']'"),
        ("gpu[3-1]", "runs backwards"),
        ("gpu[a-b]", "cannot read range 'a-b'"),
    ],
)
def test_bad_hostlist_names_the_problem(expression, fragment):
    with pytest.raises(ValueError, match=repr(expression).replace("[", r"\[")) as info:
        expand_hostlist(expression)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "value, counts",
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1(x2)", [1, 1]), ("8(x2),4,2(x1)", [8, 8, 4, 2])],
)
def test_expand_tasks_per_node(value, counts):
    assert expand_tasks_per_node(value) == counts


def test_bad_tasks_per_node():
    with pytest.raises(ValueError, match=r"'2\(y3\)'"):
        expand_tasks_per_node("2(y3)")

"""SLURM hostlist expressions: `gpu[01-04,07]`, `a[1-2]-ib,b3`, `r[1-2]-n[01-02]` -> host names.

The same expansion `scontrol show hostnames` does, without needing scontrol on the machine.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(expression: str) -> list[str]:
    """Every host named by a hostlist expression, in SLURM's order (duplicates kept)."""
    hosts: list[str] = []
    for item in _split_top_level(expression.strip()):
        if item:
            hosts.extend(_expand_item(item, expression))
    return hosts


def _split_top_level(expression: str) -> list[str]:
    """Split on commas outside brackets: `a[1,2],b` -> [`a[1,2]`, `b`]."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(expression):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(expression[start:index])
            start = index + 1
    items.append(expression[start:])
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    """One comma-free item: each bracket group multiplies, the first group varying slowest."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise ValueError(f"hostlist {whole!r}: unmatched ']' in {item!r}")
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"hostlist {whole!r}: unmatched '[' in {item!r}")
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_item(rest, whole) if rest else [""]
    return [prefix + number + tail for number in _expand_ranges(body, whole) for tail in tails]


def _expand_ranges(body: str, whole: str) -> list[str]:
    """`01-03,07` -> ["01", "02", "03", "07"]; zero padding follows the range's first number."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(
                f"hostlist {whole!r}: cannot read range {part!r}. "
                "HINT: ranges look like gpu[01-04,07]; check SLURM_JOB_NODELIST."
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"hostlist {whole!r}: range {part!r} runs backwards")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE `2(x3),1` -> [2, 2, 2, 1] (one entry per node, in node order)."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"cannot read a SLURM task count from {value!r} (part {part!r})")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts

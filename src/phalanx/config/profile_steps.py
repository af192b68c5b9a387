"""`--profile START:STOP`: which optimizer steps to trace. Pure Python: the launcher checks it.

Steps are counted like `px.global_step` (optimizer steps, from 0); the range is half-open like a
Python slice, so `10:15` traces steps 10, 11, 12, 13 and 14.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class StepRange:
    start: int
    stop: int

    @property
    def text(self) -> str:
        return f"{self.start}:{self.stop}"

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.stop


def parse(text: str) -> StepRange:
    """'10:15' -> StepRange(10, 15); anything else is a ValueError naming the value and the form."""
    match = _RANGE.match(text)
    if match is None or int(match.group(1)) >= int(match.group(2)):
        raise ValueError(
            f"profile range {text!r}: expected START:STOP with 0 <= START < STOP, in optimizer "
            "steps counted from 0, e.g. 10:15 (traces steps 10 to 14)"
        )
    return StepRange(int(match.group(1)), int(match.group(2)))

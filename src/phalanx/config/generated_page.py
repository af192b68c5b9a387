"""The `python -m MODULE docs/PAGE.md` entry of a docs page generated from code (docs/settings.md;
tests/layouts/' docs/models.md, docs/compatibility.md, docs/optimizers.md): write the page there, or
print it without an argument."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def main(argv: list[str] | None, text: Callable[[], str], command: str) -> int:
    """`command` is the documented invocation (its last word the page's path); exit 2 on bad args."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(f"usage: {command.rsplit(' ', 1)[0]} [OUT.md]", file=sys.stderr)
        return 2
    if args:
        Path(args[0]).write_text(text())
    else:
        sys.stdout.write(text())
    return 0

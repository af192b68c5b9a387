"""Names as a terminal shows them: phase, metric, host and run names come from users' scripts and
the environment, and reach `phalanx top`, the exit tables and the logs. A name with ESC or BEL in it
could retitle, clear or move the terminal (`ESC]0;...BEL`, `ESC[2J`); here every control character
is written out as its escape instead (`\\x1b`), so the name reads as data. The one sanitizer: every
place that prints a name goes through it (no torch, no phalanx imports)."""

from __future__ import annotations

import re

# C0 controls, DEL and the C1 controls (U+0080-U+009F: 8-bit CSI, OSC, ST...)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def printable(value: object) -> str:
    """`value` as one line of text with every control character (newlines too) written as `\\xNN`."""
    return _CONTROL.sub(_escape, str(value))


def printable_lines(value: object) -> str:
    """`value` as text that keeps its newlines; every other control character written as `\\xNN`."""
    return _CONTROL_BUT_NEWLINE.sub(_escape, str(value))

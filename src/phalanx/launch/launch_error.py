"""`LaunchError`, in a module of its own: the spec (spec.py) and the flag tables it types
(torchrun_flags.py) both raise it, and neither imports the other for it (no cycle)."""

from __future__ import annotations


class LaunchError(ValueError):
    """A user error in the `phalanx run` command line; the message says how to fix it."""

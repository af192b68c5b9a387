"""One finding per check, and the report (text for people, JSON for machines)."""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True)
class Finding:
    """The outcome of one check. `fix` says what to do; `fail` means a launch would break."""

    check: str
    status: str
    detail: str
    fix: str = ""
    data: dict = dataclasses.field(default_factory=dict)


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when any finding would break a launch, else 0 (warnings do not)."""
    return 1 if any(f.status == FAIL for f in findings) else 0


def format_text(findings: Sequence[Finding]) -> str:
    marks = {OK: "  ok ", WARN: " WARN", FAIL: " FAIL"}
    lines = []
    for f in findings:
        lines.append(f"{marks[f.status]}  {f.check}: {f.detail}")
        if f.fix:
            lines.append(f"        fix: {f.fix}")
    failed = sum(f.status == FAIL for f in findings)
    warned = sum(f.status == WARN for f in findings)
    if failed:
        lines.append(f"phalanx doctor: {failed} problem(s) would break a launch, {warned} warning(s).")
    else:
        lines.append(f"phalanx doctor: ready to launch ({warned} warning(s)).")
    return "\n".join(lines)


def format_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"ok": exit_code(findings) == 0, "checks": [dataclasses.asdict(f) for f in findings]}, indent=2)

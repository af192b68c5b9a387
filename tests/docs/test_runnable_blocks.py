"""The README's runnable samples run as written.

A fenced block right after `<!-- runnable -->` is executed line by line (bash, in a scratch
directory holding the repo's examples/, with `phalanx` and `torchrun` on PATH); a block after
`<!-- runnable: NAME -->` is written to NAME there first (a config file the commands use). Every
command must exit 0 within its time limit. Keep marked blocks few and quick: this runs in CI.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- runnable(?::\s*(\S+))? -->\s*\n```[a-z]*\n(.*?)```", re.S)
COMMAND_TIMEOUT_S = 240


def runnable_blocks() -> list[tuple[str | None, str]]:
    return [(m.group(1), m.group(2)) for m in MARKER.finditer((ROOT / "README.md").read_text())]


def commands(block: str) -> list[str]:
    lines = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment explains, it does not run
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def test_the_readme_marks_its_main_commands_runnable():
    ran = [c for name, block in runnable_blocks() if name is None for c in commands(block)]
    assert "python examples/wine.py" in ran
    assert any(c.startswith("phalanx run") and "--config phalanx.yaml" in c for c in ran)
    assert any(c.startswith("torchrun") for c in ran)


@pytest.mark.dist
@pytest.mark.timeout(1500)
def test_readme_runnable_blocks_run_as_written(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    for name, block in runnable_blocks():
        if name is not None:
            (tmp_path / name).write_text(block)
            continue
        for command in commands(block):
            result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=COMMAND_TIMEOUT_S)
            assert result.returncode == 0, f"README command failed: {command}\n{result.stdout}\n{result.stderr}"

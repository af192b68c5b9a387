"""The documentation's runnable samples run as written: README.md and every page of docs/.

Pages are read with markdown-it-py (CommonMark, what mkdocs' own stack parses with), not by a
pattern: a fenced block right after `<!-- runnable -->` is executed line by line (bash, in one scratch
directory holding the repo's examples/, with `phalanx` and `torchrun` on PATH); a block after
`<!-- runnable: NAME -->` is written to NAME there first (a config file the commands use). Pages
are read README first, then docs/ in name order; a command that appears on several pages (the
quickstart is on the front page and in getting started) runs once. Every command must exit 0 within
its time limit. Keep marked blocks few and quick: this runs in CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- runnable(?::\s*(\S+))? -->\s*$")
COMMAND_TIMEOUT_S = 240


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(page: Path) -> list[tuple[str | None, str]]:
    """(NAME or None, the fenced block's text) for each marker whose next token is a fenced block."""
    tokens = MarkdownIt().parse(page.read_text())
    found = []
    for token, following in zip(tokens, tokens[1:]):
        marker = MARKER.match(token.content) if token.type == "html_block" else None
        if marker and following.type == "fence":
            found.append((marker.group(1), following.content))
    return found


def commands(block: str) -> list[str]:
    lines = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment explains, it does not run
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def steps() -> list[tuple[Path, str, str]]:
    """(page, "file" | "run", NAME or command) in reading order, each command once."""
    seen: set[str] = set()
    out = []
    for page in pages():
        for name, block in runnable_blocks(page):
            if name is not None:
                out.append((page, "file", name))
                continue
            for command in commands(block):
                if command not in seen:
                    seen.add(command)
                    out.append((page, "run", command))
    return out


def test_the_main_commands_are_marked_runnable():
    readme = [c for name, block in runnable_blocks(ROOT / "README.md") if name is None for c in commands(block)]
    assert "python examples/wine.py" in readme
    assert any(c.startswith("torchrun") for c in readme)
    ran = [what for _, kind, what in steps() if kind == "run"]
    assert any(c.startswith("phalanx run") and "--config phalanx.yaml" in c for c in ran)
    assert len(ran) == len(set(ran))


def test_a_marker_without_a_block_below_it_is_not_silently_skipped():
    for page in pages():
        markers = re.findall(r"^<!-- runnable", page.read_text(), re.M)  # (not one quoted inside a sentence)
        assert len(markers) == len(runnable_blocks(page)), f"{page.name}: a marker lost its block"


@pytest.mark.dist
@pytest.mark.timeout(1500)
def test_runnable_blocks_run_as_written(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    blocks = {(page, name): block for page in pages() for name, block in runnable_blocks(page) if name}
    for page, kind, what in steps():
        if kind == "file":
            (tmp_path / what).write_text(blocks[(page, what)])
            continue
        result = subprocess.run(
            ["bash", "-c", what], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
        assert result.returncode == 0, f"{page.name} command failed: {what}\n{result.stdout}\n{result.stderr}"

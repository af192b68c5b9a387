"""The documentation site builds with `mkdocs build --strict` (every link and anchor resolves, every
page is in the nav: mkdocs.yml's `validation` makes those warnings, and --strict makes warnings
fail), into a temporary directory; the README stays a front page whose links into docs/ resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300


@pytest.mark.timeout(120)
def test_mkdocs_build_strict_passes_and_writes_only_into_the_given_directory(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    built = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert built == {"index.html"} | {f"{page}/index.html" for page in pages - {"index"}}


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move sections into docs/"


def test_readme_links_into_the_docs_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links, "the README links into docs/"
    for target, anchor in links:
        page = ROOT / target
        assert page.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
            slugs = {
                re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.replace("`", "")).strip().lower()) for h in headings
            }
            assert anchor in slugs, f"README links to {target}#{anchor}: no such heading ({sorted(slugs)})"

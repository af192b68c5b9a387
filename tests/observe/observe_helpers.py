"""Launching the observe tests' training script (scripts/train_straggler.py) under `phalanx run`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

SCRIPT = Path(__file__).parent / "scripts" / "train_straggler.py"


def phalanx_run(run_dir: Path, *script_args: str, flags: tuple[str, ...] = (), **popen: object) -> subprocess.Popen:
    """`phalanx run --nproc-per-node 2 --run-dir RUN_DIR [flags] train_straggler.py ARGS`, started."""
    env = {**os.environ, "PHALANX_RUN_DIR": str(run_dir)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(run_dir),
            *flags,
            str(SCRIPT),
            *script_args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def straggler_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "observe" / "stragglers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's (scripts/ci-chromium-deps)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def browser_page(url: str, profile: Path) -> Iterator[tuple[Any, list[str]]]:
    """(page, the page's script errors) in headless Chromium driven by playwright, at `url`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()

"""Faults on the page: rank 1 stalls on the job's first attempt, the watchdog stops the job, and the
elastic agent restarts it; the dashboard stays up, keeps the first attempt's rows with the
watchdog's verdict, and shows the new attempt's ranks as they train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.observe.observe_helpers import CHROMIUM, browser_page, free_port, phalanx_run

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_a_stalled_rank_s_verdict_stays_on_the_page_across_a_restart(tmp_path):
    port = free_port()
    stop = tmp_path / "stop"
    proc = phalanx_run(
        tmp_path,
        "--steps",
        "100000",
        "--until",
        str(stop),
        "--stall-at",
        "30",
        "--step-sleep-ms",
        "5",
        flags=("--dashboard", str(port), "--max-restarts", "1", "--watchdog-timeout", "4"),
    )
    page = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/page", timeout=10) as reply:
                    page = json.loads(reply.read())
            except OSError:
                page = None
            status = (page or {}).get("status") or {}
            if (
                status.get("attempt") == "1"
                and "0" in page["earlier"]
                and all(r.get("phases") for r in status.get("ranks", []))
            ):
                break
            time.sleep(0.5)
        assert page is not None and page["status"]["attempt"] == "1", (page, proc.poll())
        first = page["earlier"]["0"]
        assert "rank 1 stalled at step 30" in (first["verdict"] or ""), first
        assert [r["rank"] for r in first["ranks"]] == [0, 1]
        assert page["running"] and [r["rank"] for r in page["status"]["ranks"]] == [0, 1]
        top = subprocess.run(
            [sys.executable, "-m", "phalanx", "top", str(tmp_path), "--once"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert top.returncode == 0 and "attempt 1" in top.stdout, top.stdout
        if os.path.exists(CHROMIUM):  # the page shows both attempts' rows and the first one's verdict
            with browser_page(f"http://127.0.0.1:{port}/", tmp_path / "profile") as (page, errors):
                page.wait_for_function(
                    "() => document.querySelectorAll('#ranks tr.earlier').length === 2 && "
                    "document.querySelectorAll('#ranks tr.rank').length === 2",
                    timeout=30_000,
                )
                assert "attempt 0: phalanx watchdog: rank 1 stalled at step 30" in page.inner_text("#verdict")
                # the stalled rank's row of attempt 0 says what it last was: stopped, or its stall if the
                # page read it before the attempt's status aged; never "running" nor "ended"
                row = page.inner_text("#ranks tr.earlier >> nth=1")
                assert "attempt 0: stopped" in row or "attempt 0: no progress" in row, row
                assert errors == []
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]

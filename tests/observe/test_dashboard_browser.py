"""The dashboard in a real browser: a 2-rank job under `phalanx run --dashboard`, Debian's headless
Chromium (scripts/ci-chromium-deps) driven by playwright loads the page, sees a row per rank, sees it
update; `/api/status` has the documented shape; `phalanx top --once` shows the same job from another
process, and says so once the job has ended. One launch for the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.observe.observe_helpers import CHROMIUM, browser_page, free_port, phalanx_run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
SCREENSHOT = os.environ.get("PHALANX_DASHBOARD_SCREENSHOT")  # docs: where to keep the page's picture


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dashboard-run")
    stop = run_dir / "stop"
    port = free_port()
    proc = phalanx_run(
        run_dir,
        "--steps",
        "100000",
        "--until",
        str(stop),
        "--straggler",
        "data",
        "--delay-ms",
        "30",
        "--step-sleep-ms",
        "5",
        flags=("--dashboard", str(port)),
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    status = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = _get(url + "api/status")
            if len(status["ranks"]) == 2 and all(r["phases"] for r in status["ranks"]):
                break
        except OSError:
            pass
        time.sleep(0.5)
    assert status is not None and len(status["ranks"]) == 2, (status, proc.poll())
    yield {"url": url, "run_dir": run_dir, "proc": proc}
    stop.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]


def test_api_status_has_the_documented_shape(job):
    status = _get(job["url"] + "api/status")
    assert set(status) == {"step", "attempt", "running", "ended", "ranks", "straggler", "verdict", "earlier"}
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for r in status["ranks"]:
        assert set(r) == {"rank", "host", "local_rank", "step", "state", "phases"}
        assert r["host"] == socket.gethostname() and r["local_rank"] == r["rank"]
        assert {"data", "forward", "backward", "optimizer", "sleep"} <= set(r["phases"])
    request = urllib.request.Request(job["url"] + "api/status", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:  # read-only
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405
    refused.value.close()


def _listening_inode(port: int) -> str:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def test_only_the_launcher_holds_the_dashboard_s_listening_socket(job):
    """The workers are forked from the launcher (fork on CPU): they must not keep the page's port."""
    wanted = f"socket:[{_listening_inode(int(job['url'].rsplit(':', 1)[1].strip('/')))}]"
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == wanted for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.add(int(pid))
        except OSError:  # a process that ended meanwhile, or not ours to read
            continue
    assert holders == {job["proc"].pid}, holders


def test_top_once_shows_the_running_job_from_another_process(job):
    top = subprocess.run(
        [sys.executable, "-m", "phalanx", "top", str(job["run_dir"]), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert top.returncode == 0, top.stderr
    rows = [line.split() for line in top.stdout.splitlines()]
    assert [row[0] for row in rows if row and row[0] in ("0", "1")] == ["0", "1"], top.stdout
    assert "data ms" in top.stdout and "running" in top.stdout


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="no chromium: scripts/ci-chromium-deps installs it (root, apt-get)"
)
def test_the_page_shows_a_row_per_rank_and_updates(job, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with browser_page(job["url"], tmp_path / "profile") as (page, errors):
        page.wait_for_function("() => document.querySelectorAll('#ranks tr.rank').length === 2", timeout=30_000)
        first = page.inner_text("#ranks tr.rank >> nth=0")
        page.wait_for_function(
            f"() => document.querySelector('#ranks tr.rank').innerText !== {json.dumps(first)}", timeout=30_000
        )
        page.wait_for_function(
            "() => document.getElementById('straggler').innerText.includes('rank 1')", timeout=60_000
        )
        line = page.inner_text("#straggler")
        assert "in data" in line, line
        assert page.get_attribute("#ranks tr.rank >> nth=1", "class") == "rank straggler"
        page.wait_for_function(
            "() => document.querySelectorAll('#steptime .scatterlayer .trace').length === 2", timeout=30_000
        )  # a line per rank in the step-time plot
        page.screenshot(path=SCREENSHOT or str(tmp_path / "dashboard.png"), full_page=True)
        assert errors == []  # the page's script ran without an error


def test_top_says_when_no_job_runs_there(tmp_path):
    top = subprocess.run(
        [sys.executable, "-m", "phalanx", "top", str(tmp_path), "--once"], capture_output=True, text=True, timeout=60
    )
    assert top.returncode == 1 and f"no job is running in {tmp_path}" in top.stdout, top.stdout

"""Names are data (issue 41): phase, metric, host and run names that are markup or terminal escapes,
and non-finite values, shown as literal text by the dashboard in headless Chromium (no script of
theirs runs), by `phalanx top`, and by the exit table; every reply carries the CSP and framing
headers; a half-sent or idle connection is closed. The job's records are written directly (no
workers): the page reads nothing else."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest

from phalanx.observe import dashboard, records, table
from tests.observe.observe_helpers import CHROMIUM, browser_page

SCRIPT_NAME = "<img src=x onerror=\"document.title='pwned';window.pwned=1\">"
HOST = '<svg onload="window.pwned=2">\x1b[2J'
METRIC = '<b onmouseover="window.pwned=3">acc</b>\x1b]0;retitled\x07'
RUN = "<iframe src=javascript:window.pwned=4>\x1b[2J"
TERMINAL_PHASE = "\x1b]0;retitled\x07fwd\x9b2J"


def _hostile_status(diverged: bool = False) -> dict:
    """Hostile names; with `diverged`, a NaN loss and non-finite phase times too."""
    bad = (math.inf, math.nan, -math.inf) if diverged else (2.5, 3.5, 0.25)
    ranks = [
        {
            "rank": r,
            "host": HOST,
            "local_rank": r,
            "step": 5,
            "phase": SCRIPT_NAME,
            "state": "running",
            "phases": {SCRIPT_NAME: 1.5, TERMINAL_PHASE: bad[0], "backward": bad[1]},
            "steps_per_s": 20.0,
            "memory": 2**20,
            "silent_s": 0.0,
            "still_s": 0.0,
        }
        for r in range(2)
    ]
    return {
        "time": time.time() + 3600 + diverged,
        "attempt": "0",
        "world_size": 2,
        "step": 5,
        "ended": False,
        "ranks": ranks,
        "straggler": {"rank": 1, "phase": SCRIPT_NAME, "ms_per_step": 3.0},
        "straggler_message": f"straggler: rank 1 (host {HOST}) +3 ms/step in {SCRIPT_NAME}",
        "metrics": {"step": 5, "loss": bad[1] if diverged else 0.5, METRIC: bad[2]},
    }


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / RUN
    records.write_json(str(folder), records.STATUS, _hostile_status())
    return folder


@pytest.fixture
def board(run_dir):
    pytest.importorskip("uvicorn", reason="the dashboard extra")
    page = dashboard.Dashboard(str(run_dir), "127.0.0.1:0").start()
    yield page
    page.stop()


def _get(url: str):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, dict(reply.headers), reply.read()


def _diverge(board) -> None:
    records.write_json(board.history.run_dir, records.STATUS, _hostile_status(diverged=True))
    board.history.sample()


def test_non_finite_values_are_served_as_strings_not_a_500(board):
    _diverge(board)
    status, _, body = _get(f"http://127.0.0.1:{board.port}/api/page")
    page = json.loads(body)
    assert status == 200 and page["status"]["metrics"]["loss"] == "nan" and page["status"]["metrics"][METRIC] == "-inf"
    assert page["status"]["ranks"][0]["phases"] == {SCRIPT_NAME: 1.5, TERMINAL_PHASE: "inf", "backward": "nan"}
    assert page["points"][-1]["loss"] == "nan"
    api = json.loads(_get(f"http://127.0.0.1:{board.port}/api/status")[2])
    assert api["ranks"][1]["phases"]["backward"] == "nan"


def test_every_reply_forbids_inline_script_and_framing(board):
    for route in ("", "dashboard.js", "api/page", "api/status"):
        _, headers, _ = _get(f"http://127.0.0.1:{board.port}/{route}")
        policy = headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
        assert "frame-ancestors 'none'" in policy
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    _, _, html = _get(f"http://127.0.0.1:{board.port}/")
    assert b"<script>" not in html  # no inline script: the CSP would block it


def test_half_sent_and_idle_connections_are_closed(board, monkeypatch):
    monkeypatch.setattr(dashboard, "REQUEST_TIMEOUT_S", 1.0)
    for sent in (b"GET /api/status HTTP/1.1\r\nHost: x\r\n", b""):
        with socket.create_connection(("127.0.0.1", board.port), timeout=8) as conn:
            conn.sendall(sent)
            started = time.monotonic()
            assert conn.recv(100) == b""  # closed by the server, nothing answered
            assert time.monotonic() - started < 5


def _ask_from(source: str, port: int) -> bytes:
    """One whole request from loopback address `source`; the reply's first bytes ('' if closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as conn:
        conn.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return conn.recv(64)


def _eventually(source: str, port: int, prefix: bytes) -> bytes:
    deadline = time.monotonic() + 10
    while not (reply := _ask_from(source, port)).startswith(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    return reply


def test_one_client_holding_connections_half_open_leaves_the_page_to_others(board, monkeypatch):
    """Was: 100 half-sent requests from one address filled uvicorn's 64 places and every other
    client got 503 until they were closed. Now one address holds MAX_PER_CLIENT; beyond, 429."""
    monkeypatch.setattr(dashboard, "REQUEST_TIMEOUT_S", 60.0)  # held for the whole test, however loaded
    held: list[socket.socket] = []
    try:
        for _ in range(100):
            conn = socket.create_connection(("127.0.0.1", board.port), timeout=10, source_address=("127.0.0.1", 0))
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # half-sent: never finished
            held.append(conn)
        assert _ask_from("127.0.0.2", board.port).startswith(b"HTTP/1.1 200")  # another client: the page
        assert _ask_from("127.0.0.1", board.port).startswith(b"HTTP/1.1 429 Too Many Requests")
        while len(held) >= dashboard.MAX_PER_CLIENT:  # within its limit again, the same client is served
            held.pop().close()
        assert _eventually("127.0.0.1", board.port, b"HTTP/1.1 200").startswith(b"HTTP/1.1 200")
    finally:
        for conn in held:
            conn.close()


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="no chromium: scripts/ci-chromium-deps installs it (root, apt-get)"
)
def test_hostile_names_show_as_text_and_run_no_script_in_chromium(board, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    console: list[str] = []
    with browser_page(f"http://127.0.0.1:{board.port}/", tmp_path / "profile") as (page, errors):
        page.on("console", lambda message: console.append(message.text))
        page.wait_for_function("() => document.querySelectorAll('#ranks tr.rank').length === 2", timeout=30_000)
        page.wait_for_function("() => document.querySelectorAll('#loss .main-svg').length > 0", timeout=30_000)
        page.mouse.move(200, 120)  # over the metrics line
        time.sleep(1.5)  # another refresh or two: a handler would have fired by now
        assert (page.evaluate("() => window.pwned"), page.title()) == (None, "phalanx: watching a job")
        heads = page.eval_on_selector_all("#ranks th", "ths => ths.map(th => th.textContent)")
        assert f"{SCRIPT_NAME} ms" in heads and f"{TERMINAL_PHASE} ms" in heads
        assert (
            page.evaluate("() => document.querySelectorAll('body img, body iframe, #ranks svg, #metrics b').length")
            == 0
        )
        assert page.text_content("#run") == RUN
        assert page.text_content("#ranks tr.rank td:nth-child(2)") == HOST
        assert page.text_content("#metrics") == f"loss 0.5000, {METRIC} 0.2500"
        assert SCRIPT_NAME in page.text_content("#straggler")
        _diverge(board)  # a NaN loss: the page goes on, and says nan
        page.wait_for_function("() => document.getElementById('job').textContent.includes('loss nan')", timeout=10_000)
        assert page.text_content("#metrics") == f"loss nan, {METRIC} -inf"
        cells = page.eval_on_selector_all("#ranks tr.rank >> nth=0 >> td", "tds => tds.map(td => td.textContent)")
        assert cells[6:9] == ["1.5", "inf", "nan"], cells
        assert errors == [] and not [m for m in console if "Content Security Policy" in m], (errors, console)


def _no_control_characters(text: str) -> None:
    assert not [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F], repr(text)


def test_top_shows_names_and_non_finite_values_without_control_characters(run_dir):
    records.write_json(str(run_dir), records.STATUS, _hostile_status(diverged=True))
    top = subprocess.run(
        [sys.executable, "-m", "phalanx", "top", str(run_dir), "--once"], capture_output=True, text=True, timeout=60
    )
    assert top.returncode == 0, top.stderr
    _no_control_characters(top.stdout)
    assert "\\x1b]0;retitled\\x07fwd\\x9b2J ms" in top.stdout and "\\x1b[2J" in top.stdout
    assert "loss nan (step 5)" in top.stdout
    row = top.stdout.splitlines()[3].split()
    assert row[:2] == ["0", "<svg"] and ["1.5", "inf", "nan"] == row[-5:-2], top.stdout
    colored = table.render(str(run_dir), records.read_status(str(run_dir)), color=True)
    assert colored.count("\x1b") == 2  # the straggler row's colour, nothing from the names


def test_the_exit_table_and_the_straggler_line_escape_names():
    from phalanx.observe.exchange import Exchange
    from phalanx.observe.straggler import Straggler

    line = Straggler(1, HOST, 1, TERMINAL_PHASE, 30.0, 0.9, 20).message
    _no_control_characters(line)
    assert "\\x1b[2J" in line
    exchange = Exchange.__new__(Exchange)
    exchange._peers = [{"rank": 0, "host": HOST, "num_steps": 2, "totals": {TERMINAL_PHASE: 0.01}}]
    text = exchange.phase_table()
    _no_control_characters(text)
    assert "\\x1b]0;retitled\\x07fwd" in text and "5.0" in text


def test_the_launcher_s_failure_report_escapes_the_host_name():
    from types import SimpleNamespace

    from phalanx.launch.report import format_failures

    failure = SimpleNamespace(local_rank=0, exitcode=3, error_file_data=None, signal_name=lambda: "", timestamp=0)
    text = format_failures(SimpleNamespace(failures={0: failure}), 2, host=HOST)
    _no_control_characters(text)
    assert 'on host <svg onload="window.pwned=2">\\x1b[2J' in text

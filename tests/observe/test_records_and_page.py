"""The run dir's records as `phalanx top` and the dashboard read them (no processes): the table, the
'no job' lines, restarts kept as earlier rows, the dashboard's routes and token."""

from __future__ import annotations

import time

import pytest

from phalanx.observe import records, table
from phalanx.observe.history import History


def _status(attempt="0", step=10, ended=False, straggler=None, rank1=None):
    ranks = [
        {
            "rank": r,
            "host": "vm",
            "local_rank": r,
            "step": step,
            "phase": "step",
            "state": "running",
            "phases": {"data": 1.0 + 30 * (r == 1), "backward": 5.0},
            "steps_per_s": 25.0,
            "memory": 2**20,
            "silent_s": 0.0,
            "still_s": 0.0,
        }
        for r in range(2)
    ]
    ranks[1].update(rank1 or {})
    return {
        "time": time.time(),
        "attempt": attempt,
        "world_size": 2,
        "step": step,
        "ended": ended,
        "ranks": ranks,
        "straggler": straggler,
        "straggler_message": None,
        "metrics": {"step": 8, "loss": 0.5},
    }


def test_top_shows_a_row_per_rank_and_what_is_wrong_with_one(tmp_path):
    records.write_json(
        str(tmp_path),
        records.STATUS,
        _status(
            straggler={"rank": 1, "phase": "data", "ms_per_step": 30.0},
            rank1={"state": "silent", "silent_s": 12.0, "phase": "backward", "step": 7},
        ),
    )
    records.write_text(str(tmp_path), records.verdict_name("0"), "phalanx watchdog: rank 1 stalled at step 7")
    status = records.read_status(str(tmp_path))
    screen = table.render(str(tmp_path), status, color=True)
    assert table.not_running_line(str(tmp_path), status) is None
    assert "silent 12 s (backward, step 7)" in screen and "rank 1 stalled" in screen
    assert table.BOLD_RED in screen.splitlines()[4] and "loss 0.5" in screen
    assert records.api_status(status) == {
        "step": 10,
        "attempt": "0",
        "running": True,
        "ended": False,
        "straggler": {"rank": 1, "phase": "data", "ms_per_step": 30.0},
        "ranks": [
            {
                "rank": r,
                "host": "vm",
                "local_rank": r,
                "step": 10 if r == 0 else 7,
                "state": "running" if r == 0 else "silent",
                "phases": {"data": 1.0 + 30 * r, "backward": 5.0},
            }
            for r in range(2)
        ],
        "verdict": "phalanx watchdog: rank 1 stalled at step 7",
        "earlier": {},
    }


def test_top_says_when_the_job_ended_or_stopped_writing(tmp_path):
    assert "no job is running" in table.not_running_line(str(tmp_path), None)
    records.write_json(str(tmp_path), records.STATUS, _status(ended=True))
    assert "ended at" in table.not_running_line(str(tmp_path), records.read_status(str(tmp_path)))
    records.write_json(str(tmp_path), records.STATUS, {**_status(), "time": time.time() - 60})
    assert "60 s old" in table.not_running_line(str(tmp_path), records.read_status(str(tmp_path)))


def test_the_newest_run_is_the_one_whose_status_was_written_last(tmp_path):
    for name in ("b", "a"):
        (tmp_path / name).mkdir()
    records.write_json(str(tmp_path / "b"), records.STATUS, _status())
    assert records.newest_run(str(tmp_path)) == str(tmp_path / "b")
    assert records.newest_run(str(tmp_path / "none")) is None


def test_a_restart_keeps_the_earlier_attempt_s_rows_and_the_plots_go_on(tmp_path):
    history = History(str(tmp_path))
    records.write_json(str(tmp_path), records.STATUS, _status("0", step=10))
    history.sample()
    records.write_json(str(tmp_path), records.STATUS, {**_status("1", step=3), "time": time.time() + 1})
    history.sample()
    page = history.page()
    assert page["running"] and page["status"]["attempt"] == "1"
    assert [r["step"] for r in page["earlier"]["0"]["ranks"]] == [10, 10]
    assert [(p["attempt"], p["step"]) for p in page["points"]] == [("0", 10), ("1", 3)]


@pytest.fixture
def client_for(tmp_path):
    testclient = pytest.importorskip("starlette.testclient", reason="the dashboard extra")
    from phalanx.observe.dashboard import Dashboard

    def make(address):
        board = Dashboard(str(tmp_path), address)
        records.write_json(str(tmp_path), records.STATUS, _status())
        board.history.sample()
        return board, testclient.TestClient(board.app())

    return make


def test_off_loopback_every_route_needs_the_token(client_for):
    board, client = client_for("0.0.0.0:8765")
    assert board.token and board.url.endswith(f"?token={board.token}")
    for route in ("/", "/api/status", "/api/page", "/plotly.min.js", "/dashboard.js"):
        assert client.get(route).status_code == 403
        assert client.get(route + "?token=wrong").status_code == 403
        assert client.get(f"{route}?token={board.token}").status_code == 200
    assert f"plotly.min.js?token={board.token}" in client.get(f"/?token={board.token}").text
    assert f"dashboard.js?token={board.token}" in client.get(f"/?token={board.token}").text


def test_on_loopback_no_token_and_nothing_but_reads(client_for):
    board, client = client_for("127.0.0.1:8765")
    assert board.token is None and board.url == "http://127.0.0.1:8765/"
    assert client.get("/api/status").json()["step"] == 10
    assert client.post("/api/status").status_code == 405

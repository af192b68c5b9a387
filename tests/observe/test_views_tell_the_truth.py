"""The views tell the truth in every state (issue 41): `/api/status`, the page's data and `phalanx
top` show the job's real step after a resume, no rank "running" after the end or once the status
stopped coming, and earlier attempts with the watchdog's verdict (no processes: the exchange rank 0
runs, the records it writes, the dashboard's routes through starlette's test client)."""

from __future__ import annotations

import json
import math
import os
import re
import time

import pytest

from phalanx.observe import records, table
from phalanx.observe.anatomy import StepAnatomy
from phalanx.observe.exchange import Exchange
from tests.observe.observe_helpers import CHROMIUM, browser_page

VERDICT = "phalanx watchdog: rank 1 (local rank 1 on node 0) went silent at step 40: its process is gone"


def _exchange(run_dir: str, job_step: int | None, batches: int) -> Exchange:
    """Rank 0 of 2 after `batches` prepared batches of this process; the job at `job_step`."""
    anatomy = StepAnatomy()
    for step in range(batches):
        anatomy.next_step(step)
        anatomy.step_boundary()
    exchange = Exchange(
        anatomy,
        rank=0,
        world_size=2,
        local_rank=0,
        attempt="1",
        run_dir=run_dir,
        phase=lambda: "forward",
        warn=lambda line: None,
        job_step=lambda: job_step,
    )
    for rank in range(2):
        exchange._receive({**exchange.summary(), "rank": rank, "steps": []})
    return exchange


@pytest.fixture
def views(tmp_path):
    testclient = pytest.importorskip("starlette.testclient", reason="the dashboard extra")
    from phalanx.observe.dashboard import Dashboard

    board = Dashboard(str(tmp_path), "127.0.0.1:0")
    client = testclient.TestClient(board.app())

    def read() -> tuple[dict, dict, str]:
        board.history.sample()
        status = records.read_status(str(tmp_path))
        return client.get("/api/status").json(), client.get("/api/page").json(), table.render(str(tmp_path), status)

    return read


def test_after_a_resume_the_views_show_the_job_s_step_not_this_process_s_batches(tmp_path, views):
    # resumed from step 168: this process read 152 batches, the job is at step 320 (before: 'step 151')
    _exchange(str(tmp_path), job_step=320, batches=152).write_status()
    api, page, top = views()
    assert api["step"] == 320 and [r["step"] for r in api["ranks"]] == [320, 320]
    assert page["status"]["step"] == 320
    assert "step 320" in top.splitlines()[1] and "step 151" not in top
    # a loop with no prepared optimizer counts no job steps: its batches are its steps
    _exchange(str(tmp_path), job_step=None, batches=7).write_status()
    assert views()[0]["step"] == 6


def test_after_the_end_no_rank_reads_running(tmp_path, views):
    exchange = _exchange(str(tmp_path), job_step=40, batches=40)
    exchange.write_status()
    api, _, _ = views()
    assert api["running"] and [r["state"] for r in api["ranks"]] == ["running", "running"]
    exchange.finish()
    api, page, top = views()
    assert api["ended"] and not api["running"]
    assert [r["state"] for r in api["ranks"]] == ["ended", "ended"]
    assert [r["state"] for r in page["status"]["ranks"]] == ["ended", "ended"]
    assert "running" not in top.split("\n", 2)[2], top


def test_a_status_that_stopped_coming_shows_no_rank_running(tmp_path, views):
    # a killed node: its rank 0 writes no more; the last status said "running"
    exchange = _exchange(str(tmp_path), job_step=40, batches=40)
    exchange.write_status()
    old = time.time() - 60
    os.utime(records.path(str(tmp_path), records.STATUS))
    status = records.read_status(str(tmp_path))
    records.write_json(
        str(tmp_path), records.STATUS, {**{k: v for k, v in status.items() if k != "age_s"}, "time": old}
    )
    api, page, top = views()
    assert not api["running"] and not api["ended"]
    assert [r["state"] for r in api["ranks"]] == ["stopped (last seen running)"] * 2
    assert [r["state"] for r in page["status"]["ranks"]] == ["stopped (last seen running)"] * 2
    assert "stopped (last seen running)" in top and "60 s old" in top


def test_earlier_attempts_are_listed_with_the_watchdog_s_verdict(tmp_path, views):
    records.write_json(str(tmp_path), records.STATUS, {**_exchange(str(tmp_path), 40, 40).status(), "attempt": "0"})
    views()
    # the next attempt starts, then the watchdog's report of the first is written (by a surviving rank)
    _exchange(str(tmp_path), job_step=44, batches=4).write_status()
    views()
    records.write_text(str(tmp_path), records.verdict_name("0"), VERDICT)
    api, page, top = views()
    assert api["attempt"] == "1" and api["earlier"] == {"0": VERDICT} and api["verdict"] is None
    assert page["earlier"]["0"]["verdict"] == VERDICT  # before: empty, read once at the switch
    assert [r["state"] for r in page["earlier"]["0"]["ranks"]] == ["stopped", "stopped"]  # before: "running"
    assert f"attempt 0 (earlier): {VERDICT}" in top


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="no chromium: scripts/ci-chromium-deps installs it (root, apt-get)"
)
def test_the_page_in_chromium_shows_each_state_as_it_is(tmp_path):
    """One browser session through a job's life: an attempt stopped by the watchdog, the resumed
    attempt at the job's step with a NaN loss, the end, and a status that stopped coming."""
    pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    pytest.importorskip("uvicorn", reason="the dashboard extra")
    from phalanx.observe.dashboard import Dashboard

    run_dir = str(tmp_path / "run")
    board = Dashboard(run_dir, "127.0.0.1:0")

    def write(status: dict, age_s: float = -3600) -> None:  # fresh for an hour: a slow browser start
        records.write_json(run_dir, records.STATUS, {**status, "time": time.time() - age_s})

    def show(status: dict, wait_for: str, age_s: float = -3600) -> None:
        write(status, age_s)
        board.history.sample()
        page.wait_for_function(f"() => document.body.innerText.includes({json.dumps(wait_for)})", timeout=15_000)

    def rows(selector: str) -> list[list[str]]:
        return page.eval_on_selector_all(
            f"#ranks {selector}", "trs => trs.map(tr => [...tr.children].map(td => td.textContent))"
        )

    first = _exchange(run_dir, job_step=40, batches=40)
    write({**first.status(), "attempt": "0"})
    board.start()
    try:
        with browser_page(f"http://127.0.0.1:{board.port}/", tmp_path / "profile") as (page, errors):
            page.wait_for_function("() => document.getElementById('job').textContent.includes('step 40')")
            assert [r[3] for r in rows("tr.rank")] == ["running", "running"]
            # the watchdog stopped attempt 0; attempt 1 resumed from step 168, this process read 152
            # batches, the job is at step 320, and its loss went NaN
            resumed = _exchange(run_dir, job_step=320, batches=152).status()
            show({**resumed, "metrics": {"step": 320, "loss": math.nan}}, "loss nan")
            records.write_text(run_dir, records.verdict_name("0"), VERDICT)
            board.history.sample()
            page.wait_for_function("() => document.getElementById('verdict').textContent.length > 0")
            job = page.text_content("#job")
            assert job.startswith("running: attempt 1, 2 ranks, step 320, loss nan"), job
            assert page.text_content("#metrics") == "loss nan"
            assert [(r[0], r[3], r[4]) for r in rows("tr.rank")] == [("0", "running", "320"), ("1", "running", "320")]
            assert [(r[0], r[3], r[4]) for r in rows("tr.earlier")] == [
                ("0", "attempt 0: stopped", "40"),
                ("1", "attempt 0: stopped", "40"),
            ]
            assert page.text_content("#verdict") == f"attempt 0: {VERDICT}\n"
            # the job ended: no rank reads running, and nothing is marked wrong
            ended = _exchange(run_dir, job_step=330, batches=162)
            ended.ended = True
            show(ended.status(), "ended: attempt 1")
            assert [(r[3], r[4]) for r in rows("tr.rank")] == [("ended", "330")] * 2
            assert page.eval_on_selector_all("#ranks tr.rank", "trs => trs.map(tr => tr.className)") == ["rank"] * 2
            # a status that stopped coming (a killed node): no rank reads running either
            stale = _exchange(run_dir, job_step=340, batches=172).status()
            show(stale, "not running (last status", age_s=60)
            assert [r[3] for r in rows("tr.rank")] == ["stopped (last seen running)"] * 2
            assert re.match(
                r"not running \(last status 6\d s old\): attempt 1, 2 ranks, step 340", page.text_content("#job")
            )
            assert "running" not in "".join(r[3] for r in rows("tr.earlier"))
            assert errors == []
    finally:
        board.stop()

"""The S3 store gone mid-job (moto's server stopped): the next save ends in one phalanx message.

Before: building the CheckpointWriteError asked the dead store for the latest checkpoint and the
job ended in 148 lines of aiohttp/botocore traceback. Now every rank raises the same message, built
from what the job knows (its last checkpoint, step 2), naming the endpoint and the fix, within a
bounded time, with the model and step as they were; the launcher's report stays within a dozen lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.checkpoint.s3_server import s3_server
from tests.dist.harness import ROOT
from tests.server_process import stop

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
SCRIPT = "tests/checkpoint/store_lost.py"


def test_a_save_to_a_stopped_store_ends_in_one_phalanx_message_on_every_rank(tmp_path):
    pytest.importorskip("moto", reason="moto[server] is a test dependency: pip install -e '.[test]'")
    pytest.importorskip("s3fs", reason="s3fs is the s3 extra: pip install -e '.[s3]'")
    out = tmp_path / "out"
    out.mkdir()
    with s3_server(tmp_path) as s3:
        env = dict(
            os.environ,
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            **s3.env,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        url = s3.url("lost")
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx",
                "run",
                "--nproc-per-node",
                "2",
                "--checkpoint-dir",
                url,
                "--run-dir",
                str(tmp_path / "run"),
                SCRIPT,
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 180
            while not (out / "saved").exists():
                assert job.poll() is None and time.monotonic() < deadline, job.communicate()
                time.sleep(0.2)
            os.kill(s3.pid, 15)  # the real server, stopped: connections are refused from now on
            os.waitpid(s3.pid, 0)
            (out / "stopped").write_text("1")
            _, stderr = job.communicate(timeout=200)
        finally:
            if job.poll() is None:
                stop(job)
    assert job.returncode == 1, stderr[-4000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["text"] == ranks[1]["text"]
    text = ranks[0]["text"]
    assert text.startswith(f"saving checkpoint step 3 to {url}/step-00000003 failed on rank ")
    assert "the storage endpoint cannot be reached (EndpointConnectionError" in text and s3.endpoint in text
    assert f"the latest good checkpoint is step 2 ({url}/step-00000002)" in text
    assert "HINT: check AWS_ENDPOINT_URL" in text and "or that the store is running" in text
    for rank in ranks:  # bounded: botocore's retries of the one failed call, the store not asked again
        assert rank["seconds"] < 60, rank
        assert rank["intact"] and rank["step"] == 3 and rank["after"] == 4, rank
    # the report starts at the watchdog's verdict or the first failed rank's line (`phalanx: rank R (local
    # rank ...`), never at rank 0's start banner (`phalanx: rank 0 of 2 on cpu ...`), which is there too
    start = re.search(r"phalanx watchdog|phalanx: rank \d+ \(local rank", stderr)
    assert start, stderr[-4000:]
    report = stderr[start.start() :].strip().splitlines()
    assert len(report) <= 12, "\n".join(report)
    assert "CheckpointWriteError: saving checkpoint step 3" in stderr
    for library in ("botocore", "aiohttp", "s3fs", "site-packages"):
        assert library not in stderr.replace("EndpointConnectionError", ""), stderr[-6000:]
    frames = [line for line in report if line.startswith('  File "')]  # the script's own frames only
    assert frames and all("store_lost.py" in line for line in frames), "\n".join(report)

"""Checkpoints in S3 (moto's server over HTTP, tests/checkpoint/s3_server.py) work as on a local disk.

One job, under `phalanx run --max-restarts 1` with async saves and checkpoint_keep 3: rank 0 is
killed inside the save of step 20 (its shards uploaded, the manifest not: an interrupted upload),
the job restarts from step 15, then SIGTERM preempts it with a checkpoint; the same command resumes
it to the end. The weights equal the uninterrupted local run's bit for bit; the interrupted save
was never loaded and is gone; `latest`, retention and `phalanx inspect --verify` work on the
bucket; and the checkpoint loads on one rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import read_events
from tests.checkpoint.s3_server import BUCKET, READ_ONLY_PREFIX, aws_env, free_port
from tests.checkpoint.test_preemption import SCRIPT, preemption_line, signalled
from tests.dist.harness import ROOT, run_command, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
slow = pytest.mark.slow  # the shared job: three launches of two ranks, about 100 s


def s3_env(s3, **extra: str) -> dict[str, str]:
    return dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        **s3.env,
        **extra,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def s3_run(s3, url: str, out: Path, run_dir: Path, *script_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        url,
        "--run-dir",
        str(run_dir),
        SCRIPT,
        "--out",
        str(out),
        "--async-save",
        "--keep",
        "3",
        "--kills",
        "20s:0",
        *script_args,
    ]


@pytest.fixture(scope="module")
def job(s3, tmp_path_factory):
    base = tmp_path_factory.mktemp("s3job")
    url, out = s3.url("run1"), base / "out"
    os.environ.update(s3.env)  # for signalled(), which builds its own environment
    try:
        stopped = signalled(
            s3_run(s3, url, out, base / "run", "--slow-from", "27"),
            out,
            lambda p: p.send_signal(signal.SIGTERM),
            timeout=400,
        )
    finally:
        for key in s3.env:
            os.environ.pop(key, None)
    after_stop = s3.keys("run1")
    stopped_events = read_events(out)
    resumed = run_command(s3_run(s3, url, out, base / "run"), s3_env(s3), timeout=400)
    return {
        "url": url,
        "out": out,
        "stopped": stopped,
        "after_stop": after_stop,
        "stopped_events": stopped_events,
        "resumed": resumed,
        "events": read_events(out),
    }


@slow
def test_kill_preempt_and_resume_through_s3_end_bitwise_equal_to_the_uninterrupted_run(reference, job):
    assert job["stopped"].returncode == 143, job["stopped"].stderr[-6000:]
    assert job["resumed"].returncode == 0, job["resumed"].stderr[-6000:]
    assert re.search(
        r"phalanx: restart 1 of 1: rank 0 was killed by signal SIGKILL .*resuming from checkpoint "
        rf"step 15 \({re.escape(job['url'])}/step-00000015\)",
        job["stopped"].stderr,
    ), job["stopped"].stderr[-4000:]
    match = preemption_line(job["stopped"].stderr)
    step = int(match.group(2))
    assert match.group(3) == f"{job['url']}/step-{step:08d}" and step >= 27
    starts = [(e["attempt"], e["event"], e["step"]) for e in job["events"] if e["event"] != "step"]
    assert starts == [(0, "started", 0), (1, "resumed", 15), (0, "resumed", step)]
    final = torch.load(job["out"] / "final.pt", weights_only=True)
    assert final.keys() == reference["final"].keys()
    for name, expected in reference["final"].items():
        assert torch.equal(final[name], expected), name


@slow
def test_the_bucket_holds_latest_and_the_newest_three_committed_checkpoints_only(s3, job):
    steps = sorted({key.split("/")[0] for key in s3.keys("run1") if key.startswith("step-")})
    assert steps == ["step-00000030", "step-00000035", "step-00000040"]
    assert s3.client().get_object(Bucket=BUCKET, Key="run1/latest")["Body"].read().decode().strip() == "step-00000040"
    for name in steps:  # every prefix committed: the manifest lists exactly the objects there
        manifest = json.loads(s3.client().get_object(Bucket=BUCKET, Key=f"run1/{name}/manifest.json")["Body"].read())
        held = [key.split("/", 1)[1] for key in s3.keys("run1") if key.startswith(name + "/")]
        assert sorted(manifest["files"]) == sorted(set(held) - {"manifest.json"})
    # After the stop: the save cut off at step 20 was replaced by a committed one, nothing uncommitted left.
    stopped = {key.split("/")[0] for key in job["after_stop"] if key.startswith("step-")}
    for name in stopped:
        assert f"{name}/manifest.json" in job["after_stop"], name


@slow
def test_inspect_verify_reads_the_bucket(s3, job):
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "inspect", "--verify", job["url"]],
        cwd=ROOT,
        env=s3_env(s3),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"root {job['url']}: latest -> step-00000040" in proc.stdout
    assert "step 40, saved by 2 rank(s)" in proc.stdout and "verify: OK" in proc.stdout


def load_latest(url: str) -> dict:
    from phalanx import Phalanx
    from tests.checkpoint.resumable import build

    px = Phalanx(checkpoint_dir=url)
    model = build(px)[0]
    loaded = px.load_state()
    return {
        "loaded": loaded,
        "step": px.global_step,
        "state": {k: v.detach().clone() for k, v in px.get_state_dict(model).items()},
    }


@slow
def test_the_two_rank_checkpoint_in_s3_loads_on_one_rank(s3, job, monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    [one] = run_ranks("tests.checkpoint.test_s3:load_latest", 1, args=(job["url"],), timeout=200)
    assert one["loaded"] and one["step"] == 40
    final = torch.load(job["out"] / "final.pt", weights_only=True)
    for name, expected in final.items():
        assert torch.equal(one["state"][name], expected), name


# ---- bad storage, refused before anything starts ------------------------------------------------
def _refused(env: dict[str, str], url: str, tmp_path: Path) -> str:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", "--checkpoint-dir", url, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"phalanx run: error: checkpoint_dir {url} cannot be written: "), (
        proc.stderr
    )
    assert "HINT:" in lines[0]
    return lines[0]


def test_a_bucket_that_does_not_exist_is_refused_by_phalanx_run_and_by_phalanx(s3, tmp_path):
    line = _refused(s3_env(s3), "s3://no-such-bucket/run1", tmp_path)
    assert "the bucket 'no-such-bucket' does not exist" in line and "aws s3 mb s3://no-such-bucket" in line
    code = (
        "from phalanx import Phalanx\ntry:\n    Phalanx(checkpoint_dir='s3://no-such-bucket/run1')\n"
        "except ValueError as e:\n    print(e)\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=s3_env(s3), capture_output=True, text=True, timeout=120
    )
    assert (
        "checkpoint_dir s3://no-such-bucket/run1 cannot be written: the bucket 'no-such-bucket' does not exist"
        in shown.stdout
    ), shown.stdout + shown.stderr


def test_wrong_credentials_are_refused_before_launch(s3, tmp_path):
    env = dict(s3_env(s3), **aws_env(s3.endpoint, "AKIAWRONGWRONGWRONG1", "wrong"))
    line = _refused(env, s3.url("run2"), tmp_path)
    assert "the store refused the credentials (InvalidAccessKeyId" in line and "AWS_ACCESS_KEY_ID" in line


def test_a_read_only_prefix_is_refused_before_launch(s3, tmp_path):
    line = _refused(s3_env(s3), s3.url(f"{READ_ONLY_PREFIX}/run3"), tmp_path)
    assert "is not allowed (AccessDenied" in line and "read-only" in line and "s3:PutObject" in line


def test_an_unreachable_endpoint_is_refused_before_launch(s3, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    env = dict(s3_env(s3), AWS_ENDPOINT_URL=closed)
    line = _refused(env, s3.url("run4"), tmp_path)
    assert (
        f'the storage endpoint cannot be reached (EndpointConnectionError: Could not connect to the endpoint URL: "{closed}/'
        in line
    )

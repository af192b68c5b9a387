"""etcd, the rendezvous store of `--rdzv-backend etcd-v2` / `etcd`, absent or lost (a real etcd).

- Absent at start: refused before any worker starts, naming the endpoint and the fix (before: a
  116-line torch traceback ending "RendezvousConnectionError", after the workers' launch began).
- Lost mid-job: the running job goes on while etcd is away; when it comes back within --rdzv-timeout
  the launcher says so and the job trains on; when it stays away the workers stop at an agreed step
  with a checkpoint, and the job ends with one line naming the store (before: the agent died within a
  second of etcd's stop, in 140 lines of torch's traceback, whatever --max-restarts said).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.dist.harness import ROOT, free_port
from tests.multinode.etcd_server import start_etcd, why_no_etcd
from tests.server_process import stop

SCRIPT = ROOT / "tests" / "multinode" / "elastic_train.py"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "GLOO_"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        TMPDIR=str(tmp_path),
    )
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_etcd_absent_at_start_is_refused_before_any_worker_starts(backend, tmp_path):
    port = free_port()  # nothing listens there
    script = tmp_path / "never.py"
    script.write_text("open('started', 'w').write('1')\n")
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            str(script),
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=100,
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"phalanx run: error: the rendezvous store (etcd, --rdzv-backend {backend}) at 127.0.0.1:{port} does not "
        f"answer: Connection refused. HINT: start etcd there first (etcd --enable-v2 --listen-client-urls "
        f"http://127.0.0.1:{port} --advertise-client-urls http://127.0.0.1:{port}), or correct --rdzv-endpoint"
    ]
    assert not (tmp_path / "started").exists() and seconds < 30


class _Job:
    """`phalanx run` of elastic_train.py, its stderr lines gathered as they come."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]):
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, what, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.lines[-40:])
            time.sleep(0.1)

    def said(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def end(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                stop(self.proc)
        self._reader.join(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return code


@pytest.mark.slow  # one launch of 2 ranks and three starts of etcd: about 40 s
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_etcd_lost_mid_job_the_job_goes_on_and_otherwise_stops_with_a_checkpoint(tmp_path):
    reason = why_no_etcd()
    if reason:
        pytest.skip(reason)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ports = free_port(), free_port()
    log = open(tmp_path / "etcd.log", "ab")
    etcd = start_etcd(tmp_path, "127.0.0.1", *ports, log)
    where = f"etcd at 127.0.0.1:{ports[0]}"
    job = None
    try:
        job = _Job(
            [
                sys.executable,
                "-m",
                "phalanx",
                "run",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "etcd-v2",
                "--rdzv-endpoint",
                f"127.0.0.1:{ports[0]}",
                "--rdzv-timeout",
                "6",
                "--max-restarts",
                "1",
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-keep",
                "0",
                "--split-batches",
                "--run-dir",
                str(tmp_path / "run"),
                str(SCRIPT),
                "--out",
                str(out),
                "--park",
                "2:8,2:16",
                "--steps",
                "400",
                "--step-s",
                "0.05",
            ],
            tmp_path,
            _env(tmp_path),
        )

        def parked(step: int):
            return lambda: all((out / f"parked-2-{step}-{rank}").exists() for rank in range(2))

        # 1. etcd away for about 3 s while the workers train from step 8 to 16: the job goes on.
        job.wait_for(parked(8))
        stop(etcd)
        (out / "go-2-8").write_text("")
        job.wait_for(lambda: job.said(f"phalanx: the rendezvous store ({where}) does not answer"))
        job.wait_for(parked(16))
        time.sleep(3.0)
        etcd = start_etcd(tmp_path, "127.0.0.1", *ports, log)
        job.wait_for(lambda: job.said(f"phalanx: the rendezvous store ({where}) answers again after"))
        # 2. etcd gone for good: after --rdzv-timeout (6 s) the workers stop with a checkpoint.
        stop(etcd)
        stopped = time.monotonic()
        (out / "go-2-16").write_text("")
        code = job.end(timeout=120)
        seconds = time.monotonic() - stopped
    finally:
        if job is not None and job.proc.poll() is None:
            stop(job.proc)
        if etcd.poll() is None:
            stop(etcd)
        log.close()
    text = "\n".join(job.lines)
    assert code == 143, text[-4000:]
    assert "Traceback" not in text and "RendezvousConnectionError" in text  # named in phalanx's line only
    assert (
        job.said(
            f"has not answered for 6 s (--rdzv-timeout): stopping the workers with a checkpoint. "
            f"HINT: bring etcd back at 127.0.0.1:{ports[0]}, then run the same command to resume"
        )
        == 1
    )
    final = [line for line in job.lines if line.startswith("phalanx: preempted by SIGTERM")]
    assert len(final) == 1 and f"(the rendezvous store {where} did not answer for 6 s) at step " in final[0], text
    step = int(final[0].split(" at step ")[1].split(":")[0])
    assert step > 16 and f"checkpoint {ckpt}/step-{step:08d} saved" in final[0]
    assert (ckpt / "latest").read_text().strip() == f"step-{step:08d}"
    assert not job.said("phalanx: restart")  # the restart allowed was not spent on the store
    assert 6 <= seconds < 60
    phalanx_lines = [line for line in job.lines if line.startswith("phalanx")]
    assert len(phalanx_lines) <= 6, text

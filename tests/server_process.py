"""Stopping a test's own server process (moto's S3, etcd): politely, then by force."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

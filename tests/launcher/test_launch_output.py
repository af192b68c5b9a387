"""Workers' output: whole lines on the launcher's streams, torchrun's --log-dir/--tee/--local-ranks-filter."""

import re

import pytest

from tests.launcher.launch_helpers import SCRIPTS, run_cli

MANY_LINES = SCRIPTS / "many_lines.py"
LINE = re.compile(r"^(?P<prefix>\[default\d\]:)?rank(?P<rank>\d) (?P<stream>out|err) (?P<i>\d{5}) (x{100}|y{100})$")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _parse(text: str) -> tuple[dict[tuple[str, str], list[int]], list[str]]:
    """(rank, stream) -> line numbers in order, and the lines that are not one whole line."""
    seen: dict[tuple[str, str], list[int]] = {}
    broken = []
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            seen.setdefault((match["rank"], match["stream"]), []).append(int(match["i"]))
        elif line.startswith("rank") or "xxxx" in line or "yyyy" in line:
            broken.append(line)
    return seen, broken


def test_two_ranks_printing_5000_lines_at_once_merge_no_line(tmp_path):
    result = run_cli(["run", "--nproc-per-node", "2", str(MANY_LINES), "5000"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out, broken_out = _parse(result.stdout)
    err, broken_err = _parse(result.stderr)
    assert broken_out == [] and broken_err == []
    assert out == {(r, "out"): list(range(5000)) for r in "01"}  # every line, once, in order
    assert err == {(r, "err"): list(range(0, 5000, 10)) for r in "01"}


def test_log_dir_tee_and_local_ranks_filter_as_torchrun(tmp_path):
    logs = tmp_path / "logs"
    result = run_cli(
        [
            "run",
            "--nproc_per_node",
            "2",
            "--log-dir",
            str(logs),
            "--tee",
            "3",
            "--local-ranks-filter",
            "0",
            str(MANY_LINES),
            "200",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # torchrun's layout: LOG_DIR/<run id>_<random>/attempt_0/<local rank>/{stdout,stderr}.log, every rank
    (run_dir,) = logs.iterdir()
    attempt = run_dir / "attempt_0"
    assert sorted(p.name for p in attempt.iterdir() if p.is_dir()) == ["0", "1"]
    for rank in "01":
        stdout, broken = _parse((attempt / rank / "stdout.log").read_text())
        assert (stdout, broken) == ({(rank, "out"): list(range(200))}, [])
        stderr, broken = _parse((attempt / rank / "stderr.log").read_text())
        assert (stderr, broken) == ({(rank, "err"): list(range(0, 200, 10))}, [])
    # the console shows rank 0 only, each line with torchrun's prefix
    console_out = [line for line in result.stdout.splitlines() if "rank" in line]
    assert len(console_out) == 200 and all(line.startswith("[default0]:rank0 out ") for line in console_out)
    assert _parse(result.stderr)[0] == {("0", "err"): list(range(0, 200, 10))}
    assert "rank1" not in result.stdout + result.stderr

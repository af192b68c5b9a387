"""px.log sinks (CSV/JSONL contents), phalanx plot, the progress bar's TTY rule, rank-aware logging."""

import csv
import json
import logging
import os
import pty
import subprocess
import sys
import textwrap

import pytest
import torch

from phalanx import Phalanx, cli
from phalanx.logging import rank_log
from phalanx.logging.metrics import MetricsLogger
from phalanx.logging.plot import read_metrics
from phalanx.logging.progress import bar_enabled


def read_csv(path):
    with open(path, newline="") as fp:
        return list(csv.reader(fp))


def test_csv_and_jsonl_sinks_hold_every_row(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), is_main=True, sink_names=["csv", "jsonl"])
    assert not os.listdir(tmp_path)  # nothing written before the first log
    logger.log({"loss": torch.tensor(0.75), "lr": 1e-3}, step=10)
    logger.log({"loss": 0.5, "acc": torch.tensor([0.875])}, step=20)  # a new column mid-run
    logger.log({"acc": 1})  # step defaults to last + 1
    logger.close()

    rows = read_csv(tmp_path / "metrics.csv")
    assert rows[0] == ["step", "time", "loss", "lr", "acc"]
    assert [[r[0], r[2], r[3], r[4]] for r in rows[1:]] == [
        ["10", "0.75", "0.001", ""],
        ["20", "0.5", "", "0.875"],
        ["21", "", "", "1"],
    ]
    assert all(float(r[1]) > 1.7e9 for r in rows[1:])  # wall-clock time stamps

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"step": 10, "loss": 0.75, "lr": 0.001},
        {"step": 20, "loss": 0.5, "acc": 0.875},
        {"step": 21, "acc": 1},
    ]
    assert capsys.readouterr().out.splitlines() == [
        "step 10 | loss 0.75 | lr 0.001",
        "step 20 | loss 0.5 | acc 0.875",
        "step 21 | acc 1",
    ]


def test_tensorboard_sink_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), is_main=True, sink_names=["auto"], console=False)
    for step, loss in [(1, 0.9), (2, 0.7), (3, 0.4)]:
        logger.log({"loss": loss}, step=step)
    logger.close()
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl", "tensorboard"]  # auto: all three
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("loss")] == [(1, 0.9), (2, 0.7), (3, 0.4)]


def test_non_main_ranks_write_nothing(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), is_main=False, sink_names=["csv", "jsonl"])
    logger.log({"loss": 1.0}, step=1)
    assert os.listdir(tmp_path) == [] and capsys.readouterr().out == ""


def test_log_rejects_non_scalars_with_a_hint(tmp_path):
    logger = MetricsLogger(str(tmp_path), is_main=True, sink_names=["jsonl"])
    with pytest.raises(ValueError, match="metric 'loss' must be a number or a one-element tensor.*HINT: reduce"):
        logger.log({"loss": torch.ones(3)})
    with pytest.raises(ValueError, match="unknown metrics sink"):
        MetricsLogger(str(tmp_path), is_main=True, sink_names=["nosuch"]).log({"a": 1})


def test_custom_sink_and_facade_delegation(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_LOG_SINKS", "jsonl")
    seen = []

    class Recorder:
        def write(self, step, metrics):
            seen.append((step, metrics))

        def close(self):
            seen.append("closed")

    px = Phalanx()
    px.add_sink(Recorder())
    px.log({"loss": 2.5}, step=3)
    assert seen == [(3, {"loss": 2.5})]
    assert sorted(os.listdir(px.run_dir)) == ["logs", "metrics.jsonl"]  # sinks from PHALANX_LOG_SINKS only


def test_plot_writes_a_png(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), is_main=True, sink_names=["csv", "jsonl"])
    for step in range(1, 6):
        logger.log({"loss": 1.0 / step}, step=step)
    logger.log({"val_acc": 0.9}, step=5)
    logger.close()
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(tmp_path), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_metrics(str(tmp_path)) == {"loss": [(s, 1.0 / s) for s in range(1, 6)], "val_acc": [(5, 0.9)]}
    os.remove(tmp_path / "metrics.jsonl")  # the CSV alone is enough
    assert cli.main(["plot", str(tmp_path)]) == 0 and (tmp_path / "metrics.png").stat().st_size > 1000
    assert cli.main(["plot", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl or metrics.csv" in capsys.readouterr().err


def test_bar_rule():
    class Tty:
        def isatty(self):
            return True

    assert bar_enabled(True, "auto", Tty()) and not bar_enabled(False, "auto", Tty())  # main only
    with open(os.devnull, "w") as devnull:
        assert not bar_enabled(True, "auto", devnull)
        assert bar_enabled(True, "on", devnull) and not bar_enabled(True, "off", Tty())
        assert bar_enabled(True, True, devnull) and not bar_enabled(False, True, Tty())


PROGRESS_SCRIPT = textwrap.dedent("""
    from phalanx import Phalanx
    px = Phalanx()
    for i in px.progress(range(5), desc="train"):
        px.log({"loss": 1.0 / (i + 1)}, step=i)
    print("done")
""")


def _run_script(tmp_path, stdout, env_extra=None):
    script = tmp_path / "bar.py"
    script.write_text(PROGRESS_SCRIPT)
    env = {**os.environ, **(env_extra or {})}
    env.pop("PHALANX_PROGRESS", None)
    return subprocess.run([sys.executable, str(script)], stdout=stdout, stderr=subprocess.PIPE, env=env, timeout=120)


@pytest.mark.dist
def test_progress_bar_absent_when_stdout_is_not_a_tty(tmp_path):
    result = _run_script(tmp_path, subprocess.PIPE)
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert out == "".join(f"step {i} | loss {1.0 / (i + 1):.4g}\n" for i in range(5)) + "done\n"
    assert "\r" not in out and "it/s" not in out and "step/s" not in out


@pytest.mark.dist
def test_progress_bar_drawn_on_a_terminal(tmp_path):
    """The control for the test above: on a pseudo-terminal the same script draws a bar."""
    leader, follower = pty.openpty()
    try:
        result = _run_script(tmp_path, follower)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child side is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
    out = b"".join(chunks).decode(errors="replace")
    assert result.returncode == 0, result.stderr.decode()
    assert "train: 100%" in out and "5/5" in out and "step/s" in out and "loss=0.2" in out
    assert "step 0 | loss" not in out  # metrics went to the bar's postfix, not as lines


def test_rank_logging_prefix_levels_and_file(tmp_path, capsys):
    logger = rank_log.setup(1, str(tmp_path), "INFO", all_ranks=False)
    try:
        rank_log.get_logger("checkpoint").info("saved")
        rank_log.get_logger("checkpoint").warning("slow disk")
        err = capsys.readouterr().err
        assert err == "[rank 1] WARNING phalanx.checkpoint: slow disk\n"  # INFO is main-only on the console
        lines = (tmp_path / "logs" / "rank1.log").read_text().splitlines()
        assert [line.split(" ", 2)[2] for line in lines] == [
            "[rank 1] INFO phalanx.checkpoint: saved",
            "[rank 1] WARNING phalanx.checkpoint: slow disk",
        ]
        rank_log.setup(1, None, "INFO", all_ranks=True)
        rank_log.get_logger().info("hello")
        assert capsys.readouterr().err == "[rank 1] INFO phalanx: hello\n"
        assert not logger.propagate
    finally:
        rank_log.setup(0, None, "WARNING")
    ours = [h for h in logging.getLogger("phalanx").handlers if getattr(h, "_phalanx_handler", False)]
    assert len(ours) == 1  # re-setup replaces its handlers, never stacks them

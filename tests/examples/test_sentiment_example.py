"""examples/sentiment.py end to end: `phalanx run --config` on 2 CPU processes, a slice of the corpus.

One launch (imports and BERT set-up cost seconds per process); the tests below read its results.
The config file names the strategy (overridden by a flag), the sinks and the run directory (a
file-only runtime setting the launcher exports as PHALANX_RUN_DIR).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from phalanx import cli
from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sentiment.py"
LIMIT, VAL, BATCH = 640, 64, 8  # 10% of the slice is validation


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentiment")
    config = root / "run.yaml"
    config.write_text(
        "nproc_per_node: 2\nstrategy: zero1  # the --strategy flag wins\nlog_sinks: [csv, jsonl]\nrun_dir: run\n"
    )
    result = run_cli(
        [
            "run",
            "--config",
            str(config),
            "--strategy",
            "ddp",
            str(EXAMPLE),
            "--limit",
            str(LIMIT),
            "--epochs",
            "1",
            "--batch-size",
            str(BATCH),
        ],
        env={"PHALANX_RUN_DIR": None, "PHALANX_STRATEGY": None, "PHALANX_PROGRESS": None},
        timeout=240,
    )
    return result, root / "run"


def test_trains_and_evaluates_every_validation_review_once(run):
    result, run_dir = run
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"validation accuracy (\d\.\d{4}) on (\d+) reviews; metrics in (\S+)", result.stdout)
    assert match, result.stdout
    assert int(match.group(2)) == VAL  # gather_for_metrics drops the sampler's padding
    assert 0.0 <= float(match.group(1)) <= 1.0
    assert Path(match.group(3)) == run_dir  # run_dir came from the config file


def test_config_flag_beats_file_and_logging_is_rank_aware(run):
    result, run_dir = run
    assert "[rank 0] INFO phalanx: rank 0 of 2 on cpu, strategy ddp" in result.stderr
    assert "[rank 1] INFO" not in result.stderr  # info is main-only on the console
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    assert "[rank 1] INFO phalanx: rank 1 of 2 on cpu, strategy ddp" in rank1  # ...but in rank 1's file
    assert (run_dir / "logs" / "rank0.log").exists()


def test_metrics_files_and_no_progress_bar_in_captured_output(run):
    result, run_dir = run
    steps = (LIMIT - VAL) // (2 * BATCH)  # 36: 2 ranks x 8 samples per step
    with open(run_dir / "metrics.csv", newline="") as fp:
        rows = list(csv.DictReader(fp))
    assert [int(r["step"]) for r in rows] == [*range(20, steps + 1, 20), steps]
    assert rows[-1]["val_acc"] != "" and all(r["loss"] != "" for r in rows[:-1])
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [j["step"] for j in jsonl] == [int(r["step"]) for r in rows]
    assert sorted(p.name for p in run_dir.iterdir()) == ["logs", "metrics.csv", "metrics.jsonl", "observe", "vocab.txt"]
    assert "\r" not in result.stdout and "step/s" not in result.stdout  # stdout is a pipe here
    assert "step 20 | loss " in result.stdout


def test_plot_of_the_run(run):
    _, run_dir = run
    assert cli.main(["plot", str(run_dir)]) == 0
    png = (run_dir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_model_flag_loads_a_local_pretrained_bert(tmp_path):
    """--model PATH: from_pretrained on a local directory (here a tiny BERT saved by the test), one process."""
    import subprocess
    import sys

    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"好不错差很一般书"]))
    model_dir = tmp_path / "bert"
    BertTokenizer(str(vocab)).save_pretrained(model_dir)
    BertForSequenceClassification(
        BertConfig(
            vocab_size=14,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=2,
        )
    ).save_pretrained(model_dir)
    reviews = tmp_path / "reviews.csv"
    reviews.write_text("label,review\n" + "".join(f"{i % 2},{'很好' if i % 2 else '很差'}{i}\n" for i in range(40)))
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--model",
            str(model_dir),
            "--csv",
            str(reviews),
            "--epochs",
            "1",
            "--batch-size",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"validation accuracy \d\.\d{4} on 4 reviews", result.stdout), result.stdout

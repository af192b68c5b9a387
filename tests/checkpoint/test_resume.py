"""Kill-and-resume is exact, mid-epoch resume replays the same batches, and a 2-rank checkpoint
continues on 1 and 3 ranks with the same global batch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import RESUMABLE, read_events
from tests.dist.harness import ROOT, run_command, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

# Attempt 0: rank 1 dies after step 12 (between saves). Attempt 1: rank 0 dies inside the save of
# step 20 (shards written, no manifest). Attempt 2: rank 1 dies after step 33. Attempt 3 finishes.
KILLS = "12:1,20s:0,33:1"


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("killed")
    (base / "out").mkdir()
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--checkpoint-dir",
        str(base / "ckpt"),
        "tests/checkpoint/resumable.py",
        "--out",
        str(base / "out"),
        "--kills",
        KILLS,
        "--async-save",
    ]
    proc = run_command(command, env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return {
        "ckpt": base / "ckpt",
        "events": read_events(base / "out"),
        "final": torch.load(base / "out" / "final.pt", weights_only=True),
        "log": proc.stderr,
    }


def launch_with_restarts(base: Path, kills: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--checkpoint-dir",
        str(base / "ckpt"),
        *extra,
        "tests/checkpoint/resumable.py",
        "--out",
        str(base / "out"),
        "--kills",
        kills,
    ]
    return run_command(command, env, timeout=240)


def test_kill_and_auto_resume_under_zero3_matches_the_uninterrupted_run(tmp_path):
    """The same exact-resume contract with sharded (FSDP2) model and optimizer state."""
    (tmp_path / "ref" / "out").mkdir(parents=True)
    reference = run_ranks(
        RESUMABLE,
        2,
        args=(str(tmp_path / "ref" / "ckpt"), str(tmp_path / "ref" / "out"), 40, 5),
        env={"PHALANX_STRATEGY": "zero3"},
        timeout=150,
    )
    assert [r["strategy"] for r in reference] == ["zero3", "zero3"]
    (tmp_path / "killed" / "out").mkdir(parents=True)
    proc = launch_with_restarts(tmp_path / "killed", "17:1,28:0", "--strategy", "zero3")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    events = read_events(tmp_path / "killed" / "out")
    assert {e["strategy"] for e in events} == {"zero3"}
    assert [e["step"] for e in events if e["event"] == "resumed"] == [15, 25]
    expected = torch.load(tmp_path / "ref" / "out" / "final.pt", weights_only=True)
    final = torch.load(tmp_path / "killed" / "out" / "final.pt", weights_only=True)
    assert final.keys() == expected.keys() and len(final) == 4
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)


def steps_of(events):
    return [e for e in events if e["event"] == "step"]


def test_kill_and_auto_resume_ends_bitwise_equal_to_the_uninterrupted_run(reference, killed):
    assert reference["final"].keys() == killed["final"].keys()
    for name, expected in reference["final"].items():
        assert torch.equal(killed["final"][name], expected), name


def test_each_restart_resumed_from_the_newest_intact_checkpoint(killed):
    starts = [(e["attempt"], e["event"], e["step"]) for e in killed["events"] if e["event"] != "step"]
    assert [s[:2] for s in starts] == [(0, "started"), (1, "resumed"), (2, "resumed"), (3, "resumed")]
    resumed = [s[2] for s in starts[1:]]
    # Saves are async: the one in flight when a rank dies may be lost, never the one before it.
    assert resumed[0] in (5, 10)
    assert resumed[1] == 15, "the save torn by the kill at step 20 must not be loaded"
    assert resumed[2] in (25, 30)
    assert "left by an interrupted save" in killed["log"]


def test_exit_waits_for_the_last_async_save(killed):
    """The script never waits: the step-40 async save in flight at exit must still be published."""
    assert (killed["ckpt"] / "latest").read_text().strip() == "step-00000040"
    assert (killed["ckpt"] / "step-00000040" / "manifest.json").is_file()
    assert not list(killed["ckpt"].glob(".staging-*"))


def test_every_replayed_step_sees_the_same_batch_and_loss(reference, killed):
    """Resumes land mid-epoch (4 steps per epoch): the next batch must be the one the run would have seen."""
    expected = {e["step"]: e for e in steps_of(reference["events"])}
    replayed = steps_of(killed["events"])
    assert len(replayed) > 40  # steps after each checkpoint ran twice
    for event in replayed:
        assert event["indices"] == expected[event["step"]]["indices"], event["step"]
        assert event["loss"] == expected[event["step"]]["loss"], event["step"]
    resumed = [e["step"] for e in killed["events"] if e["event"] == "resumed"]
    assert any(step % 4 for step in resumed), "at least one resume must start mid-epoch"


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:
    """Save at step 10 on 2 ranks, continue to step 20 on 1, 2 and 3 ranks (global batch 12)."""
    base = tmp_path_factory.mktemp("reshard")
    plain = {"steps": 20, "every": 5, "global_batch": 12, "kills": "", "async_save": False, "keep": 0, "noise": False}
    (base / "w2" / "out").mkdir(parents=True)
    run_ranks(RESUMABLE, 2, args=(str(base / "w2" / "ckpt"), str(base / "w2" / "out"), *plain.values()), timeout=150)
    runs = {2: read_events(base / "w2" / "out")}
    for world in (1, 3):
        root = base / f"w{world}"
        (root / "out").mkdir(parents=True)
        shutil.copytree(base / "w2" / "ckpt" / "step-00000010", root / "ckpt" / "step-00000010")
        run_ranks(RESUMABLE, world, args=(str(root / "ckpt"), str(root / "out"), *plain.values()), timeout=150)
        runs[world] = read_events(root / "out")
    return runs


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_continues_with_the_same_global_batches_and_loss_curve(resharded, world):
    full = {e["step"]: e for e in steps_of(resharded[2])}
    events = resharded[world]
    assert events[0]["event"] == "resumed" and events[0]["step"] == 10 and events[0]["world_size"] == world
    continued = steps_of(events)
    assert [e["step"] for e in continued] == list(range(11, 21))
    for event in continued:
        assert sorted(event["indices"]) == sorted(full[event["step"]]["indices"]), event["step"]
    torch.testing.assert_close(
        torch.tensor([e["loss"] for e in continued]),
        torch.tensor([full[e["step"]]["loss"] for e in continued]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    """split_batches (DataLoader batch_size = the global batch, 12): 20 steps on 2 ranks, and the same
    run's step-10 checkpoint continued on 1 rank by the same script, unchanged."""
    base = tmp_path_factory.mktemp("split")
    plain = {
        "steps": 20,
        "every": 5,
        "global_batch": 12,
        "kills": "",
        "async_save": False,
        "keep": 0,
        "noise": False,
        "split_batches": True,
    }
    (base / "w2" / "out").mkdir(parents=True)
    run_ranks(RESUMABLE, 2, args=(str(base / "w2" / "ckpt"), str(base / "w2" / "out"), *plain.values()), timeout=150)
    (base / "w1" / "out").mkdir(parents=True)
    shutil.copytree(base / "w2" / "ckpt" / "step-00000010", base / "w1" / "ckpt" / "step-00000010")
    run_ranks(RESUMABLE, 1, args=(str(base / "w1" / "ckpt"), str(base / "w1" / "out"), *plain.values()), timeout=150)
    return {
        world: {
            "events": read_events(base / f"w{world}" / "out"),
            "final": torch.load(base / f"w{world}" / "out" / "final.pt", weights_only=True),
        }
        for world in (1, 2)
    }


def test_split_batches_on_two_ranks_trains_exactly_like_a_script_that_divides_the_batch_itself(split, resharded):
    """batch_size=12 with split_batches on 2 ranks = batch_size=6 per rank: the same batches, the same losses."""
    assert [(e["step"], e["indices"], e["loss"]) for e in steps_of(split[2]["events"])] == [
        (e["step"], e["indices"], e["loss"]) for e in steps_of(resharded[2])
    ]


def test_split_batches_checkpoint_of_two_ranks_resumes_on_one_and_ends_like_the_two_rank_run(split):
    events = split[1]["events"]
    assert events[0] == {
        "attempt": 0,
        "world_size": 1,
        "strategy": events[0]["strategy"],
        "event": "resumed",
        "step": 10,
    }
    full = {e["step"]: e for e in steps_of(split[2]["events"])}
    continued = steps_of(events)
    assert [e["step"] for e in continued] == list(range(11, 21))
    for event in continued:  # the same 12 samples a step on 1 rank as on 2
        assert sorted(event["indices"]) == sorted(full[event["step"]]["indices"]), event["step"]
    assert split[1]["final"].keys() == split[2]["final"].keys() and len(split[1]["final"]) == 4
    for name, expected in split[2]["final"].items():
        torch.testing.assert_close(split[1]["final"][name], expected, rtol=1e-5, atol=1e-6)

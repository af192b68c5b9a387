"""The seed posts' own scripts (tests/seeds/scripts/, written in their style), each under
`phalanx run --nproc-per-node 2`: every sample seen once per epoch per data-parallel group, and
nothing silent (a world of one, a setting that did not reach the script, a save of shards).

Each case is one launch; a launch checks everything its script shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist.harness import free_port
from tests.launcher.launch_helpers import run_cli

SCRIPTS = Path(__file__).parent / "scripts"
NUM_TRAIN, NUM_VALID = 64, 50
SAMPLER_LINE = (
    "[rank 0] INFO phalanx.data: prepare() took over the script's DistributedSampler(shuffle=True, seed=0, "
    "drop_last=False): it now splits the data over the {n} data-parallel rank{s}{tp} instead of being "
    "split a second time; set_epoch on it still sets the epoch"
)


def launch(tmp: Path, script: str, *flags: str, nproc: int = 2, args: tuple[str, ...] = ()) -> tuple[str, list[dict]]:
    """Run SCRIPT on `nproc` processes; (launcher output, each rank's report: 2 ranks)."""
    out = tmp / "out"
    out.mkdir()
    result = run_cli(
        ["run", "--nproc-per-node", str(nproc), *flags, str(SCRIPTS / script), str(out), *args],
        env={"PHALANX_RUN_DIR": str(tmp / "run")},
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    name = script.removesuffix(".py")
    return output, [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]


def warnings_of(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("phalanx run: warning:")]


# ---- seed 003's DDP script moved onto phalanx: the script's DistributedSampler taken over ----------
# Three launches (ddp, zero3, tp 2) shared by the tests below: slow tier; tests/unit/test_rank_sampler.py
# checks the same arithmetic without processes.


@pytest.fixture(scope="module")
def sampler_runs(tmp_path_factory):
    runs = {}
    for layout, flags in {
        "ddp": ("--strategy", "ddp"),
        "zero3": ("--strategy", "zero3"),
        "tp2": ("--tp", "2", "--tp-plan", '{"fc1": "colwise", "fc2": "rowwise"}'),
    }.items():
        tmp = tmp_path_factory.mktemp(layout)
        runs[layout] = (*launch(tmp, "ddp_sampler.py", *flags), tmp / "out")
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_every_sample_once_per_epoch_and_every_eval_sample_gathered_once(sampler_runs, layout):
    output, reports, _ = sampler_runs[layout]
    for epoch in range(2):
        per_rank = [r["seen"][epoch] for r in reports]
        assert [len(s) for s in per_rank] == [NUM_TRAIN // 2] * 2  # was 16 each: sharded a second time
        assert sorted(per_rank[0] + per_rank[1]) == list(range(NUM_TRAIN))
    assert [sorted(r["gathered"]) for r in reports] == [list(range(NUM_VALID))] * 2  # was 25 of 50
    assert reports[0]["seen"][0] != reports[0]["seen"][1]  # set_epoch reshuffled
    assert output.count(SAMPLER_LINE.format(n=2, s="s", tp="")) == 2, output[-4000:]  # train and eval loaders
    assert not warnings_of(output)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_tp2_both_tensor_parallel_ranks_read_the_same_rows_all_of_them(sampler_runs):
    output, reports, _ = sampler_runs["tp2"]
    assert [r["dp_size"] for r in reports] == [1, 1]
    for epoch in range(2):
        assert reports[0]["seen"][epoch] == reports[1]["seen"][epoch]  # were different halves
        assert sorted(reports[0]["seen"][epoch]) == list(range(NUM_TRAIN))
    assert [sorted(r["gathered"]) for r in reports] == [list(range(NUM_VALID))] * 2
    tp_note = " (it counted 2 processes; ranks that hold one model replica read the same rows)"
    assert SAMPLER_LINE.format(n=1, s="", tp=tp_note) in output, output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_seeds_all_reduced_accuracy_equals_gather_for_metrics_under_data_parallel(sampler_runs):
    for layout in ("ddp", "zero3"):
        _, reports, _ = sampler_runs[layout]
        assert reports[0]["accs"] == reports[1]["accs"]
        assert all(0 <= acc <= 1 for acc in reports[0]["accs"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_and_zero3_train_the_same_weights(sampler_runs):
    ddp = torch.load(sampler_runs["ddp"][2] / "full.pt")
    zero3 = torch.load(sampler_runs["zero3"][2] / "full.pt")
    assert ddp.keys() == zero3.keys()
    for key in ddp:
        torch.testing.assert_close(zero3[key], ddp[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_model_module_saves_the_whole_model_under_ddp_and_says_what_to_use_otherwise(sampler_runs):
    _, reports, out = sampler_runs["ddp"]
    assert reports[0]["saved"] == "model.pt" and reports[0]["module_error"] is None
    saved, full = torch.load(out / "model.pt"), torch.load(out / "full.pt")
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in saved)
    for layout in ("zero3", "tp2"):
        _, reports, out = sampler_runs[layout]
        assert reports[0]["saved"] is None and not (out / "model.pt").exists()  # no shards saved as a model
        error = reports[0]["module_error"]
        assert error.startswith("model.module: under ") and "holds this rank's part only" in error
        assert "px.get_state_dict(model)" in error and "px.unwrap_model(model)" in error


# ---- scripts that never create Phalanx() ---------------------------------------------------------


def test_a_plain_torch_ddp_script_is_one_world_and_an_ignored_strategy_is_said(tmp_path):
    output, reports = launch(tmp_path, "plain_ddp.py", "--strategy", "zero3")
    for epoch in range(2):
        assert sorted(reports[0]["seen"][epoch] + reports[1]["seen"][epoch]) == list(range(NUM_TRAIN))
    assert warnings_of(output) == [
        "phalanx run: warning: --strategy zero3 had no effect: plain_ddp.py never created Phalanx(), which is how "
        "phalanx's runtime settings reach a script (a plain torch script keeps the layout it builds itself). "
        "HINT: create px = Phalanx() and px.prepare(...) in the script, or drop the flag"
    ]


def test_a_script_that_joins_no_process_group_is_reported_as_separate_worlds_of_one(tmp_path):
    output, reports = launch(tmp_path, "data_parallel.py")
    assert [sorted(r["seen"][0]) for r in reports] == [list(range(NUM_TRAIN))] * 2  # each read everything
    assert warnings_of(output) == [
        "phalanx run: warning: ranks 0, 1 never joined a process group of 2: they ran as 2 separate worlds of one "
        "(each read all the data and acted as the main process). HINT: create Phalanx() in the script (or call "
        "torch.distributed.init_process_group); Accelerate, HF Trainer and Lightning Fabric scripts join by themselves "
        "under phalanx run"
    ]


def test_an_accelerate_script_without_cpu_true_joins_one_world_with_the_precision_asked(tmp_path):
    output, reports = launch(tmp_path, "accelerate_seed.py", "--mixed-precision", "bf16", "--strategy", "zero3")
    assert [(r["num_processes"], r["is_main"], r["mixed_precision"]) for r in reports] == [
        (2, True, "bf16"),
        (2, False, "bf16"),
    ]
    for epoch in range(2):
        assert sorted(reports[0]["seen"][epoch] + reports[1]["seen"][epoch]) == list(range(NUM_TRAIN))
    assert sorted(reports[0]["gathered"]) == list(range(NUM_VALID))
    assert warnings_of(output) == [
        "phalanx run: warning: --strategy zero3 had no effect: accelerate_seed.py never created Phalanx(); it used "
        "Accelerate, which got what `accelerate launch` would give it (the device, mixed precision), and Accelerate "
        "runs FSDP on accelerators only. HINT: create px = Phalanx() and px.prepare(...) in the script, or drop the flag"
    ]


def test_the_hf_trainer_joins_one_world_with_the_precision_asked_and_each_rank_trains_on_half(tmp_path):
    output, reports = launch(tmp_path, "hf_trainer.py", "--mixed-precision", "bf16")
    assert [(r["world_size"], r["steps"], r["mixed_precision"]) for r in reports] == [(2, 4, "bf16")] * 2  # 32 rows
    assert sorted(reports[0]["seen"][0] + reports[1]["seen"][0]) == list(range(32))
    assert not warnings_of(output)


def test_an_mp_spawn_script_that_adopts_its_group_gets_the_strategy_and_says_nothing_more(tmp_path):
    """Seed 004's mp.spawn: the worker itself joins no group (a world of one); its two children do,
    and their Phalanx() takes the strategy phalanx run was given."""
    output, reports = launch(tmp_path, "mp_spawn.py", "--strategy", "zero3", nproc=1, args=(str(free_port()),))
    assert [(r["world_size"], r["strategy"]) for r in reports] == [(2, "zero3"), (2, "zero3")]
    for epoch in range(2):
        assert sorted(reports[0]["seen"][epoch] + reports[1]["seen"][epoch]) == list(range(NUM_TRAIN))
    assert not warnings_of(output)

"""DDP options through Phalanx(): find_unused_parameters, comm hooks (bf16 on gloo, PowerSGD) with
exact resume, and the refusals under strategies without DDP."""

import pytest
import torch

from phalanx import Phalanx
from tests.dist.harness import run_ranks
from tests.launcher.launch_helpers import run_cli


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_comm_hooks_train_and_resume_exactly(tmp_path):
    ranks = run_ranks(
        "tests.loop.ddp_workloads:hook_resume",
        world_size=2,
        args=(str(tmp_path), ["bf16", "powersgd", "fp16@zero1"]),
        timeout=300,
    )
    for hook in ("bf16", "powersgd", "fp16@zero1"):
        for r in ranks:
            result = r[hook]
            assert result["strategy"] == ("zero1" if hook.endswith("zero1") else "ddp")
            assert result["hook_name"] == "HookState"
            losses = result["losses"]
            assert all(b < a for a, b in zip(losses, losses[1:])), f"{hook}: loss did not decrease: {losses}"
            for key, value in result["straight"].items():
                assert torch.equal(ranks[0][hook]["straight"][key], value)  # ranks agree
                if "resumed" in result:  # (zero1: phalanx's save_state does not cover ZeRO yet)
                    assert torch.equal(result["resumed"][key], value), f"{hook}: {key} differs after resume"
    # PowerSGD really compressed (its error feedback is non-zero), and differs from bf16's result.
    assert ranks[0]["powersgd"]["error_norm"] > 0
    assert ranks[0]["powersgd"]["buckets"] >= 2  # several buckets in flight on gloo, no hang
    assert ranks[0]["bf16"]["bucket_bytes"] == int(0.01 * 1024 * 1024)  # bucket_cap_mb reached DDP
    assert not torch.equal(ranks[0]["powersgd"]["straight"]["0.weight"], ranks[0]["bf16"]["straight"]["0.weight"])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_unused_branch_trains_with_find_unused_parameters():
    ranks = run_ranks("tests.loop.ddp_workloads:unused_branch", world_size=2, args=(True,), timeout=240)
    for r in ranks:
        assert r["find_unused"] is True
        assert r["losses"][-1] < r["losses"][0]
        assert not torch.equal(r["after"]["used.weight"], r["before"]["used.weight"])
        assert torch.equal(r["after"]["unused.weight"], r["before"]["unused.weight"])
        for key in r["after"]:
            assert torch.equal(r["after"][key], ranks[0]["after"][key])


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"strategy": "zero3", "comm_hook": "fp16"}, "comm_hook='fp16'"),
        ({"strategy": "zero2", "comm_hook": "powersgd"}, "comm_hook='powersgd'"),
        ({"strategy": "zero3", "find_unused_parameters": True}, "find_unused_parameters=True"),
        ({"strategy": "fsdp", "static_graph": True}, "static_graph=True"),
    ],
)
def test_ddp_options_refused_without_ddp(kwargs, named):
    canonical = {"fsdp": "zero3"}.get(kwargs["strategy"], kwargs["strategy"])  # aliases resolve where parsed
    with pytest.raises(
        ValueError,
        match=rf"{named} \(from Phalanx\(\)\): DistributedDataParallel options, but strategy "
        rf"'{canonical}' uses FSDP2, which has no DDP\. HINT: use strategy ddp or zero1",
    ):
        Phalanx(**kwargs)


def test_bad_ddp_values_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"Phalanx\(comm_hook='int8'\): choose one of none, bf16, fp16, powersgd"):
        Phalanx(comm_hook="int8")
    monkeypatch.setenv("PHALANX_BUCKET_CAP_MB", "-3")
    with pytest.raises(ValueError, match=r"PHALANX_BUCKET_CAP_MB=-3: expected a number of MB > 0"):
        Phalanx()
    monkeypatch.delenv("PHALANX_BUCKET_CAP_MB")
    with pytest.raises(ValueError, match=r"powersgd_start_iter=1: PowerSGD with error feedback needs at least 2"):
        Phalanx(comm_hook="powersgd", powersgd_start_iter=1)


def test_ddp_options_pass_in_a_world_of_one():
    # One script at every scale: under plain python the DDP options have nothing to act on.
    px = Phalanx(strategy="ddp", comm_hook="powersgd", powersgd_start_iter=2, find_unused_parameters=True)
    assert px.strategy_name == "single"
    assert px.settings.options.ddp.given == ("find_unused_parameters", "comm_hook", "powersgd_start_iter")


def test_launcher_refuses_comm_hook_under_zero3_before_starting_workers(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    result = run_cli(["run", "--nproc-per-node", "2", "--strategy", "zero3", "--comm-hook", "fp16", str(script)])
    assert result.returncode == 2
    assert (
        "phalanx run: error: comm_hook='fp16' (from --comm-hook, --strategy): DistributedDataParallel options, "
        "but strategy 'zero3'"
    ) in result.stderr
    assert "a worker started" not in result.stderr + result.stdout
    result = run_cli(["run", "--strategy", "zero2", str(script)], env={"PHALANX_FIND_UNUSED_PARAMETERS": "1"})
    assert result.returncode == 2
    assert (
        "find_unused_parameters=True (from --strategy, PHALANX_FIND_UNUSED_PARAMETERS): DistributedDataParallel "
        "options, but strategy 'zero2'"
    ) in result.stderr


def test_settings_from_a_config_file(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text(
        "strategy: ddp\ncomm_hook: powersgd\npowersgd_rank: 4\npowersgd_start_iter: 10\n"
        "bucket_cap_mb: 50\nstatic_graph: true\ngrad_accum_remainder: drop\n"
    )
    px = Phalanx.from_config(path)
    ddp = px.settings.options.ddp
    assert (ddp.comm_hook, ddp.powersgd_rank, ddp.powersgd_start_iter, ddp.bucket_cap_mb, ddp.static_graph) == (
        "powersgd",
        4,
        10,
        50.0,
        True,
    )
    assert ddp.ddp_kwargs() == {
        "find_unused_parameters": False,
        "static_graph": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 50.0,
    }
    assert px.settings.grad_accum_remainder == "drop"
    path.write_text("strategy: zero3\ncomm_hook: fp16\n")
    with pytest.raises(
        ValueError,
        match=r"comm_hook='fp16' \(from \S*phalanx.yaml\): DistributedDataParallel options, "
        r"but strategy 'zero3'",
    ):
        Phalanx.from_config(path)

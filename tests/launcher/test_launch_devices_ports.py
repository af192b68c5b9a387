"""Process counts, device and thread variables, port checks: pure functions, no workers."""

import socket

import pytest

from phalanx.launch import agent, devices, ports, report
from phalanx.launch.spec import LaunchError, LaunchSpec


def test_resolve_nproc():
    never = lambda: pytest.fail("GPUs must not be counted")  # noqa: E731
    assert devices.resolve_nproc(3, None, never, num_cores=8) == 3
    assert devices.resolve_nproc(None, (1, 3), never, num_cores=8) == 2
    assert devices.resolve_nproc(None, None, lambda: 4, num_cores=8) == 4
    assert devices.resolve_nproc(None, None, lambda: 0, num_cores=8) == devices.CPU_DEFAULT_NPROC
    assert devices.resolve_nproc(None, None, lambda: 0, num_cores=1) == 1


def test_resolve_nproc_torchrun_words():
    never = lambda: pytest.fail("GPUs must not be counted")  # noqa: E731
    assert devices.resolve_nproc(None, None, never, num_cores=6, kind="cpu") == 6
    assert devices.resolve_nproc(None, None, lambda: 3, num_cores=6, kind="gpu") == 3
    with pytest.raises(
        LaunchError, match=r"--nproc-per-node gpu: no GPU is visible here. HINT: use --nproc-per-node N or cpu"
    ):
        devices.resolve_nproc(None, None, lambda: 0, num_cores=6, kind="gpu")


def test_oversubscription_is_one_warning_with_the_numbers():
    assert devices.oversubscription_warning(4, 2, 0, "1") == (
        "phalanx: warning: 4 workers on 2 CPU core(s) (oversubscribed: they will compete for cores); "
        "OMP_NUM_THREADS=1 per worker."
    )
    assert devices.oversubscription_warning(3, 64, 2, "8") == (
        "phalanx: warning: 3 workers share 2 visible GPU(s) on this node (oversubscribed: ranks will share devices); "
        "OMP_NUM_THREADS=8 per worker."
    )
    assert devices.oversubscription_warning(2, 2, 0, "1") is None
    assert devices.oversubscription_warning(2, 1, 2, "1") is None  # one worker per GPU: cores do not matter


def test_omp_share_and_user_setting_wins():
    assert devices.omp_threads_per_worker(8, 2) == 4
    assert devices.omp_threads_per_worker(2, 4) == 1
    assert devices.worker_env_for_devices(2, None, {}, num_cores=8) == {"OMP_NUM_THREADS": "4"}
    assert devices.worker_env_for_devices(2, None, {"OMP_NUM_THREADS": "3"}, num_cores=8) == {}


def test_gpus_set_cuda_visible_devices_and_refuse_conflicts():
    env = devices.worker_env_for_devices(2, (1, 3), {"OMP_NUM_THREADS": "1"}, num_cores=8)
    assert env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert devices.cuda_visible_devices_for((1, 3), {"CUDA_VISIBLE_DEVICES": "1,3"}) == "1,3"
    with pytest.raises(LaunchError, match=r"--gpus 0 conflicts with CUDA_VISIBLE_DEVICES='2'"):
        devices.cuda_visible_devices_for((0,), {"CUDA_VISIBLE_DEVICES": "2"})
    devices.check_gpu_indices((0, 1), num_gpus=2)
    with pytest.raises(LaunchError, match=r"names GPU 3, but this machine has 2 visible GPU\(s\) \(indices: 0..1\)"):
        devices.check_gpu_indices((0, 3), num_gpus=2)
    with pytest.raises(LaunchError, match=r"has 0 visible GPU\(s\) \(indices: none\)"):
        devices.check_gpu_indices((0,), num_gpus=0)


def test_busy_port_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not ports.is_port_free(port)
        with pytest.raises(LaunchError, match=rf"--master-port {port} is already in use.*omit --master-port"):
            ports.check_master_port(port)
    assert ports.is_port_free(port)


def test_rendezvous_settings():
    single = agent.rendezvous_settings(LaunchSpec(target="t.py"))
    assert (single["rdzv_backend"], single["rdzv_endpoint"], single["local_addr"]) == (
        "phalanx-static",
        "127.0.0.1:0",
        "127.0.0.1",
    )
    fixed = agent.rendezvous_settings(LaunchSpec(target="t.py", master_port=1234, node_rank=0))
    assert (fixed["rdzv_backend"], fixed["rdzv_endpoint"], fixed["rdzv_configs"]) == (
        "phalanx-static",
        "127.0.0.1:1234",
        {"rank": 0},
    )
    multi = agent.rendezvous_settings(
        LaunchSpec(target="t.py", nnodes=2, node_rank=1, master_addr="n0", master_port=9, rdzv_id="j")
    )
    assert (multi["rdzv_endpoint"], multi["rdzv_configs"], multi["run_id"]) == (
        "n0:9",
        {"rank": 1, "timeout": 600},
        "j",
    )


def test_start_method_and_traceback_trim():
    assert agent.choose_start_method("auto", 0) == "fork"
    assert agent.choose_start_method("auto", 2) == "spawn"
    assert agent.choose_start_method("fork", 2) == "fork"
    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/phalanx/launch/worker.py", line 3, in main\n'
        "    run_target()\n"
        '  File "<frozen runpy>", line 88, in _run_code\n'
        '  File "/u/train.py", line 5, in <module>\n'
        "    boom()\n"
        "RuntimeError: boom\n"
    )
    assert report.trim_traceback(text) == (
        'Traceback (most recent call last):\n  File "/u/train.py", line 5, in <module>\n    boom()\nRuntimeError: boom'
    )


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_launcher_modules_import_neither_torch_nor_runtime():
    import subprocess
    import sys

    code = (
        "import sys, phalanx.cli, phalanx.launch.agent, phalanx.launch.worker\n"
        "phalanx.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'phalanx.runtime')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

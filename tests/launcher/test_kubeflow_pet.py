"""Kubeflow's PyTorchJob: each pod runs `phalanx run train.py` with PET_* set by the operator.

Two "nodes" on this machine: two `phalanx run` processes with PET_NODE_RANK 0 and 1 and no flags,
meeting at this machine's own address (multi-node refuses a loopback master address, which other
machines could not reach; the traffic stays on this machine).
"""

import os
import subprocess
import sys

import pytest

from phalanx.cluster import network
from tests.dist.harness import free_port
from tests.launcher.launch_helpers import RECORD_ENV, read_records

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _own_address() -> str:
    external = network.non_loopback_interfaces(network.interface_addresses())
    ipv4 = [a for addresses in external.values() for a in addresses if ":" not in a]
    if not ipv4:
        pytest.skip("this machine has no non-loopback IPv4 address to stand for the master pod's")
    return ipv4[0]


def test_two_pods_with_operator_pet_variables_form_one_job(tmp_path):
    master, port = _own_address(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_", "MASTER_", "GLOO_", "NCCL_"))}
    procs = []
    for node_rank in (0, 1):
        env = {
            **base,
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(node_rank),
            "PET_NPROC_PER_NODE": "1",
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "phalanx", "run", "--rdzv-timeout", "120", str(RECORD_ENV), str(tmp_path)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=240) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    records = read_records(tmp_path)
    assert sorted(records) == [0, 1]
    for rank, record in records.items():
        assert record["world_size"] == 2
        env = record["env"]
        assert (env["GROUP_RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == (
            str(rank),
            "0",
            "2",
            master,
        )

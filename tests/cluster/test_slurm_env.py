"""Real-world SLURM environment snapshots -> what `phalanx run` and the runtime derive from them."""

import pytest

from phalanx.cluster.slurm import (
    SlurmError,
    in_slurm,
    launch_settings,
    master_port_for_job,
    read_allocation,
    torch_env_from_slurm,
)


def srun_env(job_id, nodelist, node_id, tasks_per_node, procid=None, localid=0, ntasks=None, gpus=None, **extra):
    """The variables srun sets for one task (the subset phalanx reads, spelled as SLURM spells them)."""
    env = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id if procid is None else procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_ID": "0",
        "SLURMD_NODENAME": "irrelevant",
    }
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    env.update(extra)
    return env


def batch_env(job_id, nodelist, tasks_per_node, nnodes, gpus=None):
    """The batch script's environment on the first node: no step variables."""
    env = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_NNODES": str(nnodes),
        "SLURM_NTASKS": "8",
    }
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def test_not_in_slurm():
    assert not in_slurm({"PATH": "/bin"})
    assert not in_slurm({"SLURM_JOB_ID": "5"})  # half an allocation is no allocation
    assert torch_env_from_slurm({"PATH": "/bin"}) == {}
    with pytest.raises(SlurmError, match="not inside a SLURM allocation"):
        read_allocation({})


def test_port_derives_from_job_id_below_ephemeral_range():
    assert master_port_for_job(123456) == 15000 + 123456 % 15000 == 18456
    assert master_port_for_job(123457) == 18457
    assert all(15000 <= master_port_for_job(j) < 30000 for j in (0, 1, 14999, 15000, 987654321))


# --- srun phalanx run (one task per node) ---


def test_single_node_one_task_four_gpus():
    launch = launch_settings(srun_env(123456, "gpu07", 0, "1", ntasks=1, gpus=4))
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port) == (1, 0, "gpu07", 18456)
    assert launch.nproc_per_node == 4
    assert launch.rdzv_id == "slurm-123456"


def test_four_nodes_one_task_per_node_third_node():
    env = srun_env(4242, "gpu[01-04]", 2, "1(x4)", ntasks=4, gpus=8)
    launch = launch_settings(env)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.nproc_per_node) == (4, 2, "gpu01", 8)
    assert launch.master_port == 15000 + 4242


def test_heterogeneous_nodelist_master_is_first_expanded_host():
    env = srun_env(77, "a[1-2]-ib,b3", 2, "1(x3)", ntasks=3, gpus=2)
    launch = launch_settings(env)
    assert (launch.nnodes, launch.node_rank, launch.master_addr) == (3, 2, "a1-ib")


def test_step_nodelist_wins_over_job_nodelist():
    env = srun_env(9, "gpu[01-02]", 1, "1(x2)", ntasks=2, gpus=1, SLURM_JOB_NODELIST="gpu[01-08]")
    assert launch_settings(env).nnodes == 2


def test_cpu_only_allocation_leaves_nproc_to_the_launcher():
    launch = launch_settings(srun_env(31, "cn[100-101]", 0, "1(x2)", ntasks=2))
    assert launch.nproc_per_node is None and launch.nnodes == 2 and launch.master_addr == "cn100"


def test_gpus_counted_from_job_gpus_when_gpus_on_node_absent():
    env = srun_env(31, "cn5", 0, "1", ntasks=1, SLURM_JOB_GPUS="0,1")
    assert launch_settings(env).nproc_per_node == 2


def test_explicit_nproc_within_allocation_is_kept():
    assert launch_settings(srun_env(1, "g1", 0, "1", ntasks=1, gpus=4), nproc_per_node=2).nproc_per_node == 2


def test_nproc_more_than_allocated_gpus_fails_with_fix():
    env = srun_env(1, "g[1-2]", 0, "1(x2)", ntasks=2, gpus=4)
    with pytest.raises(SlurmError) as info:
        launch_settings(env, nproc_per_node=8)
    message = str(info.value)
    assert "--nproc-per-node 8 but SLURM allocated 4 GPU(s)" in message
    assert "SLURM_GPUS_ON_NODE=4" in message
    assert "#SBATCH --gpus-per-node=8" in message and "--nproc-per-node auto (= 4)" in message


def test_one_task_per_gpu_under_phalanx_run_fails_with_fix():
    env = srun_env(5, "gpu[01-02]", 1, "4(x2)", procid=5, localid=1, ntasks=8, gpus=4)
    with pytest.raises(SlurmError) as info:
        launch_settings(env)
    message = str(info.value)
    assert "SLURM started 4 tasks on this node" in message
    assert "--ntasks-per-node=1" in message and "srun python train.py" in message


def test_nnodes_mismatch_fails_with_fix():
    with pytest.raises(SlurmError, match=r"--nnodes 4 but the SLURM step runs on 2 node\(s\).*#SBATCH --nodes=4"):
        launch_settings(srun_env(5, "gpu[01-02]", 0, "1(x2)", ntasks=2, gpus=4), nnodes=4)


def test_batch_script_on_several_nodes_fails_with_fix():
    with pytest.raises(SlurmError) as info:
        launch_settings(batch_env(8, "gpu[01-02]", "4(x2)", 2, gpus=4))
    assert "job has 2 nodes (gpu01, gpu02)" in str(info.value)
    assert "srun --ntasks-per-node=1 phalanx run" in str(info.value)


def test_batch_script_on_one_node_runs_there():
    launch = launch_settings(batch_env(8, "gpu05", "8", 1, gpus=8))
    assert (launch.nnodes, launch.node_rank, launch.nproc_per_node, launch.master_addr) == (1, 0, 8, "gpu05")


def test_inconsistent_task_counts_are_reported():
    with pytest.raises(SlurmError, match=r"lists 3 host\(s\).*task counts for 2"):
        read_allocation(srun_env(5, "n[1-3]", 0, "1(x2)", ntasks=2))


def test_node_id_outside_hosts_is_reported():
    with pytest.raises(SlurmError, match=r"SLURM_NODEID=3 is outside the 2 host\(s\)"):
        read_allocation(srun_env(5, "n[1-2]", 3, "1(x2)", ntasks=2))


# --- srun python train.py (one task per GPU): the runtime's fallback ---


def test_one_task_per_gpu_maps_to_torch_variables():
    env = srun_env(5, "gpu[01-02]", 1, "4(x2)", procid=5, localid=1, ntasks=8, gpus=4)
    assert torch_env_from_slurm(env) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu01",
        "MASTER_PORT": str(15005),
    }


def test_uneven_tasks_per_node_local_world_size_follows_this_node():
    env = srun_env(6, "a[1-2]-ib,b3", 2, "2(x2),1", procid=4, localid=0, ntasks=5)
    derived = torch_env_from_slurm(env)
    assert (derived["LOCAL_WORLD_SIZE"], derived["GROUP_RANK"], derived["MASTER_ADDR"]) == ("1", "2", "a1-ib")


def test_user_master_addr_and_port_are_kept():
    env = srun_env(6, "n[1-2]", 0, "1(x2)", ntasks=2, MASTER_ADDR="10.0.0.1", MASTER_PORT="29999")
    derived = torch_env_from_slurm(env)
    assert (derived["MASTER_ADDR"], derived["MASTER_PORT"]) == ("10.0.0.1", "29999")


def test_torchrun_variables_win_over_slurm():
    env = srun_env(5, "gpu[01-02]", 1, "1(x2)", ntasks=2, RANK="3", WORLD_SIZE="8")
    assert torch_env_from_slurm(env) == {}


def test_batch_script_derives_nothing():
    assert torch_env_from_slurm(batch_env(8, "gpu[01-02]", "4(x2)", 2)) == {}


def test_procid_outside_ntasks_is_reported():
    with pytest.raises(SlurmError, match="SLURM_PROCID=9/SLURM_LOCALID=0 do not fit 2 task"):
        torch_env_from_slurm(srun_env(5, "n[1-2]", 1, "1(x2)", procid=9, ntasks=2))


def test_dist_context_reads_slurm_under_plain_srun():
    from phalanx.runtime.context import DistContext

    env = srun_env(5, "gpu[01-02]", 1, "4(x2)", procid=6, localid=2, ntasks=8)
    ctx = DistContext.from_env(env, cpu=True)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size, ctx.node_rank) == (6, 2, 8, 4, 1)


def test_ntasks_per_node_when_tasks_per_node_is_absent():
    env = srun_env(5, "n[1-2]", 0, "", ntasks=8, SLURM_NTASKS_PER_NODE="4")
    del env["SLURM_TASKS_PER_NODE"], env["SLURM_STEP_TASKS_PER_NODE"]
    assert read_allocation(env).tasks_per_node == (4, 4)
    with pytest.raises(SlurmError, match="SLURM started 4 tasks on this node"):
        launch_settings(env)

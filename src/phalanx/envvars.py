"""Every environment variable phalanx reads or writes, named in one place.

torch's own launcher variables come first: phalanx never invents a second name for them.
Modules import the constants from here instead of spelling the strings themselves.
"""

from __future__ import annotations

# --- set by torchrun / torch's elastic agent (and by `phalanx run`, which uses that agent) ---
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node rank, as the elastic agent names it
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# --- devices and transports (read by CUDA, gloo, NCCL, OpenMP) ---
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

# --- SLURM (read only; see phalanx.cluster.slurm) ---
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_NODEID = "SLURM_NODEID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_NODELIST = "SLURM_NODELIST"  # older name of SLURM_JOB_NODELIST
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"  # set by srun only: the step's hosts
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"  # set by srun only: marks a job step
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"  # e.g. "2(x3),1"
SLURM_STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
SLURM_JOB_GPUS = "SLURM_JOB_GPUS"
SLURM_STEP_GPUS = "SLURM_STEP_GPUS"

# --- phalanx's own settings are PHALANX_<NAME>, derived from the schema (phalanx.config.schema);
# this is a launcher switch, not a setting:
PHALANX_SLURM = "PHALANX_SLURM"  # "0": phalanx run ignores a surrounding SLURM allocation
# set by `phalanx run` for its workers: "1" = the launcher prints the preemption line and decides
# whether to requeue; workers only record their outcome for it (else rank 0 prints the line itself)
PHALANX_LAUNCHER = "PHALANX_LAUNCHER"
# set by `phalanx run`'s agent for its workers: the attempt of the worker group, the same on every node
# (torch's TORCHELASTIC_RESTART_COUNT is per node: a node that joins an elastic job later counts from 0)
PHALANX_ATTEMPT = "PHALANX_ATTEMPT"
# set by `phalanx run` for its workers: the job's parallel plan, built once by the launcher, with the
# inputs it was built from (strategies/plan/job_plan.py); a worker whose settings ask the same adopts it
PHALANX_PLAN = "PHALANX_PLAN"
# set by `phalanx parity` for the workers of its two runs (runtime/parity_record.py):
PHALANX_PARITY_RECORD = "PHALANX_PARITY_RECORD"  # the JSON-lines file rank 0 writes each step's figures to
PHALANX_PARITY_STEPS = "PHALANX_PARITY_STEPS"  # optimizer steps to record before leaving
PHALANX_PARITY_BATCH_SCALE = "PHALANX_PARITY_BATCH_SCALE"  # prepared loaders' batch x this (the 1-process run)
# set by `phalanx run` for its workers: the directory each worker leaves a note in at its end (did it
# join a process group, use Accelerate), read by the launcher (launch/worker_notes.py); every
# Phalanx() under it, in a worker or a process the worker started (mp.spawn), touches the file
# PHALANX_CREATED_MARKER there
PHALANX_WORKER_NOTES = "PHALANX_WORKER_NOTES"
PHALANX_CREATED_MARKER = "phalanx-created"  # a file name in PHALANX_WORKER_NOTES, not a variable

#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for the opt-in end-to-end test (tests/slurm).
#   local_slurm.sh start DIR   writes DIR/slurm.conf, starts munged, slurmctld, slurmd (as root);
#                              use it with SLURM_CONF=DIR/slurm.conf
#   local_slurm.sh stop DIR    stops exactly the daemons started with DIR (their pid files)
# Needs Debian's slurmctld slurmd slurm-client munge (scripts/ci-slurm-deps installs them).
set -euo pipefail
cmd=$1; dir=$(realpath -m "$2")
case "$cmd" in
  start)
    mkdir -p "$dir/state" "$dir/spool" "$dir/log"
    host=$(hostname -s)
    cpus=$(nproc)
    port=${PHALANX_TEST_SLURM_PORT:-16817}
    cat > "$dir/slurm.conf" <<CONF
ClusterName=phalanxtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    munged --force -S "$dir/munge.sock" --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
      --seed-file="$dir/munged.seed"
    slurmctld -i -f "$dir/slurm.conf"
    slurmd -f "$dir/slurm.conf"
    for _ in $(seq 60); do
      if SLURM_CONF="$dir/slurm.conf" sinfo -h -o %T 2>/dev/null | grep -qx idle; then exit 0; fi
      sleep 0.5
    done
    echo "local SLURM did not become idle; logs in $dir/log" >&2
    SLURM_CONF="$dir/slurm.conf" sinfo >&2 || true
    exit 1
    ;;
  stop)
    for name in slurmd slurmctld munged; do
      if [ -f "$dir/$name.pid" ]; then
        kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
      fi
    done
    ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac

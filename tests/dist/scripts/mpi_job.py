"""`mpiexec -n 2 python mpi_job.py OUT_DIR`: Phalanx() takes rank and size from MPI."""

import sys

from tests.dist.spawn_workloads import shard_report, write_report

if __name__ == "__main__":
    write_report(sys.argv[1], shard_report())

"""A training script for `phalanx run`: rank 1 misbehaves at step 3 (argv[1]: raise/sleep/kill/leave)."""

import sys

from tests.dist.failure_workloads import misbehave_at_step_3

if __name__ == "__main__":
    misbehave_at_step_3(sys.argv[1])  # the watchdog timeout comes from `phalanx run --watchdog-timeout`

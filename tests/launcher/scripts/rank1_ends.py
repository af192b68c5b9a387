"""Test worker: rank 1 ends with `sys.exit(N)` (argv[1] = N) or, with argv[1] = "kill", by SIGKILL;
the other ranks wait to be stopped. No process group: the exit code path only."""

import os
import signal
import sys
import time

if os.environ["RANK"] == "1":
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
time.sleep(60)

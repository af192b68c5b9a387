"""Test worker: joins the group, writes OUT/ready{rank} (argv[1] = OUT), then waits for Ctrl-C."""

import os
import sys
import time

from phalanx import Phalanx

px = Phalanx()
px.wait_for_everyone()
open(os.path.join(sys.argv[1], f"ready{px.rank}"), "w").close()
time.sleep(120)

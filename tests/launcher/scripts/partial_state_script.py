"""Accelerate's distributed inference as its docs write it: `PartialState()` alone (no Accelerator)
and `split_between_processes`; each process writes what it saw."""

import json
import os
import sys

from accelerate import PartialState

state = PartialState()
with state.split_between_processes(["a", "b", "c", "d"]) as part:
    seen = {"num_processes": state.num_processes, "index": state.process_index, "part": list(part)}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)

"""The job's parallel plan is built once: by `phalanx run`, which hands it to its workers
(PHALANX_PLAN), or by each worker's `Phalanx()` when nothing handed it one (torchrun) or the script
asks for another layout. Strategy auto decides replicas or shards of that plan, never rebuilding it.
Each worker counts the calls of presets.build, the one function that makes a plan."""

from __future__ import annotations

import json

import pytest

from tests.launcher.launch_helpers import run_cli

SCRIPT = """
import json, os, sys

import torch

from phalanx.strategies.plan import presets

builds = []
build = presets.build


def counting(*args, **kwargs):
    builds.append(args[0])
    return build(*args, **kwargs)


presets.build = counting
from phalanx import Phalanx

px = Phalanx(**json.loads(sys.argv[2]))
px.prepare(torch.nn.Linear(4, 4))
with open(os.path.join(sys.argv[1], f"rank{px.rank}.json"), "w") as fp:
    json.dump({"builds": builds, "plan": px.plan.describe()}, fp)
"""

CASES = {  # launcher, its flags, what the script passes to Phalanx(), the plan, builds in each worker
    "phalanx run, auto": ("phalanx", ["--strategy", "auto"], {}, "ddp: dp_replicate 2 (2 process(es))", []),
    "phalanx run, zero3": ("phalanx", ["--strategy", "zero3"], {}, "zero3: dp_shard 2 (2 process(es))", []),
    "the script asks another": (
        "phalanx",
        ["--strategy", "ddp"],
        {"strategy": "zero3"},
        "zero3: dp_shard 2 (2 process(es))",
        ["zero3"],
    ),
    "torchrun": (
        "torch.distributed.run",
        [],
        {"strategy": "zero1"},
        "zero1: dp_replicate 2 (2 process(es))",
        ["zero1"],
    ),
}


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_worker_builds_the_plan_at_most_once(tmp_path, case):
    module, flags, asked, plan, builds = CASES[case]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch = ["run", *flags] if module == "phalanx" else ["--nproc-per-node", "2"]
    if module == "phalanx":
        launch += ["--nproc-per-node", "2"]
    result = run_cli(
        [*launch, str(script), str(tmp_path), json.dumps(asked)], module=module, timeout=120, env={"PHALANX_CPU": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks == [{"builds": builds, "plan": plan}] * 2

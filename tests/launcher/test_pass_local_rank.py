"""torch.distributed.launch scripts (argparse requires --local_rank) under `phalanx run --pass-local-rank`."""

import json

import pytest

from tests.launcher.launch_helpers import SCRIPTS, run_cli

LEGACY = SCRIPTS / "legacy_local_rank.py"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_legacy_script_trains_with_the_flag_and_the_report_names_it_without(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(
        ["run", "--nproc-per-node", "2", "--pass-local-rank=--local_rank", str(LEGACY), "--out", str(out)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines().count("trained on 2 ranks") == 1
    records = {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    for rank, record in records.items():
        assert (record["local_rank_arg"], record["local_rank"], record["world_size"]) == (rank, rank, 2)
    assert records[0]["seen"] == [0.0, 2.0, 4.0, 6.0] and records[1]["seen"] == [1.0, 3.0, 5.0, 7.0]  # own shards
    assert records[0]["weight"] == records[1]["weight"]  # trained together

    result = run_cli(["run", "--nproc-per-node", "2", str(LEGACY), "--out", str(out)], cwd=tmp_path)
    assert result.returncode != 0
    assert "the following arguments are required: --local_rank" in result.stderr
    assert (
        "phalanx: the script requires --local_rank, which torch.distributed.launch passed and torchrun does not. "
        "HINT: phalanx run --pass-local-rank=--local_rank SCRIPT ... passes it to every worker."
    ) in result.stderr

"""Issue 54 item 2: a setting two sources give differently is said at start, as the user sees it:
which source won, which lost, and how to change it; under `phalanx run` by the launcher (a flag over
a PHALANX_* variable) and by the script's rank 0 (a Phalanx() keyword over the launcher's flag).
One 2-rank launch covers both."""

import pytest

from tests.launcher.launch_helpers import SCRIPTS, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

PRECEDENCE = (
    "(a Phalanx() keyword beats phalanx run's flags and PHALANX_* variables, a flag beats a variable, "
    "both beat a config file)"
)


def test_a_keyword_over_the_launchers_flag_and_a_flag_over_a_variable_are_said(tmp_path):
    result = run_cli(
        ["run", "--nproc-per-node", "2", "--strategy", "zero3", "--seed", "7", str(SCRIPTS / "keyword_strategy.py")],
        cwd=tmp_path,
        env={"PHALANX_SEED": "5"},
    )
    assert result.returncode == 0, result.stderr
    assert "strategy ddp" in result.stdout  # the keyword won, as configuration.md says
    said = [line for line in result.stderr.splitlines() if " overrides " in line]
    assert said == [
        f"phalanx run: warning: --seed 7 overrides PHALANX_SEED=5 {PRECEDENCE}. HINT: give seed in one place: "
        "drop PHALANX_SEED=5, or change --seed 7",
        f"[rank 0] WARNING phalanx: Phalanx(strategy='ddp') overrides phalanx run's --strategy zero3 {PRECEDENCE}. "
        "HINT: drop strategy= from Phalanx(...) to take phalanx run's --strategy zero3, or stop giving it there",
    ], result.stderr

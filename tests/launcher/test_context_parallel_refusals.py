"""`phalanx run` refuses a context-parallel layout it cannot run before any worker starts (exit 2,
the fix named), from the flag, the variable and the YAML file alike."""

from __future__ import annotations

import pytest

from tests.launcher.launch_helpers import run_cli

SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, env, yaml, message",
    [
        (["--cp", "3"], {}, None, "cp=3 does not divide the 2 processes. HINT: choose cp among 1, 2"),
        ([], {"PHALANX_CP": "2", "PHALANX_PP": "2"}, None, "cp=2 with pp=2: context parallel is not composed"),
        (["--strategy", "dp"], {}, "cp: 2\n", "strategy 'dp' runs one process, and cp=2"),
    ],
)
def test_bad_cp_layout_refused_before_launch(tmp_path, flags, env, yaml, message):
    script, marker = tmp_path / "train.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    if yaml is not None:
        (tmp_path / "cfg.yaml").write_text(yaml)
        flags = [*flags, "--config", str(tmp_path / "cfg.yaml")]
    result = run_cli(["run", "--nproc-per-node", "2", *flags, str(script), str(marker)], env=env, timeout=45)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not marker.exists()

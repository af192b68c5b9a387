"""--pass-local-rank's pure parts: spelling check, bare-flag expansion, the report's hint."""

import pytest

from phalanx.launch import local_rank
from phalanx.launch.spec import LaunchError


def test_hint_for_a_required_local_rank_names_the_flag_and_spelling():
    old = local_rank.hint_for_argparse_error("the following arguments are required: --local_rank", passed=False)
    assert old.endswith("HINT: phalanx run --pass-local-rank=--local_rank SCRIPT ... passes it to every worker.")
    new = local_rank.hint_for_argparse_error("the following arguments are required: --out, --local-rank", passed=False)
    assert new.endswith("HINT: phalanx run --pass-local-rank SCRIPT ... passes it to every worker.")


def test_hint_for_an_unrecognized_local_rank_suggests_the_other_spelling_or_env():
    hint = local_rank.hint_for_argparse_error("unrecognized arguments: --local-rank=1", passed=True)
    assert hint == (
        "the script does not accept the local rank argument. HINT: pass --pass-local-rank=--local_rank "
        "if it expects that spelling, or drop --pass-local-rank and read os.environ['LOCAL_RANK']."
    )


def test_other_argparse_errors_get_no_hint():
    assert local_rank.hint_for_argparse_error("the following arguments are required: --data", passed=False) is None


def test_bare_flag_before_the_script_only():
    takes_value = {"--nproc-per-node": True, "--standalone": False}.get
    tokens = ["--nproc-per-node", "2", "--standalone", "--pass-local-rank", "train.py", "--pass_local_rank"]
    assert local_rank.expand_bare_flag(tokens, takes_value) == [
        "--nproc-per-node",
        "2",
        "--standalone",
        "--pass-local-rank=--local-rank",
        "train.py",
        "--pass_local_rank",
    ]


@pytest.mark.parametrize("value", ["local_rank", "--", "--local rank", "train.py"])
def test_a_value_that_is_not_a_flag_is_refused(value):
    with pytest.raises(LaunchError, match=rf"--pass-local-rank takes the flag name the script expects.*got '{value}'"):
        local_rank.check_spelling(value)

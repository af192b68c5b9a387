"""Issue 54 item 4: an unknown flag gets what it likely meant, as the user sees it (the command's
error line): a peer launcher's spelling mapped to phalanx's, a typo matched; every subcommand."""

from __future__ import annotations

import pytest

from phalanx import cli
from phalanx.launch import flag_spelling
from phalanx.launch.misplaced_flag import launcher_flags


def error_of(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["run", "--num_processes", "2", "train.py"],
            "phalanx run: error: unrecognized arguments: --num_processes. did you mean --nproc-per-node? "
            "(--num_processes is Accelerate's spelling, counting the processes of every machine; phalanx run "
            "counts one machine's)",
        ),
        (
            ["run", "--num_machines", "2", "train.py"],
            "phalanx run: error: unrecognized arguments: --num_machines. did you mean --nnodes? "
            "(--num_machines is Accelerate's spelling)",
        ),
        (
            ["run", "--num-gpus=2", "train.py"],
            "phalanx run: error: unrecognized arguments: --num-gpus=2. did you mean --nproc-per-node? "
            "(--num-gpus is the DeepSpeed launcher's spelling)",
        ),
        (
            ["run", "--stratgy", "zero3", "train.py"],
            "phalanx run: error: unrecognized arguments: --stratgy. did you mean --strategy?",
        ),
        (
            ["plan", "--wrld-size", "2", "train.py"],
            "phalanx plan: error: unrecognized arguments: --wrld-size train.py. did you mean --world-size?",
        ),
    ],
)
def test_an_unknown_flag_says_what_it_likely_meant(capsys, argv, line):
    assert error_of(capsys, argv) == line


def test_a_flag_nothing_resembles_keeps_the_old_words(capsys):
    assert error_of(capsys, ["run", "--bogus", "train.py"]) == (
        "phalanx run: error: unrecognized arguments: --bogus. phalanx run's own flags go before the script; "
        "everything after the script name is passed to the script. HINT: see phalanx run --help"
    )


def test_every_peer_flag_maps_to_a_flag_phalanx_run_takes():
    assert {ours for ours, _ in flag_spelling.PEER_FLAGS.values()} <= launcher_flags()


def test_a_peer_s_flag_after_the_script_gets_the_command_that_works():
    """The script's argparse rejected Accelerate's --num_processes written after it: the hint names
    phalanx run's flag and moves it before the script, the script's path as typed."""
    from phalanx.launch.misplaced_flag import hint_for_misplaced_flag

    hint = hint_for_misplaced_flag(
        "train.py: error: unrecognized arguments: --num_processes 2",
        "examples/train.py",
        ["--lr", "0.5", "--num_processes", "2"],
    )
    assert hint == (
        "--num_processes (Accelerate's spelling, counting the processes of every machine; phalanx run counts "
        "one machine's) means `phalanx run`'s --nproc-per-node, a launcher flag written after the script: what "
        "follows the script goes to the script, and examples/train.py's argparse rejected it. HINT: put launcher "
        "flags before the script: phalanx run --nproc-per-node 2 examples/train.py --lr 0.5"
    )

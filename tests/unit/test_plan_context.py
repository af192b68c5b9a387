"""`phalanx plan --cp N`: activations of one cp rank's part of the rows, the layout checked first."""

from __future__ import annotations

import re

from phalanx import cli

MODEL = "tests/dist/cp_workloads.py:tiny_llama"


def activations(out: str) -> str:
    return re.search(r"activations per rank, any strategy.*?: (\S+ \S+) after the forward", out).group(1)


def test_cp_reports_one_ranks_part(capsys):
    assert cli.main(["plan", MODEL, "--world-size", "4", "--input", "2x64", "--budget", "1GB"]) == 0
    whole = activations(capsys.readouterr().out)
    assert cli.main(["plan", MODEL, "--world-size", "4", "--input", "2x64", "--cp", "2", "--budget", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "context parallel: cp 2, each rank holds 32 of every row's 64 tokens" in out
    assert "data-parallel ranks 2" in out
    assert activations(out) != whole
    longest = re.search(
        r"longest sequence that fits 1\.0 GiB per rank \(zero3's model state, batch 2\): (\d+) tokens "
        r"at cp 2, (\d+) at cp 1",
        out,
    )
    at_cp, alone = (int(n) for n in longest.groups())
    assert at_cp % 4 == 0 and alone % 2 == 0 and at_cp > alone  # each rank holds half of every row


def test_cp_layouts_refused_with_the_fix(capsys):
    assert cli.main(["plan", MODEL, "--world-size", "4", "--cp", "3"]) == 2
    assert (
        "--cp 3 x --tp 1 x --pp 1 does not divide --world-size 4. HINT: choose cp among 1, 2, 4"
        in capsys.readouterr().err
    )
    assert cli.main(["plan", MODEL, "--world-size", "4", "--cp", "2", "--input", "2x30"]) == 2
    assert "a sequence length that is a multiple of 4" in capsys.readouterr().err

"""`phalanx run --pass-local-rank`: the `--local-rank=N` argument of torch.distributed.launch scripts.

Why: scripts written for `python -m torch.distributed.launch` declare `--local_rank` (or
`--local-rank`) with argparse and fail without it; torchrun stopped passing it. With the flag each
worker gets `--local-rank=<its local rank>` (or the spelling given) after the script's own arguments.
When a worker dies of argparse's complaint about that argument, the launcher's report points to the
flag (`hint_for_argparse_error`, used by the worker wrapper). Pure: no torch import.
"""

from __future__ import annotations

import re
from typing import Callable

from phalanx.launch.spec import LaunchError

DEFAULT_SPELLING = "--local-rank"
FLAG_NAME = "--pass-local-rank"
LOCAL_RANK_MACRO = "${local_rank}"  # torch's elastic agent replaces it with each worker's local rank
_FLAG = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*$")
_COMPLAINTS = (
    re.compile(r"the following arguments are required: .*--local[-_]rank"),
    re.compile(r"unrecognized arguments: .*--local[-_]rank"),
)


FLAG_SPELLINGS = (FLAG_NAME, "--pass_local_rank")


def expand_bare_flag(tokens: list[str], takes_value: Callable[[str], bool]) -> list[str]:
    """`--pass-local-rank SCRIPT` -> `--pass-local-rank=--local-rank SCRIPT`, before the script only.

    Why: the flag's value is optional, and argparse would take the script's name as that value.
    A value is given with '=' (`--pass-local-rank=--local_rank`). `takes_value(token)` tells whether
    a launcher flag consumes the next token, to find where the script's name is.
    """
    out = list(tokens)
    expect_value = False
    for index, token in enumerate(out):
        if expect_value:
            expect_value = False
            continue
        if token in FLAG_SPELLINGS:
            out[index] = f"{FLAG_NAME}={DEFAULT_SPELLING}"
        elif token == "--" or not token.startswith("-"):
            break  # the script (or module) name: the rest belongs to it
        elif "=" not in token:
            expect_value = takes_value(token)
    return out


def check_spelling(value: str) -> str:
    """The flag spelling to pass (e.g. --local-rank, --local_rank); anything else is a LaunchError."""
    if not _FLAG.match(value):
        raise LaunchError(
            f"{FLAG_NAME} takes the flag name the script expects, such as --local-rank or --local_rank, got {value!r}. "
            f"HINT: write {FLAG_NAME}=--local_rank (with '='), or {FLAG_NAME} alone for --local-rank."
        )
    return value


def worker_argument(spelling: str) -> str:
    """`--local-rank=${local_rank}`: torch's agent substitutes each worker's local rank."""
    return f"{spelling}={LOCAL_RANK_MACRO}"


def hint_for_argparse_error(message: str, passed: bool) -> str | None:
    """A hint when argparse's error `message` is about the local-rank argument, else None."""
    if not any(pattern.search(message) for pattern in _COMPLAINTS):
        return None
    if "unrecognized" in message:
        wanted = "--local_rank" if "--local-rank" in message else "--local-rank"
        return (
            f"the script does not accept {'the local rank argument' if passed else 'a --local-rank argument'}. "
            f"HINT: pass {FLAG_NAME}={wanted} if it expects that spelling, or drop {FLAG_NAME} and read "
            "os.environ['LOCAL_RANK']."
        )
    wanted = "--local_rank" if "--local_rank" in message else "--local-rank"
    suffix = "" if wanted == DEFAULT_SPELLING else f"={wanted}"
    return (
        f"the script requires {wanted}, which torch.distributed.launch passed and torchrun does not. "
        f"HINT: phalanx run {FLAG_NAME}{suffix} SCRIPT ... passes it to every worker."
    )

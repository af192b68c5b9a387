"""Test-wide guards: no test may leak launcher variables or a process group into the next, the
suite never writes into the repository or the system's temporary folder and leaves no ResourceWarning
(all checked when the session ends)."""

import atexit
import gc
import os
import shutil
import tempfile
import warnings
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_IGNORED_OUTPUTS = ("runs", "ckpt")  # what phalanx writes by default, ignored by git: checked by name

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaked_distributed_state():
    before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    assert before == after, f"test leaked launcher variables: {before} -> {after}"
    import torch.distributed as dist

    if dist.is_initialized():
        from phalanx.runtime import process_group

        if process_group.owns_world_of_one():  # a Phalanx() in a world of one: its group of one lives until exit
            process_group.destroy_process_group()
            return
        dist.destroy_process_group()
        pytest.fail("test left a process group initialised")


@pytest.fixture(autouse=True)
def no_phalanx_settings_from_outside():
    """Every test starts with no PHALANX_* variable (a developer's PHALANX_STRATEGY=zero3 must not
    change what the tests check), and whatever a test sets is gone afterwards: the variables as they
    were are put back."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("PHALANX_")}
    for key in saved:
        del os.environ[key]
    yield
    for key in [k for k in os.environ if k.startswith("PHALANX_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def run_dir_in_tmp(no_phalanx_settings_from_outside, monkeypatch, tmp_path_factory):
    """Phalanx() and `phalanx run` write logs/metrics under PHALANX_RUN_DIR (default ./runs/<time>):
    keep tests' in a temporary directory of their own, outside tmp_path (tests compare tmp_path's
    files), never in the repository."""
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path_factory.mktemp("phalanx-run")))


@pytest.fixture(scope="session", autouse=True)
def session_run_dir(tmp_path_factory):
    """Session- and module-scoped fixtures start ranks before `run_dir_in_tmp` (per test) takes effect,
    and their ranks would write `runs/<time>` into the repository: a temporary run directory for the
    whole session covers them (`no_phalanx_settings_from_outside` hides it inside each test and puts it
    back after)."""
    previous = os.environ.get("PHALANX_RUN_DIR")
    os.environ["PHALANX_RUN_DIR"] = str(tmp_path_factory.mktemp("phalanx-session-run"))
    yield
    if previous is None:
        os.environ.pop("PHALANX_RUN_DIR", None)
    else:
        os.environ["PHALANX_RUN_DIR"] = previous


def repository_outputs() -> set[str]:
    """Untracked files git does not ignore, plus the entries of the ignored output folders."""
    found = {
        f"{name}/{entry.name}"
        for name in _IGNORED_OUTPUTS
        if (ROOT / name).is_dir()
        for entry in (ROOT / name).iterdir()
    }
    try:
        listed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return found  # no git (an unpacked sdist): the output folders are still checked
    if listed.returncode == 0:
        found |= {line[3:] for line in listed.stdout.splitlines() if line.startswith("?? ")}
    return found


# What the suite's processes would otherwise leave in the system's temporary directory: multiprocessing's
# listener folders (a process that ends by os._exit never removes its own), torch's elastic agent's log
# folders and error files (plain torchrun keeps them), phalanx's own launch folders.
_TMP_LEFTOVERS = ("pymp-", "torchelastic_", "pytorch-errorfile-", "phalanx-")


SECOND_TIER: tuple[str, ...] = (
    # The first tier is the quick check: the unit tests and one multi-process run of each layout and
    # feature (the composition matrix, the idiom corpus, the strategies, the seeds). These launches go
    # to the second tier by cost: 4-rank layouts, whole examples, kill-and-resume and failure runs, and
    # the files whose module-wide spawns took 15-75 s on 2 cores (measured with --durations=0; the
    # first tier took 1703 s for 1920 tests before this list grew, the README promises 15 minutes).
    # A whole file moves when its tests share one module-scoped spawn. CI runs both tiers.
    "tests/examples/test_finetune_llm.py::",
    "tests/multinode/test_two_nodes_netns.py::",
    "tests/dist/test_zero3_meta.py::test_compiled_losses_equal_eager_over_20_steps_under_ddp_and_zero3",
    "tests/checkpoint/test_storage_faults.py::test_a_full_disk_stops_every_rank_with_one_message_and_keeps_latest",
    "tests/dist/test_strategies_wine.py::test_wine_zero3_and_deepspeed_stage3_reach_the_same_loss_and_accuracy_as_ddp",
    "tests/dist/test_closure_optimizers.py::test_a_closure_optimizer_under_ddp_takes_one_process_step",
    "tests/dist/test_ema.py::test_averaged_model_under_zero2_with_tp_is_refused_naming_the_way",
    "tests/dist/test_ema.py::test_torch_averaged_model_equals_one_process_under_hsdp_2x2",
    "tests/dist/test_failures.py::",
    "tests/launcher/test_parity.py::",
    "tests/docs/test_runnable_blocks.py::",
    "tests/unit/test_meta_regions.py::test_compile_wraps_the_checkpointed_unit",
    "tests/dist/test_tensor_parallel.py::",
    "tests/checkpoint/test_resume.py::",
    "tests/dist/test_hsdp.py::",
    "tests/dist/test_uneven.py::",
    "tests/checkpoint/test_store_lost.py::",
    "tests/dist/test_spawn_and_adopt.py::",
    "tests/dist/test_worker_start.py::",
    "tests/checkpoint/test_async_save.py::",
    "tests/examples/test_sentiment_example.py::",
    "tests/examples/test_sentiment_export.py::",
    "tests/dist/test_pp_idioms.py::",
    "tests/loop/test_seeding.py::",
    "tests/dist/test_pp_layouts.py::",
    "tests/observe/test_straggler_runs.py::",
    "tests/checkpoint/test_preemption.py::",
    "tests/dist/test_findings.py::",
    "tests/dist/test_context_parallel.py::",
    "tests/launcher/test_failure_reports.py::",
    "tests/dist/test_tied_checkpoints.py::",
    "tests/dist/test_gloo_comms.py::",
    # this round's additions pushed the first tier to 757 s (the brief: 12 minutes): a file and two cases moved
    "tests/launcher/test_exit_without_hanging.py::",
    "tests/launcher/test_launch_compat.py::test_a_fabric_script_that_calls_launch_joins_one_world",
    "tests/launcher/test_launch_compat.py::test_an_accelerate_partial_state_script_joins_one_world",
)
"""nodeid prefixes marked `slow` at collection: the one list of tests moved to the second tier by cost."""


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SECOND_TIER):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    # Python hides ResourceWarning by default: shown, every one reaches pytest_warning_recorded.
    config.addinivalue_line("filterwarnings", "always::ResourceWarning")
    # One temporary folder for the whole session, removed at its end: TMPDIR reaches every process the
    # tests start, so what they write through tempfile goes with it (pytest's own tmp_path too).
    system_tmp = tempfile.gettempdir()
    before = set(os.listdir(system_tmp))
    session_tmp = tempfile.mkdtemp(prefix="phalanx-tests-")
    os.environ["TMPDIR"] = tempfile.tempdir = session_tmp
    config.stash[_tmp_key] = (system_tmp, before, session_tmp)
    # Removed at the interpreter's exit, after every other exit hook (atexit runs the first registered
    # last): a Phalanx() made in this process by a test writes its run's last status at exit.
    atexit.register(shutil.rmtree, session_tmp, True)


def _left_in_system_tmp(session) -> list[str]:
    system_tmp, before, session_tmp = session.config.stash[_tmp_key]
    return sorted(
        os.path.join(system_tmp, name)
        for name in set(os.listdir(system_tmp)) - before
        if name.startswith(_TMP_LEFTOVERS) and os.path.join(system_tmp, name) != session_tmp
    )


def pytest_warning_recorded(warning_message, when, nodeid, location):
    """An unclosed socket or file (a ResourceWarning, also when it surfaced from a finalizer as an
    unraisable exception) fails the session at its end, with where it was seen."""
    text = str(warning_message.message)
    if issubclass(warning_message.category, ResourceWarning) or "ResourceWarning" in text:
        _resource_warnings.append(
            f"{nodeid or when}: {warning_message.category.__name__}: {text}"
            f" ({warning_message.filename}:{warning_message.lineno})"
        )


def pytest_sessionstart(session):
    session.config.stash[_before_key] = repository_outputs()


def _left_resource_warnings() -> list[str]:
    """The ResourceWarnings seen during the session, and those the last garbage collection gives."""
    with warnings.catch_warnings(record=True) as late:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    return _resource_warnings + [
        f"at the session's end (garbage collected): {w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in late
        if issubclass(w.category, ResourceWarning)
    ]


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when tests left files in the repository (the README promises they never do), or
    left a socket or file unclosed (ResourceWarning)."""
    leaks = _left_resource_warnings()
    if leaks:
        _fail_session(
            session,
            "unclosed resources (ResourceWarning)",
            f"{len(leaks)} ResourceWarning(s); close what is opened (with-blocks, .close()):\n  "
            + "\n  ".join(leaks[:20]),
        )
    left = _left_in_system_tmp(session)
    if left:
        _fail_session(
            session,
            f"files left in {session.config.stash[_tmp_key][0]}",
            "tests left these outside the session's temporary folder (write through tempfile, or "
            "under tmp_path):\n  " + "\n  ".join(left[:20]),
        )
    before = session.config.stash.get(_before_key, None)
    if before is None:
        return
    added = sorted(repository_outputs() - before)
    if added:
        shown = "\n  ".join(added[:20]) + (f"\n  ... and {len(added) - 20} more" if len(added) > 20 else "")
        _fail_session(
            session,
            "files left in the repository",
            f"tests wrote into the repository ({ROOT}); they must write under a temporary directory:\n  {shown}",
        )


def _fail_session(session, title: str, message: str) -> None:
    """Mark the session failed; the message is printed by pytest_terminal_summary, just above the
    final count, so a CI log's tail says why a run with every test passed still failed."""
    _session_failures.append((title, message))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_logreport(report):
    """Each test file's time: its tests' setup, call and teardown (a module's shared spawn is in its
    first test's setup), summed for the report at the session's end."""
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    if report.when == "call":
        _file_tests[path] = _file_tests.get(path, 0) + 1


FILE_SHARE = 0.04
"""A test file over this share of the run's time is named in the report: the suite must fit CI's
budget (both tiers within 45 minutes on 2 cores), and a file that grows is where to look first."""


def _file_report(terminalreporter) -> None:
    if len(_file_seconds) < 2:
        return
    total = sum(_file_seconds.values())
    ranked = sorted(_file_seconds.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", f"time per test file: {len(ranked)} files, {total:.0f} s in all (the 15 longest)")
    for path, seconds in ranked[:15]:
        flag = f"  over {FILE_SHARE:.0%} of the run" if seconds > FILE_SHARE * total else ""
        terminalreporter.write_line(
            f"{seconds:8.1f} s {seconds / total:6.1%}  {_file_tests.get(path, 0):4d} tests  {path}{flag}"
        )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _file_report(terminalreporter)
    for title, message in _session_failures:
        terminalreporter.write_sep("=", title, red=True)
        terminalreporter.write_line(message, red=True)


_before_key = pytest.StashKey[set]()
_tmp_key = pytest.StashKey[tuple]()
_resource_warnings: list[str] = []
_session_failures: list[tuple[str, str]] = []
_file_seconds: dict[str, float] = {}
_file_tests: dict[str, int] = {}

"""`phalanx.spawn(fn, *args, nprocs=None, **kwargs)`: run a function on N ranks from Python.

For notebooks and scripts that want the launch inside Python rather than on the command line. The
workers are started by torch's elastic agent (`elastic_launch`, as `phalanx run` does), so each
sees torchrun's environment and `Phalanx()` inside `fn` joins the job as under `phalanx run`.

Start method: in an interactive session (Jupyter, IPython, the REPL: `__main__` has no file) the
workers are forked, the only way a function defined in the notebook reaches them (as Accelerate's
notebook_launcher does); CUDA must not be initialised in the parent then. From a script, fork on
CPU-only machines (fast: no second `import torch`) and spawn when GPUs are in use, as `phalanx run`
chooses; under spawn, `fn` must be importable (a module-level function, script under
`if __name__ == "__main__":`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping

from phalanx.launch import devices
from phalanx.launch.agent import choose_start_method, no_cuda_init, rendezvous_settings
from phalanx.launch.private_tmp import private_tempdir
from phalanx.launch.report import format_failures
from phalanx import config
from phalanx.launch.spec import LaunchSpec


class SpawnError(RuntimeError):
    """phalanx.spawn could not start, or a rank failed; the message names the rank or the fix."""


def spawn(
    fn: Callable[..., Any], *args: Any, nprocs: int | None = None, start_method: str = "auto", **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nprocs` ranks; return their return values, in rank order.

    `nprocs=None`: one per visible GPU, else 2 on CPU (as `phalanx run --nproc-per-node auto`).
    `start_method`: auto (see the module doc), fork or spawn. A rank that raises makes this call
    raise SpawnError with that rank and its traceback; the other ranks are stopped.
    """
    nprocs = check_nprocs(nprocs)
    methods = config.BY_NAME["start_method"].kind.choices()  # the start_method setting's choices
    if start_method not in methods:
        raise SpawnError(f"start_method must be one of {', '.join(methods)}, got {start_method!r}")
    num_gpus = devices.count_visible_gpus()
    if nprocs is None:
        nprocs = devices.resolve_nproc(None, None, lambda: num_gpus, devices.count_cpu_cores())
    method = spawn_start_method(start_method, interactive=is_interactive(), num_gpus=num_gpus)
    check_can_start(fn, method, cuda_initialised=_cuda_initialised(), interactive=is_interactive())
    if method == "spawn":
        check_arguments_can_be_sent(args, kwargs)
    return _launch(fn, args, kwargs, nprocs, method)


def check_nprocs(nprocs: Any) -> int | None:
    if nprocs is None:
        return None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise SpawnError(
            f"nprocs must be a positive integer or None, got {nprocs!r}. HINT: leave it out "
            "(None) for one process per visible GPU, or 2 on a CPU-only machine."
        )
    return nprocs


def is_interactive() -> bool:
    """True in a Jupyter kernel, IPython or the REPL: functions there live in a `__main__` without a file."""
    main = sys.modules.get("__main__")
    return main is None or not hasattr(main, "__file__")


def spawn_start_method(requested: str, interactive: bool, num_gpus: int) -> str:
    """auto -> fork in interactive sessions, else as `phalanx run` (fork on CPU, spawn with GPUs)."""
    if requested == "auto" and interactive:
        return "fork"
    return choose_start_method(requested, num_gpus)


def check_can_start(fn: Callable[..., Any], method: str, cuda_initialised: bool, interactive: bool) -> None:
    """Refuse, before any worker starts, what the start method cannot do."""
    if not callable(fn):
        raise SpawnError(f"phalanx.spawn needs a function to run on every rank, got {fn!r}")
    if method == "fork" and cuda_initialised:
        raise SpawnError(
            "CUDA is already initialised in this process, and forked workers cannot use it. HINT: "
            + (
                "restart the kernel and call phalanx.spawn before any cell touches CUDA (tensors, "
                "models or torch.cuda calls belong inside the function)."
                if interactive
                else "call phalanx.spawn before touching CUDA, or pass start_method='spawn'."
            )
        )
    if method != "spawn":
        return
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) == "__main__" and interactive:
        raise SpawnError(
            f"{name} is defined in this interactive session, which spawned workers cannot "
            "import. HINT: use start_method='fork' (the default here), or move it to a module."
        )
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise SpawnError(
            f"{name} cannot be sent to spawned workers ({type(error).__name__}: {error}). HINT: define it "
            "at the top level of a module or of the script (lambdas and functions defined inside "
            "other functions cannot be pickled), or use start_method='fork' on a CPU-only machine."
        ) from None


def check_arguments_can_be_sent(args: tuple, kwargs: dict) -> None:
    """Spawned workers receive the arguments pickled: refuse what cannot be, naming it."""
    for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        try:
            pickle.dumps(value)
        except Exception as error:
            raise SpawnError(
                f"{name} ({type(value).__name__}) cannot be sent to spawned workers "
                f"({type(error).__name__}: {error}). HINT: pass something picklable (paths, numbers, "
                "tensors) and build the rest inside the function, or use start_method='fork' on CPU."
            ) from None


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _launch(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int, method: str) -> list[Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from phalanx.launch import bound_store

    bound_store.register()
    with no_cuda_init():
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            max_restarts=0,
            start_method=method,
            **rendezvous_settings(LaunchSpec(target="<spawn>")),
        )
    worker_env = devices.worker_env_for_devices(nprocs, None, os.environ, devices.count_cpu_cores())
    # See launch.agent: the fork warning is about threads the forked child does not use.
    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
    try:
        with _exported(worker_env), private_tempdir():  # the agent passes its environment on to every worker
            results = elastic_launch(config, run_in_worker)(fn, args, kwargs, method == "fork")
    except ChildFailedError as error:
        raise SpawnError(format_failures(error, nprocs)) from None
    return [results[rank] for rank in range(nprocs)]


def run_in_worker(fn: Callable[..., Any], args: tuple, kwargs: dict, forked: bool) -> Any:
    """The agent's entrypoint in every worker: a forked one first drops what it inherited."""
    from phalanx.launch.worker import reset_inherited_process_state, run_exit_handlers

    if forked:
        reset_inherited_process_state()
    try:
        return fn(*args, **kwargs)
    finally:
        if forked:
            run_exit_handlers()


@contextlib.contextmanager
def _exported(env: Mapping[str, str]) -> Iterator[None]:
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

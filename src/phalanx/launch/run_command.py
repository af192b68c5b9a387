"""`phalanx run`: torchrun's flags (both spellings) -> `LaunchSpec` -> torch's elastic agent.

Every setting flag is derived from the schema (`phalanx.config.SETTINGS`): a setting added there
appears here. `main` resolves flags, PHALANX_* variables, the config file and a DeepSpeed JSON
once, checks them all before importing torch, then launches. Errors print
`phalanx run: error: ...` and exit 2, before any worker starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

from phalanx import config
from phalanx.launch.node_setup import CLUSTER_ERRORS, apply_slurm, node_setup_for
from phalanx import envvars
from phalanx.launch.rendezvous import parse_nnodes
from phalanx.launch import capacity, devices, etcd_store, framework_env, local_rank, ports, torchrun_flags, worker_notes
from phalanx.launch.spec import LaunchError, LaunchSpec, parse_gpus, validate
from phalanx.launch.run_flags import configure  # noqa: F401 (its home for cli, parity and tests: run_command.configure)
from phalanx.logging import dir_lock, sinks

PROG_ERROR = "phalanx run: error:"
EXIT_USAGE = 2


def resolve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> config.Resolved:
    """Flags > PHALANX_* variables > --config file > defaults, every value checked."""
    env = os.environ if env is None else env
    given = {s.name: getattr(args, s.name, None) for s in config.SETTINGS}
    layers = [config.from_yaml(args.config)] if getattr(args, "config", None) else []
    return config.resolve(*layers, config.from_env(env), config.from_flags(given), warn=False)


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """Turn parsed flags into a validated spec (pure: no torch, no processes)."""
    torchrun_flags.apply_pet_env(args, os.environ)  # PET_* as torchrun reads them (Kubeflow sets them)
    if getattr(args, "standalone", False):
        _check_standalone(args)
    try:
        resolved = resolve_settings(args)
    except config.ConfigError as error:
        raise LaunchError(str(error)) from None
    cfg = resolved.config
    try:  # a tracker whose library is missing here: refused before any worker starts
        sinks.expand(list(cfg.log_sinks), list(cfg.trackers or []))
    except ValueError as error:
        raise LaunchError(str(error)) from None
    agent = torchrun_flags.agent_options(args)
    min_nnodes, nnodes = parse_nnodes(cfg.nnodes)
    nproc_kind = cfg.nproc_per_node if isinstance(cfg.nproc_per_node, str) else "auto"
    spec = LaunchSpec(
        target=args.target,
        target_args=tuple(args.target_args),
        is_module=args.module,
        nproc_per_node=None if isinstance(cfg.nproc_per_node, str) else cfg.nproc_per_node,
        nproc_kind=nproc_kind,
        allow_oversubscribe=cfg.allow_oversubscribe,
        nnodes=nnodes,
        min_nnodes=min_nnodes if min_nnodes != nnodes else None,
        rdzv_timeout=cfg.rdzv_timeout,
        node_rank=cfg.node_rank,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
        rdzv_backend=cfg.rdzv_backend,
        rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_id=cfg.rdzv_id,
        max_restarts=cfg.max_restarts,
        gpus=None if cfg.gpus is None else parse_gpus(cfg.gpus),
        start_method=cfg.start_method,
        worker_env=config.worker_env(resolved),
        deepspeed=resolved.deepspeed,
        settings=resolved,
        pass_local_rank=None if args.pass_local_rank is None else local_rank.check_spelling(args.pass_local_rank),
        verbose=cfg.verbose,
        agent=agent,
        checkpoint_dir=cfg.checkpoint_dir,
        preemption_signals=cfg.preemption_signals,
        preempt_grace=cfg.preempt_grace,
        requeue=cfg.requeue,
    )
    torchrun_flags.check_agent_options(
        agent, is_module=spec.is_module, nproc_per_node=spec.nproc_per_node, target=spec.target
    )
    return validate(apply_slurm(spec, os.environ))


def _check_standalone(args: argparse.Namespace) -> None:
    """--standalone: one node, a private rendezvous on a free loopback port (phalanx's single-node default)."""
    if args.nnodes not in (None, "1", "1:1"):
        raise LaunchError(f"--standalone runs a single node, but --nnodes is {args.nnodes}. HINT: drop one of them.")
    if args.rdzv_endpoint or args.rdzv_backend not in (None, "static", "c10d"):
        raise LaunchError("--standalone picks its own rendezvous on loopback; drop --rdzv-endpoint/--rdzv-backend.")
    args.rdzv_backend = "static"  # phalanx's loopback-only store on a free port: what torchrun's standalone means


def prepare(spec: LaunchSpec) -> tuple[int, int, dict[str, str]]:
    """Checks needing the machine (ports, GPUs): (nproc_per_node, GPUs in use, env for workers)."""
    num_cores = devices.count_cpu_cores()
    if spec.checkpoint_dir:  # refused here, not at the first save hours into the run
        from phalanx.checkpoint import atomic
        from phalanx.checkpoint.object_path import location

        try:
            atomic.check_writable(location(spec.checkpoint_dir))
        except atomic.CheckpointDirNotWritable as error:
            raise LaunchError(str(error)) from None
    if spec.rdzv_backend in etcd_store.ETCD_BACKENDS:  # else a 116-line torch traceback from the agent
        problem = etcd_store.check_reachable(spec.rdzv_backend, spec.rdzv_endpoint)
        if problem:
            raise LaunchError(problem)
    if spec.gpus is not None:
        devices.cuda_visible_devices_for(spec.gpus, os.environ)  # conflict check, before torch
    if spec.master_port is not None and spec.node_rank == 0 and spec.rdzv_backend == "static":
        ports.check_master_port(spec.master_port)
    if spec.gpus is not None:
        num_gpus = devices.count_visible_gpus()
        devices.check_gpu_indices(spec.gpus, num_gpus)
        num_gpus_in_use = len(spec.gpus)
    else:
        num_gpus_in_use = devices.count_visible_gpus()
    nproc = devices.resolve_nproc(spec.nproc_per_node, spec.gpus, lambda: num_gpus_in_use, num_cores, spec.nproc_kind)
    refusal = capacity.check(nproc, num_cores, capacity.task_limit(), spec.allow_oversubscribe)
    if refusal:  # else a fork that fails or waits, and a launch that hangs with an empty log
        raise LaunchError(refusal)
    handed = check_layout(spec, nproc)
    env = devices.worker_env_for_devices(nproc, spec.gpus, os.environ, num_cores)
    warning = devices.oversubscription_warning(
        nproc, num_cores, num_gpus_in_use, env.get(envvars.OMP_NUM_THREADS) or os.environ.get(envvars.OMP_NUM_THREADS)
    )
    if warning:
        print(warning, file=sys.stderr, flush=True)
    env.update(spec.worker_env)
    env.update(framework_env.accelerate_env(spec.settings, num_gpus_in_use, os.environ))  # as `accelerate launch`
    env.update(
        framework_env.fabric_env(
            spec.settings,
            nproc,
            spec.nnodes if spec.min_nnodes is None else None,
            num_gpus_in_use,
            os.environ,
            framework_env.script_source(spec.target, spec.is_module),
        )
    )  # as `fabric run`, or as torchrun for a script that calls fabric.launch()
    if handed is not None:
        env[envvars.PHALANX_PLAN] = handed  # the job's plan, built once: workers asking the same adopt it
    return nproc, num_gpus_in_use, env


def check_layout(spec: LaunchSpec, nproc: int) -> str | None:
    """The parallel layout the settings describe, on every node count the job may have: tp (x pp)
    must divide the processes, hsdp's replicas must fit the nodes, settings the layout would ignore are
    refused. Also DeepSpeed's batch identity, which counts data-parallel ranks. Returns the plan of
    each membership the job may have (every node count of an elastic job) as the workers'
    PHALANX_PLAN (strategies/plan/job_plan.py), each built once here."""
    if spec.settings is None:
        return None
    from phalanx.strategies.plan import job_plan, settings_check

    cfg = spec.settings.config
    deepspeed = spec.settings.deepspeed
    handed, warnings = [], {}
    fewest = spec.min_nnodes or spec.nnodes
    for nnodes in range(fewest, spec.nnodes + 1):  # each membership an elastic job may have gets its plan
        where = {
            "world_size": nproc * nnodes,
            "local_world_size": nproc,
            "cpu_offload": bool(deepspeed is not None and deepspeed.cpu_offload),
        }
        try:
            plan = job_plan.build(cfg.strategy, cfg, **where)
            warnings.update(
                dict.fromkeys(settings_check.check(spec.settings, settings_check.checked_plan(spec.settings, plan)))
            )
            if spec.deepspeed is not None and spec.min_nnodes is None:
                spec.deepspeed.check_world(plan.dp_size)
        except ValueError as error:
            if nnodes in (fewest, spec.nnodes):  # the ends are refused; a size between may never form
                raise LaunchError(str(error)) from None
            continue  # a membership of this size would refuse itself in its workers, with the same error
        handed.append((plan, job_plan.inputs(cfg.strategy, cfg, **where)))
    for warning in warnings:
        print(f"phalanx run: warning: {warning}", file=sys.stderr, flush=True)
    if not plan.tp_within(nproc):
        what = "is larger than" if cfg.tp > nproc else "does not divide"
        print(
            f"phalanx run: warning: tp={cfg.tp} {what} the {nproc} processes of a node: tensor-parallel groups then "
            "span nodes, and their all-reduces cross the slower links on every layer. HINT: keep tp within a "
            "node (a divisor of --nproc-per-node) and let the data-parallel dims span the nodes",
            file=sys.stderr,
            flush=True,
        )
    return job_plan.hand_off(handed)


def main(args: argparse.Namespace) -> int:
    """`phalanx run`: validate, export the workers' environment, launch; return the exit code."""
    try:
        spec = spec_from_args(args)
        nproc, num_gpus_in_use, env = prepare(spec)
        node = node_setup_for(spec, os.environ)  # multi-node: interface, own address, store host
    except (LaunchError, *CLUSTER_ERRORS) as error:
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    for line in config.override_lines(spec.settings):  # a flag beside a variable or a file of another value
        print(f"phalanx run: warning: {line}", file=sys.stderr)
    if node is not None:
        env.update(node.env)
    env[envvars.PHALANX_LAUNCHER] = "1"  # workers leave the preemption line to this launcher
    log_dir = launcher_log_dir(env, spec.single_node)
    try:
        locks = lock_dirs(spec, os.path.dirname(log_dir))
    except dir_lock.DirectoryInUse as error:  # before the notes are cleared: they are the other job's
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run(spec, nproc, num_gpus_in_use, node, env, log_dir)
    finally:
        for lock in locks:
            lock.release()


def _run(spec: LaunchSpec, nproc: int, num_gpus_in_use: int, node, env: dict[str, str], log_dir: str) -> int:
    notes_dir = env[envvars.PHALANX_WORKER_NOTES] = os.path.join(log_dir, "workers")
    if spec.single_node:  # read after a single-node run only; nodes sharing a run dir must not clear each other's
        worker_notes.clear(notes_dir)
    try:
        page = start_dashboard(spec, os.path.dirname(log_dir))
    except ValueError as error:  # the extra is missing, the address taken: before any worker starts
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    os.environ.update(env)  # the elastic agent passes its environment on to every worker
    from phalanx.launch.agent import launch
    from phalanx.launch.report import agent_log_level_is_debug

    verbose = spec.verbose or agent_log_level_is_debug(os.environ)
    end_watch, said = None, None
    if spec.single_node:  # settings no script took: said while the job runs, not only at its end
        end_watch = worker_notes.say_while_running(
            notes_dir, nproc, lambda notes: _no_effect(notes_dir, notes, spec, num_gpus_in_use), _say
        )
    try:
        code = launch(spec, nproc, num_gpus_in_use, node, verbose=verbose, log_dir=log_dir)
    finally:
        if end_watch is not None:
            said = end_watch()
        if page is not None:
            page.stop()
    if code == 0 and spec.single_node:  # what the workers did that would otherwise go unsaid
        say_what_workers_did(notes_dir, spec, nproc, num_gpus_in_use, said=said)
    return code


def lock_dirs(spec: LaunchSpec, run_dir: str) -> list:  # -> list[DirLock]
    """One job per directory: lock the run directory and a local checkpoint directory for the whole
    job (restarts included), or raise DirectoryInUse naming the holder. A single node's launcher
    only: across nodes each launcher would lock the shared directories against its peers."""
    if not spec.single_node:
        return []
    wanted = {os.path.realpath(run_dir): "run directory (--run-dir)"}
    if spec.checkpoint_dir and "://" not in spec.checkpoint_dir.replace("file://", ""):
        wanted.setdefault(os.path.realpath(spec.checkpoint_dir.replace("file://", "")), "checkpoint directory")
    locks = []
    try:
        for directory, what in wanted.items():
            locks.append(dir_lock.acquire(directory, what))
    except dir_lock.DirectoryInUse:
        for lock in locks:
            lock.release()
        raise
    for lock in locks:
        if lock.took_over is not None:
            _say(f"phalanx: took over the lock of {lock.directory} from {lock.took_over.describe()}, no longer running")
    return locks


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _no_effect(notes_dir: str, notes: list, spec: LaunchSpec, num_gpus_in_use: int) -> str | None:
    return worker_notes.no_effect_line(
        notes, worker_notes.phalanx_created(notes_dir), spec.settings, spec.target, num_gpus_in_use
    )


def say_what_workers_did(
    notes_dir: str, spec: LaunchSpec, nproc: int, num_gpus_in_use: int, said: str | None = None
) -> None:
    """Separate worlds of one, and settings that never reached the script: one line each (the
    second unless the same line was said while the job ran)."""
    notes = worker_notes.read(notes_dir)
    for line in (worker_notes.separate_worlds_line(notes, nproc), _no_effect(notes_dir, notes, spec, num_gpus_in_use)):
        if line and line != said:
            _say(line)


def start_dashboard(spec: LaunchSpec, run_dir: str):  # -> Dashboard | None
    """--dashboard: serve the job's page from node 0's launcher; the URL is printed (with its token)."""
    address = spec.settings.config.dashboard if spec.settings is not None else None
    if not address or spec.node_rank != 0:
        return None
    from phalanx.observe.dashboard import Dashboard

    if not spec.single_node and not os.environ.get(config.BY_NAME["run_dir"].env or ""):
        print(
            "phalanx run: warning: --dashboard across nodes shows the job only with a --run-dir that "
            "rank 0's node shares with this launcher",
            file=sys.stderr,
            flush=True,
        )
    page = Dashboard(run_dir, address).start()
    print(f"phalanx run: dashboard at {page.url}", file=sys.stderr, flush=True)
    return page


def launcher_log_dir(env: dict[str, str], single_node: bool) -> str:
    """RUN_DIR/logs, where the launcher's log goes beside the ranks' logs.

    On one node with no run directory chosen, the launcher creates `runs/<time>` and exports it
    (PHALANX_RUN_DIR), so the workers use the same one. Across nodes rank 0 still chooses the
    workers' directory; each launcher then logs under a fresh local `runs/<time>` of its own.
    """
    from phalanx.logging.run_dir import DEFAULT_ROOT, make_unique_dir

    variable = config.BY_NAME["run_dir"].env or ""
    run_dir = env.get(variable) or os.environ.get(variable)
    if run_dir:
        run_dir = os.path.abspath(run_dir)
    else:
        run_dir = make_unique_dir(DEFAULT_ROOT)
        if single_node:
            env[variable] = run_dir
    return os.path.join(run_dir, "logs")

"""What the workers did that the launcher cannot see: did each join a process group, and of what
size; did it use Accelerate; was a Phalanx() created. Read after the run to say what would otherwise
be silent: workers that ran as separate worlds of one, settings that never reached the script.

Each worker writes one small JSON file, `rank<N>.json`, into the directory the launcher names in
PHALANX_WORKER_NOTES (its run directory's logs/workers); every Phalanx() touches the file
PHALANX_CREATED_MARKER there (also in processes a worker starts itself, e.g. with mp.spawn). Pure
file and text work here; the worker side (launch/worker.py) watches init_process_group.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable

from phalanx import envvars

# Runtime settings the launcher acts on itself: they take effect without Phalanx() in the script.
_LAUNCHER_ACTS_ON = frozenset({"checkpoint_dir", "preemption_signals", "preempt_grace", "requeue", "run_dir"})


@dataclass
class WorkerNote:
    rank: int
    group_size: int | None = None  # world size of the default process group it joined; None: none
    accelerate: bool = False  # it made an Accelerator (HF Trainer does)
    fabric: bool = False  # Lightning Fabric joined the process group
    finished: bool = False  # the script had returned (the note at its end); False: the note while it runs


def write(note: WorkerNote, environ: Any = os.environ) -> None:
    """Leave `note` where the launcher reads it (nothing when not under `phalanx run`)."""
    directory = environ.get(envvars.PHALANX_WORKER_NOTES)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{note.rank}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as fp:
        json.dump(asdict(note), fp)
    os.replace(path + ".tmp", path)


def clear(directory: str) -> None:
    """Remove an earlier run's notes (a run directory can be reused), before the workers start; a
    note another launcher removed meanwhile is gone already."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name == envvars.PHALANX_CREATED_MARKER or (name.startswith("rank") and name.endswith(".json")):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))


def phalanx_created(directory: str) -> bool:
    """Whether any process of the run created Phalanx()."""
    return os.path.exists(os.path.join(directory, envvars.PHALANX_CREATED_MARKER))


def read(directory: str) -> list[WorkerNote]:
    """Every worker's note, by rank (a worker killed before its end left none)."""
    if not os.path.isdir(directory):
        return []
    notes = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name), encoding="utf-8") as fp:
                notes.append(WorkerNote(**json.load(fp)))
    return sorted(notes, key=lambda note: note.rank)


def say_while_running(
    directory: str,
    workers: int,
    line: Callable[[list[WorkerNote]], str | None],
    say: Callable[[str], None],
    interval_s: float = 1.0,
) -> Callable[[], str | None]:
    """Read the notes once a second while the job runs; once every worker has left one (a few seconds
    after joining its group, launch/worker.py) say `line(notes)` once, if anything. Returns the call
    that ends the watch and gives back what was said."""
    done, said = threading.Event(), []

    def watch() -> None:
        while not done.wait(interval_s):
            try:
                notes = read(directory)
            except (OSError, ValueError):  # a note being replaced: read again next time
                continue
            if len(notes) < workers:
                continue
            text = line(notes)
            if text:
                said.append(text)
                say(text)
            return

    thread = threading.Thread(target=watch, name="phalanx-worker-notes", daemon=True)
    thread.start()

    def end() -> str | None:
        done.set()
        thread.join(timeout=5)
        return said[0] if said else None

    return end


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def separate_worlds_line(notes: list[WorkerNote], world_size: int) -> str | None:
    """The warning for workers that never joined a process group of `world_size`."""
    alone = [note.rank for note in notes if (note.group_size or 1) < world_size]
    if world_size <= 1 or not alone:
        return None
    return (
        f"phalanx run: warning: {_ranks(alone)} never joined a process group of {world_size}: they ran as "
        f"{len(alone)} separate world{'s' if len(alone) > 1 else ''} of one (each read all the data and acted as the main process). HINT: "
        "create Phalanx() in the script (or call torch.distributed.init_process_group); Accelerate, HF "
        "Trainer and Lightning Fabric scripts join by themselves under phalanx run"
    )


def no_effect_line(
    notes: list[WorkerNote], created: bool, settings: Any, target: str, num_gpus_in_use: int
) -> str | None:
    """The warning for settings given to `phalanx run` that no worker could apply (`created`: was a
    Phalanx() created)."""
    from phalanx import config
    from phalanx.launch.framework_env import reaches_accelerate, reaches_fabric

    if settings is None or not notes or created:
        return None
    accelerate = any(note.accelerate for note in notes)
    fabric = any(note.fabric for note in notes)
    ignored = []
    for setting in config.RUNTIME:
        if not settings.is_set(setting.name) or setting.name in _LAUNCHER_ACTS_ON:
            continue
        value = getattr(settings.config, setting.name)
        if accelerate and reaches_accelerate(setting.name, value, num_gpus_in_use):
            continue
        if fabric and reaches_fabric(setting.name, value):
            continue
        ignored.append(f"{setting.flag} {config.to_env_value(value)}")
    if not ignored:
        return None
    name = os.path.basename(target)
    if accelerate:
        given = (
            "the device"
            + (", FSDP" if num_gpus_in_use else "")
            + (", mixed precision" if settings.is_set("mixed_precision") else "")
        )
        why = (
            f"{name} never created Phalanx(); it used Accelerate, which got what `accelerate launch` would give it "
            f"({given})" + ("" if num_gpus_in_use else ", and Accelerate runs FSDP on accelerators only")
        )
    elif fabric:
        why = (
            f"{name} never created Phalanx(); it used Lightning Fabric, which got what `fabric run` would give it "
            "(the device, the processes"
            + (", mixed precision" if settings.is_set("mixed_precision") else "")
            + "; Fabric's strategy is its own)"
        )
    else:
        why = (
            f"{name} never created Phalanx(), which is how phalanx's runtime settings reach a script (a plain "
            "torch script keeps the layout it builds itself)"
        )
    return (
        f"phalanx run: warning: {', '.join(ignored)} had no effect: {why}. HINT: create px = Phalanx() and "
        "px.prepare(...) in the script, or drop the flag"
    )

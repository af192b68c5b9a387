"""An async save's bytes written by a helper process, so the training process keeps its GIL and cores.

Measured in the training process (bench/checkpoint.py, 2 cores): DCP's writer thread serializes every
tensor with `torch.save`, hashes it and, for a URL, drives s3fs's event loop, all Python that holds
the GIL; the training loop's thread then waits for the GIL between its ops, and a low-priority thread
holding it makes the wait longer (a niced thread is preempted while holding the GIL). So an async save
here is split: the training process stages the state once into one shared-memory arena (a memfd, the
copy DCP's stager makes anyway), plans with DCP as before (its collectives stay in DCP's thread,
on the async group), and hands the plan with arena offsets to one helper process per training
process (Linux's idle scheduling class, else nice 19). The helper runs the same DCP
storage writer over views of the arena, hashing each file as it writes it, and answers with DCP's
write results and the files' sizes and sha256; DCP's thread only waits on a socket meanwhile. Its
writes step aside while the training process waits for a CPU (host_only/polite_writes.py: on CPU runs).

Where memfd or fd passing is missing (not Linux), or a state holds a tensor type the arena does not
stage (e.g. ShardedTensor), the writer stages and writes in-process as DCP does.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from phalanx.host_only import polite_writes

NICENESS = 19  # a separate process: the loop's cores are served first, the helper takes what is left
ALIGN = 64


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and os.path.isdir("/proc/self/fd")


# ---- the arena: one shared-memory block holding every staged tensor ---------------------------------
class Arena:
    """A memfd of `size` bytes mapped here; `view` places a tensor in it."""

    def __init__(self, size: int):
        self.size = max(size, 1)
        self.fd = os.memfd_create("phalanx-ckpt", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.storage = _map(self.fd, self.size)
        self._used = 0

    def view(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        start = -(-self._used // ALIGN) * ALIGN
        self._used = start + nbytes
        assert self._used <= self.size, "arena sized too small"
        return torch.empty(0, dtype=like.dtype).set_(self.storage, start // like.element_size(), like.shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self.storage.data_ptr()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map(fd: int, size: int) -> torch.UntypedStorage:
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8).untyped_storage()


def _plain_leaves(obj: Any) -> list[torch.Tensor] | None:
    """Every tensor (a DTensor's local part) in a nested state dict; None if one is of another kind."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, DTensor):
            found.append(item._local_tensor)
        elif isinstance(item, torch.Tensor):
            if type(item) is not torch.Tensor and not isinstance(item, torch.nn.Parameter):
                return None
            found.append(item)
    return found


def stage(state_dict: dict) -> tuple[dict, Arena] | None:
    """A copy of `state_dict` whose tensors live in a new arena (None: a tensor kind it does not stage)."""
    from torch.distributed.tensor import DTensor

    leaves = _plain_leaves(state_dict)
    if leaves is None:
        return None
    arena = Arena(sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in leaves))

    def copy(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: copy(value) for key, value in item.items()}
        if isinstance(item, list):
            return [copy(value) for value in item]
        if isinstance(item, tuple):
            return tuple(copy(value) for value in item)
        if isinstance(item, DTensor):
            local = copy(item._local_tensor)
            return DTensor.from_local(
                local, item.device_mesh, item.placements, run_check=False, shape=item.shape, stride=item.stride()
            )
        if isinstance(item, torch.Tensor):
            staged = arena.view(item)
            staged.copy_(item.detach())
            return staged
        return item

    with torch.no_grad():
        return copy(state_dict), arena


# ---- the writer's side in the training process ----------------------------------------------------
def out_of_process(base: type) -> type:
    """A subclass of DCP's storage writer `base` whose async saves are written by the helper."""

    class OutOfProcessWriter(base):  # type: ignore[misc, valid-type]
        _arena: Arena | None = None
        written: dict | None = None  # file name -> FileEntry, filled from the helper's answer

        def stage(self, state_dict: dict) -> dict:
            staged = stage(state_dict)
            if staged is None:
                return super().stage(state_dict)
            state, self._arena = staged
            return state

        def write_data(self, plan: Any, planner: Any) -> Any:
            arena = self._arena
            if arena is None:
                return super().write_data(plan, planner)
            try:
                items = [(item.index, _describe(planner.resolve_data(item), arena)) for item in plan.items]
                request = {
                    "writer": type(self).__mro__[1],
                    "path": str(self.path),
                    "sync_files": self.sync_files,
                    "plan": plan,
                    "items": items,
                    "arena_size": arena.size,
                    "polite": polite_writes.engages_here(),
                }  # host-only: a loop on the host's cores
                results, written = helper().write(request, arena.fd)
            finally:
                arena.close()
                self._arena = None
            if self.written is not None:
                self.written.update(written)
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(results)
            return future

    return OutOfProcessWriter


def _describe(data: Any, arena: Arena) -> tuple:
    """How the helper finds one write item's data: in the arena, or (rarely) sent along."""
    if isinstance(data, io.BytesIO):
        return ("bytes", data.getvalue())
    if arena.holds(data):
        return ("arena", data.dtype, tuple(data.shape), tuple(data.stride()), data.storage_offset())
    return ("tensor", data.detach().cpu().clone())


# ---- the helper process, seen from the training process ---------------------------------------------
CLOSE_WAIT_S = 600.0  # how long exit waits for a write in flight


class Helper:
    """One helper process and the socket to it; requests are answered one at a time."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = str(Path(__file__).resolve().parents[2])  # importable even from a source tree
        start = (
            f"import sys; sys.path.insert(0, {package_root!r}); "
            f"from phalanx.checkpoint.writer_process import main; main({theirs.fileno()})"
        )
        # its own session: a signal to the training process's group (Ctrl-C, an agent stopping workers)
        # must not end a write the training process still waits for; it ends when the socket closes
        self.process = subprocess.Popen(
            [sys.executable, "-c", start], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        try:
            os.setpriority(os.PRIO_PROCESS, self.process.pid, NICENESS)
        except OSError:  # not permitted or not supported: the helper still works, at normal priority
            pass
        self.socket = mine
        self.lock = threading.Lock()  # held from a request to its answer, and by close()
        self.closed = False

    def write(self, request: dict, fd: int) -> tuple[list, dict]:
        with self.lock:
            if self.closed:  # a save whose thread took this helper just before the exit closed it
                raise RuntimeError(
                    f"the checkpoint writer process (pid {self.process.pid}) was closed before "
                    "this write: the process is exiting"
                )
            try:
                _send(self.socket, request, [fd])
                reply = _recv(self.socket)[0]
            except OSError as error:
                reply = None
                cause: BaseException | None = error
            else:
                cause = None
            if reply is None:
                code = self.process.poll()
                raise RuntimeError(
                    f"the checkpoint writer process (pid {self.process.pid}) is gone"
                    f"{f' (exit code {code})' if code is not None else ''}: {cause or 'no answer'}"
                )
        status, *rest = reply
        if status == "error":
            raise rest[0]
        return rest[0], rest[1]

    def close(self) -> None:
        """End the helper once a write in flight has finished (closing under it fails the save). A
        write asked for afterwards fails at once: the lock is released, never kept."""
        locked = self.lock.acquire(timeout=CLOSE_WAIT_S)
        if not locked:
            print(
                f"phalanx: the checkpoint writer process (pid {self.process.pid}) did not finish its write "
                f"in {CLOSE_WAIT_S:.0f} s; stopping it",
                file=sys.stderr,
                flush=True,
            )
        try:
            self.closed = True
            self.socket.close()  # the helper ends at end of input
        finally:
            if locked:
                self.lock.release()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_helpers: dict[int, Helper] = {}
_helpers_lock = threading.Lock()


def helper() -> Helper:
    """This process's helper, started on first use (a forked child starts its own). It ends when
    `close_helper` says so, or at the end of its input when this process ends."""
    with _helpers_lock:
        found = _helpers.get(os.getpid())
        if found is not None and found.process.poll() is not None:  # it died: the next save gets a new one
            found.socket.close()
            found = None
        if found is None:
            found = _helpers[os.getpid()] = Helper()
        return found


def close_helper() -> None:
    """End this process's helper, after the write it is doing. The checkpointer calls it at exit
    once its last async save is published: the save's thread starts the helper, so an exit hook
    registered then would run before the wait for that save (atexit runs the last registered
    first), close the helper before the save had used it, and the save would start a second one."""
    with _helpers_lock:
        found = _helpers.pop(os.getpid(), None)
    if found is not None:
        found.close()


# ---- the wire: length-prefixed pickles, with file descriptors beside the length --------------------
def _send(sock: socket.socket, obj: Any, fds: list[int]) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [struct.pack("!Q", len(data))], fds)
    sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """(object, fds); (None, []) at end of input."""
    header, fds, _, _ = socket.recv_fds(sock, 8, 4)
    if not header:
        return None, []
    header += _exactly(sock, 8 - len(header))
    (size,) = struct.unpack("!Q", header)
    return pickle.loads(_exactly(sock, size)), list(fds)


def _exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end closed mid-message")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# ---- the helper process itself -------------------------------------------------------------------
class _Resolved:
    """The planner DCP's writer asks for each item's data: here, views of the arena."""

    def __init__(self, items: dict):
        self.items = items

    def resolve_data(self, item: Any) -> Any:
        return self.items[item.index]


def _write(request: dict, fds: list[int], watch: polite_writes.LoopWatch) -> tuple[list, dict]:
    from phalanx.checkpoint.hashing_fs import hashing

    storage = _map(fds[0], request["arena_size"])
    items = {}
    for index, desc in request["items"]:
        if desc[0] == "arena":
            items[index] = _in_arena(storage, *desc[1:])
        elif desc[0] == "bytes":
            items[index] = io.BytesIO(desc[1])
        else:
            items[index] = desc[1]
    writer = request["writer"](request["path"], sync_files=request["sync_files"])
    writer.per_thread_copy_ahead = 0  # the data is in memory already
    written: dict = {}
    writer.fs = hashing(writer.fs, written)
    if request["polite"]:
        writer.fs = polite_writes.polite(writer.fs, watch)
    future = writer.write_data(request["plan"], _Resolved(items))
    return future.wait(), written


def _in_arena(
    storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int
) -> torch.Tensor:
    """The staged tensor at `offset` (elements) of the arena. A contiguous one gets a storage of its
    own bytes (a slice of the arena's, the same memory): DCP's writer clones a tensor whose storage
    is larger than itself, 48 MB of copying for a 48 MB save."""
    staged = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    if not staged.is_contiguous():
        return staged
    start = offset * staged.element_size()
    return torch.empty(0, dtype=dtype).set_(storage[start : start + staged.nbytes], 0, shape, stride)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - e.g. a botocore error with required constructor arguments
        return RuntimeError(f"{type(error).__name__}: {error}")


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process decides when to stop: see Helper
    torch.set_num_threads(1)
    _run_when_idle()
    watch = polite_writes.LoopWatch(os.getppid())  # the training process that started this helper
    sock = socket.socket(fileno=fd)
    while True:
        try:
            request, fds = _recv(sock)
        except OSError:  # the training process died with our last answer unread (connection reset)
            return
        if request is None:
            return
        try:
            reply: tuple = ("ok", *_write(request, fds, watch))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the training process
            reply = ("error", _picklable(error))
        finally:
            for received in fds:
                os.close(received)
        try:
            _send(sock, reply, [])
        except OSError:  # the training process is gone: nobody is waiting for the answer
            return


def _run_when_idle() -> None:
    """Linux's SCHED_IDLE: the helper takes a core only when nothing else would run on it, not even
    a niced process. At nice 19 it still got time slices beside a training loop that used every
    core (the loop's step 1.14x slower during a save on 2 cores); idle-class, it writes in the loop's
    waits (collectives, data), and a save the loop waits for (the next one, the exit, a preemption)
    gets the cores the loop leaves idle while it waits. Every thread: a policy is a thread's own,
    and importing torch has started one already."""
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # not permitted (a restricted container), or a thread that ended: nice 19 stays
            pass

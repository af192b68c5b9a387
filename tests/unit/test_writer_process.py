"""The async checkpoint writer process (checkpoint/writer_process.py): closing it lets a write in
flight finish instead of closing the socket under it (a fresh-clone CI run once lost the last async
save of tests/checkpoint/test_resume.py that way); its staged tensors are not copied again; every
thread of it runs idle-class; it ends quietly when the training process dies mid-conversation."""

import threading

import pytest

from phalanx.checkpoint import writer_process

pytestmark = pytest.mark.skipif(not writer_process.supported(), reason="the writer process needs Linux's memfd")


def test_close_waits_for_a_write_in_flight():
    helper = writer_process.Helper()
    helper.lock.acquire()  # what Helper.write holds from its request to its reply
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (helper.close(), closed.set()))
    closer.start()
    try:
        assert not closed.wait(0.5), "close() went ahead while a write was in flight"
        assert helper.socket.fileno() != -1
    finally:
        helper.lock.release()
    closer.join(60)
    assert closed.is_set() and helper.socket.fileno() == -1
    assert helper.process.poll() == 0  # the helper ended at the end of its input


def test_a_staged_tensor_gets_a_storage_of_its_own_bytes_so_dcp_does_not_clone_it():
    import torch

    arena = torch.arange(64, dtype=torch.float32).untyped_storage()
    staged = writer_process._in_arena(arena, torch.float32, (2, 3), (3, 1), 10)
    assert staged.tolist() == [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]
    assert staged.untyped_storage().nbytes() == staged.nbytes  # DCP clones where these differ
    assert staged.data_ptr() == arena.data_ptr() + 10 * 4  # the arena's memory, not a copy
    strided = writer_process._in_arena(arena, torch.float32, (2, 2), (1, 2), 4)  # not contiguous: as staged
    assert strided.tolist() == [[4.0, 6.0], [5.0, 7.0]]
    assert strided.untyped_storage().nbytes() == arena.nbytes()
    empty = writer_process._in_arena(arena, torch.float32, (0, 3), (3, 1), 8)
    assert empty.shape == (0, 3) and empty.untyped_storage().nbytes() == 0


def test_every_thread_of_the_helper_runs_idle_class():
    import os

    helper = writer_process.Helper()
    try:
        # the helper sets its policy once it has started; ask until its threads say so
        policies = set()
        for _ in range(600):
            tids = os.listdir(f"/proc/{helper.process.pid}/task")
            policies = {os.sched_getscheduler(int(tid)) for tid in tids}
            if policies == {os.SCHED_IDLE}:
                break
            threading.Event().wait(0.05)
        assert policies == {os.SCHED_IDLE}, f"{len(tids)} threads, policies {policies}"
    finally:
        helper.close()


def test_the_helper_ends_quietly_when_the_training_process_dies_with_its_answer_unread():
    """A rank killed with the helper's answer unread resets the connection: the helper ends without
    a traceback on the job's stderr (it printed a ConnectionResetError into about half the runs of
    tests/checkpoint/test_resume.py's killed fixture)."""
    import select
    import socket
    import subprocess
    import sys

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    start = f"from phalanx.checkpoint.writer_process import main; main({theirs.fileno()})"
    helper = subprocess.Popen([sys.executable, "-c", start], pass_fds=[theirs.fileno()], stderr=subprocess.PIPE)
    theirs.close()
    writer_process._send(mine, {"not": "a request"}, [])  # answered with an error
    assert writer_process._recv(mine)[0][0] == "error"
    writer_process._send(mine, {"not": "a request"}, [])
    assert select.select([mine], [], [], 120)[0]  # its answer has arrived ...
    mine.close()  # ... unread: the helper's next read is a reset, not an end of input
    _, err = helper.communicate(timeout=120)
    assert helper.returncode == 0 and err == b"", err.decode()


def test_a_write_that_comes_after_close_fails_at_once_instead_of_waiting_forever():
    """close() used to keep the helper's lock: a save whose thread had taken the helper just before
    the exit closed it then waited for that lock forever, and the exit for the save (an exit-phase
    hang no watchdog ends). Now such a write fails with its cause."""
    import os

    helper = writer_process.Helper()
    helper.close()
    outcome: list = []

    def write() -> None:
        fd = os.memfd_create("test")
        try:
            helper.write({"not": "a request"}, fd)
            outcome.append("written")
        except RuntimeError as error:
            outcome.append(str(error))
        finally:
            os.close(fd)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(60)
    assert not writer.is_alive(), "a write after close() waits forever"
    assert outcome == [
        f"the checkpoint writer process (pid {helper.process.pid}) was closed before this write: the process is exiting"
    ]

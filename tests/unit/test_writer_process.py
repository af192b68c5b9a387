"""The async checkpoint writer process (checkpoint/writer_process.py) at exit: its atexit close is
registered at the first save, so it runs before the facade's exit hook that waits for the save in
flight; it must let that write finish instead of closing the socket under it (a fresh-clone CI run
lost the last async save of tests/checkpoint/test_resume.py that way)."""
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

"""StepBuffers: a freed buffer is handed on to the next request of its size and dtype, one in use never
is, at most `keep` unused ones are held, and every buffer is dropped when the root's forward ends
(raising or not, under no_grad too) and when the backward pass that took one ends."""

from __future__ import annotations

import torch

from phalanx.host_only.step_buffers import StepBuffers


def test_a_freed_buffer_is_handed_on_to_the_next_of_its_size_and_dtype():
    buffers = StepBuffers()
    first = buffers.take((4, 8), torch.float32, torch.device("cpu"))
    address = first.data_ptr()
    del first
    again = buffers.take((32,), torch.float32, torch.device("cpu"))
    assert again.data_ptr() == address and again.shape == (32,)
    other_dtype = buffers.take((32,), torch.float64, torch.device("cpu"))
    assert other_dtype.data_ptr() != address
    assert (buffers.fresh, buffers.reused) == (2, 1)


def test_a_buffer_in_use_is_never_handed_out_again_even_through_a_view():
    buffers = StepBuffers()
    first = buffers.take((16,), torch.float32, torch.device("cpu"))
    chunk = first.view(4, 4)[1]  # what a collective's caller keeps: a view, not the tensor
    address = first.data_ptr()
    del first
    second = buffers.take((16,), torch.float32, torch.device("cpu"))
    assert second.data_ptr() != address and buffers.reused == 0
    second_address = second.data_ptr()
    del chunk, second
    assert buffers.take((16,), torch.float32, torch.device("cpu")).data_ptr() in (address, second_address)
    assert (buffers.fresh, buffers.reused) == (2, 1)


def test_at_most_keep_unused_buffers_are_held_the_least_recently_used_dropped_first():
    buffers = StepBuffers(keep=2)
    cpu = torch.device("cpu")
    addresses = {}
    for n in (10, 20, 30):
        addresses[n] = buffers.take((n,), torch.float32, cpu).data_ptr()  # freed at once
    assert len(buffers) == 3  # 2 kept unused, and the one handed out last
    assert buffers.take((20,), torch.float32, cpu).data_ptr() == addresses[20]  # 10 dropped first
    assert buffers.take((30,), torch.float32, cpu).data_ptr() == addresses[30]
    assert len(buffers) == 2
    buffers.take((10,), torch.float32, cpu)
    assert (buffers.fresh, buffers.reused) == (4, 2)


class _Gathers(torch.nn.Module):
    """A root whose forward takes buffers as its units' gathers do, keeping none of them in use."""

    def __init__(self, buffers: StepBuffers, fail: bool = False):
        super().__init__()
        self.buffers, self.fail, self.kept = buffers, fail, []

    def forward(self, x):
        for size in (64, 64, 32):
            self.buffers.take((size,), torch.float32, torch.device("cpu"))
        self.kept.append(len(self.buffers))
        if self.fail:
            raise RuntimeError("a forward that fails")
        return x


def test_the_buffers_are_dropped_when_the_roots_forward_ends_even_when_it_raises():
    buffers = StepBuffers()
    root = _Gathers(buffers)
    buffers.release_after_forward(root)
    with torch.no_grad():  # evaluation: no backward will come to drop them
        root(torch.ones(1))
    root(torch.ones(1))
    assert root.kept == [2, 2] and len(buffers) == 0 and buffers.reused == 2  # the second 64 reused the first
    failing = _Gathers(buffers, fail=True)
    buffers.release_after_forward(failing)
    try:
        failing(torch.ones(1))
    except RuntimeError:
        pass
    assert failing.kept == [2] and len(buffers) == 0


class _TakesInBackward(torch.autograd.Function):
    """Takes two buffers of one size in backward, the first freed before the second, as a unit's
    gather and its reduction do; records their addresses."""

    @staticmethod
    def forward(ctx, x, buffers, seen):
        ctx.buffers, ctx.seen = buffers, seen
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        for _ in range(2):
            ctx.seen.append(ctx.buffers.take((64,), torch.float32, torch.device("cpu")).data_ptr())
        ctx.seen.append(len(ctx.buffers))
        return grad * 2, None, None


def test_every_buffer_is_dropped_when_the_backward_that_took_them_ends():
    buffers = StepBuffers()
    for step in range(2):
        x = torch.ones(3, requires_grad=True)
        forward_buffer = buffers.take((64,), torch.float32, torch.device("cpu")).data_ptr()  # the forward's gather
        seen: list[int] = []
        _TakesInBackward.apply(x, buffers, seen).sum().backward()
        assert seen == [forward_buffer, forward_buffer, 1], (step, seen)  # handed on within the step
        assert len(buffers) == 0  # dropped at the end of the backward, every step
        assert torch.equal(x.grad, torch.full((3,), 2.0))

"""The device-side input pipeline: the prefetcher keeps the source's order and its resumable
position, passes batches through on the CPU, and on CUDA overlaps the copies without a
host sync; synthetic batches made on the device are a pure function of (seed, index)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from perfrun.data.device_prefetch import DevicePrefetcher
from perfrun.data.device_synthetic import DeviceSyntheticStream, batch_seed
from perfrun.data.handoff_timer import HandOffTimer

CPU = torch.device("cpu")


class Counted:
    """A real DataLoader's batches from batch ``start`` on, and how many were read from it:
    the resumable position, as the trainer's batch stream keeps it."""

    def __init__(self, tokens: torch.Tensor, batch: int, start: int = 0) -> None:
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
        self._it = iter(loader)
        for _ in range(start):
            next(self._it)
        self.read = start

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = next(self._it)
        self.read += 1
        return tuple(batch)


def windows(n: int = 12, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (n, seq + 1), generator=torch.Generator().manual_seed(0))


def test_cpu_is_a_pass_through() -> None:
    source = [(torch.arange(3) + i, torch.arange(3) - i) for i in range(4)]
    pre = DevicePrefetcher(source, CPU)
    assert not pre.ahead
    got = list(pre)
    assert all(a is x and b is y for (a, b), (x, y) in zip(got, source, strict=True))  # the same tensors
    assert pre.handed == 4


@pytest.mark.parametrize("ahead", [False, True])
def test_order_and_position_are_the_sources(ahead: bool) -> None:
    tokens = windows()
    want = list(Counted(tokens, 2))
    source = Counted(tokens, 2)
    pre = DevicePrefetcher(source, CPU, position=lambda: source.read, ahead=ahead)
    assert pre.position() == 0
    for k, (x, y) in enumerate(pre, start=1):
        assert torch.equal(x, want[k - 1][0]) and torch.equal(y, want[k - 1][1])
        assert pre.position() == k  # the batch read ahead is not counted
        assert source.read == (min(k + 1, len(want)) if ahead else k)
    assert pre.handed == len(want) == 6
    with pytest.raises(StopIteration):  # and it stays exhausted
        next(pre)


def test_resuming_from_the_position_continues_exactly() -> None:
    tokens = windows()
    whole = [x for x, _ in DevicePrefetcher(Counted(tokens, 2), CPU, ahead=True)]
    source = Counted(tokens, 2)
    pre = DevicePrefetcher(source, CPU, position=lambda: source.read, ahead=True)
    first = [next(pre)[0] for _ in range(4)]
    saved = pre.position()  # what a checkpoint after step 4 stores
    resumed = Counted(tokens, 2, start=saved)
    rest = [x for x, _ in DevicePrefetcher(resumed, CPU, position=lambda: resumed.read, ahead=True)]
    assert len(first + rest) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, whole, strict=True))


@pytest.mark.gpu
def test_cuda_overlap_hands_over_exact_values_without_a_host_sync() -> None:
    """Step k reads its batch while batch k+1 is copied, over many batches, with the
    allocator free to reuse memory: every batch's sum on the GPU equals the host's."""
    device = torch.device("cuda")
    tokens = windows(64, 512)
    host = list(Counted(tokens, 4))
    source = Counted(tokens, 4)
    pre = DevicePrefetcher(source, device, position=lambda: source.read)
    assert pre.ahead
    work = torch.randn(1024, 1024, device=device)
    sums = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in pre:
            for _ in range(4):  # a step long enough for the next copy to run beside it
                work = torch.tanh(work @ work)
            sums.append(torch.stack([x.sum(), y.sum()]))  # queued behind the step's work
            del x, y  # the memory may go to a later copy once this step's work is done
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = torch.stack(sums).cpu()
    want = torch.stack([torch.stack([x.sum(), y.sum()]) for x, y in host])
    assert torch.equal(got, want)
    assert pre.position() == len(host)


@pytest.mark.gpu
def test_the_gpu_wait_counts_a_host_late_with_its_batch_not_one_that_kept_up() -> None:
    """The hand-off timer's two events sit on the compute stream with nothing between them:
    a host that reads its batch after the GPU ran dry shows that idle time; a host that
    read it while the GPU was still busy with queued work shows (almost) none."""
    device = torch.device("cuda")
    timer = HandOffTimer(device)
    torch.cuda.synchronize()  # the GPU has nothing queued: it waits for the host from now on
    with timer.hand_off():
        time.sleep(0.05)  # a slow source: at least 50 ms during which the GPU has no work
    work = torch.randn(4096, 4096, device=device)
    for _ in range(100):  # queued work the host returns from at once (a step the GPU is busy with)
        work = torch.tanh(work @ work)
    with timer.hand_off():
        pass  # the batch was ready: the host is back before the GPU reaches the hand-off
    torch.cuda.synchronize()
    late, kept_up = timer.pop_ms()
    assert late >= 45.0  # the sleep is a lower bound, whatever else the machine does
    assert kept_up < late
    assert timer.pop_ms() == []


def test_off_cuda_the_hand_off_timer_times_nothing() -> None:
    timer = HandOffTimer(CPU)
    with timer.hand_off():
        pass
    assert timer.pop_ms() is None


def stream(**kw: int) -> DeviceSyntheticStream:
    args = {"vocab_size": 50, "seq_len": 6, "batch_size": 4, "seed": 7}
    return DeviceSyntheticStream(device=CPU, **{**args, **kw})


def test_synthetic_same_seed_and_index_give_the_same_batch() -> None:
    a, b = stream(), stream()
    x, y = a.batch(3)
    assert torch.equal(x, b.batch(3)[0]) and torch.equal(y, b.batch(3)[1])
    assert not torch.equal(x, a.batch(4)[0]) and not torch.equal(x, stream(seed=8).batch(3)[0])
    assert not torch.equal(x, stream(stream=1).batch(3)[0])  # val draws apart from train
    assert x.shape == (4, 6) and x.dtype == torch.int64 and x.device == CPU
    assert int(x.min()) >= 0 and int(x.max()) < 50
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token


def test_synthetic_resume_at_k_gives_what_the_uninterrupted_stream_gives() -> None:
    whole = stream()
    batches = [whole.next() for _ in range(6)]
    assert whole.position() == {"epoch": 0, "consumed": 24}
    resumed = stream(consumed=3 * 4)
    for k in range(3, 6):
        x, y = resumed.next()
        assert torch.equal(x, batches[k][0]) and torch.equal(y, batches[k][1])
    with pytest.raises(ValueError, match="not a whole number of global batches"):
        stream(consumed=5)


def test_synthetic_ranks_together_see_the_batch_of_one_process() -> None:
    one = stream(batch_size=4).batch(2)[0]
    ranks = [stream(batch_size=2, rank=r, world=2).batch(2)[0] for r in range(2)]
    assert torch.equal(torch.stack(ranks, dim=1).reshape(4, 6), one)
    assert batch_seed(7, 0, 2) == batch_seed(7 - 2**64, 0, 2)  # seeds wrap as the host source's do


@pytest.mark.gpu
def test_synthetic_on_cuda_is_reproducible_and_does_not_sync() -> None:
    device = torch.device("cuda")
    args = {"vocab_size": 50257, "seq_len": 1024, "batch_size": 16, "seed": 1}
    a, b = DeviceSyntheticStream(device=device, **args), DeviceSyntheticStream(device=device, **args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        xs = [a.next()[0] for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert xs[0].device.type == "cuda" and not torch.equal(xs[0], xs[1])
    assert torch.equal(xs[2], b.batch(2)[0])

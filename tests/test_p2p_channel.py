"""Point-to-point: recycled receive buffers never change a result, and sends never copy.

The pool's rule (reuse a buffer only when nothing references its storage) is checked on the
holders that matter (a detached view, an autograd graph, deferred weight gradients' saved
tensors), then end to end: runtimes whose ranks reuse buffers equal the emulator bitwise
over several iterations, and the same run with a pool that reuses too early does not (so
the comparison would catch such a bug).
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.pipeline.comm import Message, MsgKind
from megatron.pipeline.runtime.transport.distributed import P2PChannel
from megatron.pipeline.runtime.transport.recv_buffers import ReceiveBuffers
from tests.async_helpers import emulate, final_params, run_pretrain, tiny_args

CPU = torch.device("cpu")
SHAPE = (4, 1, 8)


def _received(pool: ReceiveBuffers, value: float) -> torch.Tensor:
    """A receive through ``pool``: take a buffer, 'receive' ``value`` into it, lend it."""
    buf = pool.take(SHAPE, torch.float32, CPU)
    buf.fill_(value)
    return pool.lend(buf)


def test_buffer_is_reused_only_after_every_holder_let_go() -> None:
    pool = ReceiveBuffers()
    x = _received(pool, 1.0).detach().requires_grad_(True)  # what the worker stashes
    y = (x * x).sum()  # autograd saves x
    del x
    assert pool.free_count() == 0  # the graph still reads it
    y.backward()
    assert pool.free_count() == 0  # the graph is alive while y is
    del y
    assert pool.free_count() == 1
    before = pool.allocated
    again = _received(pool, 2.0)
    assert pool.allocated == before and pool.taken == 2  # reused, not allocated


def test_a_view_or_a_deferred_holder_keeps_the_buffer() -> None:
    pool = ReceiveBuffers()
    grad = _received(pool, 3.0)
    kept = [grad[1:3]]  # e.g. a deferred weight gradient's saved slice
    del grad
    second = _received(pool, 4.0)
    assert pool.allocated == 2  # the first buffer was not handed out again
    assert torch.equal(kept[0], torch.full((2, 1, 8), 3.0)) and torch.equal(second, torch.full(SHAPE, 4.0))


def test_a_buffer_with_a_receive_pending_is_never_reclaimed() -> None:
    pool = ReceiveBuffers()
    pending = pool.take(SHAPE, torch.float32, CPU)  # posted, not yet lent: only the pool sees it
    other = pool.take(SHAPE, torch.float32, CPU)
    assert other.untyped_storage().data_ptr() != pending.untyped_storage().data_ptr()


def test_kinds_do_not_mix_and_reuse_can_be_switched_off() -> None:
    pool = ReceiveBuffers()
    assert pool.reuses  # this torch can count a storage's references (else reuse is silently off)
    del_me = pool.lend(pool.take(SHAPE, torch.float32, CPU))
    del del_me
    assert pool.take(SHAPE, torch.float64, CPU).dtype == torch.float64 and pool.allocated == 2
    off = ReceiveBuffers(reuse=False)
    for _ in range(3):
        off.lend(off.take(SHAPE, torch.float32, CPU))
    assert not off.reuses and off.allocated == 3


# -- sends never copy -------------------------------------------------------------------
def _act(mb: int, src: int, dst: int) -> Message:
    return Message(MsgKind.ACT, mb, src, dst, 0, 0 if src != dst else 1)


class _DoneWork:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _channel(monkeypatch: pytest.MonkeyPatch, sent: list[torch.Tensor], payloads: list[float]) -> P2PChannel:
    """A stage-1 channel whose isend records the tensor it is handed and whose irecv
    'receives' the next of ``payloads``: the channel's own logic, no peer needed."""
    worker = SimpleNamespace(setup=SimpleNamespace(device=CPU), recv_spec=lambda msg: (SHAPE, torch.float32))
    groups = SimpleNamespace(peer=lambda stage: stage, p2p_group=lambda src, dst, lane: None)

    def isend(tensor: torch.Tensor, dst: int, group: object = None) -> _DoneWork:
        sent.append(tensor)
        return _DoneWork()

    def irecv(tensor: torch.Tensor, src: int, group: object = None) -> _DoneWork:
        tensor.fill_(payloads.pop(0))
        return _DoneWork()

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    return P2PChannel(worker, groups, timedelta(seconds=5))  # type: ignore[arg-type]


def test_sends_hand_the_stage_tensor_itself_to_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[torch.Tensor] = []
    channel = _channel(monkeypatch, sent, [])
    act = torch.randn(SHAPE)
    channel.send(_act(0, 1, 2), act)
    local = torch.randn(SHAPE)
    channel.send(_act(1, 1, 1), local)  # a stage sending to itself
    channel.flush()
    assert sent[0] is act  # no .contiguous() copy
    assert channel.wait(_act(1, 1, 1)) is local  # no clone
    transposed = torch.randn(8, 1, 4).transpose(0, 2)  # the only case that needs one copy
    channel.send(_act(2, 1, 2), transposed)
    channel.flush()
    assert sent[1].is_contiguous() and torch.equal(sent[1], transposed)


def test_channel_receives_into_recycled_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _channel(monkeypatch, [], [1.0, 2.0, 3.0])
    msgs = [_act(mb, 0, 1) for mb in range(3)]
    for m in msgs[:2]:
        channel.post(m)
    held = channel.wait(msgs[0])  # still held (stashed for its backward)
    assert torch.equal(channel.wait(msgs[1]), torch.full(SHAPE, 2.0))  # dropped at once
    channel.post(msgs[2])
    assert torch.equal(channel.wait(msgs[2]), torch.full(SHAPE, 3.0))
    assert torch.equal(held, torch.full(SHAPE, 1.0))  # not overwritten by the third receive
    assert channel.buffers.taken == 3 and channel.buffers.allocated == 2  # the second buffer served the third


# -- end to end: reuse never changes a run --------------------------------------------
DRIVER = "tests/p2p_buffers_driver.py"
# Received tensors outlive their op: gpipe's last stage stashes all m activations until the
# backwards (more than the 4 receives posted ahead, so buffers are reclaimed while others are
# held), zb-h1's deferred W keeps received gradients until it runs.
RUNS = {
    "gpipe-N2-m8": tiny_args(2, "gpipe", 8, 3),
    "zb-h1-N2-m4": tiny_args(2, "zb-h1", 4, 3),
}


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], mode: str) -> tuple[list[dict], dict, list[dict]]:
    stats = tmp_path / f"stats-{mode}"
    stats.mkdir()
    monkeypatch.setenv("P2P_BUFFERS_MODE", mode)
    monkeypatch.setenv("P2P_BUFFERS_STATS", str(stats))
    records, params = run_pretrain(argv, tmp_path / mode, script=DRIVER)
    pools = [json.loads(line) for f in sorted(stats.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    return records, params, pools


def _emulated(tmp_path: Path, argv: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    log = tmp_path / "emu.jsonl"
    workers = emulate([*argv, "--pipeline-executor", "emulator", "--log-json", str(log)])
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()], final_params(workers)


@pytest.mark.parametrize("case", list(RUNS))
def test_runtime_with_recycled_buffers_equals_emulator_bitwise(megatron_world1, tmp_path, monkeypatch, case):
    argv = RUNS[case]
    records, params, pools = _run(tmp_path, monkeypatch, argv, "pool")
    assert sum(p["allocated"] for p in pools) < sum(p["taken"] for p in pools), pools  # buffers were reused
    assert sum(p["sends"] for p in pools) > 0 and sum(p["copies"] for p in pools) == 0, pools  # stages send contiguous tensors
    losses, emu_params = _emulated(tmp_path, argv)
    assert [r["loss"] for r in records] == losses
    assert params.keys() == emu_params.keys()
    for name, value in params.items():
        assert torch.equal(value, emu_params[name]), name


def test_reusing_a_held_buffer_is_caught_by_the_comparison(megatron_world1, tmp_path, monkeypatch):
    argv = RUNS["gpipe-N2-m8"]
    records, params, _ = _run(tmp_path, monkeypatch, argv, "unsafe")
    losses, emu_params = _emulated(tmp_path, argv)
    differs = [r["loss"] for r in records] != losses or any(
        not torch.equal(value, emu_params[name]) for name, value in params.items())
    assert differs, "a pool that overwrites stashed activations went unnoticed"


# -- CUDA / NCCL (skipped without a GPU; see docs/gpu.md section 4) ------------------------
gpu = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@gpu
def test_recycled_cuda_buffer_waits_for_kernels_still_reading_it() -> None:
    """The ordering reuse relies on under NCCL: a kernel reading a received buffer may still be
    queued when its last reference is dropped; the next receive into the recycled buffer runs
    on another stream made to wait for the compute stream when it is posted (what
    ProcessGroupNCCL does for every P2P op), so the queued reader sees the old data."""
    device = torch.device("cuda")
    pool = ReceiveBuffers()
    buf = pool.take((2048, 2048), torch.float32, device)
    buf.copy_(torch.arange(2048 * 2048, dtype=torch.float32, device=device).view(2048, 2048) / 2**22)
    expected = buf.double().cpu()
    expected = (expected @ expected).sum()
    received = pool.lend(buf)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy so the reader is still queued
    result = (received @ received).double().sum()  # queued, not yet run
    del received
    again = pool.take((2048, 2048), torch.float32, device)
    assert again.data_ptr() == buf.data_ptr()  # recycled while its reader is queued
    comm = torch.cuda.Stream(device)
    comm.wait_stream(torch.cuda.current_stream(device))  # NCCL's syncStream at posting
    with torch.cuda.stream(comm):
        again.fill_(float("nan"))  # the "receive" into the recycled buffer
    torch.cuda.synchronize(device)
    assert torch.isclose(result.cpu(), expected, rtol=1e-4), (float(result), float(expected))


def _nccl_rank(rank: int, store: str, out: str) -> None:
    """Stage ``rank`` of a two-stage NCCL link through :class:`P2PChannel`: stage 0 sends six
    activations, each produced by a kernel still running when it is sent; stage 1 receives
    them two ahead, keeps every other one (a stash) and drops the rest."""
    import datetime

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60), device_id=device)
    try:
        worker = SimpleNamespace(setup=SimpleNamespace(device=device), recv_spec=lambda msg: ((1024, 1024), torch.float32))
        groups = SimpleNamespace(peer=lambda stage: stage, p2p_group=lambda src, dst, lane: None)
        channel = P2PChannel(worker, groups, timedelta(seconds=60))  # type: ignore[arg-type]
        msgs = [_act(mb, 0, 1) for mb in range(6)]
        if rank == 0:
            for mb, msg in enumerate(msgs):
                torch.cuda._sleep(50_000_000)  # the producing kernel is still queued at isend
                channel.send(msg, torch.full((1024, 1024), float(mb), device=device) + 0.0)
            channel.flush()
            return
        held, seen = {}, []
        for msg in msgs[:2]:
            channel.post(msg)
        for mb, msg in enumerate(msgs):
            got = channel.wait(msg)
            seen.append(float(got.mean()))
            if mb % 2 == 0:
                held[mb] = got
            del got
            if mb + 2 < len(msgs):
                channel.post(msgs[mb + 2])
        kept = {mb: float(t.mean()) for mb, t in held.items()}
        Path(out).write_text(json.dumps({"seen": seen, "kept": kept, "taken": channel.buffers.taken,
                                         "allocated": channel.buffers.allocated}))
    finally:
        dist.destroy_process_group()


@gpu
@two_gpus
def test_nccl_channel_recycles_buffers_without_corrupting_held_ones(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "stage1.json"
    mp.start_processes(_nccl_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True, start_method="spawn")
    result = json.loads(out.read_text())
    assert result["seen"] == [float(mb) for mb in range(6)]
    assert result["kept"] == {str(mb): float(mb) for mb in (0, 2, 4)}  # held buffers never reused
    assert result["allocated"] < result["taken"] == 6, result  # dropped ones were

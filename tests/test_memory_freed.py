"""A stage frees activations and gradients at their last op, not later (issue 18, memory).

The emulator runs a tiny two-stage GPT (each stage in the same process, the same
:class:`~megatron.pipeline.runtime.worker.StageWorker` as a distributed rank) with every worker's
ops wrapped. Each tensor whose last use is known gets a weak reference and a deadline, the op
after which nothing may hold it any more:

* the stage input ``x`` a forward stashed: its B (or BW);
* the last stage's logits (the LM head's output, which the cross-entropy turns into the
  softmax it saves): the micro-batch's B (or BW) -- a W only keeps the split linears' inputs and
  output gradients;
* a received output gradient: the micro-batch's W after a B (the last layer's linear keeps it as
  its ``dy``), its BW otherwise;
* what a B deferred for W: that W.

At every op entry all references past their deadline must be dead (plain reference counting, no
``gc.collect()``: a reference cycle would also delay the memory). Also checked: a forward that
sends frees its own copy of the output right away (the stash keeps only the graph), and after a
drained run the worker's bookkeeping and the activation meter are empty. Numerics with the freed
outputs are covered by the existing bitwise tests (the emulator against the non-pipelined
reference, B + W against BW).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch

from megatron.pipeline.ir import Op, OpKind
from tests.async_helpers import TINY_GPT

pytestmark = pytest.mark.usefixtures("megatron_world1")

Key = tuple[int, int, int]  # (stage, micro-batch, chunk)


class _NoReports:
    def submit(self, report, replica: int) -> None:
        pass


class LastUseTracker:
    """Weak references with deadlines over every worker's ops (see the module docstring)."""

    def __init__(self, workers) -> None:
        self.pending: list[tuple[weakref.ref, Key, OpKind, str]] = []  # (ref, key, deadline op kind, what)
        self.done: set[tuple[Key, OpKind]] = set()
        self.released_outputs = 0
        self.ops = 0
        self._logits: list[torch.Tensor] = []
        for worker in workers:
            self._wrap(worker)

    def expect_dead(self, tensor: torch.Tensor, key: Key, deadline: OpKind, what: str) -> None:
        self.pending.append((weakref.ref(tensor), key, deadline, what))

    def check(self) -> None:
        alive = [f"{what} of {key} after its {kind.value}" for ref, key, kind, what in self.pending
                 if (key, kind) in self.done and ref() is not None]
        assert not alive, f"kept past their last op: {alive}"

    def _wrap(self, worker) -> None:
        if worker.layout.is_last(worker.stage, worker.layout.num_chunks - 1):
            for chunk in worker.setup.chunks:
                chunk.model.output_layer.register_forward_hook(lambda mod, args, out: self._logits.append(out[0]))
        for name in ("forward", "backward", "backward_input", "weight_grad"):
            setattr(worker, name, self._around(worker, name, getattr(worker, name)))

    def _around(self, worker, name: str, run: Callable) -> Callable:
        def wrapped(op: Op, *received):
            self.check()
            self.ops += 1
            key = (worker.stage, op.microbatch, op.chunk)
            backward_done = OpKind.B if name == "backward_input" else OpKind.BW
            if name in ("backward", "backward_input") and received[0] is not None:
                self.expect_dead(received[0], key, OpKind.W if name == "backward_input" else OpKind.BW,
                                 "received output gradient")
            out = run(op, *received)
            if name == "forward":
                x, stashed, released = worker._stash[(op.microbatch, op.chunk)]
                if out is not None:  # sent: the stash keeps the graph, not the values
                    assert released and stashed.untyped_storage().nbytes() <= stashed.element_size()
                    self.released_outputs += 1
                for t in ([] if x is None else [x]):
                    self.expect_dead(t, key, OpKind.B, "stage input")
                    self.expect_dead(t, key, OpKind.BW, "stage input")
                for logits in self._logits:
                    self.expect_dead(logits, key, OpKind.B, "logits")
                    self.expect_dead(logits, key, OpKind.BW, "logits")
                self._logits.clear()
            elif name == "backward_input":
                deferred = worker._deferred.get((op.microbatch, op.chunk))
                for t in [] if deferred is None else deferred.tensors():
                    self.expect_dead(t, key, OpKind.W, "deferred x / dy")
            self.done.add((key, {"forward": OpKind.F, "backward": OpKind.BW,
                                 "backward_input": backward_done, "weight_grad": OpKind.W}[name]))
            return out
        return wrapped


def _workers(num_stages: int, microbatches: int):
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.training import build_worker
    from megatron.trainer.tasks.gpt import GPTTask

    config = parse_run_plan([
        *TINY_GPT, "--num-layers", str(2 * num_stages), "--pipeline-model-parallel-size", str(num_stages),
        "--global-batch-size", str(microbatches), "--train-iters", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--pipeline-executor", "emulator", "--device", "cpu",
    ])
    return [build_worker(GPTTask(), config, s, 0, torch.device("cpu"), isolate_rng=True) for s in range(num_stages)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tensors_die_at_their_last_op_and_a_drained_worker_holds_nothing(schedule: str) -> None:
    from megatron.pipeline.runtime.executors.common import ReportCadence
    from megatron.pipeline.runtime.executors.emulator import Emulator
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule

    stages, m = 2, 4
    workers = _workers(stages, m)
    tracker = LastUseTracker(workers)
    plan = build_schedule(schedule, ScheduleConfig(stages, m, 2))
    Emulator(workers, plan.layout, ReportCadence(1), _NoReports()).run(plan.streams())
    tracker.check()
    # The run exercised what it claims to: sends, logits, received gradients, deferred work.
    assert tracker.released_outputs == 2 * m  # stage 0's forwards, 2 iterations
    assert len([what for *_, what in tracker.pending if what == "logits"]) == 2 * 2 * m
    if schedule == "zb-h1":
        assert any(what == "deferred x / dy" for *_, what in tracker.pending)
    for worker in workers:
        assert not worker._stash and not worker._deferred and not worker._fwd_version
        assert not worker._losses and worker.meter.live_count == 0


def test_the_lm_head_saves_one_vocab_sized_buffer() -> None:
    """The last stage's largest activation, ``s * b * vocab`` fp32 per micro-batch, is saved once:
    megatron's cross-entropy turns the logits into the softmax in place and saves that (a copy,
    or logits kept next to a softmax or log-softmax, would double the stage's biggest buffer)."""
    from megatron.trainer.models.gpt import GPTModelArgs, build_gpt_stage, gpt_loss

    s, b, vocab = 16, 2, 2048
    args = GPTModelArgs(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=s,
                        max_position_embeddings=s, vocab_size=vocab)
    stage = build_gpt_stage(args, range(0, 1), False, True, 1, torch.device("cpu"))
    batch = {"labels": torch.randint(0, vocab, (b, s)), "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).expand(b, s)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = gpt_loss(stage(torch.randn(s, b, 32, requires_grad=True), batch), batch)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    vocab_sized = [n for ptr, n in saved.items() if n >= s * b * vocab * 4 and ptr not in params]
    assert vocab_sized == [s * b * vocab * 4], sorted(saved.values())[-4:]
    loss.backward()

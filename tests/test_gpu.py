"""What the first GPU session should run: the places where the CUDA/NCCL path differs from
CPU/gloo (``docs/gpu.md`` explains each one and names the torch source behind it).

Every test here but the parameter-count check and the NCCL stream model (``nccl_stream_model``,
a CPU run of the runtime's posting order against NCCL's one-stream-per-communicator
execution) carries the ``gpu`` marker, so ``tests/conftest.py`` skips it without CUDA.
Two-rank NCCL tests also need two GPUs (NCCL does not allow two ranks of one communicator on
one device); the Transformer Engine test needs ``transformer_engine``. Runs are tiny except
where messages should be realistic (``NCCL_MESSAGE_ARGS``: 8 MiB activations, above NCCL's
default buffer, so sends genuinely wait for their receivers and a leaked send is visible in the
allocator) and the GPT-2-medium throughput smoke.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.async_helpers import REPO, emulate, read_log, run_pretrain, tiny_args
from tests.test_fault_tolerance import _base_env, _free_port, _stop, _tail
from tests.test_gpt_stage import TINY, build_pipeline, run_pipeline

gpu = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="needs transformer_engine")

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# Activations [seq 512, micro-batch 8, hidden 512] fp32 = 8 MiB, above NCCL's default 4 MiB
# buffer, so a send cannot complete without its receiver running (docs/gpu.md, section 1), and
# one leaked send per micro-batch would show in the allocator peak.
NCCL_MESSAGE_ARGS = [
    "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
    "--vocab-size", "512", "--micro-batch-size", "8", "--global-batch-size", "32",
    "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "paci", "--lr", "1e-4",
    "--log-interval", "1", "--device", "cuda", "--distributed-backend", "nccl",
    "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2", *NO_DROPOUT,
]
ACTIVATION_MB = 512 * 8 * 512 * 4 / 2**20
# Deterministic cuBLAS; read when CUDA initialises, so it must be in the ranks' environment.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# --------------------------------------------------------------------- models on one GPU


@gpu
def test_bf16_stage_sdpa_close_to_fp32(megatron_world1):
    """The local spec (SDPA core attention, split linears) in bf16 on CUDA: forward and
    backward run, and the loss is the fp32 CPU pipeline's within bf16 rounding."""
    from megatron.trainer.data import MockGPTData
    from megatron.trainer.models.sdpa_attention import SDPAAttention

    local = dataclasses.replace(TINY, use_transformer_engine=False)
    bf16 = dataclasses.replace(local, bf16=True)
    gpu = build_pipeline(bf16, [2, 2], device="cuda")
    cpu = build_pipeline(local, [2, 2], device="cpu")
    assert any(isinstance(m, SDPAAttention) for m in gpu[0].modules())
    batch = MockGPTData(local.seq_length, local.vocab_size, seed=0).micro_batch([0, 1])
    gpu_loss, gpu_grads = run_pipeline(gpu, {k: v.cuda() for k, v in batch.items()})
    cpu_loss, cpu_grads = run_pipeline(cpu, batch)
    assert gpu_grads.keys() == cpu_grads.keys()
    assert all(g.is_cuda and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in gpu_grads.values())
    assert _relative(gpu_loss.item(), cpu_loss.item()) < 2e-2, (gpu_loss.item(), cpu_loss.item())


@gpu
@needs_te
def test_transformer_engine_stage_matches_local_spec(megatron_world1):
    """Transformer Engine's spec builds, initialises from the same global names as the local
    spec (so both start from the same values), and agrees with it within bf16 rounding."""
    from megatron.trainer.data import MockGPTData

    def stage(use_te: bool):
        return build_pipeline(dataclasses.replace(TINY, bf16=True, use_transformer_engine=use_te), [4], device="cuda")

    te, local = stage(True), stage(False)
    assert any("transformer_engine" in type(m).__module__ for m in te[0].modules())
    batch = {k: v.cuda() for k, v in MockGPTData(TINY.seq_length, TINY.vocab_size, seed=0).micro_batch([0, 1]).items()}
    te_loss, te_grads = run_pipeline(te, batch)
    local_loss, _ = run_pipeline(local, batch)
    assert all(torch.isfinite(g).all() for g in te_grads.values())
    assert _relative(te_loss.item(), local_loss.item()) < 2e-2, (te_loss.item(), local_loss.item())


@gpu
def test_emulator_on_cuda_matches_cpu(megatron_world1, tmp_path: Path):
    """All stages in one process on cuda:0 train to the CPU emulator's losses (fp32, no
    dropout: the emulator does not isolate the CUDA RNG per stage, docs/gpu.md F3). A small
    lr keeps Adam's sign-like first steps on near-zero gradients from amplifying rounding."""
    losses = {}
    for device in ("cpu", "cuda"):
        log = tmp_path / f"{device}.jsonl"
        emulate(tiny_args(2, "paci", 4, 3, "--device", device, "--lr", "1e-4", "--log-json", str(log), *NO_DROPOUT))
        losses[device] = [r["loss"] for r in read_log(log)]
    assert len(losses["cuda"]) == 3
    for cuda, cpu in zip(losses["cuda"], losses["cpu"]):
        assert _relative(cuda, cpu) < 1e-4, losses


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    gpu, pytest.mark.xfail(strict=True, reason="docs/gpu.md F3: the emulator does not swap the CUDA RNG")])])
def test_emulator_rng_rewind_repeats_dropout_masks(megatron_world1, device: str):
    """An emulator stage (``isolate_rng=True``) rewound to a saved RNG state draws the same
    dropout masks again, as post-validation's reruns and resumed runs require. Holds on CPU;
    on CUDA the masks come from the CUDA generator, which the emulator does not swap
    (docs/gpu.md F3): the cuda case is a strict xfail, so fixing F3 turns it into a failure
    that asks for the mark to go."""
    from megatron.pipeline.ir import Op, OpKind
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.training import build_worker

    parser = build_parser()
    GPTTask().add_arguments(parser)
    config = parse_run_plan(tiny_args(2, "1f1b", 2, 1, "--device", device, "--hidden-dropout", "0.5",
                                        "--attention-dropout", "0.5", "--pipeline-executor", "emulator"), parser)
    worker = build_worker(GPTTask(), config, 0, 0, torch.device(device), isolate_rng=True)
    op = Op(OpKind.F, 0, microbatch=0)
    state = worker.rng_state()
    first = worker.forward(op, None)
    worker.discard_forward(op)
    worker.set_rng_state(state)
    again = worker.forward(op, None)
    worker.discard_forward(op)
    other = worker.forward(op, None)  # the stream moved on: new masks
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# --------------------------------------------------------------------- device selection


@gpu
def test_resolve_device_sets_current_device_before_init(monkeypatch):
    """``run_distributed`` selects LOCAL_RANK's GPU before ``init_process_group`` and binds the
    process group to it (``device_id``: eager NCCL init), on every local rank."""
    from megatron.trainer.loop import training
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask

    class Stop(Exception):
        pass

    seen = []

    def fake_init(backend, **kwargs):
        seen.append((backend, torch.cuda.current_device(), kwargs.get("device_id")))
        raise Stop

    count = torch.cuda.device_count()
    monkeypatch.setattr(training.dist, "init_process_group", fake_init)
    parser = build_parser()
    GPTTask().add_arguments(parser)
    for local_rank in range(count + 1):  # the last one wraps around
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        config = parse_run_plan(tiny_args(1, "1f1b", 1, 1, "--device", "cuda"), parser)
        with pytest.raises(Stop):
            training.run_distributed(GPTTask(), config)
        backend, current, device_id = seen[-1]
        assert backend == "nccl" and current == local_rank % count
        assert device_id == torch.device("cuda", local_rank % count)
    torch.cuda.set_device(0)


@gpu
def test_single_rank_nccl_run(tmp_path: Path):
    """``pretrain_gpt.py`` on one GPU: NCCL world of one, eager init, allocator peak logged."""
    records, params = run_pretrain(
        tiny_args(1, "1f1b", 2, 2, "--device", "cuda", "--distributed-backend", "nccl"), tmp_path)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["peak_memory_mb"][0] > 0  # torch.cuda.max_memory_allocated, not the meter
    assert params and all(torch.isfinite(p).all() for p in params.values())


# --------------------------------------------------------------------- NCCL, two GPUs


@gpu
@two_gpus
@pytest.mark.parametrize("schedule", ["paci", "1f1b", "amdp"])
def test_two_stages_nccl_match_emulator(tmp_path: Path, monkeypatch, schedule: str):
    """Two stages over NCCL (8 MiB messages) train to the emulator's losses on one GPU: PACI
    (P2P only), 1F1B (plus the step's norm all-gather on the pipeline group) and AMDP (replica
    all-gathers; docs/gpu.md F2 breaks it today).
    fp32, no dropout, deterministic cuBLAS. The first loss (forward only, same kernels) must
    agree to 1e-6; later ones within 1e-4 relative rather than bitwise (the ranks do not
    enable torch's deterministic algorithms, so attention backward may reduce in another
    order, docs/gpu.md section 7). A P2P deadlock (docs/gpu.md F1) fails here with a named
    receive timeout."""
    for key, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(key, value)
    argv = [*NCCL_MESSAGE_ARGS, "--train-iters", "3", "--pipeline-schedule", schedule]
    runtime, runtime_params = run_pretrain(argv, tmp_path / "runtime", timeout=600)
    emulator, emulator_params = run_pretrain([*argv, "--pipeline-executor", "emulator"], tmp_path / "emulator",
                                             timeout=600)
    assert [r["iteration"] for r in runtime] == [r["iteration"] for r in emulator] == [1, 2, 3]
    assert _relative(runtime[0]["loss"], emulator[0]["loss"]) < 1e-6, (runtime, emulator)
    for a, b in zip(runtime, emulator):
        assert _relative(a["loss"], b["loss"]) < 1e-4, (runtime, emulator)
    assert runtime_params.keys() == emulator_params.keys()
    worst = max(float((runtime_params[k] - emulator_params[k]).abs().max()) for k in runtime_params)
    print(f"max |runtime - emulator| over parameters: {worst:.3e}")


@gpu
@two_gpus
def test_nccl_runtime_memory_flat(tmp_path: Path):
    """A long PACI segment (no drain for 30 iterations) keeps each rank's allocator peak flat:
    NCCL sends report completion from their CUDA event, so the reaping loop frees them (the
    gloo leak of issue 17 would add 4 x 8 MiB per iteration here)."""
    records, _ = run_pretrain([*NCCL_MESSAGE_ARGS, "--train-iters", "30"], tmp_path, timeout=600)
    peaks = [r["peak_memory_mb"] for r in records]
    for stage in range(2):
        early = max(p[stage] for p in peaks[4:10])
        late = max(p[stage] for p in peaks[20:])
        print(f"stage {stage}: allocator peak {early:.1f} MB (iterations 5-10), {late:.1f} MB (21-30)")
        assert late <= early + ACTIVATION_MB, (stage, early, late)


@gpu
@two_gpus
def test_nccl_receive_timeout_names_stage(tmp_path: Path):
    """A stalled peer makes the other rank fail within its receive timeout, with our one-line
    error naming stage, rank and op: ``wait(timeout)`` blocks the CPU on NCCL. The peer is
    SIGSTOPped once training logs; if the P2P streams stall first (docs/gpu.md F1), that stall
    is the stalled peer, and the same error is required (F1 itself fails the paci test)."""
    flags = [*tiny_args(2, "paci", 4, 1_000_000, "--device", "cuda", "--distributed-backend", "nccl"),
             "--pipeline-timeout-seconds", "5", "--distributed-timeout-minutes", "2"]
    log_json, port, procs, errs = tmp_path / "log.jsonl", _free_port(), [], []
    for rank in range(2):
        env = dict(_base_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        errs.append(tmp_path / f"rank{rank}.err")
        with open(tmp_path / f"rank{rank}.out", "w") as out, open(errs[-1], "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *flags,
                                           "--log-json", str(log_json)], cwd=REPO, env=env, stdout=out, stderr=err))
    try:
        deadline = time.monotonic() + 180
        while not log_json.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for start-up, an external event
        if log_json.exists():
            os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            procs[0].wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running 120 s after its peer stopped:\n{_tail(errs[0])}")
        print(f"rank 0 exited {time.monotonic() - stopped:.1f} s after its peer stopped")
        stderr = errs[0].read_text(errors="replace")
        assert procs[0].returncode != 0
        line = re.search(r"\[megatron-async\] error: stage 0 \(rank 0\) at \S+.*", stderr)
        assert line, stderr[-3000:]
        assert "timeout" in line[0].lower() or "timed out" in line[0].lower(), line[0]
    finally:
        _stop(procs)


_NCCL_WORK_SCRIPT = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=datetime.timedelta(minutes=2))
store = dist.distributed_c10d._get_default_store()
buf = torch.full((2 * 2**20,), float(rank), device="cuda")  # 8 MiB
if rank == 0:
    work = dist.isend(buf, dst=1)
    torch.cuda.synchronize()  # returns once the send kernel ran, i.e. rank 1 received
    print("send completed without wait:", work.is_completed(), flush=True)
    store.set("sent", "1")
    never = dist.irecv(torch.empty_like(buf), src=1)  # rank 1 never sends this
    start = time.monotonic()
    try:
        never.wait(datetime.timedelta(seconds=3))
        print("receive timeout: did not raise", flush=True)
    except Exception as exc:
        print(f"receive timeout raised after {time.monotonic() - start:.1f}s:", type(exc).__name__, exc, flush=True)
else:
    dist.irecv(buf, src=0).wait(datetime.timedelta(seconds=60))
    print("received:", float(buf[0]), flush=True)
    store.wait(["sent"], datetime.timedelta(seconds=120))
sys.stdout.flush()
os._exit(0)  # an aborted communicator must not be torn down politely
"""


@gpu
@two_gpus
def test_nccl_send_completes_without_wait(tmp_path: Path):
    """The torch behaviour our send reaping and receive timeouts rely on (docs/gpu.md
    section 2): an NCCL ``isend`` reports ``is_completed()`` once its kernel ran, without
    ``wait()``; ``wait(timeout)`` on a receive nobody answers raises instead of hanging."""
    script = tmp_path / "nccl_work.py"
    script.write_text(_NCCL_WORK_SCRIPT)
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(_base_env(), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        _stop(procs)
    print(*outputs, sep="\n")
    assert all(p.returncode == 0 for p in procs), outputs
    assert "received: 0.0" in outputs[1]
    assert "send completed without wait: True" in outputs[0]
    raised = re.search(r"receive timeout raised after ([\d.]+)s", outputs[0])
    assert raised and float(raised[1]) < 60, outputs[0]


# --------------------------------------------------------------------- overlap and recompute on CUDA


def _overlap_rank(rank: int, port: int, result_dir: str) -> None:
    """One rank of :func:`test_overlapped_buckets_on_nccl_stream_equal_flat_all_reduce`."""
    import datetime

    import torch.distributed as dist

    from megatron.pipeline.runtime.grad_buckets import OverlappedGradReduce

    os.environ.update(DETERMINISTIC_ENV)
    torch.cuda.set_device(rank)  # before init_process_group (docs/gpu.md section 3)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh())
                                      for _ in range(6)]).cuda()
        params = list(model.parameters())
        data = torch.randn(2, 256, 1024, generator=torch.Generator().manual_seed(rank)).cuda()

        def backward() -> None:
            for x in data:
                model(x).square().mean().backward()

        backward()  # the reference: plain backward, one flat all-reduce at the step
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        reference = (flat / 2).split([p.numel() for p in params])
        model.zero_grad(set_to_none=True)
        sync = OverlappedGradReduce([params], 1_100_000, None, 2, datetime.timedelta(seconds=60))
        for mb, x in enumerate(data):  # micro-batch 1 completes the window: buckets launch inside it
            with sync.grad_op(0, len(data), 0, completes=True):
                model(x).square().mean().backward()
        sync.finish()
        worst = max(float((p.grad.reshape(-1) - r).abs().max()) for p, r in zip(params, reference))
        Path(result_dir, f"rank{rank}.txt").write_text(f"{','.join(sync.launches)} {worst!r}")
    finally:
        dist.destroy_process_group()


@gpu
@two_gpus
def test_overlapped_buckets_on_nccl_stream_equal_flat_all_reduce(tmp_path: Path):
    """``OverlappedGradReduce`` on CUDA: buckets launch as asynchronous NCCL all-reduces from
    autograd's post-accumulate hooks while the rest of the backward's kernels are still being
    queued (NCCL's stream waits for the compute stream's event, docs/gpu.md section 4), and
    ``finish()`` makes the compute stream wait for them. The averaged gradients equal one flat
    all-reduce of the same gradients (two ranks: ``a + b`` is exact whatever the split)."""
    import torch.multiprocessing as mp

    from megatron.trainer.launch.launcher import free_port

    mp.start_processes(_overlap_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        launches, worst = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert launches.split(",").count("backward") >= 2, launches  # several buckets, launched mid-backward
        assert float(worst) <= 1e-6, (rank, worst)


@gpu
@two_gpus
def test_overlap_grad_reduce_on_nccl_equals_non_overlapped(tmp_path: Path, monkeypatch):
    """``--overlap-grad-reduce`` over NCCL (DP = 2 on two GPUs, 1F1B and zb-h1 with its W ops in
    one launch each) trains to the losses and weights of the reduction at the step: the issue's
    "equal to non-overlapped" on CUDA (1e-6; two ranks sum exactly, so only GPU kernel
    non-determinism between the two runs could separate them)."""
    for key, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(key, value)
    for schedule in ("1f1b", "zb-h1"):
        args = [*tiny_args(1, schedule, 2, 3, *NO_DROPOUT, "--device", "cuda", "--distributed-backend", "nccl",
                           "--lr", "1e-4", "--num-layers", "2"), "--data-parallel-size", "2", "--global-batch-size", "4"]
        plain, p_plain = run_pretrain(args, tmp_path / f"{schedule}-plain", timeout=600)
        over, p_over = run_pretrain([*args, "--overlap-grad-reduce", "--ddp-bucket-size", "300"],
                                    tmp_path / f"{schedule}-over", timeout=600)
        assert len(over) == len(plain) == 3
        for a, b in zip(over, plain):
            assert _relative(a["loss"], b["loss"]) <= 1e-6, (schedule, over, plain)
        assert p_over.keys() == p_plain.keys()
        worst = max(float((p_over[k] - p_plain[k]).abs().max()) for k in p_plain)
        assert worst <= 1e-6, (schedule, worst)


@gpu
@two_gpus
@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]], ids=["tp", "sp"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tensor_parallel_on_nccl_matches_tp1(tmp_path: Path, monkeypatch, schedule: str, sp: list[str]):
    """TP = 2 over NCCL (two GPUs, megatron's TP layers all-reducing on NCCL, the TP-reduced
    grad norm with clipping active) trains to the losses and gathered weights of TP = 1 on one
    GPU. zb-h1 runs the split linears' B/W at TP > 1 (dx all-reduced in B, W local). 1e-5, as
    the CPU tests (tests/test_tensor_parallel_runtime.py), loosened to 1e-4 for GPU kernels'
    reduction order. ``sp``: also with --sequence-parallel (megatron's CUDA mappings and RNG
    tracker, [s/2, b, h] between stages; tests/test_sequence_parallel.py on gloo)."""
    for key, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(key, value)
    args = [*tiny_args(1, schedule, 2, 3, *NO_DROPOUT, "--device", "cuda", "--distributed-backend", "nccl",
                       "--lr", "1e-4", "--num-layers", "2", "--clip-grad", "0.05")]
    tp1, p_tp1 = run_pretrain(args, tmp_path / "tp1", timeout=600)
    tp2, p_tp2 = run_pretrain([*args, "--tensor-model-parallel-size", "2", *sp], tmp_path / "tp2", timeout=600)
    assert [r["iteration"] for r in tp2] == [r["iteration"] for r in tp1] == [1, 2, 3]
    for a, b in zip(tp2, tp1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (schedule, tp2, tp1)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (schedule, tp2, tp1)
    assert p_tp2.keys() == p_tp1.keys()  # --dump-final-params gathers the TP shards
    for name in p_tp1:
        # The QKV bias's key slice has a zero true gradient: Adam turns rounding noise into steps
        # of up to lr there (tests/test_reference.py), so it is bounded by the steps taken.
        bound = 3 * 1e-4 + 1e-6 if name.endswith("linear_qkv.bias") else 1e-4
        assert float((p_tp2[name] - p_tp1[name]).abs().max()) <= bound, (schedule, name)


@gpu
@pytest.mark.parametrize("executor", ["emulator", "runtime"])
def test_recompute_on_cuda_repeats_dropout_masks(megatron_world1, tmp_path: Path, executor: str):
    """Full and selective recompute on CUDA with dropout train exactly like no recompute: the
    recomputation restores the CUDA generator (``torch.utils.checkpoint``'s
    ``preserve_rng_state`` for the inputs' device) and megatron's tracker states, so its masks
    are the forward's, and puts the generators back afterwards. Emulator: one process, both
    stages on cuda:0; runtime: one rank over NCCL (one stage, ``isolate_rng=False``, the
    runtime's RNG path). Dropout really is on: the run without it ends elsewhere."""
    from tests.test_recompute import DROPOUT, FULL_UNIFORM, SELECTIVE

    def run(name: str, *flags: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        if executor == "emulator":
            torch.cuda.manual_seed_all(0)  # the emulator's stages share the CUDA generator (F3)
            log = tmp_path / f"{name}.jsonl"
            from tests.async_helpers import final_params

            workers = emulate([*tiny_args(2, "1f1b", 4, 3, "--num-layers", "4", "--device", "cuda", *flags),
                               "--pipeline-executor", "emulator", "--log-json", str(log)])
            return [r["loss"] for r in read_log(log)], final_params(workers)
        records, params = run_pretrain([*tiny_args(1, "1f1b", 4, 3, "--num-layers", "2", "--device", "cuda",
                                                   "--distributed-backend", "nccl", *flags)], tmp_path / name)
        return [r["loss"] for r in records], params

    reference = run("none", *DROPOUT)
    no_dropout = run("no-dropout", *NO_DROPOUT)
    assert max(float((reference[1][k] - no_dropout[1][k]).abs().max()) for k in reference[1]) > 1e-4
    for name, flags in (("full", FULL_UNIFORM), ("selective", SELECTIVE)):
        losses, params = run(name, *DROPOUT, *flags)
        assert losses == pytest.approx(reference[0], rel=1e-6, abs=1e-6), (name, losses, reference[0])
        worst = max(float((params[k] - reference[1][k]).abs().max()) for k in params)
        assert worst <= 1e-6, (name, worst)


# --------------------------------------------------------------------- NCCL streams, on paper (CPU)

STREAM_MODEL_SCHEDULES = ["1f1b", "gpipe", "paci", "zb-h1", "zb-h2", "pipedream-2bw", "pipemare",
                          "interleaved-1f1b", "amdp"]


def _model_schedule(name: str, stages: int):
    from megatron.pipeline.schedules import build_schedule
    from megatron.pipeline.schedules.base import ScheduleConfig

    chunks = 2 if name == "interleaved-1f1b" else 1
    return build_schedule(name, ScheduleConfig(num_stages=stages, num_microbatches=2 * stages,
                                               num_iterations=2, num_chunks=chunks))


@pytest.mark.parametrize("name", STREAM_MODEL_SCHEDULES)
def test_nccl_stream_model_per_direction_communicators_never_stall(name):
    """The fix docs/gpu.md proposes for F1: one communicator per direction of each stage pair
    turns NCCL's one-stream-per-communicator order into our FIFO-per-direction model, so the
    runtime's posting order (receives prefetched four ops ahead) completes for every schedule."""
    from tests.nccl_stream_model import stalls

    for stages in (2, 4):
        assert stalls(_model_schedule(name, stages), "per_direction") is None, (name, stages)


@pytest.mark.parametrize("name", STREAM_MODEL_SCHEDULES)
def test_runtime_has_one_p2p_group_per_direction_of_every_message(name):
    """The runtime's side of the fix: ``StageGroups`` builds a group for each (src, dst) stage
    pair of ``directed_links`` and ``P2PChannel`` sends and receives every message on the group
    of its direction, so each group carries one direction only (the model's ``per_direction``
    key). Every message the runtime posts must have such a group, in both directions' sets."""
    from megatron.pipeline.runtime.parallel import directed_links
    from tests.nccl_stream_model import posting_program

    for stages in (2, 4):
        schedule = _model_schedule(name, stages)
        links = set(directed_links(schedule.layout))
        used = {(m.src_stage, m.dst_stage) for s in range(stages)
                for kind, m in posting_program(schedule, s) if kind in ("send", "recv")}
        assert used <= links, (name, stages, used - links)
        assert all((dst, src) in links for src, dst in links)  # activations out, gradients back


def test_nccl_stream_model_shared_streams_stall_the_runtime():
    """F1 on paper: with one stream per stage pair (lazy NCCL P2P) or one for all P2P (eager
    init, what ``run_distributed`` sets up), the runtime's 1F1B posting order forms a cycle of
    receives at the stream heads (stage 0 waits for grad 0, stage 1 for act 0), also without
    prefetching. docs/gpu.md section 1."""
    from tests.nccl_stream_model import stalls

    schedule = _model_schedule("1f1b", 2)
    for communicator in ("shared_pair", "one_world"):
        for prefetch in (4, 1):
            blocked = stalls(schedule, communicator, prefetch)
            assert blocked is not None and set(blocked) == {0, 1}, (communicator, prefetch, blocked)
    blocked = stalls(schedule, "shared_pair")
    assert [(kind, str(msg)) for kind, msg in blocked.values()] == [
        ("wait", "grad(mb0) s1.c0->s0.c0"), ("wait", "act(mb0) s0.c0->s1.c0")]


# --------------------------------------------------------------------- throughput smoke

GPT2_MEDIUM = dict(layers=24, hidden=1024, heads=16, seq=1024, vocab=50304)
# Dense bf16 peak by device-name substring, first match wins (PCIe H100s are slower).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def gpt_parameters(layers: int, hidden: int, seq: int, vocab: int) -> int:
    """Parameters of our GPT stage stack: per layer 12h^2 + 13h (QKV, projection, MLP, two
    LayerNorms, biases), word and position embeddings, final LayerNorm, untied output layer."""
    return layers * (12 * hidden * hidden + 13 * hidden) + vocab * hidden + seq * hidden + 2 * hidden + vocab * hidden


def peak_tflops() -> float | None:
    if "MEGATRON_ASYNC_PEAK_TFLOPS" in os.environ:
        return float(os.environ["MEGATRON_ASYNC_PEAK_TFLOPS"])
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)


@gpu
def test_gpt2_medium_throughput(tmp_path: Path):
    """GPT-2 medium, bf16, TP = PP = 1 on one GPU: prints tokens/s and MFU
    (6 * parameters * tokens/s / peak). The goal (>= 40% on an H100) is a benchmark target,
    not asserted; the test asserts only that training ran and the loss is finite."""
    m = GPT2_MEDIUM
    argv = ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]), "--vocab-size", str(m["vocab"]),
            "--micro-batch-size", "8", "--global-batch-size", "64", "--train-iters", "12", "--log-interval", "1",
            "--lr", "1e-4", "--bf16", "--device", "cuda", "--pipeline-model-parallel-size", "1"]
    records, _ = run_pretrain(argv, tmp_path, timeout=900)
    assert len(records) == 12 and all(math.isfinite(r["loss"]) for r in records)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[2:])  # two warm-up iterations
    params = gpt_parameters(m["layers"], m["hidden"], m["seq"], m["vocab"])
    peak = peak_tflops()
    mfu = 6 * params * tokens_per_s / (peak * 1e12) if peak else float("nan")
    print(f"GPT-2 medium bf16 on {torch.cuda.get_device_name(0)}: {params / 1e6:.0f}M parameters, "
          f"{tokens_per_s:.0f} tokens/s, MFU {100 * mfu:.1f}% (peak {peak} TFLOP/s; target >= 40%)")


def test_gpt_parameter_count_matches_the_model(megatron_world1):
    """The MFU numerator counts exactly the parameters our stage stack builds (checked on a
    small shape on CPU, so the formula is not a hand-written constant; runs without a GPU)."""
    from megatron.trainer.models.gpt import GPTModelArgs

    args = GPTModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                        max_position_embeddings=32, vocab_size=256, use_transformer_engine=False)
    (stage,) = build_pipeline(args, [2])
    assert sum(p.numel() for p in stage.parameters()) == gpt_parameters(2, 64, 32, 256)

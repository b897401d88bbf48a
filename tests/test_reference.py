"""THE reference check: pipelined training reproduces plain, non-pipelined training.

A single-process training loop written here -- full GPT model, ``torch.optim.AdamW``,
gradient accumulation, ``clip_grad_norm_`` and Megatron's LR rule, none of it from our
runtime, schedules, optimizer or LR code -- is the reference. The real distributed runtime
(``python pretrain_gpt.py``: local gloo ranks, one per stage) must reproduce its per-iteration
losses and its final parameters for 1F1B and GPipe on 2 and 4 stages and for an uneven
3-stage split; the emulator must reproduce the distributed run bit for bit.

What is shared with the trainer is only the model definition (``build_gpt_stage`` over all
layers, so initial weights are identical by construction) and the mock data set.

Tolerances. Pipelining changes no arithmetic inside a layer; the one legitimate difference
is the clip coefficient: the runtime sums per-stage fp32 squared norms in float64, torch's
``clip_grad_norm_`` takes an fp32 norm of per-tensor norms. They differ by ~1e-9 relative.
(When this test was written, computing the reference norm the runtime's way made the N=2
run equal to this reference bit for bit, every parameter.) Ten Adam steps amplify that to
~1e-7 relative in the losses and to at most a few 1e-6 of a tensor's scale in the
parameters, mostly where a gradient element is near zero (Adam's step is ~lr * g / sqrt(v),
so there a rounding difference changes its sign, not its size). Hence: losses within 1e-5
relative, and every parameter tensor within ``1e-5 * max|reference tensor| + 1e-6``:
relative to the tensor's own scale (a weight of std 0.02 is held to ~2e-6 absolute, a
LayerNorm scale of ~1 to ~1e-5), with a 1e-6 floor for the zero-initialised biases. The
attention key bias, whose gradient is exactly zero in exact arithmetic, is bounded
separately (see ``assert_matches_reference``). A genuine bug (wrong lr, loss scale, clip,
accumulation or micro-batch order) moves parameters by ~lr = 5e-3 per step, orders of
magnitude above this; the test checks that training moved every tensor by far more than
the tolerance, so the comparison cannot pass vacuously.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

ITERS = 10
MBS = 2
GBS = 16  # m = 8 micro-batches per iteration: >= 2N for N = 2, 3, 4
LAYERS = 4
HIDDEN, HEADS, QUERY_GROUPS = 64, 4, 4
COMMON = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
    "--seq-length", "32", "--vocab-size", "128",
    "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-iters", str(ITERS),
    "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
    "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--seed", "4321", "--mock-data", "--device", "cpu", "--num-threads", "1", "--log-interval", "1",
    "--untie-embeddings-and-output-weights",  # the reference loop's model; tying: tests/test_tied_embeddings.py
]

# name -> extra flags of a distributed run
DIST_RUNS = {
    "1f1b-N2": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"],
    "gpipe-N2": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"],
    "1f1b-N4": ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b"],
    "gpipe-N4": ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "gpipe"],
    "1f1b-N3-split211": ["--pipeline-model-parallel-size", "3", "--pipeline-schedule", "1f1b",
                         "--pipeline-layer-split", "2", "1", "1"],
}
LAUNCH_TIMEOUT_S = 300
MAX_CONCURRENT_LAUNCHES = 3
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = 1e-6
KEY_BIAS_ATOL = 5e-5  # see assert_matches_reference


@dataclass
class Reference:
    run: "RunResult"
    initial: dict[str, torch.Tensor]
    grad_norms: list[float]  # pre-clip global norm per iteration
    key_bias_grad_ratio: float  # max over iterations of max|grad b_k| / max|grad b_q|


@dataclass
class RunResult:
    records: list[dict]
    params: dict[str, torch.Tensor]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "<no output>"
    return text[-n:]


def _load_run(out_dir: Path, num_stages: int) -> RunResult:
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    params: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        stage = torch.load(out_dir / "params" / f"stage{s}.pt")
        assert not set(stage) & set(params), f"stage {s} repeats parameter names"
        params.update(stage)
    return RunResult(records, params)


def _run_flags(out_dir: Path, extra: list[str]) -> list[str]:
    return [*COMMON, *extra, "--log-json", str(out_dir / "log.jsonl"),
            "--dump-final-params", str(out_dir / "params")]


def _num_stages(extra: list[str]) -> int:
    return int(extra[extra.index("--pipeline-model-parallel-size") + 1])


def _launch(cmd: list[str], env: dict[str, str], log_path: Path) -> int | str:
    """Run one launch (launcher + its ranks, in a process group of its own) to completion.

    Returns the exit code, or a string if it timed out; on a timeout the whole group is
    killed, so no orphaned rank outlives the test.
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        return proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {LAUNCH_TIMEOUT_S}s"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory):
    """Start the distributed runs in the background, a few at a time.

    Imports dominate a launch (~4 s of CPU per rank), so overlapping launches with each
    other and with the in-process reference and emulator keeps both cores busy; the cap
    bounds memory (~0.4 GB per rank).
    """
    root = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_LAUNCHES)
    futures = {}
    for name, extra in DIST_RUNS.items():
        out_dir = root / name
        out_dir.mkdir()
        cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *_run_flags(out_dir, extra)]
        futures[name] = (pool.submit(_launch, cmd, env, out_dir / "output.txt"), out_dir)
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def distributed_runs(launched) -> dict[str, RunResult]:
    failures = []
    for name, (future, out_dir) in launched.items():
        code = future.result()
        if code != 0:
            failures.append(f"{name}: exit {code}\n{_tail(out_dir / 'output.txt')}")
    if failures:
        pytest.fail("distributed runs failed:\n" + "\n\n".join(failures))
    return {name: _load_run(out_dir, _num_stages(DIST_RUNS[name])) for name, (_, out_dir) in launched.items()}


# ------------------------------------------------------------------ the reference


def reference_lr(k: int, max_lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Megatron's rule for the k-th update (1-based): linear warm-up, cosine to min_lr."""
    if warmup > 0 and k <= warmup:
        return max_lr * k / warmup
    if k > decay:
        return min_lr
    progress = (k - warmup) / (decay - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _qkv_bias_mask(
    shape: torch.Size, part: int, heads: int = HEADS, groups: int = QUERY_GROUPS, hidden: int = HIDDEN
) -> torch.Tensor:
    """Megatron's fused QKV bias is laid out per query group as [q heads..., k, v]."""
    heads_per_group = heads // groups
    mask = torch.zeros(groups, heads_per_group + 2, hidden // heads, dtype=torch.bool)
    if part == 0:
        mask[:, :heads_per_group] = True
    else:
        mask[:, heads_per_group + part - 1] = True
    return mask.view(shape)


def query_mask(shape: torch.Size) -> torch.Tensor:
    return _qkv_bias_mask(shape, 0)


def key_mask(shape: torch.Size) -> torch.Tensor:
    return _qkv_bias_mask(shape, 1)


@pytest.fixture(scope="module")
def reference(megatron_world1: None, launched) -> Reference:
    """Plain training of the unsplit model."""
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.data.mock import MockGPTData
    from megatron.trainer.tasks.gpt import gpt_model_args
    from megatron.trainer.models.gpt import build_gpt_stage
    from megatron.trainer.tasks.task import microbatch_sample_indices

    config = parse_run_plan(COMMON)
    model_cfg, training, opt = config.model, config.training, config.optimizer
    assert config.parallel.pipeline_model_parallel_size == 1 and config.num_microbatches == GBS // MBS
    m = config.num_microbatches
    model = build_gpt_stage(gpt_model_args(config), range(model_cfg.num_layers), True, True, training.seed, "cpu")
    named = list(model.global_named_parameters())
    initial = {n: p.detach().clone() for n, p in named}
    no_decay = [p for n, p in named if n.endswith("bias") or p.ndim == 1]
    decay = [p for n, p in named if not (n.endswith("bias") or p.ndim == 1)]
    assert decay and no_decay
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, foreach=False,
    )
    data = MockGPTData(model_cfg.seq_length, model_cfg.vocab_size, training.seed)
    params = [p for _, p in named]
    records, norms, key_ratio = [], [], 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for it in range(ITERS):
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for j in range(it * m, (it + 1) * m):
                batch = data.micro_batch(microbatch_sample_indices(j, training.micro_batch_size, 0, 1))
                per_token = model(None, batch)  # [b, s] per-token LM loss
                mask = batch["loss_mask"]
                loss = (per_token * mask).sum() / mask.sum()
                (loss / m).backward()
                losses.append(loss.item())
            for name, p in named:
                if name.endswith("linear_qkv.bias"):
                    g = p.grad.abs()
                    key_ratio = max(key_ratio, (g[key_mask(g.shape)].max() / g[query_mask(g.shape)].max()).item())
            norm = float(torch.nn.utils.clip_grad_norm_(params, opt.clip_grad))
            lr = reference_lr(it + 1, opt.lr, opt.min_lr, opt.lr_warmup_iters, training.train_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            records.append({"iteration": it + 1, "loss": sum(losses) / m, "lr": lr})
            norms.append(norm)
    finally:
        torch.set_num_threads(threads)
    final = {n: p.detach().clone() for n, p in named}
    return Reference(RunResult(records, final), initial, norms, key_ratio)


@pytest.fixture(scope="module")
def emulator_runs(megatron_world1: None, launched, tmp_path_factory: pytest.TempPathFactory) -> dict[int, RunResult]:
    """``--pipeline-executor emulator`` through the real entry point, in this process."""
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.training import pretrain

    root = tmp_path_factory.mktemp("emu")
    runs = {}
    threads = torch.get_num_threads()
    try:
        for n in (2, 4):
            out_dir = root / f"N{n}"
            extra = [*DIST_RUNS[f"1f1b-N{n}"], "--pipeline-executor", "emulator"]
            assert pretrain(GPTTask(), _run_flags(out_dir, extra)) == 0
            runs[n] = _load_run(out_dir, n)
    finally:
        torch.set_num_threads(threads)
    return runs


# ------------------------------------------------------------------ checks


def test_reference_trains_and_exercises_warmup_and_clipping(reference: Reference) -> None:
    ref, initial, norms = reference.run, reference.initial, reference.grad_norms
    lrs = [r["lr"] for r in ref.records]
    assert lrs[:3] == pytest.approx([5e-3 / 3, 2 * 5e-3 / 3, 5e-3])  # warm-up
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # cosine decay afterwards
    assert any(n > 1.0 for n in norms), norms  # clip-grad 1.0 actually clips
    assert ref.losses[-1] < ref.losses[0] - 0.1, ref.losses
    # Training moved every tensor by far more than the comparison tolerance.
    for name, p in ref.params.items():
        moved = (p - initial[name]).abs().max().item()
        assert moved > 100 * (PARAM_RTOL * p.abs().max().item() + PARAM_ATOL), (name, moved)
    # The premise of the key-bias exemption below: its gradient is rounding noise.
    assert reference.key_bias_grad_ratio < 1e-4, reference.key_bias_grad_ratio


def assert_matches_reference(run: RunResult, ref: RunResult, norms: list[float] | None = None) -> None:
    assert [r["iteration"] for r in run.records] == list(range(1, ITERS + 1))
    for r, e in zip(run.records, ref.records):
        it = e["iteration"]
        assert math.isclose(r["loss"], e["loss"], rel_tol=LOSS_RTOL), (it, r["loss"], e["loss"])
        assert math.isclose(r["lr"], e["lr"], rel_tol=1e-12), (it, r["lr"], e["lr"])
        assert r["consumed_samples"] == it * GBS
    if norms is not None:
        got = [r["grad_norm"] for r in run.records]
        assert got == pytest.approx(norms, rel=1e-4)
    assert sorted(run.params) == sorted(ref.params)
    for name, expected in ref.params.items():
        got = run.params[name]
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        diff = (got - expected).abs()
        if name.endswith("linear_qkv.bias"):
            # The key bias adds q.b_k to every logit of a query's row, which softmax ignores:
            # its true gradient is exactly zero, its computed one rounding noise (checked in
            # the reference), and Adam turns that noise into steps of up to ~lr * noise / eps
            # whose sign any rounding difference flips. It is held to a bound of 1% of one
            # peak-lr step instead; the query and value parts to the normal tolerance.
            kmask = key_mask(diff.shape)
            key_err = diff[kmask].max().item()
            assert key_err <= KEY_BIAS_ATOL, f"{name} (key part): max abs error {key_err:.3e}"
            diff = diff.masked_fill(kmask, 0.0)
        err = diff.max().item()
        tol = PARAM_RTOL * expected.abs().max().item() + PARAM_ATOL
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


@pytest.mark.parametrize("n", [2, 4])
def test_emulator_matches_reference(n: int, emulator_runs, reference: Reference) -> None:
    assert_matches_reference(emulator_runs[n], reference.run, reference.grad_norms)


@pytest.mark.parametrize("name", list(DIST_RUNS))
def test_distributed_pipeline_matches_reference(name: str, distributed_runs, reference: Reference) -> None:
    run = distributed_runs[name]
    assert_matches_reference(run, reference.run, reference.grad_norms)
    n = _num_stages(DIST_RUNS[name])
    # The logger saw every stage: the per-stage fields have one entry per stage.
    assert all(len(r["drift_max"]) == n for r in run.records)
    assert all(r["drift_max"] == [0] * n for r in run.records)  # synchronous: no staleness


@pytest.mark.parametrize("n", [2, 4])
def test_emulator_is_bitwise_equal_to_distributed(n: int, emulator_runs, distributed_runs) -> None:
    emu, dist_run = emulator_runs[n], distributed_runs[f"1f1b-N{n}"]
    assert emu.losses == dist_run.losses  # exact float equality (JSON round-trips floats)
    assert [r["lr"] for r in emu.records] == [r["lr"] for r in dist_run.records]
    assert [r["grad_norm"] for r in emu.records] == [r["grad_norm"] for r in dist_run.records]
    assert sorted(emu.params) == sorted(dist_run.params)
    for name, p in dist_run.params.items():
        assert torch.equal(emu.params[name], p), name

"""``tools/plan_pipeline.py --profile``: the planner's unit costs measured on this machine.

Why through the trainer: the runtime's own profiling path (``--zb-profile-iters``, the
executors' :mod:`~megatron.pipeline.runtime.profiling`) times F, B and W of every op and the P2P
link exactly as a real run sees them; a separate micro-benchmark would time different code. One
process: the emulator runs both stages of a 2-stage zb-1p, evenly split, for ``PROFILE_ITERS``
profiled iterations (ZB-H1) plus one, on mock data, and the logged per-stage costs are turned into
per-layer and head costs (:func:`~megatron.pipeline.costs.unit_costs.from_two_stage_profile`).
Each rank is timed with the threads it will have (``--num-threads``: the cores over the
planned run's local ranks). The optimizer step comes from the same run's traced OPT spans (per parameter), activation
bytes from its activation meter (:func:`measured_activations`); the transport is
measured, on a CPU host, with the transport's other costs by :mod:`.link_profile` (two
processes over gloo: a message's trip and CPU, a collective's time per byte, the CPU time-sliced
cores lose). On a CPU the profile also records the host's usable cores (``host_cores``): a run of
more stages than cores shares them, which the planner models
(:mod:`megatron.pipeline.planner.shared_cores`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron.pipeline.ir import OpKind
from megatron.pipeline.costs.stages import part_parameters
from megatron.pipeline.costs.unit_costs import ActivationBytes, PassCosts, UnitCosts, from_two_stage_profile
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.schedules.base import ScheduleConfig
from megatron.pipeline.schedules.zero_bubble.zb_h1 import ZBH1
from megatron.pipeline.simulator import OpCosts, simulate_schedule
from megatron.pipeline.trace_analysis import load_traces
from megatron.trainer.tasks.balanced_partition import model_shape
from megatron.pipeline.schedules.zero_bubble.zb_1p import ZB1P
from megatron.trainer.config.job_config import JobConfig, flag_values

PROFILE_ITERS = 2
MAX_COLLECTIVE_BYTES = 64 << 20  # the collective measurement's size cap (a larger one only takes longer)
MARKER = "zero-bubble-schedule "
#: the model, batch and precision flags forwarded to the profiling run (dest -> flag)
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "seq_length", "max_position_embeddings", "vocab_size", "normalization", "position_embedding_type",
               "micro_batch_size")


def profile_command(config: JobConfig) -> list[str]:
    """The one-process emulator run that profiles ``args``' model (module docstring)."""
    training = config.training
    script = Path(__file__).resolve().parents[3] / "pretrain_gpt.py"
    cmd = [sys.executable, str(script)]
    flags = flag_values(config)
    for dest in MODEL_FLAGS:
        value = flags.get(dest)
        if value is not None:
            cmd += ["--" + dest.replace("_", "-"), str(value)]
    for flag in ("bf16", "fp16", "swiglu"):
        if flags.get(flag):
            cmd.append("--" + flag)
    m = max(2, training.global_batch_size // (training.micro_batch_size * config.parallel.data_parallel_size))
    return cmd + ["--global-batch-size", str(m * training.micro_batch_size), "--data-parallel-size", "1",
                  "--pipeline-model-parallel-size", "2", "--pipeline-schedule", ZB1P.name,
                  "--zb-profile-iters", str(PROFILE_ITERS), "--pipeline-executor", "emulator",
                  "--train-iters", str(PROFILE_ITERS + 1), "--mock-data", "--pipeline-partition", "even",
                  "--log-interval", "1"]


def host_cores() -> float | None:
    """The cores this process may run on when the profile ran on the CPU; None with a GPU
    (every rank then has a device of its own)."""
    import torch

    if torch.cuda.is_available():
        return None
    return float(len(os.sched_getaffinity(0)))


def measured_activations(decision: dict, records: list[dict], layers: int
                         ) -> tuple[ActivationBytes, ActivationBytes] | None:
    """(per-micro-batch activation bytes of a layer and the head, what a B leaves of them for
    its W), from the profiled iterations' measured peaks (``--log-activation-memory``, MiB per
    stage) and the profiled ``m_w``.

    Why through the peak: the meter reports each stage's peak over an interval, which for the
    profiled ZB-H1 iterations is the simulator's peak (in micro-batches' activations ``M_B``,
    with the profiled ``m_w`` of what a B leaves for its W) times the stage's ``M_B``. So
    ``M_B = peak / simulated peak``; stage 0 (``layers`` layers and the embedding) gives the
    layer (the embedding's output, one activation-sized tensor, folded in as with the times),
    stage 1 the head as the rest; the kept bytes are ``m_w M_B``, split the same way. None
    without measured records."""
    peaks = [r["peak_activation_mb"] for r in records[:PROFILE_ITERS] if "peak_activation_mb" in r]
    if not peaks:
        return None
    costs = tuple(OpCosts.from_dict(c) for c in decision["costs"])
    zb_h1 = ScheduleConfig(num_stages=2, num_microbatches=int(decision["num_microbatches"]))
    units = simulate_schedule(build_schedule(ZBH1.name, zb_h1), costs).peak_memory
    per_mb = [max(p[s] for p in peaks) * 2**20 / units[s] for s in range(2)]
    kept = [costs[s].m_w * per_mb[s] for s in range(2)]

    def split(stage_bytes: list[float]) -> ActivationBytes:
        layer = stage_bytes[0] / layers
        return ActivationBytes(layer=layer, head=max(0.0, stage_bytes[1] - layers * layer))

    return split(per_mb), split(kept)


def optimizer_ms_per_param(config: JobConfig, trace_dir: Path) -> float:
    """The optimizer step's time per parameter (ms): each stage's median traced OPT span (the
    emulator runs a stage's step alone: no collective waits inside it) over its parameters, the
    larger of the two stages (the slower one sets a synchronous step's pace)."""
    shape = model_shape(config)
    half = config.model.num_layers // 2
    rates = []
    for trace in load_traces(trace_dir):
        steps = [span.end - span.start for span in trace.spans if span.op.kind is OpKind.OPT]
        params = part_parameters(shape, half, trace.stage == 0, trace.stage == 1)
        if steps and params:
            rates.append(statistics.median(steps) / params)
    return max(rates, default=0.0)


def rank_threads(ranks: int) -> int:
    """The CPU threads each of ``ranks`` local ranks gets by default (the trainer's
    ``--num-threads`` default: cores over local processes, at least one)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks))


def with_link_costs(config: JobConfig, unit: UnitCosts) -> UnitCosts:
    """``unit`` with the CPU transport's costs measured on this host (:mod:`.link_profile`): an
    activation-sized message, a collective of one profiled stage's fp32 gradients."""
    from megatron.trainer.tasks.link_profile import measure_link

    shape = model_shape(config)
    half = config.model.num_layers // 2
    message = shape.seq_length * shape.micro_batch * shape.hidden * shape.activation_bytes
    gradients = int(4 * part_parameters(shape, half, True, False))
    link = measure_link(message, min(gradients, MAX_COLLECTIVE_BYTES), int(unit.host_cores or 1))
    return dataclasses.replace(unit, p2p=link.p2p, message_cpu=link.message_cpu,
                               shared_message_cpu=link.shared_message_cpu,
                               reduce_ms_per_byte=link.reduce_ms_per_byte)


def profile_unit_costs(config: JobConfig, threads: int) -> UnitCosts:
    """Run the profile and read its costs; ValueError (one line) when the run gives none.

    ``threads``: the CPU threads per rank of the runs being planned (:func:`rank_threads` of
    their local ranks). The emulator is one process and would otherwise take every core, timing
    ops several times faster than a rank that shares the host with the others.

    On a CPU host the profile runs as many copies at once as the planned ranks' threads fill
    the cores (:func:`profile_copies`), and takes the median of their costs. Why: a pipeline's
    ranks compute on all cores at once, and a core runs the same op 3-10 % slower while the
    others are busy (shared caches and memory bandwidth; measured on this project's 2-core
    host) than alone; and the median of several copies is steadier than one run."""
    model = config.model
    if model.num_layers % 2:
        raise ValueError(f"--profile splits the model over 2 stages evenly; --num-layers {model.num_layers} is odd")
    cores = host_cores()
    copies = profile_copies(cores, threads)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(copies):
            log, trace = Path(tmp) / f"profile{i}.jsonl", Path(tmp) / f"trace{i}"
            command = profile_command(config) + ["--num-threads", str(threads), "--log-activation-memory",
                                               "--log-json", str(log), "--trace-dir", str(trace)]
            runs.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                         log, trace))
        outputs = [process.communicate() for process, _, _ in runs]  # every copy ends before any is judged
        units = []
        for (process, log, trace), (stdout, stderr) in zip(runs, outputs):
            unit = read_profile(config, stdout, log, trace)
            if unit is None:
                tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
                raise ValueError(f"the profiling run logged no costs (exit {process.returncode}): {tail[0]}")
            units.append(unit)
    unit = dataclasses.replace(median_unit_costs(units), host_cores=cores)
    return unit if cores is None else with_link_costs(config, unit)


def profile_copies(cores: float | None, threads: int) -> int:
    """How many profile runs go at once: enough to keep every core busy (one on a GPU host)."""
    return 1 if cores is None else max(1, int(cores) // max(1, threads))


def read_profile(config: JobConfig, stdout: str, log: Path, trace: Path) -> UnitCosts | None:
    """One profiling run's unit costs (None: it logged none)."""
    records = [json.loads(r) for r in log.read_text().splitlines()] if log.exists() else []
    step = optimizer_ms_per_param(config, trace) if trace.is_dir() and any(trace.iterdir()) else 0.0
    for line in stdout.splitlines():
        if MARKER in line:
            decision = json.loads(line.split(MARKER, 1)[1])
            half = config.model.num_layers // 2
            unit = from_two_stage_profile(decision["costs"], (half, half), config.training.micro_batch_size,
                                          source="profiled:this host")
            measured = measured_activations(decision, records, half)
            return dataclasses.replace(unit, optimizer_per_param=step, activations=measured and measured[0],
                                       kept_for_w=measured and measured[1])
    return None


def median_unit_costs(units: list[UnitCosts]) -> UnitCosts:
    """The field-wise median of several profiles' times (the first one's measured bytes: the
    activation meter counts the same bytes in every run)."""
    def median_pass(parts: list[PassCosts]) -> PassCosts:
        return PassCosts(*(statistics.median(getattr(p, k) for p in parts) for k in ("f", "b", "w")))

    return dataclasses.replace(units[0], layer=median_pass([u.layer for u in units]),
                               embedding=median_pass([u.embedding for u in units]),
                               head=median_pass([u.head for u in units]),
                               p2p=statistics.median(u.p2p for u in units),
                               optimizer_per_param=statistics.median(u.optimizer_per_param for u in units))

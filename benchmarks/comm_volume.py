"""Communication volume per training step and rank: counted at the transport vs the theory.

Measured: the distributed runtime (CPU, gloo, one forked process per rank) runs a small GPT
with a counting shim that this benchmark installs in the launcher before the ranks fork (the
normal path is untouched): ``P2PChannel.send`` is wrapped to count each message's bytes by
kind (activation, gradient, post-validation norms), and the ``torch.distributed`` collectives
and sends are wrapped to count their input bytes by the runtime function that called them
(data-parallel reduction, the step's norm gather, AMDP's replica gathers; the rest is
"control": reports, losses, start-up). Each rank writes its counts when it destroys its process
group; the tables divide by the iterations.

Theory, two ways:

* **schedule**: :func:`megatron.pipeline.comm_volume.step_comm_volume` walks the schedule's op
  streams (torch-free) with the GPT's parameter counts from the closed formula
  (``12h^2 + 13h`` per layer, embeddings ``(V + s) h``, head ``V h + 2h``);
* **closed form** (P2P): ``m * s*b*h * 4 bytes`` per direction per hop of the rank's chunks;
  data-parallel: the stage's gradient bytes, which a ring all-reduce sends ``2(n-1)/n`` times.

Payload = bytes handed to the call (what the ratio compares); the "ring wire" column is what a
ring algorithm puts on the wire per rank for that payload. A last table applies the same
theory, without running, to the issue's shapes (GPT-2 medium, GPT-3 175B) at bf16.

    OMP_NUM_THREADS=1 python benchmarks/comm_volume.py                    # 25 cases, about a minute
    OMP_NUM_THREADS=1 python benchmarks/comm_volume.py --schedules 1f1b --layouts 2x2
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.pipeline.comm_volume import (CommShapes, analytic_p2p_bytes, ring_all_gather_bytes,  # noqa: E402
                                           ring_all_reduce_bytes, step_comm_volume)
from megatron.pipeline.ir import PipelineLayout  # noqa: E402
from megatron.trainer.config.job_config import JobConfig  # noqa: E402

COUNT_DIR_ENV = "MEGATRON_ASYNC_COMM_COUNT_DIR"
#: which positional argument of a wrapped call is its payload (input) tensor or tensor list
PAYLOAD_ARG = {"all_reduce": 0, "broadcast": 0, "isend": 0, "send": 0, "gather": 0, "reduce": 0,
               "all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
               "all_to_all_single": 1, "barrier": None}
#: the runtime function calling a collective -> what the traffic is (the frame above decides
#: between the two uses of ``replica_gather``)
CATEGORY = {"_all_reduce_mean": "data_parallel",  # GradientSync's flat all-reduce average
            "OverlappedGradReduce._launch": "data_parallel",
            "DistributedTransport.sync_gather": "sync_norms",
            "ReplicaReduction.norms": "replica_grads",
            "ReplicaReduction.finish": "replica_params"}
MEASURED_KINDS = ("p2p_act", "p2p_grad", "p2p_partial_state", "p2p_global_state", "data_parallel", "sync_norms",
                  "replica_grads", "replica_params")


def _bytes_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes_of(v) for v in value)
    return 0


class CommCounter:
    """Payload bytes and calls this process handed to communication, by category."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def add(self, category: str, nbytes: int) -> None:
        self.bytes[category] += nbytes
        self.calls[category] += 1

    def dump(self, directory: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        Path(directory, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "bytes": self.bytes,
                                                                   "calls": self.calls}))


def _category(frame: Any) -> str | None:
    """The category of a call made from ``frame`` (None: a P2P send, counted by kind)."""
    name = frame.f_code.co_qualname
    if name == "P2PChannel.send":
        return None
    if name == "DistributedTransport.replica_gather" and frame.f_back is not None:
        name = frame.f_back.f_code.co_qualname
    return CATEGORY.get(name, f"control:{name}")


def _wrap_collective(counter: CommCounter, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    index = PAYLOAD_ARG[name]

    def counted(*args: Any, **kwargs: Any) -> Any:
        category = _category(sys._getframe(1))
        if category is not None:
            payload = args[index] if index is not None and len(args) > index else kwargs.get("tensor")
            counter.add(category, _bytes_of(payload))
        return original(*args, **kwargs)

    return counted


@contextlib.contextmanager
def counting(directory: str) -> Iterator[CommCounter]:
    """Install the counting shim in this process (ranks forked inside inherit it); every rank
    writes ``directory/rank{RANK}.json`` when it destroys its process group."""
    from megatron.pipeline.runtime.transport.distributed import P2PChannel

    counter = CommCounter()
    saved: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, value: Any) -> None:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    for name in PAYLOAD_ARG:
        if hasattr(dist, name):
            patch(dist, name, _wrap_collective(counter, name, getattr(dist, name)))
    send = P2PChannel.send

    def counted_send(self: P2PChannel, msg: Any, tensor: torch.Tensor) -> None:
        if msg.src_stage != msg.dst_stage:
            counter.add(f"p2p_{msg.kind.value}", _bytes_of(tensor))
        send(self, msg, tensor)

    patch(P2PChannel, "send", counted_send)
    destroy = dist.destroy_process_group

    def dump_then_destroy(*args: Any, **kwargs: Any) -> Any:
        counter.dump(directory)
        return destroy(*args, **kwargs)

    patch(dist, "destroy_process_group", dump_then_destroy)
    try:
        yield counter
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


# ----------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Model:
    """The small GPT every run trains."""

    layers: int = 8
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    vocab: int = 512
    micro_batch: int = 2
    microbatches: int = 8  # per replica and update
    iters: int = 2

    def argv(self, pp: int, dp: int, schedule: str, extra: Sequence[str]) -> list[str]:
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden), "--num-attention-heads",
                str(self.heads), "--seq-length", str(self.seq), "--vocab-size", str(self.vocab),
                "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.microbatches * dp),
                "--pipeline-model-parallel-size", str(pp), "--data-parallel-size", str(dp),
                "--pipeline-schedule", schedule, "--train-iters", str(self.iters), "--log-interval", str(self.iters),
                "--device", "cpu", "--num-threads", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
                *extra]


#: run name -> (schedule, extra flags); interleaved uses 2 chunks per stage
SCHEDULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "1f1b": ("1f1b", ()),
    "gpipe": ("gpipe", ()),
    "interleaved-1f1b": ("interleaved-1f1b", ("--num-layers-per-virtual-pipeline-stage", "LPV")),
    "zb-h1": ("zb-h1", ()),
    "zb-2p": ("zb-2p", ()),
    "1f1b+post-validation": ("1f1b", ("--enable-optimizer-post-validation",)),
    "paci": ("paci", ()),
    "amdp": ("amdp", ()),
    "1f1b+overlap": ("1f1b", ("--overlap-grad-reduce", "--ddp-bucket-size", "20000")),
}


def layer_params(h: int) -> int:
    """One GPT layer: QKV 3h^2+3h, projection h^2+h, MLP 8h^2+5h, two layer norms 4h."""
    return 12 * h * h + 13 * h


def part_params(model: Model, part: int, parts: int, vocab: int) -> int:
    """Trained elements of model part ``part`` of ``parts`` (even layer split, untied head)."""
    n = model.layers // parts * layer_params(model.hidden)
    if part == 0:
        n += (vocab + model.seq) * model.hidden
    if part == parts - 1:
        n += vocab * model.hidden + 2 * model.hidden
    return n


def shapes_for(model: Model, layout: PipelineLayout, dp: int, vocab: int, act_bytes: int = 4) -> CommShapes:
    parts = layout.num_model_stages
    chunk_params = {(s, c): part_params(model, layout.model_stage(s, c), parts, vocab)
                    for s in range(layout.num_stages) for c in range(layout.num_chunks)}
    return CommShapes(model.seq * model.micro_batch * model.hidden, act_bytes, chunk_params, dp,
                      grad_bytes=act_bytes, param_bytes=act_bytes)


def parsed(argv: list[str]) -> JobConfig:
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask

    parser = build_parser()
    GPTTask().add_arguments(parser)
    return parse_run_plan(argv, parser)


def theory(config: JobConfig, model: Model) -> tuple[list[dict[str, float]], list[dict[str, float]],
                                                            list[tuple[float, float]]]:
    """Per stage: the schedule-derived volumes (post-validation: no update re-runs, and every
    update re-runs), and the closed-form (activation, gradient) bytes."""
    from megatron.pipeline.schedules import build_schedule

    schedule_config = config.run.schedule
    schedule = build_schedule(config.schedule.pipeline_schedule, schedule_config)
    shapes = shapes_for(model, schedule.layout, schedule_config.data_parallel_size, model.vocab)
    closed = [analytic_p2p_bytes(schedule.layout, s, schedule_config.num_microbatches, shapes.message_bytes)
              for s in range(schedule.layout.num_stages)]
    return step_comm_volume(schedule, shapes), step_comm_volume(schedule, shapes, reruns=True), closed


def measure(argv: list[str]) -> dict[int, dict[str, Any]]:
    """Run the distributed runtime with the counting shim; rank -> its counts."""
    from megatron.trainer.launch.launcher import fork_is_safe
    from megatron.trainer.loop.training import pretrain
    from megatron.trainer.tasks.gpt import GPTTask

    if not fork_is_safe():  # exec'd ranks would not inherit the shim
        raise RuntimeError("comm_volume: the launcher cannot fork its ranks here (threads or CUDA)")
    with tempfile.TemporaryDirectory() as directory:
        with counting(directory), contextlib.redirect_stdout(io.StringIO()):
            code = pretrain(GPTTask(), argv, script=str(REPO / "pretrain_gpt.py"))
        if code != 0:
            raise RuntimeError(f"pretrain exited {code}: {' '.join(argv)}")
        counts = {}
        for f in Path(directory).glob("rank*.json"):
            record = json.loads(f.read_text())
            counts[record["rank"]] = record
    return counts


def run_case(model: Model, name: str, pp: int, dp: int) -> list[dict[str, Any]]:
    """One (schedule, PP x DP) case: a row per stage and category, measured next to theory."""
    from megatron.pipeline.runtime.parallel import RankLayout

    schedule, extra = SCHEDULES[name]
    extra = tuple(str(model.layers // (2 * pp)) if e == "LPV" else e for e in extra)
    argv = model.argv(pp, dp, schedule, extra)
    per_step, rerunning, closed = theory(parsed(argv), model)
    counts = measure(argv)
    ranks = RankLayout(pp, dp)
    rows = []
    for stage in range(pp):
        mine = [counts[ranks.rank(stage, d)] for d in range(dp)]
        for kind in MEASURED_KINDS:
            values = [c["bytes"].get(kind, 0) / model.iters for c in mine]
            want = per_step[stage].get(kind, 0.0)
            if not want and not any(values):
                continue
            rows.append({"case": name, "pp": pp, "dp": dp, "stage": stage, "kind": kind,
                         "measured": max(values), "spread": max(values) - min(values), "theory": want,
                         "theory_all_rerun": rerunning[stage].get(kind, 0.0),
                         "closed_form": dict(zip(("p2p_act", "p2p_grad"), closed[stage])).get(kind),
                         "wire": _wire(kind, want, dp, pp, schedule)})
        control = sum(v for c in mine for k, v in c["bytes"].items() if k.startswith("control:")) / dp
        rows.append({"case": name, "pp": pp, "dp": dp, "stage": stage, "kind": "control (whole run)",
                     "measured": control, "spread": 0.0, "theory": None, "theory_all_rerun": None,
                     "closed_form": None, "wire": None})
    return rows


def _wire(kind: str, payload: float, dp: int, pp: int, schedule: str) -> float | None:
    """Ring wire bytes per rank of a collective's payload (P2P sends are their own wire)."""
    if kind == "data_parallel":
        return ring_all_reduce_bytes(payload, dp)
    if kind in ("replica_grads", "replica_params"):
        return ring_all_gather_bytes(payload, pp // 2 if schedule == "amdp" else 1)
    return None


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':21} {'PPxDP':5} {'st':>2} {'what':20} {'measured B/step':>15} {'schedule B':>12} "
          f"{'ratio':>6} {'closed form':>12} {'ring wire B':>12}")
    for r in rows:
        ratio = f"{r['measured'] / r['theory']:.3f}" if r["theory"] else "-"
        closed = f"{r['closed_form']:.0f}" if r["closed_form"] is not None else ""
        wire = f"{r['wire']:.0f}" if r["wire"] else ""
        theory = f"{r['theory']:.0f}" if r["theory"] is not None else ""
        note = f"  (DP ranks differ by {r['spread']:.0f})" if r["spread"] else ""
        if r["theory_all_rerun"] not in (None, r["theory"]):
            note += f"  (every update re-running: {r['theory_all_rerun']:.0f})"
        print(f"{r['case']:21} {r['pp']}x{r['dp']:<3} {r['stage']:>2} {r['kind']:20} {r['measured']:>15.0f} "
              f"{theory:>12} {ratio:>6} {closed:>12} {wire:>12}{note}")


# ------------------------------------------------------------------ the shapes


def scaled_table() -> None:
    """Theory only (no run): per-rank bytes per step of the issue's shapes, bf16, 1F1B."""
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule

    cases = [("GPT-2 medium", Model(layers=24, hidden=1024, heads=16, seq=1024, vocab=50304, micro_batch=8,
                                    microbatches=16), 4, 2),
             ("GPT-3 175B", Model(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, micro_batch=1,
                                  microbatches=64), 8, 8)]
    print(f"\n{'shape (theory, bf16, 1f1b)':27} {'PPxDP':6} {'P2P GiB/step (mid stage)':>25} "
          f"{'DP payload GiB':>15} {'DP ring wire GiB':>17}")
    for label, model, pp, dp in cases:
        config = ScheduleConfig(num_stages=pp, num_microbatches=model.microbatches, data_parallel_size=dp)
        schedule = build_schedule("1f1b", config)
        shapes = shapes_for(model, schedule.layout, dp, model.vocab, act_bytes=2)
        mid = step_comm_volume(schedule, shapes)[1]
        p2p = mid.get("p2p_act", 0) + mid.get("p2p_grad", 0)
        print(f"{label:27} {pp}x{dp:<4} {p2p / 2**30:>25.2f} {mid['data_parallel'] / 2**30:>15.2f} "
              f"{ring_all_reduce_bytes(mid['data_parallel'], dp) / 2**30:>17.2f}")


def _sensible(name: str, layout: str) -> bool:
    pp, dp = map(int, layout.split("x"))
    if name == "amdp":
        return dp == 1 and pp % 4 == 0  # AMDP is its own data parallelism; D = 0 mod 4 here
    return dp > 1 or name != "1f1b+overlap"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--layouts", nargs="*", default=["2x1", "4x1", "2x2"], help="PPxDP")
    p.add_argument("--cases", nargs="*", default=None, metavar="NAME@PPxDP",
                   help="run exactly these cases instead of --schedules x --layouts")
    for field, value in vars(Model()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    p.add_argument("--no-scaled", action="store_true", help="skip the issue's shapes (theory only)")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = Model(**{field: getattr(opts, field) for field in vars(Model())})
    print(f"GPT {model.layers} layers, h {model.hidden}, s {model.seq}, b {model.micro_batch}, "
          f"m {model.microbatches} per replica, V {model.vocab}, fp32, {model.iters} iterations; CPU gloo")
    cases = [c.split("@") for c in opts.cases] if opts.cases else \
        [(name, layout) for name in opts.schedules for layout in opts.layouts if _sensible(name, layout)]
    rows = []
    for name, layout in cases:
        pp, dp = map(int, layout.split("x"))
        rows += run_case(model, name, pp, dp)
    print_rows(rows)
    if not opts.no_scaled:
        scaled_table()
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

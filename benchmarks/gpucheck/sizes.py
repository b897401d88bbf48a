"""The runs' sizes: the issue's on a GPU, tiny ones for ``--cpu-dry-run`` (same steps, same
code paths, minutes -> seconds)."""
from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.gpucheck.flops import GPTShape

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# What each schedule needs beyond the common 4-stage flags (tests/test_checkpoint_resume.py's
# table at N = 4): interleaving takes 2 virtual stages per device (8 layers), async-1f1b is
# PACI with one micro-batch per update (here as large as the others' whole batch).
SCHEDULE_FLAGS: dict[str, list[str]] = {
    "interleaved-1f1b": ["--num-layers-per-virtual-pipeline-stage", "1"],
    "async-1f1b": ["--micro-batch-size", "{batch}", "--global-batch-size", "{batch}"],
}
COMPARED = ("1f1b", "paci", "zb-2p")  # fp32 device vs fp32 CPU (step 3) and the 4-stage throughput (step 4c)


def shape_flags(m: GPTShape) -> list[str]:
    return ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--num-attention-heads", str(m.heads),
            "--seq-length", str(m.seq), "--max-position-embeddings", str(m.seq), "--vocab-size", str(m.vocab)]


@dataclass(frozen=True)
class Sizes:
    device: str
    small: GPTShape  # step 3, 5 and 6: 8 layers so interleaving gets two chunks per stage
    small_micro: int
    bench: GPTShape  # step 4
    bench_micro: int
    iters: int = 10  # step 3
    bench_iters: int = 10
    bench_warmup: int = 3
    stages: int = 4
    microbatches: int = 8  # per update
    extra: list[str] = field(default_factory=list)

    def small_flags(self, schedule: str, *more: str) -> list[str]:
        flags = [*shape_flags(self.small), "--micro-batch-size", str(self.small_micro),
                 "--global-batch-size", str(self.small_micro * self.microbatches), "--train-iters", str(self.iters),
                 "--pipeline-model-parallel-size", str(self.stages), "--pipeline-schedule", schedule,
                 "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", *NO_DROPOUT, *self.extra]
        flags += [f.format(batch=self.small_micro * self.microbatches)
                  for f in SCHEDULE_FLAGS.get(schedule, [])]
        return [*flags, *more]

    def bench_flags(self, stages: int, schedule: str = "1f1b") -> list[str]:
        return [*shape_flags(self.bench), "--micro-batch-size", str(self.bench_micro),
                "--global-batch-size", str(self.bench_micro * self.microbatches), "--train-iters", str(self.bench_iters),
                "--pipeline-model-parallel-size", str(stages), "--pipeline-schedule", schedule, "--bf16",
                "--lr", "1e-4", "--log-interval", "1", "--device", self.device, *NO_DROPOUT, *self.extra]


GPT2_MEDIUM = GPTShape(layers=24, hidden=1024, heads=16, seq=1024, vocab=50304)
GPU = Sizes("cuda", GPTShape(8, 256, 8, 128, 1024), 4, GPT2_MEDIUM, 4)
# One thread per process keeps the dry run's timings stable on a shared CI machine.
CPU_DRY = Sizes("cpu", GPTShape(8, 16, 2, 16, 64), 1, GPTShape(4, 64, 4, 64, 256), 2,
                iters=6, bench_iters=3, bench_warmup=1, extra=["--num-threads", "1"])

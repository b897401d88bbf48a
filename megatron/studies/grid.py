"""The runs of a convergence study: which schedule, depth and optimizer, with which flags.

A study is a list of :class:`RunSpec`. Every run of a study shares the model, data order, seed
and token budget of its :class:`Preset`, so two runs differ only in what the study varies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STUDIES = ("paci", "depth")
# The delay-tolerant optimizers the studies set beside AdamW (#45), at AdamW's learning rate:
# Muon with Nesterov momentum and Moonshot's AdamW-matched update RMS (spectral scale x 0.2), and
# the delay-aware Nesterov look-ahead (NAdam, beta1 raised with the stage's declared delay).
MUON = ("--optimizer", "muon", "--muon-use-nesterov", "--muon-scale-mode", "spectral",
        "--muon-extra-scale-factor", "0.2")
LOOKAHEAD = ("--optimizer", "delay-nesterov")
ASYNC_OPTIMIZERS: dict[str, tuple[str, ...]] = {"": (), " + Muon": MUON, " + look-ahead": LOOKAHEAD}
# The studies' model since the trainer's defaults moved on: untied (asynchronous schedules must
# untie; 1F1B-flush would tie by default, #42, and train another model) and, on several stages,
# an even layer split (the balanced default, #43, moves layers off the head stage and with them
# each stage's share of the delay). Given only where they change something, so the runs they
# do not change keep their saved results.
UNTIED = ("--untie-embeddings-and-output-weights",)
EVEN_SPLIT = ("--pipeline-partition", "even")


@dataclass(frozen=True)
class Preset:
    """Model and budget of a study. ``full`` is the documented study; ``ci`` a reduced one."""

    name: str
    iterations: int  # optimizer updates per run (the token budget is iterations x tokens_per_update)
    global_batch: int  # sequences per update
    seq_length: int
    hidden_size: int
    num_heads: int
    paci_layers: int  # the PACI study's model: one layer per stage at paci_depth
    paci_depth: int
    paci_accumulations: tuple[int, ...]  # a = micro-batches per update (a = 1: async 1F1B)
    paci_iterations: int
    paci_lrs: tuple[float, ...]  # peak LRs of the PACI study (cosine decay to a tenth, as the paper)
    depth_layers: int  # the depth sweep's model, the same at every depth
    depths: tuple[int, ...]
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 1234
    eval_interval: int = 50
    eval_iters: int = 4
    rotation_refresh: int = 10

    @property
    def tokens_per_update(self) -> int:
        return self.global_batch * self.seq_length

    def model_flags(self, num_layers: int, iterations: int | None = None, lr: float | None = None,
                    decay: str = "constant") -> list[str]:
        """The tiny GPT and its recipe. The depth sweep keeps the LR constant after warm-up, so
        iterations-to-target is not shaped by a decay that ends every run at the same place;
        the PACI study decays it (cosine to a tenth, the PACI paper's recipe)."""
        lr = self.lr if lr is None else lr
        flags = [
            "--num-layers", str(num_layers), "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.num_heads), "--seq-length", str(self.seq_length),
            "--global-batch-size", str(self.global_batch), "--train-iters", str(iterations or self.iterations),
            "--lr", str(lr), "--lr-warmup-iters", str(self.warmup), "--lr-decay-style", decay,
            "--adam-beta2", "0.95", "--weight-decay", "0.1", "--seed", str(self.seed),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1",
            "--pipeline-executor", "emulator", "--log-interval", "1",
        ]
        return flags if decay == "constant" else [*flags, "--min-lr", str(lr / 10)]


FULL = Preset(name="full", iterations=400, global_batch=16, seq_length=32, hidden_size=32, num_heads=2,
              paci_layers=8, paci_depth=8, paci_accumulations=(1, 4, 8), paci_iterations=600,
              paci_lrs=(3e-4, 1e-3, 3e-3),
              depth_layers=32, depths=(1, 2, 4, 8, 16, 32))
CI = Preset(name="ci", iterations=24, global_batch=4, seq_length=16, hidden_size=16, num_heads=2,
            paci_layers=4, paci_depth=4, paci_accumulations=(1, 4), paci_iterations=24, paci_lrs=(1e-3, 1e-2),
            depth_layers=4, depths=(1, 2, 4), warmup=2, eval_interval=12, eval_iters=1, rotation_refresh=4)
PRESETS = {p.name: p for p in (FULL, CI)}


@dataclass(frozen=True)
class RunSpec:
    """One emulator run: ``flags`` are everything beyond the data flags."""

    study: str
    method: str  # the curve's label: "1F1B-flush", "PACI a=4", "AdamW", "BR 2nd/Bi", ...
    schedule: str
    depth: int
    flags: tuple[str, ...] = field(repr=False)
    variant: str = ""  # what else the study varies, e.g. "lr0.001"

    @property
    def name(self) -> str:
        """A file-safe unique name, e.g. ``depth-br-2nd-bi-p16`` or ``paci-paci-a-4-lr0.001-p8``."""
        slug = "".join(c if c.isalnum() else "-" for c in self.method.lower()).strip("-")
        while "--" in slug:
            slug = slug.replace("--", "-")
        return f"{self.study}-{slug}{'-' + self.variant if self.variant else ''}-p{self.depth}"


def paci_study(preset: Preset) -> list[RunSpec]:
    """1F1B-flush against PACI at one depth, same global batch, at each peak LR: a = 1 is async 1F1B;
    every asynchronous run with AdamW, then with Muon, then with the look-ahead (flush: AdamW).

    Flush runs the whole global batch as one micro-batch: its trajectory does not depend on the
    micro-batch count (up to rounding; the PACI paper maps one flush run to all counts too), and
    one micro-batch is its cheapest run. PACI runs ``a`` micro-batches of global_batch / a."""
    n = preset.paci_depth
    runs = []
    for lr in preset.paci_lrs:
        base = [*preset.model_flags(preset.paci_layers, preset.paci_iterations, lr, decay="cosine"),
                "--pipeline-model-parallel-size", str(n),
                "--eval-interval", str(preset.eval_interval), "--eval-iters", str(preset.eval_iters)]
        variant = f"lr{lr:g}"
        runs.append(RunSpec("paci", "1F1B-flush", "1f1b", n, (*base, "--pipeline-schedule", "1f1b",
                            "--micro-batch-size", str(preset.global_batch), *UNTIED), variant))
        for suffix, optimizer in ASYNC_OPTIMIZERS.items():
            for a in preset.paci_accumulations:
                schedule, label = ("async-1f1b", "async-1F1B (a=1)") if a == 1 else ("paci", f"PACI a={a}")
                runs.append(RunSpec("paci", label + suffix, schedule, n, (
                    *base, "--pipeline-schedule", schedule, "--micro-batch-size", str(preset.global_batch // a),
                    *optimizer), variant))
    return runs


def depth_methods(preset: Preset) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Method label -> (schedule, flags) of the depth sweep; all update once per micro-batch."""
    rotation = ("--optimizer", "basis-rotation", "--rotation-refresh-interval", str(preset.rotation_refresh))
    methods: dict[str, tuple[str, tuple[str, ...]]] = {
        "AdamW": ("async-1f1b", ()),
        # PipeMare T1 only, with the delays our async 1F1B really has (not the paper's formula).
        "PipeMare-LR": ("pipemare", ("--pipemare-lr-anneal-iters", str(preset.iterations // 2),
                                     "--pipemare-delay-model", "1f1b")),
    }
    for source, s in (("momentum", "1st"), ("second-moment", "2nd")):
        for geometry, g in (("unilateral", "Uni"), ("bilateral", "Bi")):
            methods[f"BR {s}/{g}"] = ("async-1f1b", (*rotation, "--rotation-source", source,
                                                     "--rotation-geometry", geometry))
    methods["Muon"] = ("async-1f1b", MUON)
    methods["Look-ahead"] = ("async-1f1b", LOOKAHEAD)
    return methods


def depth_study(preset: Preset) -> list[RunSpec]:
    """Async 1F1B at every depth with every optimizer: one model, more stages, more staleness."""
    runs = []
    for method, (schedule, extra) in depth_methods(preset).items():
        for p in preset.depths:
            runs.append(RunSpec("depth", method, schedule, p, (
                *preset.model_flags(preset.depth_layers), "--pipeline-model-parallel-size", str(p),
                "--pipeline-schedule", schedule, "--micro-batch-size", str(preset.global_batch), *extra,
                *(EVEN_SPLIT if p > 1 else ()))))
    return runs


def study_runs(preset: Preset, studies: tuple[str, ...] = STUDIES) -> list[RunSpec]:
    builders = {"paci": paci_study, "depth": depth_study}
    return [run for study in studies for run in builders[study](preset)]

"""The planner's cost inputs: the time of one layer, the embedding and the head, per micro-batch.

Why in these units: every stage's costs are sums of them (a stage of ``k`` layers runs ``k``
layers' F, B and W, plus the embedding on the first stage and the head on the last), so one
profile or one datasheet estimate prices every layer split, pipeline depth and schedule. Times
are milliseconds of one micro-batch of ``micro_batch`` sequences; a profile taken at another
micro-batch size is scaled linearly (:meth:`UnitCosts.at_micro_batch`), which is what matmul
time does once the device is saturated and over-estimates small micro-batches on a GPU.

File format (``--costs FILE``, written by ``--profile``): one JSON object with the fields of
:class:`UnitCosts`; ``layer``, ``embedding`` and ``head`` are ``{"f": ms, "b": ms, "w": ms}``;
the optional ``activations`` and ``kept_for_w`` are ``{"layer": bytes, "embedding": bytes, "head": bytes}``.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PassCosts:
    """Forward, input-gradient backward and weight-gradient times (ms) of one part."""

    f: float
    b: float
    w: float

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"cost {name} must be a non-negative number, got {value!r}")

    def scaled(self, factor: float) -> "PassCosts":
        return PassCosts(self.f * factor, self.b * factor, self.w * factor)

    def __add__(self, other: "PassCosts") -> "PassCosts":
        return PassCosts(self.f + other.f, self.b + other.b, self.w + other.w)


ZERO = PassCosts(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one micro-batch keeps for its backward on a layer, the embedding and the head, as
    the runtime's activation meter counts them (a profile measures them; without one the planner
    uses the analytic count, :func:`megatron.pipeline.costs.stages.part_activation_bytes`)."""

    layer: float
    embedding: float = 0.0
    head: float = 0.0

    def scaled(self, factor: float) -> "ActivationBytes":
        return ActivationBytes(self.layer * factor, self.embedding * factor, self.head * factor)

    def part(self, layers: int, first: bool, last: bool) -> float:
        """Bytes of a part of ``layers`` layers, with the embedding on the first, the head on the last."""
        return layers * self.layer + (self.embedding if first else 0.0) + (self.head if last else 0.0)


@dataclass(frozen=True)
class UnitCosts:
    """Per-micro-batch times (ms) the planner builds every stage's costs from.

    ``p2p``: from the end of a sending op to the arrival of its activation (or gradient);
    ``message_cpu``: the CPU time the transport spends on one such message, both ends together
    (gloo on a CPU host copies it through the kernel twice and wakes two threads; charged to
    the sender as :attr:`~megatron.pipeline.costs.op_costs.OpCosts.t_send`: on a dedicated core it
    delays the sender, on shared cores it is work the cores do); ``shared_message_cpu``: the same
    when twice as many ranks as cores time-share them (every hand-over between a rank's threads
    then waits for a slice and refills caches: about 3 times ``message_cpu`` on this project's
    2-core host), used by :meth:`time_sliced`; 0 when not measured;
    ``optimizer_per_param``: the optimizer step's time per parameter of a stage (ms), so a stage's
    ``t_opt`` follows its parameter count; ``sync``: the synchronous step's collective latency
    (norms, statistics) on top of it; ``source``: where the numbers came from (reported);
    ``host_cores``: the cores one node's ranks share when the costs were taken on a CPU host
    (``--profile`` there records its usable cores), None where every rank has a device of its own.
    With fewer cores than stages the planner replays candidates with processor sharing
    (:mod:`megatron.pipeline.planner.shared_cores`).
    """

    micro_batch: int
    layer: PassCosts
    embedding: PassCosts = ZERO
    head: PassCosts = ZERO
    p2p: float = 0.0
    optimizer_per_param: float = 0.0
    sync: float = 0.0
    reduce_ms_per_byte: float = 0.0  # a gradient collective (data-parallel, AMDP's replicas), per byte one rank sends
    message_cpu: float = 0.0
    shared_message_cpu: float = 0.0
    source: str = "given"
    host_cores: float | None = None
    activations: ActivationBytes | None = None  # measured by a profile; None: the analytic count
    kept_for_w: ActivationBytes | None = None  # of those, what a B leaves for its W (measured)

    def at_micro_batch(self, micro_batch: int) -> "UnitCosts":
        """The costs at another micro-batch size, linear in the sequences of a micro-batch."""
        factor = micro_batch / self.micro_batch
        return dataclasses.replace(self, micro_batch=micro_batch, layer=self.layer.scaled(factor),
                                   embedding=self.embedding.scaled(factor), head=self.head.scaled(factor),
                                   p2p=self.p2p * factor, message_cpu=self.message_cpu * factor,
                                   shared_message_cpu=self.shared_message_cpu * factor,
                                   activations=None if self.activations is None else self.activations.scaled(factor),
                                   kept_for_w=None if self.kept_for_w is None else self.kept_for_w.scaled(factor))

    def time_sliced(self) -> "UnitCosts":
        """The costs of ranks that time-share the host's cores: a message's CPU as measured there."""
        if not self.shared_message_cpu:
            return self
        return dataclasses.replace(self, message_cpu=self.shared_message_cpu)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "UnitCosts":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k not in RETIRED}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cost field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "micro_batch" not in values or "layer" not in values:
            raise ValueError("a cost file needs 'micro_batch' and 'layer'")
        parts = {k: PassCosts(**values[k]) for k in ("layer", "embedding", "head") if k in values}
        scalars = {k: float(v) for k, v in values.items() if k in SCALARS}
        cores = values.get("host_cores")
        measured = {k: ActivationBytes(**values[k]) for k in ("activations", "kept_for_w") if values.get(k) is not None}
        return cls(micro_batch=int(values["micro_batch"]), source=str(values.get("source", "file")),
                   host_cores=None if cores is None else float(cores), **measured, **parts, **scalars)


#: the plain-number fields of a cost file
SCALARS = ("p2p", "optimizer_per_param", "sync", "reduce_ms_per_byte", "message_cpu", "shared_message_cpu")
#: fields earlier profiles wrote that the model no longer reads (read and dropped):
#: ``shared_core_slowdown`` (see :mod:`megatron.trainer.tasks.link_profile`)
RETIRED = frozenset({"shared_core_slowdown"})


def load_unit_costs(path: str) -> UnitCosts:
    """Read a cost file (format: module docstring); ValueError with the path on a bad one."""
    with open(path) as f:
        try:
            return UnitCosts.from_dict(json.load(f))
        except (TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None


def save_unit_costs(costs: UnitCosts, path: str) -> None:
    with open(path, "w") as f:
        json.dump(costs.to_dict(), f, indent=2)


_TIMES = ("t_f", "t_b", "t_w")


def layer_and_head(stage_costs: Sequence[Mapping[str, float]], layers: Sequence[int]) -> tuple[PassCosts, PassCosts]:
    """(one layer's, the head's F/B/W) from a chain's per-stage times (``t_f``, ``t_b``, ``t_w``)
    with ``layers[s]`` layers on stage ``s``. A stage's time is ``k * layer`` plus the embedding
    on the first and the head on the last; the embedding (a table lookup, and a scatter-add in
    W: no matmul) is folded into the layers, so the stages before the last give the layer (their
    time over their layers) and the last stage's remainder is the head's (clipped at 0 where
    timing noise makes it negative). ValueError when the stages before the last hold no layers."""
    if len(stage_costs) != len(layers) or len(stage_costs) < 2:
        raise ValueError(f"need the costs and layer counts of a chain of at least 2 stages, got "
                         f"{len(stage_costs)} and {len(layers)}")
    body = sum(layers[:-1])
    if not body:
        raise ValueError("the stages before the last hold no layers: no per-layer cost to derive")
    layer = PassCosts(*(sum(c[k] for c in stage_costs[:-1]) / body for k in _TIMES))
    head = PassCosts(*(max(0.0, stage_costs[-1][k] - layers[-1] * getattr(layer, k[2:])) for k in _TIMES))
    return layer, head


def from_two_stage_profile(stage_costs: list[Mapping[str, float]], counts: tuple[int, int], micro_batch: int,
                           source: str = "profiled") -> UnitCosts:
    """Unit costs from the runtime's own F/B/W profile of a 2-stage split (``--zb-profile-iters``):
    stage 0 runs ``counts[0]`` layers and the embedding, stage 1 ``counts[1]`` layers and the head
    (:func:`layer_and_head`: two stages give two equations per pass for three unknowns)."""
    layer, head = layer_and_head(stage_costs, counts)
    return UnitCosts(micro_batch=micro_batch, layer=layer, head=head, p2p=float(stage_costs[0].get("t_comm", 0.0)),
                     source=source)

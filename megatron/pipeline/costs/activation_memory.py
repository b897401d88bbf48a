"""What activation recompute does to a stage's per-micro-batch memory and backward time (torch-free).

The per-layer activation memory of a transformer layer is Korthikanti et al.'s (2023, Table 2,
no tensor or sequence parallelism): ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations
and 1-byte dropout masks, of which ``5*a*s^2*b`` are core attention's internals (scores,
softmax, its dropout mask and output). Recompute keeps, per layer:

* ``selective`` (core attention recomputed): ``34*s*b*h``;
* ``full``: only the input of each recomputed unit, ``2*s*b*h`` per unit (``uniform``: one
  unit per ``n`` layers; ``block``: the first ``n`` layers are units of one, the others keep
  everything).

:func:`recompute_fraction` is the ratio kept / kept without recompute, the simulator's ``m_f``
(``megatron.pipeline.simulator.OpCosts``); :func:`recompute_costs` puts it and the
recomputation's time into a stage's costs. The recomputation reruns the forward of what it
drops: all of a full unit (its share of ``t_f``), or core attention's ``4*b*s^2*h`` of a
layer's ``24*b*s*h^2 + 4*b*s^2*h`` forward FLOPs (selective).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.pipeline.costs.op_costs import OpCosts


@dataclass(frozen=True)
class LayerShape:
    """The shapes that set a transformer layer's activation memory."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: int

    @property
    def sbh(self) -> int:
        return self.seq_length * self.micro_batch_size * self.hidden_size

    def attention_internals(self) -> float:
        """Core attention's share, ``5*a*s^2*b`` (16-bit units)."""
        return 5.0 * self.num_attention_heads * self.seq_length ** 2 * self.micro_batch_size

    def layer_bytes(self) -> float:
        """A layer without recompute, ``sbh*(34 + 5as/h)``."""
        return 34.0 * self.sbh + self.attention_internals()

    def weight_grad_bytes(self) -> float:
        """What a split backward keeps from B to W per layer: the split linears' inputs (7 sbh)
        and output gradients (9 sbh), ``32*s*b*h`` bytes in 16-bit (ffn = 4h); recompute does
        not change it (B recomputes those inputs and W keeps them)."""
        return 32.0 * self.sbh

    def attention_flop_share(self) -> float:
        """Core attention's share of a layer's forward FLOPs, ``s / (6h + s)``."""
        s, h = self.seq_length, self.hidden_size
        return s / (6.0 * h + s)


def kept_bytes(shape: LayerShape, layers: int, granularity: str | None, method: str | None = None,
               num_layers: int | None = None) -> float:
    """Activation bytes (16-bit model) one micro-batch keeps on a stage of ``layers`` layers."""
    full_layer = shape.layer_bytes()
    if granularity is None:
        return layers * full_layer
    if granularity == "selective":
        return layers * 34.0 * shape.sbh
    if granularity != "full" or num_layers is None or num_layers < 1:
        raise ValueError(f"unknown recompute {granularity!r} / {method!r} / {num_layers!r}")
    if method == "uniform":
        return -(-layers // num_layers) * 2.0 * shape.sbh
    recomputed = min(num_layers, layers)
    return recomputed * 2.0 * shape.sbh + (layers - recomputed) * full_layer


def recompute_fraction(shape: LayerShape, layers: int, granularity: str | None, method: str | None = None,
                       num_layers: int | None = None) -> float:
    """``m_f``: what F keeps with recompute, as a share of what it keeps without."""
    if layers == 0:
        return 1.0
    return kept_bytes(shape, layers, granularity, method, num_layers) / kept_bytes(shape, layers, None)


def recompute_time_share(shape: LayerShape, layers: int, granularity: str | None, method: str | None = None,
                         num_layers: int | None = None) -> float:
    """Share of the stage's layer forward time that B reruns."""
    if granularity is None or layers == 0:
        return 0.0
    if granularity == "selective":
        return shape.attention_flop_share()
    recomputed = layers if method == "uniform" else min(num_layers or 0, layers)
    return recomputed / layers


def recompute_costs(costs: OpCosts, shape: LayerShape, layers: int, granularity: str | None,
                    method: str | None = None, num_layers: int | None = None) -> OpCosts:
    """``costs`` (measured or assumed without recompute) with recompute: ``m_f`` from
    :func:`recompute_fraction`, the rerun share of ``t_f`` (the whole stage's forward, an upper
    bound on first/last stages with embedding or head) added to ``t_b`` (and ``t_bw``)."""
    extra = costs.t_f * recompute_time_share(shape, layers, granularity, method, num_layers)
    return dataclasses.replace(
        costs, m_f=recompute_fraction(shape, layers, granularity, method, num_layers), t_b=costs.t_b + extra,
        t_bw=None if costs.t_bw is None else costs.t_bw + extra)

"""Analytic unit costs from a model's FLOPs and bytes on a datasheet device (``--device``).

Why analytic: a user planning for a cluster they do not have in front of them can still rank
schedules, because what separates schedules is the *ratio* of F, B, W, P2P and the step, which
follows from the model's shape; the absolute scale (the achieved fraction of peak) moves every
candidate's tokens/s by the same factor and does not change the ranking.

Model, per micro-batch of ``b`` sequences of ``s`` tokens (:mod:`megatron.pipeline.costs.cost_model`'s
counting, split by pass; tensor parallelism ``t`` divides the matmuls):

* layer: linears ``L = 2h(q + kv) + 2h·ffn(x2 gated) + 2·ffn·h + 2qh`` FLOPs per token forward,
  core attention ``A = 4·s·a·d``; F = ``L + A``, B = ``L + 2A`` (the input gradients; attention has
  no weights), W = ``L`` (the linears' weight gradients), so F + B + W = ``3(L + A)`` =
  :func:`~megatron.pipeline.costs.cost_model.layer_flops`. With ``t > 1`` F and B each add two
  all-reduces of the ``s·b·h`` activation over the intra-node link (ring, ``2(t-1)/t``).
* head: output layer ``2hV`` per token in each pass, the loss ``4V`` forward and ``8V`` backward
  (:data:`~megatron.pipeline.costs.cost_model._LOSS_FLOPS_PER_LOGIT`), none in W.
* embedding: memory-bound: F writes the ``s·b·h`` looked-up rows, W scatter-adds them into an
  fp32 gradient (read + write), at HBM bandwidth; B is 0 (no input gradient).
* P2P: one ``s·b·h`` activation over the inter-node link per message.
* optimizer: AdamW moves ~30 bytes per parameter at HBM bandwidth (reads fp32 master, grad, m, v:
  16; writes master, m, v: 12; the 16-bit copy: 2).
* data-parallel gradient reduction: ring all-reduce of fp32 gradients over the inter-node link.

Every time is FLOPs / (peak x achieved fraction) or bytes / bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.pipeline.costs.cost_model import ModelShape
from megatron.pipeline.costs.unit_costs import PassCosts, UnitCosts

ADAMW_BYTES_PER_PARAM = 30.0  # derivation: module docstring


@dataclass(frozen=True)
class Device:
    """Datasheet figures of one accelerator (per device) and the achieved fraction of peak."""

    name: str
    peak_tflops: float  # dense 16-bit (fp32 for cpu) tensor throughput
    achieved: float  # model FLOPs utilisation reached by Megatron-style training
    hbm_gbs: float  # memory bandwidth, GB/s
    intra_gbs: float  # tensor-parallel link, GB/s per direction
    inter_gbs: float  # pipeline / data-parallel link, GB/s per direction
    memory_gb: float
    source: str


#: One table of every datasheet value the analytic costs use, with where each comes from.
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", 989.0, 0.45, 3350.0, 450.0, 50.0, 80.0,
           "NVIDIA H100 SXM5 datasheet (2023): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s "
           "bidirectional; ConnectX-7 NDR 400 Gb/s per GPU; achieved 0.45: Megatron-LM README (GPT-3 175B, "
           "47% MFU on H100)"),
    Device("a100", 312.0, 0.52, 2039.0, 300.0, 25.0, 80.0,
           "NVIDIA A100 80GB SXM datasheet (2021): 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e, NVLink 600 GB/s "
           "bidirectional; HDR 200 Gb/s per GPU; achieved 0.52: Narayanan et al. 2021, Table 1 (163 of 312 "
           "TFLOP/s, GPT-3 175B)"),
    Device("h200", 989.0, 0.45, 4800.0, 450.0, 50.0, 141.0,
           "NVIDIA H200 SXM datasheet (2024): 989 TFLOP/s dense BF16 (the H100's), 4.8 TB/s HBM3e, 141 GB, "
           "NVLink 900 GB/s bidirectional; NDR 400 Gb/s per GPU; achieved: as H100"),
    Device("cpu", 0.192, 0.3, 20.0, 5.0, 5.0, 24.0,
           "nominal x86 host, not a datasheet: 2 cores x 3 GHz x 32 fp32 FLOP/cycle (AVX2, two FMA units) = "
           "192 GFLOP/s, 0.3 reached by PyTorch's CPU GEMMs at hidden 256-1024, ~20 GB/s DRAM per process, "
           "gloo loopback ~5 GB/s; use --profile on a CPU instead"),
)}


def _flops_ms(flops: float, device: Device) -> float:
    return flops / (device.peak_tflops * 1e12 * device.achieved) * 1e3


def _bytes_ms(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e9) * 1e3


def layer_pass_flops(shape: ModelShape) -> tuple[float, float, float]:
    """(F, B, W) FLOPs of one layer on one micro-batch, no tensor parallelism (module docstring)."""
    tokens = shape.seq_length * shape.micro_batch
    h, d = shape.hidden, shape.kv_channels
    q, kv = shape.heads * d, 2 * shape.query_groups * d
    up = shape.ffn * (2 if shape.gated_mlp else 1)
    linear = 2.0 * h * (q + kv) + 2.0 * h * up + 2.0 * shape.ffn * h + 2.0 * q * h
    attention = 4.0 * shape.seq_length * shape.heads * d
    return tokens * (linear + attention), tokens * (linear + 2 * attention), tokens * linear


def head_pass_flops(shape: ModelShape) -> tuple[float, float, float]:
    """(F, B, W) FLOPs of a GPT's output layer and loss on one micro-batch."""
    tokens = shape.seq_length * shape.micro_batch
    out = 2.0 * shape.hidden * shape.vocab
    return tokens * (out + 4.0 * shape.vocab), tokens * (out + 8.0 * shape.vocab), tokens * out


def analytic_unit_costs(shape: ModelShape, device: Device, tensor_parallel: int = 1) -> UnitCosts:
    """Unit costs of ``shape`` (at its micro-batch size) on ``device`` (model: module docstring)."""
    t = tensor_parallel
    activation = shape.seq_length * shape.micro_batch * shape.hidden * shape.activation_bytes
    tp_comm = 2 * _bytes_ms(2.0 * (t - 1) / t * activation, device.intra_gbs) if t > 1 else 0.0
    f, b, w = (_flops_ms(x / t, device) for x in layer_pass_flops(shape))
    hf, hb, hw = (_flops_ms(x / t, device) for x in head_pass_flops(shape))
    rows = shape.seq_length * shape.micro_batch * shape.hidden
    embedding = PassCosts(_bytes_ms(rows * shape.activation_bytes, device.hbm_gbs), 0.0,
                          _bytes_ms(rows * 4 * 2, device.hbm_gbs))
    return UnitCosts(
        micro_batch=shape.micro_batch, layer=PassCosts(f + tp_comm, b + tp_comm, w),
        embedding=embedding, head=PassCosts(hf, hb, hw),
        p2p=_bytes_ms(activation / t, device.inter_gbs),
        optimizer_per_param=_bytes_ms(ADAMW_BYTES_PER_PARAM, device.hbm_gbs),
        reduce_ms_per_byte=_bytes_ms(1.0, device.inter_gbs), source=f"analytic:{device.name}")

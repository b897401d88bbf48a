"""Model FLOPs and MFU, counted as Megatron-LM counts them.

Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, read at commit
001b00c2 of NVIDIA/Megatron-LM) counts, per token, 3 passes (forward, weight gradient, input
gradient) x 2 FLOPs per multiply-add over the GEMMs: per layer the QKV projection
``h * (q + 2 kv)``, the core attention ``q * s / 2 * 2`` (QK^T and its product with V, halved
for the causal mask), the output projection ``q * h`` and the MLP ``h * ffn * 2`` (3 with
SwiGLU); plus the logits ``h * V``. Element-wise work (norms, softmax, loss) is not counted. This
is our own dense-model version of that formula (no MoE, MLA or MTP terms: our GPT has none).

The trainer's own ``flops_per_iteration`` (``--log-throughput``) counts the attention without
the causal halving; ``tests/test_gpu_check.py`` checks that the two differ by exactly that term.
"""
from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 peak (TFLOP/s) by device-name substring, first match wins: H100 SXM and H200 share
# the H100's 989 (NVIDIA's data sheets, without sparsity); PCIe H100s are slower.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


@dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None  # 4 * hidden when None
    query_groups: int | None = None  # heads when None (no GQA)
    swiglu: bool = False


def flops_per_token(m: GPTShape) -> float:
    """Training FLOPs per token (forward and backward), Megatron-LM's count."""
    kv_channels = m.hidden // m.heads
    q = kv_channels * m.heads
    kv = kv_channels * (m.query_groups or m.heads)
    ffn = m.ffn or 4 * m.hidden
    attention = m.hidden * (q + 2 * kv) + q * m.seq + q * m.hidden  # q*s/2 causal, x2 for QK^T and AV
    mlp = m.hidden * ffn * (3 if m.swiglu else 2)
    return 3 * 2 * (m.layers * (attention + mlp) + m.hidden * m.vocab)


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The device's dense bf16 peak, ``override`` (``--peak-tflops``) first; None if unknown."""
    if override:
        return override
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


def mfu(tokens_per_s: float, shape: GPTShape, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (None without a peak)."""
    return tokens_per_s * flops_per_token(shape) / (peak * 1e12) if peak else None

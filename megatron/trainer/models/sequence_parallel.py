"""``--sequence-parallel`` on megatron-core's local spec and on CPU.

With ``TransformerConfig.sequence_parallel`` megatron's own layers do the sharding: the
embedding scatters its output over the TP group along the sequence, column-parallel linears
all-gather their input, row-parallel linears reduce-scatter their output and the norms (and
dropouts) between them run on ``s / T`` positions. Two pieces of the local path do not follow
by themselves, and this module supplies them:

* ``WrappedTorchNorm`` (the local spec's norm without apex) refuses sequence parallelism,
  only because it has nowhere to record that its parameters now see a sequence shard:
  :class:`SequenceShardNorm` is the same ``torch.nn`` norm with megatron's
  ``sequence_parallel`` mark on its weight and bias (the mark that says "partial gradient per
  TP rank: all-reduce over the TP group", see
  :func:`megatron.pipeline.runtime.tensor_parallel.reduce_sequence_parallel_grads`);
* the embedding and the transformer block fork megatron's CUDA RNG tracker around the
  sequence-parallel region (so dropout differs per TP rank). On CPU there is no CUDA
  generator: :class:`CpuRNGStatesTracker` is the same tracker over the CPU generator.
"""
from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron.trainer.models.sequence_collectives import use_on_cpu

# megatron's offset of the TP-rank-dependent seed (model_parallel_cuda_manual_seed).
_TP_SEED_OFFSET = 2718


class SequenceShardNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` as megatron's local spec builds it, with the
    parameters marked ``sequence_parallel`` when the config is (their gradients then cover
    only this TP rank's sequence shard)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_shard_norms(spec: ModuleSpec) -> ModuleSpec:
    """The local layer spec with :class:`SequenceShardNorm` where it has ``WrappedTorchNorm``."""
    sub = spec.submodules
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, field, None) is WrappedTorchNorm:
            setattr(sub, field, SequenceShardNorm)
    return spec


def block_spec(spec: ModuleSpec, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """What to hand ``GPTModel`` as its layer spec: the layer spec as is, unless the block's
    final norm (megatron picks ``WrappedTorchNorm`` for a bare layer spec) must be a
    :class:`SequenceShardNorm`; then the block's submodules with that norm."""
    if not config.sequence_parallel or spec.submodules.input_layernorm is not SequenceShardNorm:
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=SequenceShardNorm)


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's RNG tracker over the CPU generator: ``fork`` swaps the named state in for
    the region's dropout and keeps where it ended."""

    def add(self, name: str, seed: int) -> None:
        if name in self.states_ or seed in self.seeds_:
            raise ValueError(f"RNG state {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name} was never added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def adopt_split_output_layer(model: torch.nn.Module) -> None:
    """Give GPT's output layer (a plain ``ColumnParallelLinear`` megatron builds itself) our
    split linear's matmul: megatron's sequence-parallel matmul gathers into a CUDA-only buffer,
    ours gathers on the input's device. Same parameters; its W may then be deferred too."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron.trainer.models.split_linear import SplitColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if type(layer) is ColumnParallelLinear:
        layer.__class__ = SplitColumnParallelLinear
        layer._wgrad_fifo = deque()


def seed_sequence_parallel_rng(seed: int, tp_rank: int, device: torch.device) -> None:
    """Give megatron's tracker its per-TP-rank state (``seed + 2718 + tp_rank``, megatron's
    rule): the CUDA tracker on GPUs (unless seeded already), a fresh :class:`CpuRNGStatesTracker`
    on CPU (stages are built before any forward, so every chunk of a rank installs the same)."""
    if device.type == "cuda":
        if not megatron_random.get_cuda_rng_tracker().is_initialized():
            megatron_random.model_parallel_cuda_manual_seed(seed)
        return
    use_on_cpu()
    tracker = CpuRNGStatesTracker()
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

"""What every pipeline-stage model here shares: architecture arguments, the layer split, the
local layer spec, one stage's ``TransformerConfig``, and initialisation by global name.

A model family (GPT in :mod:`.gpt`, BERT in :mod:`.bert`) builds a complete megatron-core model
per stage whose ``TransformerConfig.num_layers`` is the number of layers *of that stage*
(megatron's own parallel state has pipeline size 1; our runtime does the pipelining), wraps it
in a :class:`PipelineStage`, and re-initialises every parameter from (seed, global name) with
:meth:`PipelineStage.init_parameters`, so every split of the model starts bit-identical.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal, scaled_init_method_normal

from megatron.pipeline.runtime.tied_embeddings import mark_tied
from megatron.trainer.config.job_config import PrecisionConfig
from megatron.trainer.models.recompute import RecomputeSettings, install_recompute
from megatron.trainer.models.rope import make_rotary_device_agnostic
from megatron.trainer.models.sdpa_attention import SDPAAttention
from megatron.trainer.models.sequence_parallel import (
    adopt_split_output_layer,
    seed_sequence_parallel_rng,
    with_sequence_shard_norms,
)
from megatron.trainer.models.split_linear import with_split_linears
from megatron.trainer.config.tensor_parallel_args import check_tensor_parallel_args
from megatron.trainer.models.tensor_parallel import (
    full_shape,
    mark_tensor_parallel,
    shard_layout,
    stage_tp_group,
    take_shard,
    tp_rank_and_size,
)


@dataclass
class TransformerArgs:
    """Architecture of the whole (unsplit) transformer, whatever its head."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    num_query_groups: int | None = None  # None: num_attention_heads (no GQA)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    normalization: str = "LayerNorm"  # or "RMSNorm"
    position_embedding_type: str = "learned_absolute"  # or "rope"
    bf16: bool = False
    fp16: bool = False  # fp16 weights and activations (fp32 masters, dynamic loss scaling)
    # Megatron-LM's --swiglu, --disable-bias-linear, --norm-epsilon, --kv-channels,
    # --rotary-base, --rotary-percent, --attention-backend (see megatron_compat_args).
    swiglu: bool = False
    add_bias_linear: bool = True
    norm_epsilon: float = 1e-5
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    attention_backend: str = "auto"
    # None: Transformer Engine's spec when TE imports and CUDA is available, else local + SDPA.
    use_transformer_engine: bool | None = None
    # Megatron-LM's --recompute-granularity/-method/-num-layers (see models/recompute.py).
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_stash_weights: bool = False
    # Megatron-LM's --sequence-parallel (TP > 1): norms and dropouts on s / T positions.
    sequence_parallel: bool = False
    # Tied input embedding and output layer (Megatron's default; see runtime/tied_embeddings.py).
    tie_embeddings: bool = False

    @property
    def recompute(self) -> RecomputeSettings:
        return RecomputeSettings(self.recompute_granularity, self.recompute_method,
                                 self.recompute_num_layers, self.recompute_stash_weights)


def model_dtype(args: TransformerArgs | PrecisionConfig) -> torch.dtype:
    """The dtype of a stage's weights and of the activations it sends: bf16, fp16 or fp32."""
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


def split_layers(
    num_layers: int, num_stages: int, explicit: Sequence[int] | None = None
) -> list[range]:
    """Global layer indices owned by each pipeline stage.

    Even split by default (an uneven one must be asked for explicitly, so that a typo in the
    stage count cannot silently unbalance the pipeline). ``explicit`` gives per-stage layer
    counts; zero is allowed (e.g. a first stage holding only the embedding) but the counts must
    add up to ``num_layers``.
    """
    if num_layers < 1 or num_stages < 1:
        raise ValueError(
            f"need num_layers >= 1 and num_stages >= 1, got {num_layers}, {num_stages}"
        )
    if explicit is None:
        if num_layers % num_stages:
            raise ValueError(
                f"{num_layers} layers do not split evenly over {num_stages} stages; "
                "pass explicit per-stage counts"
            )
        counts = [num_layers // num_stages] * num_stages
    else:
        counts = [int(c) for c in explicit]
        if len(counts) != num_stages:
            raise ValueError(f"expected {num_stages} per-stage counts, got {len(counts)}")
        if any(c < 0 for c in counts):
            raise ValueError(f"per-stage layer counts must be >= 0, got {counts}")
        if sum(counts) != num_layers:
            raise ValueError(f"per-stage layer counts {counts} do not sum to {num_layers}")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def resolve_use_transformer_engine(requested: bool | None) -> bool:
    """Decide on Transformer Engine: auto means "only where it can actually run"."""
    if requested is not None:
        return requested
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def layer_spec(
    args: TransformerArgs, use_te: bool, attn_mask_type: AttnMaskType = AttnMaskType.causal
) -> ModuleSpec:
    """Megatron's transformer layer spec with the given self-attention mask type.

    The local spec gets our device-agnostic core attention and our split linears (plain
    linears unless a B/W-split backward defers their weight grads). GPT's and BERT's layers
    differ only in the mask type (causal vs padding), so both start from GPT's spec.
    """
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization)
        spec.submodules.self_attention.submodules.core_attention = SDPAAttention
        spec = with_split_linears(spec)
        if args.sequence_parallel:  # torch norms whose gradients are marked partial per TP rank
            spec = with_sequence_shard_norms(spec)
    if attn_mask_type != AttnMaskType.causal:
        spec.submodules.self_attention.params["attn_mask_type"] = attn_mask_type
    return spec


def transformer_config(args: TransformerArgs, num_stage_layers: int) -> TransformerConfig:
    """Config of one stage: its own layer count, CPU init, no fusions (they need CUDA/compile)."""
    return TransformerConfig(
        num_layers=num_stage_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # Explicit so that megatron does not derive them from this stage's layer count (which
        # may be 0, and is the wrong count anyway); ``init_parameters`` applies the same rules.
        init_method=init_method_normal(args.init_method_std),
        output_layer_init_method=scaled_init_method_normal(args.init_method_std, args.num_layers),
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=args.add_bias_linear,
        kv_channels=args.kv_channels,
        bf16=args.bf16,
        fp16=args.fp16,
        # Built in fp32 and cast afterwards: params_dtype=bf16 leaves some modules in fp32.
        params_dtype=torch.float32,
        pipeline_dtype=model_dtype(args),
        use_cpu_initialization=True,
        # Every parameter is overwritten by ``init_parameters``; skipping megatron's own init
        # saves time and leaves the global RNG untouched.
        perform_initialization=False,
        cuda_graph_scope=[],
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=args.sequence_parallel,
        # megatron checks SP against it, and RoPE's length is the shard's times it.
        **({"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size()}
           if args.sequence_parallel else {}),
        **args.recompute.config_fields(),
    )


TIED_EMBEDDING, TIED_OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
_NORM_WEIGHTS = re.compile(r"(layernorm\.weight|layer_norm_weight|norm\.weight)$")


def _param_seed(seed: int, global_name: str) -> int:
    """Stable 63-bit seed for one parameter (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(
    global_name: str, shape: torch.Size, seed: int, std: float, total_layers: int
) -> torch.Tensor:
    """Megatron's initial value for a parameter, as a pure function of its global name.

    Rules (megatron's defaults): biases 0; norm weights 1; each layer's output projections
    N(0, std / sqrt(2 * total_layers)) -- total over the whole model, not the stage; every other
    weight (linears, embeddings) N(0, std). Unknown parameters raise, so a new module type cannot
    silently keep uninitialised memory.
    """
    if global_name.endswith("bias"):
        return torch.zeros(shape)
    if _NORM_WEIGHTS.search(global_name):
        return torch.ones(shape)
    if not global_name.endswith("weight") or len(shape) < 2:
        raise ValueError(f"no init rule for parameter {global_name!r} of shape {tuple(shape)}")
    if global_name.endswith(_OUTPUT_PROJECTIONS):
        std = std / math.sqrt(2.0 * total_layers)
    generator = torch.Generator(device="cpu").manual_seed(_param_seed(seed, global_name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class PipelineStage(torch.nn.Module):
    """One pipeline stage wrapping a per-stage megatron-core model.

    The runtime calls ``forward(input_tensor, batch)``; the first stage ignores
    ``input_tensor``. ``block`` is the model's transformer-block attribute (``decoder`` for
    GPT, ``encoder`` for BERT), whose local layer numbers are mapped to global ones.

    ``middle_batch_keys``: the batch entries this stage needs when it is neither the first nor
    the last virtual stage (the worker hands a middle stage nothing else, and reads no data at
    all for it when this is empty). Attention masks are the usual case: every layer needs them.
    """

    block: str = "decoder"

    def __init__(self, args: TransformerArgs, layers: range, model: torch.nn.Module) -> None:
        super().__init__()
        self.args = args
        self.layers = layers
        self.is_first = bool(model.pre_process)
        self.is_last = bool(model.post_process)
        self.model = model
        self.middle_batch_keys: tuple[str, ...] = ()
        self._local_layer = re.compile(rf"^{self.block}\.layers\.(\d+)\.")
        if args.tie_embeddings:  # the copy exists only where the output layer lacks the embedding
            mark_tied(model.embedding.word_embeddings.weight if self.is_first else None,
                      model.output_layer.weight if self.is_last and not self.is_first else None)

    @property
    def activation_dtype(self) -> torch.dtype:
        """Dtype of the hidden states crossing stage boundaries."""
        return model_dtype(self.args)

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """``(s, b, h)`` of the tensors crossing stage boundaries (Megatron's layout)."""
        return (self.args.seq_length, micro_batch_size, self.args.hidden_size)

    def global_name(self, local_name: str) -> str:
        """Map a local parameter name to its name in the unsplit model."""
        match = self._local_layer.match(local_name)
        if match is None:  # a tied output layer's copy is the embedding: initialised, saved, loaded as it
            return TIED_EMBEDDING if self.args.tie_embeddings and local_name == TIED_OUTPUT else local_name
        index = self.layers.start + int(match.group(1))
        return f"{self.block}.layers.{index}." + local_name[match.end():]

    def global_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``named_parameters`` keyed by global names (for checkpoints and split comparisons)."""
        prefix = "model."
        for name, param in self.named_parameters():
            yield self.global_name(name[len(prefix):]), param

    @torch.no_grad()
    def init_parameters(self, seed: int) -> None:
        """Re-initialise every parameter from (seed, global name), split-independently: a
        tensor-parallel shard draws the full weight and keeps its own slice, so any TP size
        starts from the TP = 1 weights."""
        tp_rank, tp_size = tp_rank_and_size(stage_tp_group(self.model))
        for name, param in self.global_named_parameters():
            layout = shard_layout(param)
            value = init_value(
                name, full_shape(param.shape, layout, tp_size), seed,
                self.args.init_method_std, self.args.num_layers,
            )
            param.copy_(take_shard(value, layout, tp_rank, tp_size))

    def set_stage_input(self, input_tensor: torch.Tensor | None) -> None:
        """Hand a non-first stage the previous stage's hidden states (None: let them go, so
        the module does not keep the last micro-batch's activations alive)."""
        if input_tensor is None:
            self.model.set_input_tensor(None)
            return
        self.model.set_input_tensor(input_tensor.to(self.activation_dtype))


def build_stage(
    args: TransformerArgs,
    layers: range,
    seed: int,
    device: torch.device | str,
    make: Callable[[TransformerConfig, bool], torch.nn.Module],
    wrap: Callable[[torch.nn.Module], PipelineStage],
) -> PipelineStage:
    """Build the stage owning global ``layers``: ``make(config, use_te)`` builds the
    megatron-core model, ``wrap`` the stage around it; weights depend only on seed and names."""
    if layers.step != 1 or layers.start < 0 or layers.stop > args.num_layers:
        raise ValueError(f"layers {layers} outside a {args.num_layers}-layer model")
    if parallel_state.model_parallel_is_initialized():  # megatron's layers shard over its TP group
        check_tensor_parallel_args(args, parallel_state.get_tensor_model_parallel_world_size(), args.vocab_size)
    use_te = resolve_use_transformer_engine(args.use_transformer_engine)
    config = transformer_config(args, len(layers))
    if use_te:  # --attention-backend picks TE's kernel; the local spec's SDPA is the unfused maths
        config.attention_backend = AttnBackend[args.attention_backend]
    if use_te:
        from megatron.core import tensor_parallel

        # TE's core attention forks megatron's CUDA RNG tracker for dropout.
        if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if config.sequence_parallel:  # the embedding and the block fork the tracker for dropout
        seed_sequence_parallel_rng(seed, parallel_state.get_tensor_model_parallel_rank(), torch.device(device))
    # Some submodules (the position embedding is a plain ``torch.nn.Embedding``) draw their
    # default init from the global CPU RNG; fork it so building a stage has no side effects.
    with torch.random.fork_rng(devices=[]):
        model = make(config, use_te)
    if args.recompute_granularity is not None:
        install_recompute(model, args.recompute)
    make_rotary_device_agnostic(model, args.rotary_percent, args.rotary_base)
    if config.sequence_parallel and torch.device(device).type != "cuda":
        adopt_split_output_layer(model)
    mark_tensor_parallel(model, args.swiglu)
    stage = wrap(model)
    stage.init_parameters(seed)
    if args.bf16 or args.fp16:
        stage.model.to(model_dtype(args))
    return stage.to(device)

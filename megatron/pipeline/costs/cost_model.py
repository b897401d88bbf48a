"""Analytic per-layer cost of a GPT or BERT for the balanced layer split (torch-free).

Why analytic: the default split must follow from the flags alone. A split decided from
wall-clock profiling changes from run to run and machine to machine, and with it the stages'
contents, the checkpoints' layout and the emulator-equals-runtime comparisons. Counting the
matrix multiplications gives the same answer everywhere and is what dominates the time of a
layer, of the output head and of the loss (the issue's 2-stage GPT, hidden 256, vocab 8192:
the model says the last stage works 1.6x the first under the even split; measured 1.53x).

Time unit: floating-point operations of one micro-batch's forward + backward. The backward of a
matrix product costs twice its forward (the input gradient and the weight gradient), so every
matmul counts ``3 x 2 x m x k x n``. Element-wise work (norms, activations, softmax) is ignored
except for the loss's softmax over the vocabulary, which scales with ``V`` like the head.

* transformer layer, per token: QKV ``2h(a d + 2 g d)``, scores and weighted values
  ``4 s a d`` (the full ``s x s`` matrix: the causal mask does not skip work), output projection
  ``2 a d h``, MLP ``2 h f (x2 gated) + 2 f h``;
* embedding (first stage): a lookup, and a scatter-add of ``h`` per token in the backward;
* head (last stage): GPT: the output layer ``2 h V`` and the cross-entropy (~``4 V`` per
  token); BERT: the LM head's transform ``2 h^2`` first, and per sequence the pooler ``2 h^2``
  and the sentence-order head ``2 h x 2`` when it has one.

Memory (bytes, for the optional per-stage budget): static = parameters x (parameter + gradient
+ two fp32 AdamW moments + an fp32 master for bf16/fp16 parameters), the same accounting as the
profiled partition; activations = what autograd keeps per micro-batch: per token and layer
``5h + (a d + 2 g d) + f (x2 gated) x 2`` elements plus the attention probabilities ``2 a s``,
the embedding's output ``h``, the head's logits and their softmax ``2 V``.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.pipeline.costs.chunk_partition import Unit

# the loss's softmax and its gradient: exp, sum, log, subtract, scale per logit
_LOSS_FLOPS_PER_LOGIT = 4


@dataclass(frozen=True)
class ModelShape:
    """What the costs depend on, read from the flags (``kv_channels`` d, ``query_groups`` g)."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    kv_channels: int
    seq_length: int
    micro_batch: int
    vocab: int
    gated_mlp: bool = False
    bert: bool = False
    binary_head: bool = False
    position_table: int = 0  # rows of a learned position embedding (0: rotary or none)
    param_bytes: int = 4  # element size of the parameters (2 in bf16/fp16)
    activation_bytes: int = 4


@dataclass(frozen=True)
class LayerCosts:
    """Per layer ``l``: time (FLOPs), static memory and activation memory per micro-batch."""

    time: tuple[float, ...]
    static: tuple[float, ...]
    activation: tuple[float, ...]


def _matmul(m: float, k: float, n: float) -> float:
    """Forward + backward FLOPs of an ``m x k`` by ``k x n`` product."""
    return 3.0 * 2.0 * m * k * n


def _static_per_param(shape: ModelShape) -> float:
    master = 4 if shape.param_bytes < 4 else 0
    return 2 * shape.param_bytes + 8 + master


def layer_flops(shape: ModelShape) -> float:
    """Forward + backward FLOPs of one transformer layer on one micro-batch."""
    tokens = shape.seq_length * shape.micro_batch
    h, d = shape.hidden, shape.kv_channels
    q, kv = shape.heads * d, 2 * shape.query_groups * d
    up = shape.ffn * (2 if shape.gated_mlp else 1)
    per_token = (_matmul(1, h, q + kv) + _matmul(1, h, up) + _matmul(1, shape.ffn, h) + _matmul(1, q, h)
                 + 2 * _matmul(1, d, shape.seq_length) * shape.heads)
    return tokens * per_token


def embedding_flops(shape: ModelShape) -> float:
    """The lookup's backward scatter-add (the forward only copies rows)."""
    return float(shape.seq_length * shape.micro_batch * shape.hidden)


def head_flops(shape: ModelShape) -> float:
    """Output layer, loss and BERT's extra heads of one micro-batch, forward + backward."""
    tokens = shape.seq_length * shape.micro_batch
    h, v = shape.hidden, shape.vocab
    total = tokens * (_matmul(1, h, v) + 3 * _LOSS_FLOPS_PER_LOGIT * v)
    if shape.bert:
        total += tokens * _matmul(1, h, h)  # the LM head's transform
        if shape.binary_head:
            total += shape.micro_batch * (_matmul(1, h, h) + _matmul(1, h, 2))  # pooler, sentence order
    return total


def layer_parameters(shape: ModelShape) -> float:
    """Parameters of one transformer layer (weights, biases, two norms)."""
    h, d = shape.hidden, shape.kv_channels
    q, kv = shape.heads * d, 2 * shape.query_groups * d
    up = shape.ffn * (2 if shape.gated_mlp else 1)
    return h * (q + kv) + (q + kv) + q * h + h + h * up + up + shape.ffn * h + h + 4 * h


def embedding_parameters(shape: ModelShape) -> float:
    types = 2 * shape.hidden if shape.bert and shape.binary_head else 0
    return (shape.vocab + shape.position_table) * shape.hidden + types


def head_parameters(shape: ModelShape) -> float:
    """The final norm and output layer (its own copy on the last stage), BERT's heads."""
    h = shape.hidden
    total = 2 * h + shape.vocab * h + (shape.vocab if shape.bert else 0)
    if shape.bert:
        total += h * h + h + 2 * h  # LM head transform and its norm
        if shape.binary_head:
            total += h * h + h + 2 * h + 2  # pooler, sentence-order head
    return total


def layer_activation_elements(shape: ModelShape) -> float:
    """Elements one layer keeps for the backward of one micro-batch."""
    h, d = shape.hidden, shape.kv_channels
    qkv = shape.heads * d + 2 * shape.query_groups * d
    mlp = 2 * shape.ffn * (2 if shape.gated_mlp else 1)
    per_token = 5 * h + qkv + mlp + 2 * shape.heads * shape.seq_length
    return shape.seq_length * shape.micro_batch * per_token


def layer_units(shape: ModelShape) -> tuple[Unit, Unit, Unit]:
    """(one layer, the embedding's extra on the first layer, the head's extra on the last):
    time, static bytes and activation bytes per micro-batch."""
    tokens = shape.seq_length * shape.micro_batch
    per_param, act = _static_per_param(shape), shape.activation_bytes
    layer = Unit(layer_flops(shape), layer_parameters(shape) * per_param, layer_activation_elements(shape) * act)
    first = Unit(embedding_flops(shape), embedding_parameters(shape) * per_param, tokens * shape.hidden * act)
    # the logits are upcast to fp32 for the loss
    last = Unit(head_flops(shape), head_parameters(shape) * per_param, tokens * 2 * shape.vocab * 4)
    return layer, first, last


def layer_costs(shape: ModelShape) -> LayerCosts:
    """Per-layer costs with the embedding charged to layer 0 and the head to the last layer."""
    n = shape.num_layers
    layer, first, last = layer_units(shape)
    time, static, activation = [layer.time] * n, [layer.static] * n, [layer.activation] * n
    time[0] += first.time
    static[0] += first.static
    activation[0] += first.activation
    time[-1] += last.time
    static[-1] += last.static
    activation[-1] += last.activation
    return LayerCosts(tuple(time), tuple(static), tuple(activation))

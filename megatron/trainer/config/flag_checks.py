"""Generic value checks of numeric and list flags, run before anything else looks at them.

One table (:data:`DOMAINS`) says where each numeric flag lives, and one function
(:func:`check_flag_values`) walks the parser's actions, so a new ``type=int``/``type=float``
flag is covered by adding one table entry (``tests/test_bad_inputs.py`` fails for a numeric
flag without one). Every float must be finite whatever its domain: ``--lr nan`` would
otherwise reach the ranks and end in a traceback there.

List flags that argparse takes as strings (``--split``, ``--data-path`` blends) are parsed
strictly here, and the data code uses the same parsers: ``--split 80,abc`` is an error, not
"100% training".

Every failure is one line: :class:`OneLineParser` prints argparse's own errors as
``error: ...`` without the usage block, so a refusal is always exactly one line on stderr.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from megatron.trainer.config.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one ``error: ...`` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {' '.join(message.split())}\n")


@dataclass(frozen=True)
class Domain:
    """An interval of the real line; ``None`` bounds are open-ended."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def __str__(self) -> str:
        low, high = _show(self.low), _show(self.high)
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _show(bound: float | None) -> str:
    if bound is None:
        return ""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


AT_LEAST_1 = Domain(1)
NON_NEGATIVE = Domain(0)
POSITIVE = Domain(0, low_open=True)
DROPOUT = Domain(0, 1, high_open=True)  # a probability of dropping; 1 would zero every activation
BETA = Domain(0, 1, high_open=True)  # Adam's moment decay: 1 never forgets, the bias correction divides by 0
OPEN_UNIT = Domain(0, 1, low_open=True, high_open=True)
UNIT = Domain(0, 1)
SEED = Domain(0, 2**32 - 1)  # numpy's RandomState (megatron-core's datasets) takes 32-bit seeds

# Every numeric flag of the trainers (pretrain_gpt.py, pretrain_bert.py) and its domain.
# Cross-flag rules (--min-lr <= --lr, divisibility, ...) stay in the flags' own checks.
DOMAINS: dict[str, Domain] = {
    # model
    "num_layers": AT_LEAST_1, "hidden_size": AT_LEAST_1, "ffn_hidden_size": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1, "num_query_groups": AT_LEAST_1, "seq_length": AT_LEAST_1,
    "max_position_embeddings": AT_LEAST_1, "vocab_size": AT_LEAST_1, "make_vocab_size_divisible_by": AT_LEAST_1,
    "hidden_dropout": DROPOUT, "attention_dropout": DROPOUT, "init_method_std": POSITIVE,
    # training and optimizer
    "micro_batch_size": AT_LEAST_1, "global_batch_size": AT_LEAST_1, "train_iters": AT_LEAST_1, "seed": SEED,
    "lr": NON_NEGATIVE, "min_lr": NON_NEGATIVE, "lr_warmup_iters": NON_NEGATIVE, "lr_decay_iters": AT_LEAST_1,
    "weight_decay": NON_NEGATIVE, "adam_beta1": BETA, "adam_beta2": BETA, "adam_eps": POSITIVE,
    "clip_grad": NON_NEGATIVE, "rotation_refresh_interval": NON_NEGATIVE,
    "muon_momentum": BETA, "muon_num_ns_steps": AT_LEAST_1, "muon_extra_scale_factor": POSITIVE,
    "lookahead_max_momentum": BETA, "nadam_momentum_decay": NON_NEGATIVE,
    "loss_scale": POSITIVE, "initial_loss_scale": POSITIVE, "min_loss_scale": POSITIVE,
    "loss_scale_window": AT_LEAST_1, "hysteresis": AT_LEAST_1,
    # parallelism
    "pipeline_model_parallel_size": AT_LEAST_1, "tensor_model_parallel_size": AT_LEAST_1,
    "data_parallel_size": AT_LEAST_1, "pipeline_layer_split": AT_LEAST_1, "ddp_bucket_size": AT_LEAST_1,
    "num_layers_per_virtual_pipeline_stage": AT_LEAST_1, "recompute_num_layers": AT_LEAST_1,
    "microbatch_group_size_per_virtual_pipeline_stage": AT_LEAST_1,
    "decoder_first_pipeline_num_layers": AT_LEAST_1, "decoder_last_pipeline_num_layers": AT_LEAST_1,
    "distributed_timeout_minutes": POSITIVE, "pipeline_timeout_seconds": POSITIVE, "num_threads": AT_LEAST_1,
    "manual_gc_interval": NON_NEGATIVE,
    # schedules
    "zb_profile_iters": NON_NEGATIVE, "zb_memory_limit": POSITIVE, "inject_nonfinite_loss": NON_NEGATIVE,
    "pipemare_lr_anneal_iters": AT_LEAST_1, "pipemare_discrepancy_decay": OPEN_UNIT,
    "pipemare_sync_warmup_iters": NON_NEGATIVE,
    # evaluation, checkpoints, logging, partitioning
    "eval_interval": AT_LEAST_1, "eval_iters": NON_NEGATIVE, "save_interval": AT_LEAST_1,
    "exit_interval": AT_LEAST_1, "log_interval": AT_LEAST_1,
    "exit_duration_in_mins": POSITIVE, "exit_check_interval": AT_LEAST_1, "max_restarts": NON_NEGATIVE,
    "pipeline_partition_memory_gb": POSITIVE, "pipeline_partition_profile_iters": AT_LEAST_1,
    # BERT
    "mask_prob": OPEN_UNIT, "short_seq_prob": UNIT,
    # Megatron-LM compatibility (megatron_compat_args): model, sample counts, WSD, rampup
    "norm_epsilon": POSITIVE, "kv_channels": AT_LEAST_1, "rotary_base": AT_LEAST_1,
    "rotary_percent": Domain(0, 1, low_open=True), "train_samples": AT_LEAST_1,
    "lr_warmup_samples": NON_NEGATIVE, "lr_decay_samples": AT_LEAST_1, "lr_warmup_fraction": UNIT,
    "lr_wsd_decay_iters": AT_LEAST_1, "lr_wsd_decay_samples": AT_LEAST_1, "rampup_batch_size": NON_NEGATIVE,
}


def numeric_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's ``type=int`` / ``type=float`` flags."""
    return [a for a in parser._actions if a.type in (int, float) and a.option_strings]


def _values(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_flag_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every numeric flag finite and inside its :data:`DOMAINS` entry; every list flag of
    :data:`LIST_PARSERS` well formed. Raises :class:`ConfigError` for the first problem."""
    flags = vars(args)  # the flags by dest
    for action in numeric_actions(parser):
        flag = action.option_strings[-1]
        for value in _values(flags.get(action.dest)):
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{flag} must be a finite number, got {value}")
            domain = DOMAINS.get(action.dest)
            if domain is not None and value not in domain:
                raise ConfigError(f"{flag} must be {domain}, got {value}")
    for dest, parse in LIST_PARSERS.items():
        value = flags.get(dest)
        if value is not None:
            parse(value)


# ---------------------------------------------------------------------------- list flags


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def parse_split_weights(split: str) -> list[float]:
    """Megatron's ``--split`` ("969,30,1", "98/2/0" or "100"): three finite, non-negative
    shares with a positive training share. Every part must be a number."""
    text = str(split).strip()
    parts = [p.strip() for p in text.replace("/", ",").split(",")]
    numbers = [_number(p) for p in parts]
    if not text or not 1 <= len(parts) <= 3 or any(n is None for n in numbers):
        bad = next((p for p, n in zip(parts, numbers) if n is None), text)
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1 "
                          f"({bad!r} is not a number)")
    weights = [float(n) for n in numbers]  # type: ignore[arg-type]
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ConfigError(f"--split {split!r}: shares must be finite and >= 0")
    if weights[0] <= 0:
        raise ConfigError(f"--split {split!r}: the training share must be positive")
    return weights + [0.0] * (3 - len(weights))


def parse_blend(items: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Strict where megatron-core guesses: once any item is a number the list must be
    weight/prefix pairs (an odd count, a weight in a prefix's place or a prefix in a weight's
    place is an error, not a file called ``0.5``), and weights are finite, >= 0, positive in
    sum. Returns ``(prefixes, weights)``; ``weights`` is None without weights.
    """
    items = [str(x).strip() for x in items if str(x).strip()]
    if not items:
        raise ConfigError("--data-path needs a dataset prefix (or weight/prefix pairs)")
    numbers = [_number(x) for x in items]
    if all(n is None for n in numbers):
        return items, None
    if len(items) % 2:
        raise ConfigError(f"--data-path has {len(items)} items with weights among them; expected "
                          f"WEIGHT PREFIX pairs (e.g. 0.3 data/a 0.7 data/b)")
    for position, (item, number) in enumerate(zip(items, numbers)):
        is_weight_slot = position % 2 == 0
        if is_weight_slot and number is None:
            raise ConfigError(f"--data-path mixes weighted and unweighted prefixes ({item!r} is not a weight)")
        if not is_weight_slot and number is not None:
            raise ConfigError(f"--data-path: {item!r} stands where a dataset prefix belongs "
                              f"(expected WEIGHT PREFIX pairs)")
    weights = [float(n) for n in numbers[0::2]]  # type: ignore[arg-type]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path weights must be finite and >= 0 with a positive sum, got {weights}")
    return items[1::2], weights


# Flags whose string values are parsed here (the data code parses them with the same function).
LIST_PARSERS: dict[str, Callable[[Any], Any]] = {"split": parse_split_weights, "data_path": parse_blend}

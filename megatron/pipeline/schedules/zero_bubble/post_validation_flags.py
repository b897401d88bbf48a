"""Zero Bubble's optimizer post-validation (§4) as an option: its flags and options type.

Every schedule with a synchronous step takes the group (``SynchronousSchedule``); the streams
it turns on are :mod:`.post_validation`'s.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.pipeline.schedules.config import ScheduleConfig, ScheduleConfigError, ScheduleOptions
from megatron.pipeline.schedules.options import Flag, FlagGroup, OptionFields


@dataclass(frozen=True)
class PostValidationOptions(ScheduleOptions):
    """The options of a synchronous schedule: ``post_validation`` replaces each synchronous step
    by PSTEP at the end of the iteration and VALIDATE before the next one's first backward."""

    post_validation: bool = False


def _post_validation_options(values: Mapping[str, Any], config: ScheduleConfig) -> OptionFields:
    if values["optimizer_post_validation_exact"] and not values["enable_optimizer_post_validation"]:
        raise ScheduleConfigError("--optimizer-post-validation-exact needs --enable-optimizer-post-validation")
    return {"post_validation": bool(values["enable_optimizer_post_validation"])}


#: Zero Bubble's optimizer post-validation (§4), for every schedule with a synchronous step.
POST_VALIDATION_FLAGS = FlagGroup("optimizer post-validation", (
    Flag("--enable-optimizer-post-validation", action="store_true",
         help="replace the pipeline-wide optimizer step by Zero Bubble's post-validation (optimistic "
              "step, validated during the next warm-up, rolled back when clipping or a non-finite "
              "gradient requires it)"),
    Flag("--optimizer-post-validation-exact", action="store_true",
         help="roll back from a backup of weights and Adam moments (bitwise) instead of the in-place "
              "arithmetic inverse (within a few ulp); costs one more copy of the state; the default "
              "with --bf16/--fp16 (see --optimizer-post-validation-in-place)"),
), _post_validation_options, requirement="a synchronous")

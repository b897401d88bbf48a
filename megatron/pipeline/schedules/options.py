"""Command-line options a schedule declares: the flags, and how their values become options.

A schedule class lists the :class:`FlagGroup` objects it takes (``Schedule.traits.flag_groups``);
a group shared by several schedules (Zero Bubble's ``--zb-*``, post-validation) is declared once
and referenced by each. The trainer adds every registered schedule's groups to its parser,
refuses a flag given to a schedule that does not take it, and turns the values into the
schedule's typed options (``ScheduleConfig.options``, built by
:meth:`~megatron.pipeline.schedules.traits.ScheduleTraits.options_from_flags` from each group's
:meth:`FlagGroup.to_options`) -- so it never compares schedule names, and a new schedule brings
its flags with it. Pure data: no argparse, no torch.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.pipeline.schedules.config import ScheduleConfig


@dataclass(frozen=True)
class Flag:
    """One command-line flag, in ``argparse.add_argument`` terms."""

    name: str  # "--zb-profile-iters"
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    action: str | None = None  # "store_true", "append"

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under."""
        return self.name.lstrip("-").replace("-", "_")

    def argparse_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``add_argument`` (unset fields left out, argparse's defaults)."""
        fields = {"help": self.help, "type": self.type, "metavar": self.metavar,
                  "choices": self.choices, "action": self.action}
        kwargs = {key: value for key, value in fields.items() if value is not None}
        default = [] if self.action == "append" and self.default is None else self.default
        return {**kwargs, "default": default}

    @property
    def default_value(self) -> Any:
        """The value argparse stores when the flag is not given."""
        return self.argparse_kwargs()["default"]

    def is_default(self, value: Any) -> bool:
        """Whether ``value`` is what the flag means when it is not given."""
        return value == self.default_value


#: A group's part of a schedule's options dataclass: field name -> value, for the fields the
#: group's flags set (the dataclass's constructor refuses a name it does not declare)
OptionFields = dict[str, Any]
OptionsBuilder = Callable[[Mapping[str, Any], "ScheduleConfig"], OptionFields]


@dataclass(frozen=True)
class FlagGroup:
    """Flags that belong together, and how their values become fields of a schedule's options.

    ``to_options(values, config)`` gets every flag of the group by ``dest`` and the schedule's
    config without options (stages, micro-batches, chunks, data-parallel size) and returns the
    group's fields of the options dataclass (:data:`OptionFields`); it raises
    :class:`~megatron.pipeline.schedules.base.ScheduleConfigError` (one line naming the flag)
    for values no schedule of the group can use. ``requirement`` qualifies the schedules that
    take the group in the refusal of a flag given to another one ("a synchronous").
    """

    title: str
    flags: tuple[Flag, ...]
    to_options: OptionsBuilder
    requirement: str = ""

    def values(self, namespace: Any) -> dict[str, Any]:
        """This group's values read from a parsed namespace (defaults where one is absent)."""
        return {flag.dest: getattr(namespace, flag.dest, flag.argparse_kwargs()["default"]) for flag in self.flags}

    def given(self, namespace: Any) -> list[Flag]:
        """The flags of this group ``namespace`` sets to a value other than their default."""
        values = self.values(namespace)
        return [flag for flag in self.flags if not flag.is_default(values[flag.dest])]

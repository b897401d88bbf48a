"""``--dump-config PATH`` and ``--config-file PATH``: a run's flags as a file, and back.

The file holds what the user asked for, not what the run derived: every flag of the parser
(the task's and every schedule's own flags included) with its value after argparse filled in
the defaults, filed by the :class:`~megatron.trainer.config.job_config.JobConfig` section that
holds it and keyed by the flag's ``dest`` (``num_layers`` for ``--num-layers``,
``manual_gc_eval`` for ``--no-manual-gc-eval``). Values the run works out from the flags and
the host (the data-parallel size from ``WORLD_SIZE``, the global batch, the padded
vocabulary, ``--adam-kernel auto``'s choice, the built schedule, the memory estimate, the core
binding, ``auto``'s relayouts) are not in it: a flag left unset stays unset, so the file
means the same on another host. That is also why the snapshot is taken right after parsing,
before :func:`~megatron.trainer.plan.parse.check_args` derives Megatron-LM's defaults into the namespace.

``--dump-config`` runs every flag check first (a command line that would be refused is not
written), writes the file and exits with status 0 without starting a rank: like ``--help``,
it answers a question about the command line (``-`` writes to standard output). The
format follows the name: ``.json`` is JSON (``null`` for an unset flag), anything else TOML
(an unset flag is a comment, since TOML has no null), written by :func:`toml_text` below,
which only needs flat sections of booleans, numbers, strings and lists of them.

``--config-file`` reads such a file (TOML with :mod:`tomllib`, or JSON) as the parser's
defaults, as torchtitan's ``--job.config_file`` does; flags on the command line override it
(a repeatable flag given on the command line replaces the file's list). A file may leave
flags out (they keep the parser's defaults). A missing or unreadable file, an unknown
section or key, a value of the wrong type or outside the flag's choices is refused with one
line and exit status 2 before any rank starts. A boolean the file turns on can only be
turned off on the command line by a flag that stores False (``--no-...``), as argparse goes.

What the file sets is in the parsed namespace like any flag of argv, so ``auto``, which
derives its other layouts from the user's flags as parsed
(:mod:`megatron.trainer.loop.auto.candidates`), drops a flag a layout does not take whether it
came from the file or the command line.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, fields

from megatron.pipeline.schedules import flag_groups
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import SECTION_TYPES, TaskOptions, UnplacedFlagError
from megatron.trainer.config.values import FlagValue, with_values

#: The two flags of this module: they say where the flags come from or go, so they are not
#: flags of the run (not in the file, not in the :class:`JobConfig`).
FILE_FLAGS = ("config_file", "dump_config")
#: Section of the task's own flags (``PretrainTask.add_arguments``).
TASK_SECTION = "task"

#: The flags by section, then by ``dest``.
Sections = dict[str, dict[str, FlagValue]]
#: The flags by ``dest``.
Flags = dict[str, FlagValue]


def add_config_file_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("configuration file")
    g.add_argument("--config-file", default=None, metavar="PATH",
                   help="read the flags from PATH (TOML, or JSON if PATH ends in .json; as written by "
                        "--dump-config); flags on the command line override the file's")
    g.add_argument("--dump-config", default=None, metavar="PATH",
                   help="check the flags, write them (defaults filled in, by section; nothing derived "
                        "from them or the host) to PATH (.json: JSON, else TOML; -: standard output) "
                        "and exit without training")


# ---------------------------------------------------------------------------- the flags


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The run's flags by ``dest``: every option of ``parser`` but ``--help`` and this module's."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.default is not argparse.SUPPRESS and a.dest not in FILE_FLAGS}


def flag_sections(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag's section, by ``dest``: the :class:`JobConfig` section with a field of that
    name, ``schedule`` for the schedules' own flags, ``task`` for the task's."""
    owners: dict[str, str] = {}
    for section, cls in SECTION_TYPES.items():
        owners.update((f.name, section) for f in fields(cls))
    owners.update((flag.dest, "schedule") for group in flag_groups() for flag in group.flags)
    task_options: type[TaskOptions] = parser.get_default("task_options") or TaskOptions
    owners.update((f.name, TASK_SECTION) for f in fields(task_options))
    sections = {}
    for dest in flag_actions(parser):
        if dest not in owners:  # build_job_config refuses the same namespace: a programming error
            raise UnplacedFlagError(f"no JobConfig section has a field for {dest}")
        sections[dest] = owners[dest]
    return sections


def asked_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Sections:
    """Every flag's value in ``args`` by section (sections in :class:`JobConfig`'s order, flags
    in ``--help``'s); call it before anything derives values into ``args``."""
    out: Sections = {section: {} for section in (*SECTION_TYPES, TASK_SECTION)}
    for dest, section in flag_sections(parser).items():
        out[section][dest] = copy.deepcopy(getattr(args, dest))
    return {section: values for section, values in out.items() if values}


# ---------------------------------------------------------------------------- writing


def toml_text(sections: Sections, header: str = "") -> str:
    """``sections`` as TOML: one table per section; ``None`` (no TOML value) as a comment."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, values in sections.items():
        lines += ["", f"[{section}]"]
        for key, value in values.items():
            lines.append(f"# {key} =  (unset)" if value is None else f"{key} = {_toml_value(key, value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's shortest round-trip form; inf/nan are TOML's spelling too
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)) and None not in value:
        return "[" + ", ".join(_toml_value(key, v) for v in value) + "]"
    raise ConfigError(f"--dump-config: {key} = {value!r} has no TOML form (write JSON: a PATH ending in .json)")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: the escapes TOML names, other control characters as ``\\uXXXX``."""
    body = "".join(_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                   for ch in text)
    return f'"{body}"'


HEADER = ("Megatron-Async run configuration, written by --dump-config: every flag by section, keyed by\n"
          "its dest, as given or defaulted (nothing derived). Read it back with --config-file PATH;\n"
          "flags on the command line override it.")


def config_text(sections: Sections, path: str) -> str:
    """The file's text: JSON for a ``.json`` path, else TOML."""
    if path.endswith(".json"):
        try:
            return json.dumps(sections, indent=2, allow_nan=False) + "\n"
        except ValueError as exc:
            raise ConfigError(f"--dump-config {path}: {exc}") from None
    return toml_text(sections, HEADER)


def write_config(sections: Sections, path: str) -> None:
    """Write ``sections`` to ``path`` atomically (``-``: standard output)."""
    text = config_text(sections, path)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"--dump-config {path}: a flag's value is not valid Unicode text") from None
    tmp = None
    try:  # atomic: ranks started by torchrun may all write the same file
        fd, tmp = tempfile.mkstemp(prefix=".dump-config-", dir=os.path.dirname(os.path.abspath(path)))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise ConfigError(f"--dump-config {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------- reading


def read_config(parser: argparse.ArgumentParser, path: str) -> Flags:
    """The flags of the file at ``path`` by ``dest``, checked against ``parser``'s flags (types,
    choices, list lengths; raises :class:`ConfigError` with one line)."""
    where = f"--config-file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise ConfigError(f"{where}: not valid {kind}: {' '.join(str(exc).split())}") from None
    actions, sections = flag_actions(parser), flag_sections(parser)
    names = sorted(set(sections.values()))
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected sections ({', '.join(names)}), got a {type(data).__name__}")
    values: Flags = {}
    for section, table in data.items():
        if section in sections and not isinstance(table, dict):  # a flag outside any section
            raise ConfigError(f"{where}: {section} is outside a section (it belongs to [{sections[section]}])")
        if section not in names:
            raise ConfigError(f"{where}: unknown section [{section}] (sections: {', '.join(names)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table of flags, got a {type(table).__name__}")
        for key, value in table.items():
            if sections.get(key) != section:
                raise ConfigError(f"{where}: [{section}] {key}: {_unknown(key, sections)}")
            values[key] = _checked(actions[key], value, f"{where}: [{section}] {key}")
    return values


def _unknown(key: str, sections: dict[str, str]) -> str:
    if key in sections:
        return f"belongs to [{sections[key]}]"
    dest = key.lstrip("-").replace("-", "_")
    if dest in sections:
        return f"unknown key (keys are flags' dests: {dest})"
    return "unknown key (no such flag for this script)"


def _checked(action: argparse.Action, value: object, where: str) -> FlagValue:
    """``value`` as the parser's default for ``action``: the type the command line would give."""
    if value is None:
        if action.default is None:
            return None
        raise ConfigError(f"{where}: null, but the flag is never unset (default {action.default!r})")
    if action.nargs == 0:  # store_true / store_false / store_const
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if action.nargs == "+" and not value:
            raise ConfigError(f"{where}: expected at least one value")
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise ConfigError(f"{where}: expected {action.nargs} values, got {len(value)}")
        return [_scalar(action, v, where) for v in value]
    scalar = _scalar(action, value, where)
    # A string default goes through the flag's type in argparse (as a command-line value would),
    # so a flag with a converting type gets the file's text, converted once.
    return value if isinstance(value, str) else scalar


def _scalar(action: argparse.Action, value: object, where: str) -> FlagValue:
    kind = action.type
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        converted: FlagValue = value
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        converted = float(value)
        if not math.isfinite(converted):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
    else:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        try:
            converted = value if kind is None else kind(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"{where}: {value!r}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


# ---------------------------------------------------------------------------- the command line


@dataclass(frozen=True)
class CommandLine:
    """A parsed command line: the namespace (without this module's two flags), the flags as
    asked (what ``--dump-config`` writes), and where to write them."""

    args: argparse.Namespace
    asked: Sections
    dump_path: str | None

    def dump_if_asked(self, parser: argparse.ArgumentParser) -> None:
        """``--dump-config PATH``: write the flags and exit with status 0 (one line and status 2
        if the file cannot be written)."""
        if self.dump_path is None:
            return
        try:
            write_config(self.asked, self.dump_path)
        except ConfigError as exc:
            parser.exit(2, f"error: {exc}\n")
        if self.dump_path != "-":
            print(f"configuration written to {self.dump_path}", flush=True)
        parser.exit(0)


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> CommandLine:
    """``parser.parse_args(argv)`` over the values of ``--config-file`` (if given): argv wins.
    Exits with status 2 and one line on a bad file; ``parser`` is left as it was."""
    args = parser.parse_args(argv)
    if args.config_file is not None:
        try:
            values = read_config(parser, args.config_file)
        except ConfigError as exc:
            parser.exit(2, f"error: {exc}\n")
        args = _parse_over(parser, argv, values)
    asked = asked_flags(parser, args)
    dump_path = args.dump_config
    for dest in FILE_FLAGS:
        delattr(args, dest)
    return CommandLine(args, asked, dump_path)


def _parse_over(parser: argparse.ArgumentParser, argv: Sequence[str] | None, values: Flags) -> argparse.Namespace:
    """Parse ``argv`` with ``values`` as the defaults. A repeatable flag's default is ``None``
    meanwhile, so a list argv gives replaces the file's instead of extending it."""
    actions = flag_actions(parser)
    appended = {dest for dest, a in actions.items() if isinstance(a, argparse._AppendAction)}
    saved_defaults = dict(parser._defaults)
    saved = {dest: a.default for dest, a in actions.items()}
    try:
        parser.set_defaults(**{**values, **dict.fromkeys(appended)})
        args = parser.parse_args(argv)
    finally:
        parser._defaults.clear()
        parser._defaults.update(saved_defaults)
        for dest, action in actions.items():
            action.default = saved[dest]
    # a repeatable flag not on the command line: the file's, else the parser's default
    return with_values(args, **{dest: values[dest] if dest in values else copy.copy(saved[dest])
                                for dest in appended if getattr(args, dest) is None})


# ---------------------------------------------------------------------------- editing a command line

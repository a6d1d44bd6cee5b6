"""A config's fields as command-line flags: `Flag` (one field) and `FlagGroup` (one
config, one group of --help), which the tables of `service/flags.py` are made of.

A flag takes its type and default from its field and its name from the field's name:
`claim_idle_ms: int = 2000` is `--claim-idle-ms`, an int, 2000. A field that defaults to
True is turned off by `--no-<field>`, one that defaults to False on by `--<field>`, and a
tuple field takes its flag once per item.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol


class Arguments(Protocol):
    """Where flags are added: a parser, or one of its argument groups."""

    def add_argument(self, *names: str, **options: Any) -> argparse.Action: ...


@dataclass(frozen=True)
class Flag:
    """One command-line flag that sets one config field."""

    field: str
    help: str
    # Where the field's name does not say it; else --field-name, or --no-field-name for
    # a field that defaults to True.
    name: str = ""
    choices: tuple[str, ...] | None = None
    # The field counts in units this many times smaller than the flag (bytes for MiB).
    unit: int = 1
    # Where the flag's default is not the field's; called as the parser is built.
    default: Callable[[], Any] | None = None
    # Whether --help adds "(default: ...)"; off where the help says the default in words.
    show_default: bool = True

    def option(self, field_default: Any) -> str:
        """The flag as typed: --claim-idle-ms, --no-cuda-graphs."""
        if self.name:
            return self.name
        dashed = self.field.replace("_", "-")
        return f"--no-{dashed}" if field_default is True else f"--{dashed}"

    def dest(self, field_default: Any) -> str:
        """Its attribute in the parsed arguments: the option's words (--no-X sets X)."""
        words = self.option(field_default).removeprefix("--")
        if field_default is True:
            words = words.removeprefix("no-")
        return words.replace("-", "_")

    def add_to(self, arguments: Arguments, field_type: Any, field_default: Any) -> None:
        option, dest = self.option(field_default), self.dest(field_default)
        if field_type is bool:
            action = "store_false" if field_default else "store_true"
            arguments.add_argument(option, dest=dest, action=action, help=self.help)
        elif typing.get_origin(field_type) is tuple:  # None when not given: the field keeps its default
            help = f"{self.help} (repeatable; default: {' '.join(field_default)})"
            arguments.add_argument(option, dest=dest, action="append", help=help)
        else:
            if type(None) in typing.get_args(field_type):  # optional: the flag takes the other type
                field_type = next(t for t in typing.get_args(field_type) if t is not type(None))
            default = self.default() if self.default else field_default
            if self.unit > 1:
                default //= self.unit
            help = self.help + (" (default: %(default)s)" if self.show_default else "")
            arguments.add_argument(option, dest=dest, type=field_type, default=default, choices=self.choices, help=help)

    def value(self, args: argparse.Namespace, field_default: Any) -> Any:
        """The field's value from the parsed arguments; None leaves the field's default."""
        value = getattr(args, self.dest(field_default))
        if value is None:
            return None
        if isinstance(value, list):  # a repeated flag
            return tuple(value)
        if self.unit > 1:
            return value * self.unit
        return value


@dataclass(frozen=True)
class FlagGroup:
    """The flags of one config, listed together under `title` in --help."""

    title: str
    config: type
    flags: tuple[Flag, ...]
    # Fields no flag of this table sets: they keep their defaults, or the caller gives
    # them to `build`.
    unflagged: tuple[str, ...] = ()

    def add_to(self, parser: argparse.ArgumentParser) -> Arguments:
        """Adds the flags, as one group of --help; returns the group (for flags of its own)."""
        where = self.config.__module__.replace(".", "/") + ".py"
        group = parser.add_argument_group(self.title, f"sets {self.config.__name__} ({where})")
        types, defaults = typing.get_type_hints(self.config), self.config()
        for flag in self.flags:
            flag.add_to(group, types[flag.field], getattr(defaults, flag.field))
        return group

    def build(self, args: argparse.Namespace, **fields: Any):
        """The config from the parsed arguments; `fields` set what no flag does."""
        defaults = self.config()
        values = {flag.field: flag.value(args, getattr(defaults, flag.field)) for flag in self.flags}
        given = {name: value for name, value in values.items() if value is not None}
        return self.config(**{**given, **fields})

    def options(self) -> dict[str, str]:
        """Each flag as typed, to the field it sets: {"--no-cuda-graphs": "cuda_graphs"}."""
        defaults = self.config()
        return {flag.option(getattr(defaults, flag.field)): flag.field for flag in self.flags}

    def without(self, *fields: str) -> FlagGroup:
        """These flags left out (their fields then keep their defaults)."""
        kept = tuple(flag for flag in self.flags if flag.field not in fields)
        return replace(self, flags=kept, unflagged=self.unflagged + fields)

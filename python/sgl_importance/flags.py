"""One declaration per flag; the argparse arguments and the validation come from it.

A dataclass field declared with :func:`flag` carries a :class:`Flag` in its
metadata: how the command line's text is parsed, what is allowed (a choice list, or
a predicate and the words that describe it) and the ``--help`` text.
:func:`add_arguments` adds one argument per field and :func:`check_fields` checks
each field's value, both in declaration order, so ``--help`` lists the flags in that
order and the first invalid one is the one reported. Every refusal reads
``<flag> <value!r> is invalid; allowed: <what>``.

Stdlib and ``validate`` only; nothing here knows which flags exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from sgl_importance.validate import int_in, invalid, is_number

# The key of a field's metadata that holds its Flag.
FLAG = "flag"


@dataclass(frozen=True)
class Flag:
    """How one flag parses and what it allows.

    Attributes:
        help: the ``--help`` text.
        choices: the allowed values (argparse refuses the others before validation).
        type: argparse's conversion of the command line's text; None keeps the string.
        valid: whether a value is allowed, where there are no ``choices``; None allows any.
        allowed: what is allowed, in words, for the error message (without ``choices``).
        then: a check of the whole object, run right after this field's own: a rule
            that involves other fields.
    """

    help: str
    choices: Optional[tuple[str, ...]] = None
    type: Optional[Callable[[str], Any]] = None
    valid: Optional[Callable[[Any], bool]] = None
    allowed: str = ""
    then: Optional[Callable[[Any], None]] = None

    def check(self, label: str, value: Any, choices: Optional[tuple[str, ...]] = None) -> None:
        """Raise ValueError naming ``label``, the value and what is allowed, unless it is.

        Args:
            label: how the message names the setting (a flag, or a request's key).
            value: the value to check.
            choices: narrower choices than the declaration's (a request's own setting).
        """
        choices = self.choices if choices is None else choices
        if choices is not None:
            ok, allowed = value in choices, ", ".join(choices)
        else:
            ok, allowed = self.valid is None or self.valid(value), self.allowed
        if not ok:
            raise invalid(f"{label} {value!r}", allowed)


def flag(default: Any, spec: Flag) -> Any:
    """A dataclass field with ``default`` whose flag is ``spec``."""
    return field(default=default, metadata={FLAG: spec})


def choice(choices: tuple[str, ...], help: str) -> Flag:
    """A flag whose value is one of ``choices``."""
    return Flag(help, choices=choices)


def integer(low: int, high: int, help: str) -> Flag:
    """A flag whose value is an integer in ``[low, high]``."""
    return Flag(
        help,
        type=int,
        valid=lambda value: int_in(value, low, high),
        allowed=f"an integer in [{low}, {high}]",
    )


def number(within: Callable[[float], bool], allowed: str, help: str) -> Flag:
    """A flag whose value is a number (int or float) for which ``within`` holds."""
    return Flag(help, type=float, valid=lambda value: is_number(value) and within(value), allowed=allowed)


def specs(cls: type) -> dict[str, Flag]:
    """Field name -> its Flag, in declaration order."""
    return {f.name: f.metadata[FLAG] for f in fields(cls) if FLAG in f.metadata}


def add_arguments(group: Any, cls: type, name_of: Callable[[str], str]) -> None:
    """Add one argument per declared field of ``cls`` to ``group`` (a parser or its group).

    Args:
        group: where the arguments go (``add_argument`` is all it needs).
        cls: the dataclass; each field's default is the flag's.
        name_of: field name -> flag name (``--...``).
    """
    for f in fields(cls):
        spec = f.metadata.get(FLAG)
        if spec is None:
            continue
        options: dict[str, Any] = {}
        if spec.choices is not None:
            options["choices"] = spec.choices
        if spec.type is not None:
            options["type"] = spec.type
        group.add_argument(name_of(f.name), default=f.default, help=spec.help, **options)


def check_fields(obj: Any, name_of: Callable[[str], str]) -> None:
    """Check every declared field of ``obj`` in order, then its ``then`` rule.

    Raises:
        ValueError: for the first field whose value is not allowed.
    """
    for name, spec in specs(type(obj)).items():
        spec.check(name_of(name), getattr(obj, name))
        if spec.then is not None:
            spec.then(obj)

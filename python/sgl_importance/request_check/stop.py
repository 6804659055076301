"""Stop strings and stop regexes, bounded by the work each costs the scheduler per decode step.

SGLang matches every stop string and searches every stop regex over the output's
tail on each decode step, in the scheduler, with Python's backtracking engine:
``(a+)+b`` over a few dozen characters takes seconds and doubles with each one.
A regex is accepted only when its match length is bounded and its backtracking
paths at one position are few (:func:`stop_regex_cost`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sgl_importance.request_check.fields import InvalidFieldError, caller_field

try:  # Python >= 3.11 keeps the regex parser here
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# SGLang's own caps (sampling_params.py), repeated so the message can name them.
MAX_STOP_STRINGS = 32
MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_BYTES = 256
# A stop string also widens the tail SGLang decodes and matches every step.
MAX_STOP_CHARS = 256
# A stop regex must match at most this many characters (SGLang then only searches
# a tail of that many tokens) and leave its backtracking at most this many ways to
# match from one position; both bound the work a pattern costs per decode step.
MAX_STOP_REGEX_SPAN = 64
MAX_STOP_REGEX_PATHS = 256


def _strings(path: str, value: Any, count: int) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise InvalidFieldError(caller_field(path), value, "a string or a list of strings")
    if len(items) > count:
        raise InvalidFieldError(caller_field(path), f"a list of {len(items)}", f"at most {count} entries")
    return items


def check_stop_strings(value: Any) -> None:
    """``stop``: at most :data:`MAX_STOP_STRINGS` strings of at most :data:`MAX_STOP_CHARS` characters."""
    if value is None:
        return
    for item in _strings("sampling_params.stop", value, MAX_STOP_STRINGS):
        if len(item) > MAX_STOP_CHARS:
            raise InvalidFieldError(
                caller_field("sampling_params.stop"), item, f"stop strings of at most {MAX_STOP_CHARS} characters"
            )


class _Unsafe(Exception):
    pass


# Exactly the constructs SGLang's own length bound (sampling_params.get_max_seq_length)
# understands: for any other it searches the whole output on every step.
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT}
_ONE_CHAR = {_sre.LITERAL, _sre.ANY, _sre.IN}
_ZERO_WIDTH = {_sre.AT}
_UNBOUNDED_NAMES = {
    "NOT_LITERAL": "a negated single character [^c]",
    "ASSERT": "a lookahead or lookbehind",
    "ASSERT_NOT": "a negative lookahead or lookbehind",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repetition",
}


@dataclass(frozen=True)
class _Cost:
    span: int  # longest match, in characters
    paths: int  # ways backtracking may try to match from one position
    repeats: bool  # holds a repetition


def _cap(value: int) -> int:
    # Only compared against small limits; capped so huge products stay cheap.
    return min(value, 1 << 40)


def _cost(items: _sre_parse.SubPattern) -> _Cost:
    span, paths, repeats = 0, 1, False
    for op, arg in items:
        if op in _ONE_CHAR:
            part = _Cost(1, 1, False)
        elif op in _ZERO_WIDTH:
            part = _Cost(0, 1, False)
        elif op == _sre.SUBPATTERN:
            part = _cost(arg[-1])
        elif op == _sre.BRANCH:
            branches = [_cost(branch) for branch in arg[1]]
            part = _Cost(
                max(b.span for b in branches),
                _cap(sum(b.paths for b in branches)),
                any(b.repeats for b in branches),
            )
        elif op in _REPEATS:
            low, high, body = arg
            if high == _sre.MAXREPEAT:
                raise _Unsafe("unbounded repetition (*, +, {n,}); a bounded one such as {0,16} is allowed")
            inner = _cost(body)
            if inner.repeats:
                raise _Unsafe("nested repetition (a repeated group that holds a repetition)")
            if inner.paths == 1:
                ways = high - low + 1
            else:
                ways = sum(_cap(inner.paths**k) for k in range(low, min(high, 64) + 1))
            part = _Cost(high * inner.span, _cap(ways), True)
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            raise _Unsafe("a backreference")
        else:
            name = str(op)
            raise _Unsafe(f"{_UNBOUNDED_NAMES.get(name, name)}, whose length SGLang cannot bound")
        span, paths, repeats = span + part.span, _cap(paths * part.paths), repeats or part.repeats
    return _Cost(span, paths, repeats)


STOP_REGEX_RULE = (
    f"at most {MAX_STOP_REGEXES} Python regular expressions of at most {MAX_STOP_REGEX_BYTES} bytes, "
    f"each matching at most {MAX_STOP_REGEX_SPAN} characters, built from characters, classes, ., "
    "anchors, groups, | and bounded repetition ({m,n}, ?) that is not nested, with at most "
    f"{MAX_STOP_REGEX_PATHS} ways to match at one position over all of them"
)


def stop_regex_cost(pattern: str) -> tuple[int, int]:
    """(longest match in characters, ways to match at one position) of a stop regex.

    SGLang searches each stop regex with Python's backtracking engine over the
    output's tail on every decode step, in the scheduler. A bounded match length
    keeps that tail short (SGLang sizes it from the pattern with the same rules),
    and without nested repetition or backreferences the tries per position are
    the product of the repetition ranges and alternatives.

    Raises:
        ValueError: why the pattern cannot be a stop regex at all.
    """
    if len(pattern.encode("utf-8", "surrogatepass")) > MAX_STOP_REGEX_BYTES:
        raise ValueError(f"is longer than {MAX_STOP_REGEX_BYTES} bytes")
    try:
        re.compile(pattern)
        parsed = _sre_parse.parse(pattern)
        cost = _cost(parsed)
    except (re.error, OverflowError, ValueError) as err:
        raise ValueError(f"is not a valid pattern ({err})") from None
    except RecursionError:
        raise ValueError("nests too deeply") from None
    except _Unsafe as err:
        raise ValueError(f"has {err}") from None
    return cost.span, cost.paths


def check_stop_regexes(value: Any) -> None:
    """``stop_regex``: patterns whose cost per decode step is bounded (:data:`STOP_REGEX_RULE`)."""
    if value is None:
        return
    field = caller_field("sampling_params.stop_regex")
    total = 0
    for pattern in _strings("sampling_params.stop_regex", value, MAX_STOP_REGEXES):
        try:
            span, paths = stop_regex_cost(pattern)
        except ValueError as err:
            raise InvalidFieldError(field, pattern, STOP_REGEX_RULE, why=str(err)) from None
        if span > MAX_STOP_REGEX_SPAN:
            raise InvalidFieldError(field, pattern, STOP_REGEX_RULE, why=f"matches up to {span} characters")
        total += paths
        if total > MAX_STOP_REGEX_PATHS:
            raise InvalidFieldError(field, value, STOP_REGEX_RULE, why=f"has {total} ways to match at one position")

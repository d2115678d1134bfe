"""Durations as written in pipeline specs.

One form everywhere: a string of one or more ``<integer><unit>`` parts, largest unit first,
units ``d`` (days), ``h`` (hours), ``m`` (minutes), ``s`` (seconds). Examples: ``"30s"``,
``"15m"``, ``"2h"``, ``"1h30m"``, ``"1d12h"``. Bare numbers are rejected on purpose: ``30``
could mean seconds or minutes, so the unit is always written.

A duration is longer than zero (:data:`DurationS`): a zero timeout or poll interval has no
meaning (Airflow even reads a zero ``execution_timeout`` as "no timeout"). A delay may be zero
(:data:`DelayS`): ``retry_delay: 0s`` retries at once, as Airflow allows.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNITS_S = {"d": 86_400, "h": 3_600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([dhms])")
_WHOLE = re.compile(r"^(?:\d+[dhms])+$")
MAX_DURATION_S = 366 * 86_400
"""The longest duration a spec may give (a year): anything longer is a typo, and Python's
``timedelta`` and Airflow's timeouts overflow far beyond it."""


def parse_duration(text: object, *, allow_zero: bool = False) -> int:
    """Parse a duration string into whole seconds.

    Raises:
        ValueError: the value is not a string of ``<int><unit>`` parts in the order d, h, m, s,
            or it is zero (unless ``allow_zero``).
    """
    if isinstance(text, bool) or not isinstance(text, str):
        raise ValueError(
            f"a duration is a string such as '30s', '15m', '2h' or '1h30m' "
            f"(got {text!r} of type {type(text).__name__})"
        )
    value = text.strip()
    if not _WHOLE.match(value):
        raise ValueError(
            f"not a duration (got {text!r}; expected parts like '30s', '15m', '2h', '1h30m' "
            f"with units d, h, m, s)"
        )
    parts = _PART.findall(value)
    order = [list(_UNITS_S).index(unit) for _, unit in parts]
    if order != sorted(set(order)):
        raise ValueError(
            f"duration units must appear once each, largest first (got {text!r}; "
            f"expected e.g. '1h30m')"
        )
    seconds = sum(int(n) * _UNITS_S[unit] for n, unit in parts)
    if seconds <= 0 and not allow_zero:
        raise ValueError(f"a duration must be longer than zero (got {text!r})")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"a duration may be at most {format_duration(MAX_DURATION_S)} "
                         f"(got {text!r})")
    return seconds


def parse_duration_or_zero(text: object) -> int:
    """:func:`parse_duration` that also accepts zero (``"0s"``): a delay, not a timeout."""
    return parse_duration(text, allow_zero=True)


def format_duration(seconds: int) -> str:
    """Inverse of :func:`parse_duration` for a number of seconds (``"0s"`` for zero)."""
    out = []
    rest = int(seconds)
    for unit, size in _UNITS_S.items():
        if rest >= size:
            out.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(out) or "0s"


DurationS = Annotated[
    int,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {"type": "string", "pattern": _WHOLE.pattern, "examples": ["30s", "15m", "1h30m"]}
    ),
]
"""A duration in whole seconds, written in specs as ``"1h30m"`` (see module docstring)."""

DelayS = Annotated[
    int,
    BeforeValidator(parse_duration_or_zero),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {"type": "string", "pattern": _WHOLE.pattern, "examples": ["0s", "30s", "5m"]}
    ),
]
"""A delay in whole seconds, written like a duration, that may be zero (``"0s"``)."""

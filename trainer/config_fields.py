"""Typed, checked reads from the job config's JSON objects, for trainforge.trainer.config.

`Section` reads one JSON object field by field (type, range, choices, defaults) and remembers
which keys were read, so that unknown keys can be refused; every problem raises `ConfigError`
naming the field path, the value given and what was expected.
"""

from __future__ import annotations

import math
import os
from typing import Any

from trainforge.contract import JOB_FORMAT, S3_URI
from trainforge.trainer.errors import ConfigError

# S3 bucket naming rules (3-63 characters: lower-case letters, digits, '.', '-'), as the spec checks.


class Section:
    """Typed reads from one JSON object, remembering which keys were used."""

    def __init__(self, obj: Any, path: str) -> None:
        if not isinstance(obj, dict):
            raise ConfigError(f"{path or 'job config'}: expected a JSON object, got {show(obj)}")
        self.obj, self.path, self.used = obj, path, set()

    def _get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``; ``default`` when it is absent, or ConfigError when that is None."""
        if key not in self.obj:
            if default is None:
                raise ConfigError(f"{self._name(key)}: required field is missing")
            return default
        self.used.add(key)
        return self.obj[key]

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def section(self, key: str, optional: bool = False) -> Section:
        """The sub-object ``key``; an empty one when ``optional`` and absent (fields take defaults)."""
        return Section(self._get(key, {} if optional else None), self._name(key))

    def str(self, key: str, choices: tuple[str, ...] | None = None, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self._name(key)}={show(value)}: expected a non-empty string")
        if choices is not None and value not in choices:
            raise ConfigError(f"{self._name(key)}={value!r}: expected one of {list(choices)}")
        return value

    def location(self, key: str) -> str:
        """An absolute local path or an ``s3://bucket[/prefix]`` URI (`S3_URI`)."""
        value = self.str(key)
        if "://" in value:
            if not S3_URI.match(value):
                raise ConfigError(
                    f"{self._name(key)}={value!r}: expected an absolute path or an "
                    "s3://bucket/prefix URI (bucket: 3-63 lower-case letters, digits, '.' or '-')"
                )
            return value
        if not os.path.isabs(value):
            raise ConfigError(
                f"{self._name(key)}={value!r}: expected an absolute path or an s3://bucket/prefix "
                "URI (the trainer may run in another working directory)"
            )
        return value

    def int(self, key: str, lo: int | None = None, hi: int | None = None, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self._name(key)}={show(value)}: expected an integer")
        self._range(key, value, lo, hi)
        return value

    def optional_int(self, key: str, lo: int | None = None) -> int | None:
        """`int`, or None when ``key`` is absent."""
        return self.int(key, lo) if key in self.obj else None

    def float(
        self, key: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
        hi_open: bool = False,
    ) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self._name(key)}={show(value)}: expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{self._name(key)}={value}: expected a finite number")
        self._range(key, value, lo, hi, lo_open, hi_open)
        return value

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self._name(key)}={show(value)}: expected true or false")
        return value

    def auto_or_bool(self, key: str, default: str | bool) -> str | bool:
        """``"auto"``, true or false; anything else (the string ``"true"``, the number 1) is refused."""
        value = self._get(key, default)
        if not (value is True or value is False or value == "auto"):
            raise ConfigError(f"{self._name(key)}={show(value)}: expected 'auto', true or false")
        return value

    def _range(self, key, value, lo, hi, lo_open=False, hi_open=False) -> None:
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and (value >= hi if hi_open else value > hi)
        if below or above:
            raise ConfigError(f"{self._name(key)}={value}: expected {interval(lo, hi, lo_open, hi_open)}")

    def done(self) -> None:
        unknown = sorted(set(self.obj) - self.used)
        if unknown:
            names = ", ".join(self._name(k) for k in unknown)
            raise ConfigError(f"unknown field(s) {names}: not part of {JOB_FORMAT}")


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def interval(lo, hi, lo_open, hi_open) -> str:
    if hi is None:
        return f"a value {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"a value {'<' if hi_open else '<='} {hi}"
    return f"a value in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def scalar_overrides(value: Any, path: str) -> dict[str, Any]:
    """``model.config_overrides``: a JSON object of scalars (which keys: trainforge.trainer.model.llama_config)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}={show(value)}: expected a JSON object")
    for key, item in value.items():
        if item is not None and not isinstance(item, (bool, int, float, str)):
            raise ConfigError(f"{path}.{key}={show(item)}: expected a JSON scalar")
    return dict(value)

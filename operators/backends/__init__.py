"""Cluster engines behind one contract (:mod:`operators.backends.base`).

Engine modules are imported only when used, so parsing a DAG never imports an engine's client.
"""

from __future__ import annotations

from typing import Any

from operators.backends.base import Backend

ENGINES = ("local",)


def get_backend(engine: str, **kwargs: Any) -> Backend:
    """The backend for ``engine``, built from plain keyword values (as a trigger carries them).

    Raises:
        ValueError: the engine is unknown.
    """
    if engine == "local":
        from operators.backends.local import LocalBackend

        return LocalBackend(**kwargs)
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")

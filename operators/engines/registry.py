"""Deprecated name of :mod:`trainforge.engines.descriptors`, kept for engines written against it.

``from trainforge.engines.registry import Engine`` still works and warns once on import; import
from :mod:`trainforge.engines.descriptors` instead.
"""

from __future__ import annotations

import warnings

from trainforge.engines.descriptors import (
    DEFAULT_ENGINE,
    ENTRY_POINT_GROUP,
    Engine,
    EngineRegistryError,
    backend_kwargs,
    engine_names,
    engines,
    get_backend,
    get_engine,
)

__all__ = [
    "DEFAULT_ENGINE",
    "ENTRY_POINT_GROUP",
    "Engine",
    "EngineRegistryError",
    "backend_kwargs",
    "engine_names",
    "engines",
    "get_backend",
    "get_engine",
]

warnings.warn(
    "trainforge.engines.registry is deprecated: import from trainforge.engines.descriptors",
    DeprecationWarning,
    stacklevel=2,
)

"""The threads the pages' slow calls (MLflow, engines) run in, and a deadline over them.

The routes themselves run in Starlette's thread pool (plain ``def``), never on the API
server's event loop; calls that may hang run here so that a route can give up on them at its
deadline and answer with what it has.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

POOL = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="trainforge-ui")


class _Late:
    """Stands for a future that missed the deadline: ``result`` raises TimeoutError."""

    def result(self, timeout: float | None = None) -> Any:
        raise TimeoutError("no answer before the deadline")


def bounded(futures: dict[cf.Future, Any], timeout_s: float) -> Iterator[tuple[Any, Any]]:
    """``(future, value)`` pairs of a ``{future: value}`` mapping once each is done or the
    deadline has passed; a late one comes as an object whose ``result`` raises TimeoutError."""
    done, late = cf.wait(futures, timeout=timeout_s)
    for future in done:
        yield future, futures[future]
    for future in late:
        future.cancel()
        yield _Late(), futures[future]

"""Reading back what this product has itself just written, on stores whose reads lag writes.

Some S3-compatible stores answer a HEAD or GET of an object with 404 for seconds after its PUT
succeeded. For an object the product wrote — a checkpoint manifest the trainer has just put, the
dataset manifest prepare_data uploaded before it launched the trainer — "missing" then means
"not visible yet": :func:`settled` reads again, at growing intervals, for at most the store's
``settle_s`` (0 on a local disk, where a written file is there at once), and logs how long it
waited. Reads of anything else keep "missing" as the answer at once: only callers that know the
product wrote the object call this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from trainforge.storage.base import Location, Storage

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_POLL_S = 0.25  # first wait; doubled after each miss
MAX_POLL_S = 4.0


def settled(read: Callable[[Location], T | None], location: Location, what: str, settle_s: float,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], Any] = time.sleep) -> tuple[T | None, float]:
    """``(read(location), seconds waited)``: ``read`` again while it answers None, for at most
    ``settle_s`` seconds in all (waits of 0.25 s doubling up to 4 s).

    A wait is logged (WARNING, naming ``what``, the location and the seconds): when the object
    appeared, and when it still had not at the end. Errors of ``read`` propagate at once.
    """
    started = clock()
    value = read(location)
    poll_s = FIRST_POLL_S
    while value is None and (left := settle_s - (clock() - started)) > 0:
        sleep(min(poll_s, left))
        poll_s = min(poll_s * 2, MAX_POLL_S)
        value = read(location)
    waited_s = clock() - started
    if value is not None and waited_s > 0 and settle_s > 0 and waited_s >= FIRST_POLL_S:
        log.warning("%s %s became readable %.1f s after it was written (the store's reads lag "
                    "its writes)", what, location, waited_s)
    elif value is None and settle_s > 0:
        log.warning("%s %s is still missing after waiting %.1f s for the store's read-after-write "
                    "lag", what, location, waited_s)
    return value, waited_s


def read_written(store: Storage, location: Location, what: str) -> tuple[bytes | None, float]:
    """The bytes of ``location``, which this product wrote a moment ago, and the seconds waited
    for them to become readable (:func:`settled` with the store's ``settle_s``)."""
    return settled(store.read_bytes, location, what, getattr(store, "settle_s", 0.0))


def size_written(store: Storage, location: Location, what: str) -> tuple[int | None, float]:
    """The size of ``location``, which this product wrote a moment ago, and the seconds waited."""
    return settled(store.size, location, what, getattr(store, "settle_s", 0.0))

"""Closing the books: the buckets and the productive time sum to the wall time.

    wall_s = productive_s + sum(known buckets) + other_s

A bucket is known (seconds) or unknown (a reason, "unknown: ..." or "not applicable: ...");
an unknown bucket's time, like anything no bucket explains, is in ``other``. ``other`` is the
remainder, so the identity holds by construction; it is negative only when the clocks disagree
(rank 0's machine and the orchestrator's), which :func:`close_books` reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.ledger.names import BUCKETS, OTHER


class BooksError(ValueError):
    """Buckets that cannot be closed: an unknown bucket name, or a negative known value."""


@dataclass(frozen=True)
class Books:
    wall_s: float
    productive_s: float
    buckets: dict[str, float]
    """Every known bucket, ``other`` included, seconds."""
    unknown: dict[str, str]
    """Bucket -> why it is not known."""

    @property
    def goodput_pct(self) -> float:
        return 100.0 * self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def clock_skew_s(self) -> float:
        """How far the known parts exceed the wall time (0 when they do not)."""
        return max(0.0, -self.buckets[OTHER])


def close_books(wall_s: float, productive_s: float, buckets: dict[str, float | str]) -> Books:
    """The :class:`Books` of a job: ``buckets`` maps each bucket but ``other`` to seconds or to
    the reason it is unknown; ``other`` is computed.

    Raises:
        BooksError: a bucket outside `trainforge.ledger.names.BUCKETS`, ``other`` given, or a
            negative number of seconds.
    """
    known: dict[str, float] = {}
    unknown: dict[str, str] = {}
    for name, value in buckets.items():
        if name not in BUCKETS or name == OTHER:
            raise BooksError(f"bucket {name!r}: expected one of {', '.join(BUCKETS[:-1])} "
                             f"({OTHER!r} is the computed remainder)")
        if isinstance(value, str):
            unknown[name] = value
        elif value < 0:
            raise BooksError(f"bucket {name!r}: {value} s is negative (expected >= 0)")
        else:
            known[name] = float(value)
    known[OTHER] = wall_s - productive_s - sum(known.values())
    return Books(float(wall_s), float(productive_s), known, unknown)

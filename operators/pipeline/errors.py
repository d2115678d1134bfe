"""The errors of reading a pipeline spec: one :class:`SpecIssue` per problem, all raised at once
as one :class:`SpecError`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecIssue:
    """One problem in one spec file."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ValueError):
    """A pipeline spec is invalid. ``issues`` holds every problem found; ``str()`` lists them."""

    def __init__(self, issues: Iterable[SpecIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

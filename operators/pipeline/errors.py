"""The errors of reading a pipeline spec: one :class:`SpecIssue` per problem, all raised at once
as one :class:`SpecError`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

_PLAIN_KEY = re.compile(r"[\w\-]+")


def dotted(loc: Iterable) -> str:
    """A field path as errors show it: ``training.optimization.max_steps``, ``stages.0.name``.

    A key that is not a plain name (a trailing space, a dot, a colon, an empty key) is shown
    quoted, so that the path stays one readable token: ``data."validation_fraction "``.
    """
    return ".".join(str(p) if isinstance(p, int) or _PLAIN_KEY.fullmatch(str(p)) else
                    json.dumps(str(p), ensure_ascii=False) for p in loc)


#: How an issue outside any field shows its place instead of a field path.
TOP_LEVEL = "(top level)"


@dataclass(frozen=True)
class SpecIssue:
    """One problem in one spec file: ``path`` is the dotted field path, "" for the top level."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        # every line names a field; a problem outside any field (an empty file, a syntax error
        # between sections) is at the top level
        return f"{self.file}:{self.line}:{self.column}: {self.path or TOP_LEVEL}: {self.message}"


class SpecError(ValueError):
    """A pipeline spec is invalid. ``issues`` holds every problem found; ``str()`` lists them."""

    def __init__(self, issues: Iterable[SpecIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

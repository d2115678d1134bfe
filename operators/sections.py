"""The base class of every spec section (the pipeline's sections and the engines' blocks), and the
error a cross-field rule raises.

It sits outside :mod:`trainforge.pipeline` so that an engine's block can subclass it without
importing the pipeline model, which itself asks the engine registry for the blocks.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

#: pydantic error type of a rule that involves several fields (see :func:`field_errors`).
CROSS_FIELD = "cross_field"
#: Error kind of a YAML boolean given where a number is expected (see :class:`WrongScalar`).
BOOL_FOR_NUMBER = "bool_for_number"


def _kind(field: Any) -> str | None:
    """``"number"`` for an ``int``/``float`` field (or either ``| None``), ``"bool"`` for a
    ``bool`` field (or ``| None``), else None. Fields with their own before-validator (durations)
    parse the raw value themselves and are left alone."""
    if any(isinstance(m, (BeforeValidator, PlainValidator)) for m in field.metadata):
        return None
    annotation = field.annotation
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    # Annotated[int, Ge(1)] counts as int (override models wrap their members so)
    args = {typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
            for m in members} - {type(None)}
    if args and args <= {int, float}:
        return "number"
    if args == {bool}:
        return "bool"
    return None


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


class SpecModel(BaseModel):
    """Base of every spec section: unknown keys are errors, values are immutable.

    Booleans and numbers do not stand in for each other: pydantic's lax mode turns ``true``
    into ``1`` (so ``retries: yes`` would silently be one retry) and ``1`` into ``true``. Every
    number field refuses a boolean and every boolean field refuses anything but true/false.
    Nor does text stand in for a number: lax mode reads ``"300"`` as 300, which the published
    JSON Schema (``type: integer``) rejects, so editors and the loader would disagree.
    """

    # allow_inf_nan=False: ``.inf`` / ``.nan`` are never a setting, and JSON (job requests,
    # manifests) has no spelling for them.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kinds = {name: _kind(f) for name, f in cls.model_fields.items()}
        cls._numbers = frozenset(n for n, k in kinds.items() if k == "number")
        cls._bools = frozenset(n for n, k in kinds.items() if k == "bool")

    # One call per section, not per field: this runs for every spec the DAG files parse.
    @model_validator(mode="before")
    @classmethod
    def _bools_and_numbers_apart(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        wrong = None
        for name, value in data.items():
            if value is True or value is False:
                if name in cls._numbers:
                    wrong = wrong or dict(data)
                    wrong[name] = WrongScalar(value, "number")
            elif type(value) is str and name in cls._numbers and _is_number_text(value):
                wrong = wrong or dict(data)
                wrong[name] = WrongScalar(value, "unquoted number")
            elif name in cls._bools and value is not None:
                wrong = wrong or dict(data)
                wrong[name] = WrongScalar(value, "bool")
        return data if wrong is None else wrong


def _is_number_text(text: str) -> bool:
    """Whether pydantic's lax mode would read ``text`` as a number (``"300"``, ``" 1e-4 "``)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


class WrongScalar:
    """Stands in for a boolean or quoted number given to a number field, or a non-boolean given
    to a boolean field, so that pydantic rejects it with the field's own location while every other field
    is still checked. The loader turns the error into "expected a number, not a boolean".
    """

    __slots__ = ("value", "expected")

    def __init__(self, value: Any, expected: str) -> None:
        self.value, self.expected = value, expected

    def __repr__(self) -> str:
        return repr(self.value)

    def message(self) -> str:
        """The one-line text of the error."""
        if self.expected == "number":
            return f"expected a number, not a boolean (got {self.value})"
        if self.expected == "unquoted number":
            return (f"a quoted number is text; write {self.value.strip()} without quotes "
                    f"(got {self.value!r}; expected a number)")
        if isinstance(self.value, str) and self.value.strip().lower() in ("true", "false"):
            return (f"a quoted boolean is text; write {self.value.strip().lower()} without quotes "
                    f"(got {self.value!r}; expected true or false)")
        return f"expected true or false (got {self.value!r})"


def field_errors(model: type[BaseModel], *errors: tuple[tuple, str, Any, tuple]) -> ValidationError:
    """A ``ValidationError`` that places each cross-field problem at the field it is about.

    Raise it from a ``model_validator(mode="after")``: pydantic nests each location under the
    model's own, so ``("global_batch_size",)`` raised in ``OptimizationSection`` reaches the
    user as ``training.optimization.global_batch_size``, at that key's line.

    Args:
        model: the model class raising it (names the error's title).
        errors: ``(loc, message, input, fallback)`` per problem: ``loc`` relative to the model;
            ``message`` the full one-line text, ``(got X; expected Y)`` included; ``input`` the
            value at fault; ``fallback`` a relative location to point at when ``loc`` is not
            written in the file (a default value), e.g. ``("engine",)``, or ``()``.
    """
    return ValidationError.from_exception_data(
        model.__name__,
        [
            InitErrorDetails(
                type=PydanticCustomError(
                    CROSS_FIELD, "{message}",
                    {"message": message, "relative_loc": tuple(loc), "fallback": tuple(fallback)},
                ),
                loc=tuple(loc),
                input=value,
            )
            for loc, message, value, fallback in errors
        ],
    )


def check_length(value: str, limit: int, what: str) -> None:
    """Raise ValueError saying the length of a name that is empty or over ``limit`` characters.

    Called before a name's character check, so that a name too long for its system (a dag_id,
    a DNS label) is refused for its length, with the limit, not for its characters.
    """
    if not value:
        raise ValueError(f"{what} may not be empty (got ''; expected 1 to {limit} characters)")
    if len(value) > limit:
        shown = repr(value[:24] + "...")
        raise ValueError(f"{what} is too long (got {len(value)} characters, {shown}; expected "
                         f"at most {limit})")

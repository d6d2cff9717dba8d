"""What every typed settings section shares: strict types, and errors that name the key.

A ``Section`` is one JSON object of a config (or the keyword arguments that mean the same).
Every problem becomes a ``ConfigError`` (a ``ValueError``) with one ``dotted.key.path: problem``
line per problem, saying what is allowed.
"""

from __future__ import annotations

import difflib
import json
import typing
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A bad zenflow/DeepSpeed config. The message has one ``dotted.key: problem`` line per problem."""


class Problem(ConfigError):
    """A problem found inside a model validator, where pydantic knows the section but not the key.

    Carries the key relative to that section so that the final message can name the full path.
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def integral(value: Any) -> Any:
    # JSON configs commonly write sizes as 5e8, which json reads as a float.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(integral)]


class Section(BaseModel):
    """One JSON object of the config.

    Strict types: JSON ``true`` is not the number 1 and ``"2"`` is not the number 2; NaN and
    Infinity are not numbers. Integers written as floats (``5e8``) are accepted where an int is
    expected.
    ``ignored_keys`` are DeepSpeed keys accepted with a notice; ``key_hints`` are DeepSpeed keys we
    reject with a specific fix.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    ignored_keys: ClassVar[frozenset[str]] = frozenset()
    key_hints: ClassVar[dict[str, str]] = {}


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe(value: Any) -> str:
    if value is None:
        return "null"
    kind = {bool: "a boolean", list: "a list", str: "a string"}.get(type(value))
    if kind is None:
        kind = "a number" if isinstance(value, (int, float)) else type(value).__name__
    return f"{kind} ({json.dumps(value, default=repr)[:60]})"


def validate(model: type[BaseModel], data: dict, path: str = "", context: dict | None = None):
    """``model`` validated from ``data``; a ``ConfigError`` naming each key (under ``path``)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as error:
        raise ConfigError(format_errors(error, path)) from None


def format_errors(error: ValidationError, path: str) -> str:
    lines = []
    for problem in error.errors():
        keys = [path] if path else []
        keys += [str(part) for part in problem["loc"]]
        cause = problem.get("ctx", {}).get("error")
        if isinstance(cause, Problem):
            keys.append(cause.key)
            message = cause.message
        else:
            message = problem["msg"].removeprefix("Value error, ")
            if problem["type"] not in ("value_error", "missing"):
                message += f", got {describe(problem['input'])}"
        lines.append(f"{'.'.join(keys) or 'config'}: {message}")
    return "\n".join(dict.fromkeys(lines))

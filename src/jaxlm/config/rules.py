"""ConfigError, and the range rules a setting declares on its field (`positive()`, `at_least(0)`,
`between("[0, 1)")`): validation.check_fields reads them and names the setting, its range and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from jaxlm.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-fixable configuration mistake; its message is a single line."""


def setting(default, help: str, rule: Rule | None = None):
    """A dataclass field with a help string shown by `jaxlm train --help`, and the range `rule` its values keep."""
    metadata = {"help": help} if rule is None else {"help": help, "rule": rule}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Rule:
    """The values one setting allows (None, an unset optional setting, always passes) and how the error says
    it: `{key}={value} must be {says}`."""
    allows: Callable[[Any], bool]
    says: str


def _noted(says: str, note: str) -> str:
    return f"{says} ({note})" if note else says


def positive(note: str = "") -> Rule:
    return Rule(lambda v: v > 0, _noted("> 0", note))


def at_least(lo: int, note: str = "") -> Rule:
    return Rule(lambda v: v >= lo, _noted(f">= {lo}", note))


def between(interval: str, note: str = "") -> Rule:
    """`between("[0, 1)")`: the range as the message writes it, a bracket taking its end in, a parenthesis
    leaving it out."""
    left, right = interval[0], interval[-1]
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return Rule(lambda v: (lo <= v if left == "[" else lo < v) and (v <= hi if right == "]" else v < hi),
                _noted(f"in {interval}", note))

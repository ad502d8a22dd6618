"""The one base of the errors a user can cause and fix (a bad setting, missing data, a corrupt checkpoint, a bad
request): the CLI catches it once and prints its message as one line, `error: <message>`."""

from __future__ import annotations


class UserError(Exception):
    """An error the user can cause and fix: the CLI prints its message as one line and exits with
    `exit_status` (2 by default; a subclass sets its own with `class X(UserError, exit_status=1)`)."""

    exit_status: int = 2

    def __init_subclass__(cls, exit_status: int | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if exit_status is not None:
            cls.exit_status = exit_status


class MissingExtra(UserError):
    """A command needs packages of an optional extra that are not installed."""


# The packages of each extra that its commands import (pyproject.toml's extras).
EXTRA_MODULES = {"serve": ("fastapi", "uvicorn", "orjson"), "eval": ("lm_eval", "httpx")}


def require_extra(what: str, *extras: str) -> None:
    """Raise MissingExtra, naming the install, unless every module of `extras` can be imported: checked before a
    command loads a model, so that it ends in one line rather than an ImportError minutes later."""
    import importlib.util

    missing = [m for e in extras for m in EXTRA_MODULES[e] if importlib.util.find_spec(m) is None]
    if missing:
        names = ",".join(extras)
        raise MissingExtra(f"{what} needs {', '.join(missing)}, which are not installed: pip install "
                           f"'jaxlm[{names}]' (in a clone: pip install -e '.[{names}]')")

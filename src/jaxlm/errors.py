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


def require_extra(what: str, extra: str, modules: tuple[str, ...]) -> None:
    """Raise MissingExtra, naming the install, unless every module of `modules` can be imported: checked before a
    command loads a model, so that it ends in one line rather than an ImportError minutes later."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"{what} needs {', '.join(missing)}, which are not installed: pip install "
                           f"'jaxlm[{extra}]' (in a clone: pip install -e '.[{extra}]')")

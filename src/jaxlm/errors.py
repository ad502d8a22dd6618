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

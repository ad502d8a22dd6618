"""What every data module raises and shares: the one-line data error, and the ways invalid UTF-8 may be treated."""

from jaxlm.errors import UserError


class DataError(UserError, ValueError):
    """Missing, unreadable or inconsistent data; the message says how to fix it."""


# --errors of `jaxlm prepare`: invalid UTF-8 replaced by U+FFFD, dropped, or refused.
UTF8_ERRORS = ("replace", "skip", "strict")

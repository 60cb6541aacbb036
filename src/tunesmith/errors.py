"""The one exception type for mistakes a user can make (bad path, bad data, no memory, missing extra).

The CLI turns it into a single line on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class TunesmithError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code = EXIT_USER_ERROR


def missing_extra(package: str, extra: str, what: str) -> TunesmithError:
    """Error for an optional dependency that is not installed."""
    return TunesmithError(
        f"{what} needs the '{package}' package, which is not installed. "
        f"Install it with: pip install 'tunesmith[{extra}]'"
    )

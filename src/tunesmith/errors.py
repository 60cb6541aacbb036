"""The one exception type for mistakes a user can make (bad path, bad data, no memory, missing extra).

The CLI turns it into a single line on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class TunesmithError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code = EXIT_USER_ERROR
    label = "error"  # the word before the message on stderr


class Interrupted(TunesmithError):
    """A run stopped on request (SIGINT, SIGTERM) after saving a checkpoint; the exit code is 128 + the signal
    number, as a shell reports a process killed by it: 130 for Ctrl-C, 143 for SIGTERM."""

    label = "stopped"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class PeerLost(TunesmithError):
    """This process of a several-process run stopped because another one did (or a collective timed out). Its own
    exit code lets the launcher tell this consequence from the failure that caused it: which of the two ends
    first is a race."""

    exit_code = 75  # EX_TEMPFAIL: the run continues with --resume


def missing_extra(package: str, extra: str, what: str) -> TunesmithError:
    """Error for an optional dependency that is not installed."""
    return TunesmithError(
        f"{what} needs the '{package}' package, which is not installed. "
        f"Install it with: pip install 'tunesmith[{extra}]'"
    )

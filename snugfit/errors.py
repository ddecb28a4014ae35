"""User-facing errors: one line naming the problem and the fix, printed without a traceback."""


class SnugfitError(Exception):
    """Bad input or an impossible request. The CLI prints `error: <message>` and exits with status 2."""


class PlanError(SnugfitError, ValueError):
    """A plan that cannot run as written (or a name no registry entry has); the message names the field and
    the fix."""


class Stopped(SnugfitError):
    """A run stopped on request (a signal) with its state saved. The CLI prints the message as is and exits with
    128 + the signal's number, as a shell reports a process the signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = 128 + signum


class PeerFailed(SnugfitError):
    """Another rank failed first and said why in its own `error:` line; this one exits with status 2 and says
    nothing more, so a launch that fails prints one line, not one per rank."""

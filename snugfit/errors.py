"""User-facing errors: one line naming the problem and the fix, printed without a traceback."""


class SnugfitError(Exception):
    """Bad input or an impossible request. The CLI prints `error: <message>` and exits with status 2."""

"""The one exception type users see: a bad input, named, with the fix."""


class SpecDecError(ValueError):
    """A user-facing error: the message names the bad value and how to fix it.

    The CLI prints it without a traceback and exits with status 2.
    """

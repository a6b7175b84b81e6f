"""The one exception type that reaches users: its message is a single line saying what is wrong
and what to do. Internal invariants use `assert` instead."""


class CmoeError(Exception):
    """A user-facing error: bad input, a missing file, a mismatch. The CLI prints it as one line."""

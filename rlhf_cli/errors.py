"""User-facing errors: one line on stderr, non-zero exit, no traceback unless ``debug=true``."""


class RlhfError(Exception):
    """An error the user can fix. The message names the file or key and says what to do."""

    exit_code = 2

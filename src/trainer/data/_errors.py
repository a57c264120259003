"""The one exception type the data pipeline raises for bad input."""

from named import NamedError


class DataError(NamedError, ValueError):
    """Bad data input: a missing or corrupt file, an empty corpus, an impossible setting.

    The message always names the culprit (the file, the glob pattern, the config key) and,
    where there is one, the fix.
    """

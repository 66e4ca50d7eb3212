"""Errors a user can cause.

Anything raised as ``ConfigError`` is printed by the CLI as one line, ``error: <message>``,
with exit code 2 and no traceback. The message names the config key and the fix.
"""


class ConfigError(ValueError):
    """A configuration, size or path that cannot work; the message is one line for the user."""


class OutOfSpace(ConfigError):
    """A write filled the disk; the message names the path, the space needed and the space free."""

"""How a command's start-up ends: one ``error:`` line for a bad value, or, under
``ARLOPTI_STARTUP_CHECK=1``, a clean stop once everything is checked.

    StartupError(message)    a bad input (a config value, a file, a folder): one line naming it
    ConfigError(message)     an invalid configuration value; the message names the field
    startup_done(command)    where start-up ends and the work begins
"""

from __future__ import annotations

import os
import sys

STARTUP_CHECK_ENV = "ARLOPTI_STARTUP_CHECK"


class StartupError(ValueError):
    """A bad input a command cannot start with, raised where it is found: a config value, a model
    folder's file, the run folder. The message is the one ``error:`` line the command prints, and
    names the field, file or path (a ValueError, so that a command's start-up catches it)."""


class ConfigError(StartupError):
    """An invalid configuration value; the message names the field."""


def startup_done(command: str) -> None:
    """Where a command's start-up (arguments parsed, config validated, paths resolved) ends and its
    work begins. With ``ARLOPTI_STARTUP_CHECK=1`` in the environment the command stops here and
    exits 0, so a command line can be checked without running it; ``tests/test_examples.py``
    checks every documented command line this way."""
    if os.environ.get(STARTUP_CHECK_ENV) == "1":
        print(f"{command}: start-up check passed ({STARTUP_CHECK_ENV}=1: stopping before the work)")
        sys.exit(0)

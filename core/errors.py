"""User errors: what the user must fix, reported in one line with exit code 2 instead of a traceback.

A command wraps its body in `user_errors_exit` (or `compose_errors_exit` around `@hydra.main`); anything that raises
a `UserError`, a file error, or Hydra's and OmegaConf's complaints about a config is then one line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


class UserError(Exception):
    """Something the user must fix (a value, a file, a directory): the message is one line naming it and what to
    do, and `python -m train` prints it without a traceback and exits with code 2."""


class ConfigError(UserError, ValueError):
    """A value the user must change: one line naming the key and what is allowed (exit code 2, no traceback)."""


class ReportedError(UserError):
    """User errors already put into words elsewhere (by worker processes): the message is printed as it is."""


# What `python -m train` reports in one line with exit code 2: the project's user errors and the OS's file errors.
USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, PermissionError)


def user_error_line(error: BaseException) -> str:
    """The line a user error is reported with (`config error: optim.lr=-1 must be >= 0`)."""
    if isinstance(error, ReportedError):
        return str(error)
    return f"{'config error' if isinstance(error, ConfigError) else 'error'}: {error}"


def user_error_text(error: BaseException) -> str | None:
    """The one line `error` is reported with if the user must fix something (a value, a key left unset, a file);
    None for anything else, a bug, whose traceback is wanted."""
    if isinstance(error, USER_ERRORS):
        return user_error_line(error)
    if isinstance(error, _config_read_errors()):
        return user_error_line(config_error(error))
    return None


def _config_read_errors() -> tuple[type[BaseException], ...]:
    """What Hydra and OmegaConf raise on a config the user must fix. Only where they are loaded: a process that
    never imported them cannot have raised their errors, and this module needs neither."""
    errors: list[type[BaseException]] = []
    if "hydra.errors" in sys.modules:
        errors.append(sys.modules["hydra.errors"].HydraException)
    if "omegaconf.errors" in sys.modules:
        omegaconf_errors = sys.modules["omegaconf.errors"]
        errors += [omegaconf_errors.MissingMandatoryValue, omegaconf_errors.InterpolationToMissingValueError]
    return tuple(errors)


@contextlib.contextmanager
def user_errors_exit() -> Iterator[None]:
    """Around a command's body: a user error becomes its one line on stderr and exit code 2 (or the error's own
    `exit_code`: 1 for a stop that is not the user's to fix, a worker that died), not a traceback."""
    try:
        yield
    except Exception as err:
        line = user_error_text(err)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))


@contextlib.contextmanager
def compose_errors_exit() -> Iterator[None]:
    """Around a `@hydra.main` command: an override Hydra cannot apply (an unknown group option, bad syntax, a key
    the schema lacks) or a value left unset (`???`) becomes one line and exit code 2, like every user error, instead
    of Hydra's report of several lines and exit code 1. Hydra then raises its errors instead of reporting them
    (`HYDRA_FULL_ERROR`)."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with user_errors_exit():
            yield
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def config_error(err: Exception) -> ConfigError:
    """Hydra's or OmegaConf's several-line complaint about a config as a one-line `ConfigError` naming the key."""
    from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

    if isinstance(err, InterpolationToMissingValueError):  # `hydra.run.dir: ${output_dir}` with output_dir unset
        return _not_set(str(err).splitlines()[0].rpartition("Missing mandatory value: ")[2])
    if isinstance(err, MissingMandatoryValue):
        return _not_set(err.full_key)
    if isinstance(err, OmegaConfBaseException):
        return ConfigError(f"{_dotted(err.full_key)}: {err.msg.splitlines()[0]}")
    return ConfigError(_compose_error_text(err))


def _not_set(key: str) -> ConfigError:
    key = _dotted(key)
    return ConfigError(f"{key} is not set: give {key}=... on the command line")


def _dotted(key: str) -> str:
    """OmegaConf's `sources[0].paths` as the user writes it on the command line: `sources.0.paths`."""
    return key.replace("[", ".").replace("]", "")


def _compose_error_text(err: Exception) -> str:
    """Hydra's several-line message in one line: its first line, then the group's options or the cause's first line."""
    first = str(err).strip().splitlines()[0].rstrip(".")
    if getattr(err, "override", None) is not None:  # a parse error: the value needs quotes, most often
        return (f"cannot parse override '{err.override}' ({first}); a value with spaces or characters other than "
                """letters, digits and -_./ goes in quotes: 'key="value"'""")
    if getattr(err, "options", None):  # an unknown group option
        return f"{first}; options: {', '.join(err.options)}"
    cause = str(err.__cause__ or "").strip().splitlines()
    return f"{first}: {cause[0]}" if cause else first

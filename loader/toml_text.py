"""TOML text to a table, with every way it can fail as one ValueError (TomlError).

tomllib recurses once per level of nested arrays or inline tables, so a few thousand of them
(a 10 kB file) raise RecursionError; callers that read other people's TOML (a repo's
kernel-status.toml, a mirror's kernels-mirror.toml, a project's pyproject.toml) turn TomlError
into their own typed error.
"""

from __future__ import annotations


class TomlError(ValueError):
    """Not valid TOML, or nested too deeply to parse."""


def loads(text: str) -> dict:
    """Parse `text`; TomlError (with a short reason) when it is not TOML this parser can read."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and int()'s digit limit, which tomllib lets out
        raise TomlError(str(exc)) from None
    except RecursionError:
        raise TomlError("arrays or tables nested too deeply") from None

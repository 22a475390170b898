"""The format of kernel-status.toml (see status.py): `parse` and the `Redirect` it describes.

Apart from status.py because a warm load of a repo without a status file (most repos) reads only
an empty record and never needs it. kernels.status re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import KernelStatusError
from .spec import validate_repo_id, validate_revision

# The file's name is part of its format; status.py reads it from here on its cold paths only.
FILENAME = "kernel-status.toml"


@dataclass(frozen=True)
class Redirect:
    """Load `destination` at `revision` instead of this repo."""

    destination: str
    revision: str = "main"
    kind: str = "redirect"


def parse(text: str, *, where: str = FILENAME) -> Redirect:
    """A kernel-status.toml's status; KernelStatusError (a ValueError) when it is malformed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KernelStatusError(f"{where}: not valid TOML ({exc})") from None
    kind = data.get("kind")
    if not kind:
        raise KernelStatusError(f"{where}: kernel-status.toml must contain a 'kind' field")
    if kind != "redirect":
        raise KernelStatusError(f"{where}: Unknown kernel status kind: {kind!r}")
    destination = data.get("destination")
    if not isinstance(destination, str) or not destination:
        raise KernelStatusError(f"{where}: kernel-status.toml must contain a 'destination' field")
    revision = data.get("revision", "main")
    if not isinstance(revision, str):
        raise KernelStatusError(f"{where}: 'revision' must be a string, got {revision!r}")
    # The destination becomes a request of its own: hold it to the same rules as a user's.
    validate_repo_id(destination)
    validate_revision(revision)
    return Redirect(destination, revision)

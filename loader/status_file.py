"""The format of kernel-status.toml (see status.py): `parse` and the `Redirect` it describes.

Apart from status.py because a warm load of a repo without a status file (most repos) reads only
an empty record and never needs it. kernels.status re-exports both names.

The text is the publisher's, or a hostile mirror's: whatever it holds, `parse` returns a Redirect
or raises KernelStatusError with one short printable line (values are shown cut and escaped).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidSpec, KernelStatusError
from .spec import validate_repo_id, validate_revision

# The file's name is part of its format; status.py reads it from here on its cold paths only.
FILENAME = "kernel-status.toml"
# A status file is three short lines. tomllib takes time quadratic in a dotted key's depth (a
# 64 KiB key took 27 s), so the cap is small: at 4 KiB the worst file parses in a fraction of a second.
MAX_BYTES = 4 * 1024
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class Redirect:
    """Load `destination` at `revision` instead of this repo."""

    destination: str
    revision: str = "main"
    kind: str = "redirect"


def _shown(value: object) -> str:
    """A value of the file as an error may show it: a short escaped string, else its type."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}"
    text = ascii(value[:_SHOWN_CHARS])
    return text + "..." if len(value) > _SHOWN_CHARS else text


def parse(text: str, *, where: str = FILENAME) -> Redirect:
    """A kernel-status.toml's status; KernelStatusError (a ValueError) when it is malformed."""
    from .toml_text import TomlError, loads

    if len(text) > MAX_BYTES:  # a record written under an older, larger cap
        raise KernelStatusError(f"{where}: {len(text)} characters, more than a status file holds")
    try:
        data = loads(text)
    except TomlError as exc:
        reason = str(exc).splitlines()[0][:200]
        raise KernelStatusError(f"{where}: not valid TOML ({reason})") from None
    kind = data.get("kind")
    if not kind:
        raise KernelStatusError(f"{where}: kernel-status.toml must contain a 'kind' field")
    if kind != "redirect":
        raise KernelStatusError(f"{where}: Unknown kernel status kind: {_shown(kind)}")
    destination = data.get("destination")
    if not isinstance(destination, str) or not destination:
        raise KernelStatusError(f"{where}: kernel-status.toml must contain a 'destination' field")
    revision = data.get("revision", "main")
    if not isinstance(revision, str):
        raise KernelStatusError(f"{where}: 'revision' must be a string, got {_shown(revision)}")
    # The destination becomes a request of its own: hold it to the same rules as a user's.
    try:
        validate_repo_id(destination)
    except InvalidSpec:
        raise KernelStatusError(
            f"{where}: 'destination' {_shown(destination)} is not a repo id ('org/name')"
        ) from None
    try:
        validate_revision(revision)
    except InvalidSpec:
        raise KernelStatusError(
            f"{where}: 'revision' {_shown(revision)} is not a branch, tag or 40-hex commit"
        ) from None
    return Redirect(destination, revision)

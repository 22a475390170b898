"""Environment variables and the config file, read in one place.

Values are read when asked for (not at import), so tests and long-running processes see changes.
huggingface_hub's own variables (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE) are read here too, with the
same meaning huggingface_hub gives them, so the loader can decide "offline" without importing it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

DEFAULT_RESOLVE_TTL = 3600.0
DEFAULT_LOCK_TIMEOUT = 600.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "on", "yes", "true"}


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def cache_root() -> Path:
    """Root of the kernels cache: KERNELS_CACHE, else ~/.cache/kernels (XDG_CACHE_HOME honoured)."""
    explicit = os.environ.get("KERNELS_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kernels"


def offline() -> bool:
    """True when HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) asks for no network."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")
    )


def endpoint() -> str:
    """The Hub endpoint huggingface_hub will talk to."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def _seconds(name: str, default: float, example: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        from .errors import InvalidSpec

        raise InvalidSpec(
            f"{name}={raw!r} is not a number of seconds",
            hint=f"set {name} to seconds, e.g. {example}",
        ) from None
    return max(0.0, value)


def resolve_ttl() -> float:
    """Seconds a resolution record stays fresh (KERNELS_RESOLVE_TTL; 0 = always re-check)."""
    return _seconds("KERNELS_RESOLVE_TTL", DEFAULT_RESOLVE_TTL, "3600, or 0 to always re-check")


def lock_timeout() -> float:
    """Seconds one wait for a cache lock may last before it fails naming the holder
    (KERNELS_LOCK_TIMEOUT, default 600: a slow download of a large kernel fits)."""
    return _seconds("KERNELS_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT, "600")


def allow_pr_revisions() -> bool:
    """KERNELS_ALLOW_PR_REVISIONS=1: `refs/pr/N` revisions (unreviewed pull-request code, which
    the publisher's trust does not cover) may be loaded."""
    return _truthy(os.environ.get("KERNELS_ALLOW_PR_REVISIONS"))


def config_path() -> Path:
    """The user config file: KERNELS_CONFIG, else ~/.config/kernels/config.toml."""
    explicit = os.environ.get("KERNELS_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "kernels" / "config.toml"


def _read_config() -> dict:
    """The config file's table. It names trusted publishers, so a config file that other users
    could write is refused (UnsafePermissions), never read."""
    path = config_path()
    try:
        if not path.is_file():
            return {}
    except OSError:  # e.g. a HOME this user may not enter: no config it can read, so none
        return {}
    from .exposure import refuse_exposed

    refuse_exposed(path, "the kernels config file (it decides whom to trust)")
    return load_toml(path)


def load_toml(path: Path, *, what: str = "config file", hint: str | None = None) -> dict:
    """Parse a TOML file; InvalidSpec naming `what` and the file when it is broken, with `hint`
    (default: fix or remove it, right for the optional config file)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except Exception as exc:
        from .errors import InvalidSpec

        raise InvalidSpec(
            f"{what} {path} is not valid TOML: {exc}",
            hint=hint or f"fix or remove {path}",
        ) from None


def trusted_publishers() -> frozenset[str]:
    """Orgs the user trusts: KERNELS_TRUSTED_PUBLISHERS (comma or space separated) + config file."""
    names: set[str] = set()
    env = os.environ.get("KERNELS_TRUSTED_PUBLISHERS", "")
    names.update(part for part in env.replace(",", " ").split() if part)
    configured = _read_config().get("trusted_publishers", [])
    if isinstance(configured, list):
        names.update(str(part) for part in configured if str(part))
    return frozenset(names)


def lockfile_override() -> Path | None:
    """KERNELS_LOCKFILE, when set."""
    raw = os.environ.get("KERNELS_LOCKFILE")
    return Path(raw).expanduser() if raw else None


def download_timeout() -> float | None:
    """KERNELS_DOWNLOAD_TIMEOUT: the overall deadline of one file's download, in seconds (None:
    the default, which grows with the file's size); a non-positive or unparsable value is ignored."""
    raw = os.environ.get("KERNELS_DOWNLOAD_TIMEOUT")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def serve_token() -> str | None:
    """KERNELS_SERVE_TOKEN: the token `kernels serve` asks of clients of its request-log routes
    (header X-Mirror-Token); unset, those routes do not exist."""
    return os.environ.get("KERNELS_SERVE_TOKEN") or None

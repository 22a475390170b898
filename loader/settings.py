"""Environment variables and the config file, read in one place.

Values are read when asked for (not at import), so tests and long-running processes see changes.
huggingface_hub's own variables (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE) are read here too, with the
same meaning huggingface_hub gives them, so the loader can decide "offline" without importing it.
"""

from __future__ import annotations

import functools
import math
import os
import stat
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
    get = os.environ.get
    return _config_path(get("KERNELS_CONFIG"), get("XDG_CONFIG_HOME"), get("HOME"))


@functools.lru_cache(maxsize=8)
def _config_path(explicit: str | None, xdg: str | None, home: str | None) -> Path:
    # Keyed by the variables it reads: a warm load asks twice (trust, signature policy).
    if explicit:
        return Path(explicit).expanduser()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "kernels" / "config.toml"


_config_memo: tuple[tuple, dict] | None = None


def _read_config() -> dict:
    """The config file's table (read-only: shared between callers). It names trusted
    publishers, so a config file that other users could write is refused (UnsafePermissions),
    never read. The parse is reused while the file's stat is unchanged (ctime included, which no
    program can set back); the permission check runs on every call."""
    global _config_memo
    path = config_path()
    try:
        st = os.stat(path)
    except OSError:  # absent, or a HOME this user may not enter: no config it can read, so none
        return {}
    if not stat.S_ISREG(st.st_mode):
        return {}
    from .exposure import refuse_exposed

    refuse_exposed(path, "the kernels config file (it decides whom to trust)")
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    memo = _config_memo
    if memo is not None and memo[0] == key:
        return memo[1]
    table = load_toml(path)
    _config_memo = (key, table)
    return table


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


def sigstore_trusted_root() -> Path | None:
    """KERNELS_SIGSTORE_TRUSTED_ROOT: a Sigstore trusted_root.json that signature checks use
    instead of the public-good root sigstore keeps on disk."""
    raw = os.environ.get("KERNELS_SIGSTORE_TRUSTED_ROOT")
    return Path(raw).expanduser() if raw else None


# -- the signature policy at load time (loader/signatures.py) -----------------------------------

SIGNATURE_MODES = ("off", "warn", "require")
SIGNATURE_ENV = "KERNELS_SIGNATURE_POLICY"
_MODE_HINT = (
    "use off, warn or require, e.g. KERNELS_SIGNATURE_POLICY=warn or "
    "KERNELS_SIGNATURE_POLICY='off,kernels-community=require'"
)


def _signature_mode(value: object, where: str) -> str:
    if isinstance(value, str) and value.strip().lower() in SIGNATURE_MODES:
        return value.strip().lower()
    from .errors import InvalidSpec

    raise InvalidSpec(
        f"{where}: {value!r} is not a signature policy (off, warn or require)", hint=_MODE_HINT
    )


def _publisher_key(key: str, where: str) -> str:
    """`key` when it can name a publisher (an org); InvalidSpec otherwise, since a rule that can
    never match (a repo id, a typo) would leave the policy off without a word."""
    import re

    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", key):
        return key
    from .errors import InvalidSpec

    raise InvalidSpec(
        f"{where}: {key!r} is neither a publisher (an org name) nor an endpoint (https://host); "
        "a rule for it would never apply",
        hint=_MODE_HINT,
    )


def _signature_rules() -> list[tuple[str | None, dict[str, str], dict[str, str]]]:
    """(default, {publisher: mode}, {endpoint: mode}) from the environment, then the config."""
    env_default, env_publishers, env_endpoints = None, {}, {}
    for item in os.environ.get(SIGNATURE_ENV, "").replace(",", " ").split():
        key, sep, value = item.rpartition("=")
        mode = _signature_mode(value, SIGNATURE_ENV)
        if not sep:
            env_default = mode
        elif "://" in key:
            env_endpoints[key.rstrip("/")] = mode
        else:
            env_publishers[_publisher_key(key, SIGNATURE_ENV)] = mode
    rules = [(env_default, env_publishers, env_endpoints)]
    table = _read_config().get("signatures")
    if table is None:
        return rules
    where = f"{config_path()} [signatures]"
    if not isinstance(table, dict):  # `signatures = "warn"`: the default alone
        rules.append((_signature_mode(table, where), {}, {}))
        return rules
    default = table.get("policy")
    sections = []
    for name in ("publishers", "endpoints"):
        section = table.get(name, {})
        if not isinstance(section, dict):
            from .errors import InvalidSpec

            raise InvalidSpec(
                f"{where}: {name} must be a table of names to off, warn or require",
                hint=f'e.g. [signatures.{name}] "kernels-community" = "require"',
            )
        check = _publisher_key if name == "publishers" else lambda k, _where: k
        sections.append(
            {
                check(str(k), f"{where} {name}").rstrip("/"): _signature_mode(
                    v, f"{where} {name}.{k}"
                )
                for k, v in section.items()
            }
        )
    rules.append(
        (None if default is None else _signature_mode(default, where), sections[0], sections[1])
    )
    return rules


def signature_policy(repo_id: str, endpoint_url: str | None = None) -> str:
    """ "off", "warn" or "require": whether loading `repo_id` from `endpoint_url` (default: the
    current endpoint) needs a valid Sigstore signature. The most specific rule wins: the
    publisher (the org of `repo_id`), then the endpoint, then the default; at each level
    KERNELS_SIGNATURE_POLICY (`mode`, `org=mode`, `https://host=mode`, comma-separated) before
    the config file's `[signatures]` table (`policy`, `publishers`, `endpoints`). Default "off"."""
    publisher = repo_id.split("/", 1)[0]
    where = (endpoint_url or endpoint()).rstrip("/")
    rules = _signature_rules()  # nothing set and no config file: one stat
    for level in (lambda r: r[1].get(publisher), lambda r: r[2].get(where), lambda r: r[0]):
        for rule in rules:
            mode = level(rule)
            if mode is not None:
                return mode
    return "off"


def signature_signers(publisher: str) -> tuple[str, ...]:
    """The GitHub workflow URIs whose Sigstore certificates sign `publisher`'s kernels
    (`[signatures.signers]` in the config file: "org" = ["https://github.com/<org>/<repo>/
    .github/workflows/<file>@<ref>", ...]); empty: the reference's default signers."""
    table = _read_config().get("signatures")
    signers = table.get("signers", {}) if isinstance(table, dict) else {}
    uris = signers.get(publisher, []) if isinstance(signers, dict) else None
    if not isinstance(uris, list) or not all(isinstance(u, str) for u in uris):
        from .errors import InvalidSpec

        raise InvalidSpec(
            f"{config_path()} [signatures.signers]: {publisher!r} must be a list of workflow URIs",
            hint='e.g. "my-org" = ["https://github.com/my-org/kernels/.github/workflows/'
            'build.yaml@refs/heads/main"]',
        )
    return tuple(uris)


TRL_HEAD_CHOICES = ("kernels", "trl")


def trl_head() -> str:
    """KERNELS_TRL_HEAD: which kernel serves TRL's fused_lm_head calls on a model whose loss head
    this package bound: "kernels" (the default, the training kernels' log-prob head) or "trl"
    (TRL's own ChunkedLogProbFunction / ChunkedDivergenceFunction). Read when kernelize binds."""
    raw = os.environ.get("KERNELS_TRL_HEAD")
    if raw is None or raw.strip() == "":
        return "kernels"
    value = raw.strip().lower()
    if value not in TRL_HEAD_CHOICES:
        from .errors import InvalidSpec

        raise InvalidSpec(
            f"KERNELS_TRL_HEAD={raw!r} is neither 'kernels' nor 'trl'",
            hint="set KERNELS_TRL_HEAD=trl to keep TRL's own fused head, or unset it",
        )
    return value

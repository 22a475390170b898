"""Small JSON records the loader keeps between runs.

- `ResolutionRecord`: (repo, revision) -> commit, and when that was last checked.
- `RepoIndex`: per (repo, commit): the remote file listing (immutable, so cached forever) and,
  per installed variant, the manifest digest of its tree.
- `TrustRecord`: a publisher trust decision and where it came from.
- `VerdictRecord`: what a signature check of a tree found (the loader's signature policy).

Keys are opaque strings to this module; it knows nothing of what a repo or a revision means.

Scoping: a store made with an `endpoint` (an opaque string: the loader passes the Hub URL) reads
and writes only that endpoint's entry of a resolution or trust record file
(`{"endpoints": {endpoint: record}}`), keeps one listing file per endpoint, and uses an
installed variant only when its record lists that endpoint, so what one server said is never
taken as another's answer. A store made without one (tools, tests) reads the latest of any.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .fsutil import atomic_write_json, read_json, safe_key, unsafe_key
from .manifest import Manifest, ManifestError


@dataclass(frozen=True)
class ResolutionRecord:
    repo: str
    revision: str
    commit: str
    checked_at: float

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.checked_at


@dataclass(frozen=True)
class TrustRecord:
    publisher: str
    trusted: bool
    source: str  # "hub", "user", "trust_remote_code"
    checked_at: float


class VerdictRecord:
    """What a verification of the tree `tree` under the policy `key` found (`verdict`, with
    a one-line `detail`), and when.

    A plain class, not a dataclass: this module is imported by every warm load, signature
    policy or not, and building a dataclass costs ~0.6 ms of that load's ~16 ms."""

    __slots__ = ("tree", "key", "verdict", "detail", "checked_at")

    def __init__(self, tree: str, key: str, verdict: str, detail: str, checked_at: float):
        self.tree = tree
        self.key = key
        self.verdict = verdict
        self.detail = detail
        self.checked_at = checked_at

    def __repr__(self) -> str:
        return f"VerdictRecord({self.tree!r}, {self.key!r}, {self.verdict!r}, {self.detail!r})"


def _read_scoped(path: Path, endpoint: str | None) -> dict | None:
    """The record at `path` for `endpoint`; with None, the most recently checked of any."""
    data = read_json(path)
    entries = data.get("endpoints") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        return None  # absent, damaged, or written before records were scoped
    if endpoint is not None:
        found = entries.get(endpoint)
        return found if isinstance(found, dict) else None
    found = [e for e in entries.values() if isinstance(e, dict)]
    return max(found, key=lambda e: e.get("checked_at", 0) or 0, default=None)


def _write_scoped(path: Path, endpoint: str | None, record: dict) -> None:
    """Set `endpoint`'s record in the file at `path`, keeping other endpoints' records. Two
    writers racing may lose one endpoint's record; that only costs it a re-check."""
    data = read_json(path)
    entries = data.get("endpoints") if isinstance(data, dict) else None
    entries = dict(entries) if isinstance(entries, dict) else {}
    entries[endpoint or ""] = record
    atomic_write_json(path, {"endpoints": entries})


def _endpoints_of(path: Path) -> list[str]:
    data = read_json(path)
    entries = data.get("endpoints") if isinstance(data, dict) else None
    return sorted(e for e in entries if e) if isinstance(entries, dict) else []


def endpoint_key(endpoint: str) -> str:
    """A short file-name-safe key for an endpoint string."""
    return hashlib.sha256(endpoint.encode("utf-8")).hexdigest()[:16]


class RecordStore:
    """refs/<repo>/<revision>.json and trust/<publisher>.json."""

    def __init__(self, refs: Path, trust: Path, endpoint: str | None = None):
        self.refs = refs
        self.trust_dir = trust
        self.endpoint = endpoint

    def _ref_path(self, repo: str, revision: str) -> Path:
        return self.refs / safe_key(repo) / f"{safe_key(revision)}.json"

    def get(self, repo: str, revision: str) -> ResolutionRecord | None:
        data = _read_scoped(self._ref_path(repo, revision), self.endpoint)
        if data is None:
            return None
        try:
            return ResolutionRecord(repo, revision, str(data["commit"]), float(data["checked_at"]))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, record: ResolutionRecord) -> None:
        _write_scoped(
            self._ref_path(record.repo, record.revision),
            self.endpoint,
            {"commit": record.commit, "checked_at": record.checked_at},
        )

    def revisions(self, repo: str) -> list[ResolutionRecord]:
        folder = self.refs / safe_key(repo)
        out = []
        if folder.is_dir():
            for item in sorted(folder.glob("*.json")):
                record = self.get(repo, unsafe_key(item.name[: -len(".json")]))
                if record:
                    out.append(record)
        return out

    def endpoints(self, repo: str, revision: str) -> list[str]:
        """Every endpoint with a resolution record of (repo, revision), whatever this store's
        endpoint: for messages that say where something was cached, never for a decision."""
        return _endpoints_of(self._ref_path(repo, revision))

    def trusted_at(self, publisher: str) -> list[str]:
        """Every endpoint whose recorded answer trusts `publisher` (messages only, as above)."""
        data = read_json(self.trust_dir / f"{safe_key(publisher)}.json")
        entries = data.get("endpoints") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            return []
        return sorted(e for e, r in entries.items() if isinstance(r, dict) and r.get("trusted"))

    def repos(self) -> list[str]:
        if not self.refs.is_dir():
            return []
        return sorted(unsafe_key(p.name) for p in self.refs.iterdir() if p.is_dir())

    def get_trust(self, publisher: str) -> TrustRecord | None:
        data = _read_scoped(self.trust_dir / f"{safe_key(publisher)}.json", self.endpoint)
        if data is None:
            return None
        try:
            return TrustRecord(
                publisher, bool(data["trusted"]), str(data["source"]), float(data["checked_at"])
            )
        except (KeyError, TypeError, ValueError):
            return None

    def put_trust(self, record: TrustRecord) -> None:
        data = asdict(record)
        del data["publisher"]
        _write_scoped(self.trust_dir / f"{safe_key(record.publisher)}.json", self.endpoint, data)


# How many trees one variant record remembers (`trees`): a commit served differently by a few
# endpoints keeps each version; past this the oldest is forgotten (a lock naming it downloads).
MAX_RECORDED_TREES = 8


def _recorded_trees(data: object) -> dict[str, list[str]]:
    """{tree digest: endpoints that listed it} of a variant record: its `trees`, and its current
    `tree` (a record written before `trees` existed has only that)."""
    if not isinstance(data, dict):
        return {}
    out: dict[str, list[str]] = {}
    trees = data.get("trees")
    if isinstance(trees, dict):
        for digest, endpoints in trees.items():
            if isinstance(digest, str) and isinstance(endpoints, list):
                out[digest] = [e for e in endpoints if isinstance(e, str) and e]
    current, endpoints = data.get("tree"), data.get("endpoints")
    if isinstance(current, str) and isinstance(endpoints, list):
        known = out.setdefault(current, [])
        known.extend(e for e in endpoints if isinstance(e, str) and e and e not in known)
    return out


class RepoIndex:
    """index/<repo>/<commit>/{listing[-<endpoint key>].json, variants/<variant>.json} and
    manifests/<digest>.json. A variant record names the current tree and the endpoints whose
    listing it matched, and keeps every tree recorded for the variant (`trees`: digest ->
    endpoints), for locks, whose digests choose among them whatever the endpoint."""

    def __init__(self, index: Path, manifests: Path, endpoint: str | None = None):
        self.index = index
        self.manifests = manifests
        self.endpoint = endpoint

    def _listing_name(self) -> str:
        return (
            "listing.json"
            if self.endpoint is None
            else f"listing-{endpoint_key(self.endpoint)}.json"
        )

    def _usable(self, data: object) -> bool:
        if not isinstance(data, dict) or "tree" not in data:
            return False
        endpoints = data.get("endpoints")
        return self.endpoint is None or (isinstance(endpoints, list) and self.endpoint in endpoints)

    def _commit_dir(self, repo: str, commit: str) -> Path:
        return self.index / safe_key(repo) / safe_key(commit)

    # The remote listing of a commit: {variant: [file dicts]} in whatever shape the caller uses.
    def get_listing(self, repo: str, commit: str) -> dict | None:
        data = read_json(self._commit_dir(repo, commit) / self._listing_name())
        return data if isinstance(data, dict) else None

    def put_listing(self, repo: str, commit: str, listing: dict) -> None:
        atomic_write_json(self._commit_dir(repo, commit) / self._listing_name(), listing)

    # Installed variants: (repo, commit, variant) -> manifest digest.
    def get_variant(self, repo: str, commit: str, variant: str) -> Manifest | None:
        data = read_json(self._commit_dir(repo, commit) / "variants" / f"{safe_key(variant)}.json")
        if not self._usable(data):
            return None
        return self.get_manifest(str(data["tree"]))

    def put_variant(self, repo: str, commit: str, variant: str, manifest: Manifest) -> None:
        """Record the variant's tree; another endpoint's record of the same tree is kept (each
        endpoint vouched for the same bytes), a different tree replaces it as the current one
        and joins the trees recorded (`trees`), newest last."""
        self.put_manifest(manifest)
        path = self._commit_dir(repo, commit) / "variants" / f"{safe_key(variant)}.json"
        old = read_json(path)
        endpoints: list[str] = []
        if isinstance(old, dict) and old.get("tree") == manifest.digest:
            endpoints = [e for e in old.get("endpoints", []) if isinstance(e, str)]
        if self.endpoint is not None and self.endpoint not in endpoints:
            endpoints.append(self.endpoint)
        trees = _recorded_trees(old)
        listed = trees.pop(manifest.digest, [])
        trees[manifest.digest] = listed + [e for e in endpoints if e not in listed]
        trees = dict(list(trees.items())[-MAX_RECORDED_TREES:])
        atomic_write_json(
            path,
            {
                "tree": manifest.digest,
                "installed_at": time.time(),
                "endpoints": endpoints,
                "trees": trees,
            },
        )

    def tree_endpoints(self, repo: str, commit: str, variant: str, tree: str) -> list[str]:
        """The endpoints whose listing of (repo, commit, variant) gave the tree `tree`, whatever
        this store's endpoint (empty: no endpoint recorded it as that variant of that commit)."""
        path = self._commit_dir(repo, commit) / "variants" / f"{safe_key(variant)}.json"
        return _recorded_trees(read_json(path)).get(tree, [])

    def drop_variant(self, repo: str, commit: str, variant: str) -> None:
        path = self._commit_dir(repo, commit) / "variants" / f"{safe_key(variant)}.json"
        path.unlink(missing_ok=True)

    def installed_variants(self, repo: str, commit: str) -> list[str]:
        folder = self._commit_dir(repo, commit) / "variants"
        if not folder.is_dir():
            return []
        return sorted(
            unsafe_key(p.name[: -len(".json")])
            for p in folder.glob("*.json")
            if self._usable(read_json(p))
        )

    def variant_endpoints(self, repo: str, commit: str) -> list[str]:
        """The endpoints whose listing gave an installed variant of (repo, commit), whatever
        this store's endpoint: for messages that say where a kernel was cached from."""
        folder = self._commit_dir(repo, commit) / "variants"
        found: set[str] = set()
        if folder.is_dir():
            for item in folder.glob("*.json"):
                data = read_json(item)
                if isinstance(data, dict) and "tree" in data:
                    endpoints = data.get("endpoints")
                    if isinstance(endpoints, list):
                        found.update(e for e in endpoints if isinstance(e, str) and e)
        return sorted(found)

    def get_manifest(self, digest: str) -> Manifest | None:
        data = read_json(self.manifests / f"{digest}.json")
        if data is None:
            return None
        try:
            manifest = Manifest.from_json(data)
        except ManifestError:
            return None
        return manifest if manifest.digest == digest else None

    def put_manifest(self, manifest: Manifest) -> None:
        path = self.manifests / f"{manifest.digest}.json"
        if not path.exists():
            atomic_write_json(path, manifest.to_json())

    def entries(self):
        """Every (repo, commit, variant, manifest digest) installed."""
        if not self.index.is_dir():
            return
        for repo_dir in sorted(self.index.iterdir()):
            for commit_dir in sorted(p for p in repo_dir.iterdir() if p.is_dir()):
                vdir = commit_dir / "variants"
                if not vdir.is_dir():
                    continue
                for item in sorted(vdir.glob("*.json")):
                    data = read_json(item)
                    if self._usable(data):
                        yield (
                            unsafe_key(repo_dir.name),
                            unsafe_key(commit_dir.name),
                            unsafe_key(item.name[: -len(".json")]),
                            str(data["tree"]),
                        )


class VerdictStore:
    """signatures/<tree digest>-<key>.json: verdicts of the loader's signature checks, kept per
    endpoint like every record. `key` is opaque here (the loader's name for what was checked
    against: signers and trust root)."""

    def __init__(self, root: Path, endpoint: str | None = None):
        self.root = root
        self.endpoint = endpoint

    def _path(self, tree: str, key: str) -> Path:
        return self.root / f"{safe_key(tree)}-{safe_key(key)}.json"

    def get(self, tree: str, key: str) -> VerdictRecord | None:
        data = _read_scoped(self._path(tree, key), self.endpoint)
        if data is None:
            return None
        try:
            return VerdictRecord(
                tree, key, str(data["verdict"]), str(data["detail"]), float(data["checked_at"])
            )
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, record: VerdictRecord) -> None:
        data = {"verdict": record.verdict, "detail": record.detail, "checked_at": record.checked_at}
        _write_scoped(self._path(record.tree, record.key), self.endpoint, data)

"""Trust and integrity: code nobody decided to trust never runs, and changed bytes never load.

The kernels here append a line to a marker file when they are imported, so "did its code run?"
is a file on disk, not a guess. Each refusal has a positive control that shows the same kernel
does write the marker once it is trusted.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
from kernels import HubUnavailable, IntegrityError, UntrustedPublisher
from kernels.cache import Cache
from kernels.locked import get_locked_kernel, load_kernel
from kernels.lockfile import LockEntry, Lockfile, Requested, write_lock
from kernels.serve.faults import FaultPlan

from tests.reliability.helpers import (
    assert_user_error,
    cli_argv,
    installed_variants,
    payload,
    pure_kernel,
    python_argv,
    record,
    sha256,
)

EVIL = "evil-org/marker"
BLOB = payload(700, 5000)


def _marker_kernel(hub, repo: str, marker: Path, *, value: int = 1, meta: dict | None = None):
    w = hub.writer(repo)
    code = f"open({str(marker)!r}, 'a').write('ran\\n')"
    files = pure_kernel(
        repo.split("/")[1], value=value, lfs={"blob.bin": BLOB}, writer=w, init_code=code, meta=meta
    )
    return w.commit(files, branch="v1"), files


def _ran(marker: Path) -> bool:
    return marker.exists()


def _kernel_modules() -> set[str]:
    return {m for m in sys.modules if m.startswith("_kernels_")}


@pytest.fixture
def evil(hub, tmp_path):
    hub.trust("someone-else")  # the mirror trusts another org, not this one
    marker = tmp_path / "evil-ran"
    _marker_kernel(hub, EVIL, marker)
    return marker


@pytest.mark.parametrize(
    "trust",
    [False, None, [], ["other-org"], ["evil-org/other-repo"], ("evil-or",), ["evil"]],
)
def test_untrusted_code_never_runs_without_a_decision(hub, evil, trust):
    before = _kernel_modules()
    with pytest.raises(UntrustedPublisher):
        kernels.get_kernel(EVIL, version=1, trust_remote_code=trust)
    with pytest.raises(UntrustedPublisher):
        kernels.install_kernel(EVIL, version=1, trust_remote_code=trust)
    assert not _ran(evil) and _kernel_modules() == before
    assert not list(Cache(os.environ["KERNELS_CACHE"]).objects.iter_digests())  # nothing fetched
    record("untrusted publisher, no decision (code must not run)", 2)


def test_other_orgs_in_the_allowlists_decide_nothing(hub, evil, monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "other-org, evil-orgs evil")
    config = tmp_path / "config.toml"
    config.write_text('trusted_publishers = ["someone-else", "evil-org/other"]\n')
    monkeypatch.setenv("KERNELS_CONFIG", str(config))
    with pytest.raises(UntrustedPublisher):
        kernels.get_kernel(EVIL, version=1)
    assert not _ran(evil)


@pytest.mark.parametrize("how", ["argument", "list", "env", "config", "hub"])
def test_an_explicit_decision_runs_it(hub, evil, monkeypatch, tmp_path, how):
    """The positive control: the same kernel does run once somebody decided to trust it."""
    trust: object = False
    if how == "argument":
        trust = True
    elif how == "list":
        trust = ["evil-org"]
    elif how == "env":
        monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "evil-org")
    elif how == "config":
        config = tmp_path / "config.toml"
        config.write_text('trusted_publishers = ["evil-org"]\n')
        monkeypatch.setenv("KERNELS_CONFIG", str(config))
    else:
        hub.trust("evil-org")
    module = kernels.get_kernel(EVIL, version=1, trust_remote_code=trust)
    assert module.VALUE == 1
    assert _ran(evil)  # the marker path is in the code: each test's kernel is new content


def test_cli_pull_of_an_untrusted_kernel_fetches_nothing(hub, evil):
    assert_user_error(subprocess.run(cli_argv("pull", f"{EVIL}@v1"), capture_output=True,
                                     text=True, timeout=120), "not a trusted")  # fmt: skip
    assert not list(Cache(os.environ["KERNELS_CACHE"]).objects.iter_digests())


OFFLINE_LOAD = """
    import kernels
    try:
        kernels.get_kernel('evil-org/marker', version=1)
    except kernels.UntrustedPublisher:
        print('refused')
"""


def _run_offline(code: str) -> subprocess.CompletedProcess:
    """`code` in a child interpreter with HF_HUB_OFFLINE=1."""
    return subprocess.run(
        python_argv(code),
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )


def test_offline_keeps_the_recorded_decision(hub, evil, monkeypatch):
    # Loaded once with an explicit decision: the Hub's answer (not trusted) is recorded.
    kernels.get_kernel(EVIL, version=1, trust_remote_code=True)
    evil.unlink()
    out = _run_offline(OFFLINE_LOAD)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr
    assert not _ran(evil)  # the cached variant is there, and still did not run
    # The Hub unreachable instead of offline: a network error, still no run.
    hub.server.faults = FaultPlan.parse("503:1")
    monkeypatch.setenv("KERNELS_RESOLVE_TTL", "0")
    with pytest.raises(HubUnavailable):
        kernels.get_kernel(EVIL, version=1)
    assert not _ran(evil)


def test_offline_keeps_a_recorded_trust(hub, tmp_path):
    hub.trust("good-org")
    marker = tmp_path / "good-ran"
    _marker_kernel(hub, "good-org/marker", marker, value=4)
    kernels.get_kernel("good-org/marker", version=1)
    code = "import kernels; print(kernels.get_kernel('good-org/marker', version=1).VALUE)"
    out = _run_offline(code)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr
    assert marker.read_text() == "ran\nran\n"  # this process, then the offline one


def test_an_untrusted_dependency_stops_a_trusted_kernel(hub, tmp_path):
    hub.trust("good-org")
    parent_marker, dep_marker = tmp_path / "parent-ran", tmp_path / "dep-ran"
    _marker_kernel(hub, "evil-org/dep", dep_marker)
    meta = {"kernel-depends": [{"repo-id": "evil-org/dep", "version": 1}]}
    _marker_kernel(hub, "good-org/parent", parent_marker, meta=meta)
    for trust in (False, ["good-org"], ["good-org/parent"]):
        with pytest.raises(UntrustedPublisher):
            kernels.get_kernel("good-org/parent", version=1, trust_remote_code=trust)
        assert not _ran(parent_marker) and not _ran(dep_marker)
    kernels.get_kernel("good-org/parent", version=1, trust_remote_code=["good-org", "evil-org"])
    assert _ran(parent_marker) and _ran(dep_marker)


# -- integrity: every changed byte is caught ---------------------------------------------------


def _flip(path: Path, rng: random.Random) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    mode = path.stat().st_mode
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    path.chmod(mode)
    return original


def _restore(path: Path, original: bytes) -> None:
    mode = path.stat().st_mode
    path.chmod(0o644)
    path.write_bytes(original)
    path.chmod(mode)


def test_verify_all_catches_every_changed_byte(hub, tmp_path):
    hub.trust("good-org")
    _marker_kernel(hub, "good-org/flip", tmp_path / "flip-ran")
    kernels.install_kernel("good-org/flip", version=1)
    cache = Cache(os.environ["KERNELS_CACHE"])
    [(repo, commit, variant)] = installed_variants(cache.root)
    manifest, tree = cache.installed(repo, commit, variant)
    targets = [tree / e.path for e in manifest.files]
    targets.append(cache.index.manifests / f"{manifest.digest}.json")
    rng = random.Random(7)
    caught = 0
    for target in targets:
        original = _flip(target, rng)
        try:
            out = subprocess.run(cli_argv("verify", "--all"), capture_output=True, text=True)
            assert out.returncode == 1, (target.name, out.stdout)
            assert "CORRUPT good-org/flip" in out.stdout
            name = target.name if target.parent == tree else "<manifest>"
            assert name in out.stdout, (name, out.stdout)
            caught += 1
        finally:
            _restore(target, original)
        done = subprocess.run(cli_argv("verify", "--all"), capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
    record("one flipped byte in each cached file and the manifest: `verify --all`", caught)


FLIPPED_LOAD = """
    import kernels
    try:
        kernels.get_kernel('good-org/flip', version=1)
    except kernels.IntegrityError:
        print('refused')
"""


def test_a_changed_byte_is_never_imported(hub, tmp_path):
    """Same size, same code length: only the digest can tell. Offline, nothing can repair it."""
    hub.trust("good-org")
    marker = tmp_path / "flip-ran"
    _marker_kernel(hub, "good-org/flip", marker)
    tree = kernels.install_kernel("good-org/flip", version=1)
    init = tree / "__init__.py"
    original = init.read_bytes()
    assert b"'ran\\n'" in original
    _restore(init, original.replace(b"'ran\\n'", b"'RAN\\n'"))  # a same-size edit
    out = subprocess.run(
        python_argv(FLIPPED_LOAD),
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr
    assert not _ran(marker)
    record("same-size edit of a cached __init__.py (must not be imported)", 1)
    # Online, the damaged copy is replaced by a verified one, and that one runs.
    out = subprocess.run(python_argv(FLIPPED_LOAD.replace("print('refused')", "raise")),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert marker.read_text() == "ran\n"


# -- a lock pins exact bytes ----------------------------------------------------------------


def _lock(tmp_path: Path, repo: str, commit: str, files: dict, *, tamper: str | None) -> Path:
    prefix = "build/torch-universal/"
    digests = {}
    for path, content in files.items():
        if not path.startswith(prefix):
            continue
        rel = path[len(prefix) :]
        data = (
            BLOB
            if rel == "blob.bin"
            else (content.encode() if isinstance(content, str) else content)
        )
        digests[rel] = sha256(data)
    if tamper is not None:
        digests[tamper] = sha256(b"not these bytes")
    lock_path = tmp_path / "kernels.lock"
    write_lock(Lockfile([LockEntry(repo, Requested(version=1), commit, {"torch-universal": digests})]),
               lock_path)  # fmt: skip
    return lock_path


@pytest.mark.parametrize("tamper", ["__init__.py", "_impl.py", "blob.bin", "metadata.json"])
def test_a_lock_pins_exact_bytes(hub, tmp_path, tamper):
    hub.trust("lock-org")
    marker = tmp_path / "lock-ran"
    commit, files = _marker_kernel(hub, "lock-org/pinned", marker)
    bad = _lock(tmp_path, "lock-org/pinned", commit, files, tamper=tamper)
    before = _kernel_modules()
    with pytest.raises(IntegrityError, match=tamper.replace(".", r"\.")):
        get_locked_kernel("lock-org/pinned", lockfile=bad)
    with pytest.raises(IntegrityError):
        load_kernel("lock-org/pinned", lockfile=bad)  # from the cache only: same answer
    assert not _ran(marker) and _kernel_modules() == before
    record("a lock whose sha256 differs from the bytes (IntegrityError, nothing imported)", 2)
    good = _lock(tmp_path, "lock-org/pinned", commit, files, tamper=None)
    assert get_locked_kernel("lock-org/pinned", lockfile=good).VALUE == 1  # the control
    assert _ran(marker)


ANY_LOAD = """
    import json, kernels
    try:
        m = kernels.get_kernel('good-org/flip', version=1)
    except kernels.KernelsError as exc:
        print(json.dumps({'error': type(exc).__name__}))
    else:
        print(json.dumps({'value': m.VALUE, 'digests': m.digests()}))
"""


def test_a_flipped_byte_anywhere_in_the_cache_never_loads_wrong_bytes(hub, tmp_path):
    """Every file of a populated cache (objects, trees, manifests, records, stamps, aliases), a
    flipped bit in each: a load gets the right kernel or a typed error, never other bytes and
    never an untyped crash; online, damaged content (objects/ ... index/) is repaired. A damaged
    record (refs/, trust/) may point elsewhere until it is re-checked: a typed error."""
    hub.trust("good-org")
    _marker_kernel(hub, "good-org/flip", tmp_path / "flip-ran", meta=None)
    good = {"value": 1, "digests": {"blob.bin": sha256(BLOB)}}
    root = Path(os.environ["KERNELS_CACHE"])
    kernels.install_kernel("good-org/flip", version=1)
    seen_inodes = set()
    targets = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_file() and st.st_size and st.st_ino not in seen_inodes:
            seen_inodes.add(st.st_ino)
            targets.append(path)
    rng = random.Random(11)
    outcomes: dict[str, int] = {}

    def load(**env) -> dict:
        out = subprocess.run(python_argv(ANY_LOAD), capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr  # a KernelsError is printed; anything else fails
        return json.loads(out.stdout)

    for target in targets:
        original = _flip(target, rng)
        try:
            offline = load(HF_HUB_OFFLINE="1")
            assert offline == good or set(offline) == {"error"}, (target, offline)
            online = load()
            parts = target.relative_to(root).parts  # ("v1", bucket, ...) or a top-level file
            bucket = parts[1] if len(parts) > 2 else ""
            if bucket in ("refs", "trust"):
                assert online == good or set(online) == {"error"}, (target, online)
            else:
                assert online == good, (target, online)
        finally:
            if target.exists():
                _restore(target, original)
        for mode, result in (("offline", offline), ("online", online)):
            key = f"{mode}: " + ("right kernel" if result == good else result["error"])
            outcomes[key] = outcomes.get(key, 0) + 1
    record(
        "one flipped bit in each file of the cache: offline and online loads",
        len(targets),
        outcomes=outcomes,
    )

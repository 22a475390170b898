"""Shared fixtures: a local Hub (`hub`) and an isolated environment for every test (autouse).

Why one server for the whole session: huggingface_hub reads HF_ENDPOINT once, at import, into
`constants.ENDPOINT`, the URL template, its trusted-host lists and the module-level `HfApi`
behind `huggingface_hub.list_repo_refs` & co. Patching all of those per test is brittle across
client versions. So this module starts one `MirrorServer` on 127.0.0.1 (random port) when it is
imported, before any test module can import huggingface_hub, and sets HF_ENDPOINT to it. Each
test that takes `hub` gets that server re-pointed at a fresh, empty root (so fresh caches), a
cleared request log and no hooks; the same URL stays valid for the whole run, in-process and in
subprocesses. Tests that need a server of their own start a `MirrorServer` and pass
`endpoint=` to the client.

The autouse `_isolated_env` fixture gives every test a fresh HF_HOME (also patched into
huggingface_hub.constants when that module is already imported, since it too is read at import),
a fresh KERNELS_CACHE, no KERNELS_* settings from the caller's shell, HF_HUB_OFFLINE unset and
telemetry off.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from kernels.serve import BuiltRepo, GitRepoWriter, MirrorServer, build_mirror
from kernels.serve.mirror import CONFIG_NAME, read_trusted_publishers

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="kernels-tests-"))
_EMPTY_ROOT = _SESSION_DIR / "empty-root"
_EMPTY_ROOT.mkdir()
_SERVER = MirrorServer(_EMPTY_ROOT).start()

os.environ["HF_ENDPOINT"] = _SERVER.url
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HOME"] = str(_SESSION_DIR / "hf-home")
os.environ.pop("HF_HUB_OFFLINE", None)
os.environ.pop("HF_TOKEN", None)
# A CI proxy must not intercept loopback traffic.
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))

HUB_URL = _SERVER.url


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the session's server and remove its folder: a run leaves nothing in the temp folder
    (scripts/test.sh also runs pytest inside a folder it removes; a direct run has none)."""
    _SERVER.shutdown()
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


class Hub:
    """The local Hub of one test: `root/<org>/<name>` repos served at `url`."""

    def __init__(self, root: Path, server: MirrorServer):
        self.root = root
        self.server = server
        self.url = server.url

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, request target) of every request since the test started (or the last reset)."""
        return self.server.requests

    def reset_requests(self) -> None:
        self.server.reset_requests()

    def writer(self, repo_id: str) -> GitRepoWriter:
        """A writer for the repo `org/name` under this hub's root (created empty when missing)."""
        org, _, name = repo_id.partition("/")
        if not org or not name or "/" in name:
            raise ValueError(f"repo id must be 'org/name', got {repo_id!r}")
        return GitRepoWriter(self.root / org / name)

    def build(self, src: Path, *, trust: Iterable[str] | None = None) -> list[BuiltRepo]:
        """Mirror the Hub-layout folders under `src` (see kernels.serve.build_mirror) into root.
        Whom the mirror trusts is the builder's decision, never the source's: here `trust`, else
        (on purpose, for the suite's own folders) the orgs src/kernels-mirror.toml names."""
        if trust is None and (src / CONFIG_NAME).is_file():
            trust = read_trusted_publishers(src / CONFIG_NAME)
        return build_mirror(src, self.root, trusted_publishers=trust)

    def trust(self, *orgs: str) -> None:
        """Write root/kernels-mirror.toml so that exactly `orgs` are trusted publishers."""
        names = ", ".join(f'"{org}"' for org in orgs)
        (self.root / "kernels-mirror.toml").write_text(f"trusted_publishers = [{names}]\n")


def _reset_server(root: Path) -> None:
    _SERVER.root = root
    _SERVER.tree_hook = None
    _SERVER.file_hook = None
    _SERVER.lfs_redirect = True
    _SERVER.reset_requests()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    """The session's local Hub, re-pointed at a fresh empty root for this test."""
    root = tmp_path / "hub-root"
    root.mkdir()
    _reset_server(root)
    try:
        yield Hub(root, _SERVER)
    finally:
        _reset_server(_EMPTY_ROOT)


KERNELS_TESTS = Path(__file__).resolve().parent / "kernels"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def _torch_path_outside_tests_kernels(request: pytest.FixtureRequest, monkeypatch) -> None:
    """Only tests/kernels runs the kernels on Triton's interpreter. Its conftest switches the
    interpreter on for the whole process (it must be on before triton is imported), which made
    every other test of a run that collects it (the whole suite) run its bound kernels
    interpreted: tests/models three times slower than alone, for no extra coverage. Here every
    other test gets the kernels' torch formulas, as in a run of its own folder: the kernels read
    TRITON_INTERPRET when they dispatch, so it is unset for the test, while Triton's own switch
    stays on (its `knobs` override) so that a kernel imported now is still decorated for the
    interpreter, as tests/kernels needs if it uses the same module later."""
    if not _interpreting() or KERNELS_TESTS in Path(str(request.node.path)).parents:
        return
    try:
        import triton
    except ImportError:
        return
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # a Triton before 3.4: no override, so the interpreter stays on everywhere
        return
    knobs.runtime.interpret = True  # decoration keeps using the interpreter (process-wide)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


_HF_PATH_CONSTANTS = {
    # constant name in huggingface_hub.constants -> path under HF_HOME
    "HF_HOME": "",
    "HF_HUB_CACHE": "hub",
    "HUGGINGFACE_HUB_CACHE": "hub",
    "HF_ASSETS_CACHE": "assets",
    "HF_XET_CACHE": "xet",
    "HF_TOKEN_PATH": "token",
    "HF_STORED_TOKENS_PATH": "stored_tokens",
}


@pytest.fixture(autouse=True)
def _isolated_env(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh HF_HOME and KERNELS_CACHE, no inherited KERNELS_* settings, online, no telemetry."""
    base = tmp_path_factory.mktemp("env")
    hf_home = base / "hf-home"
    for name in list(os.environ):
        if name.startswith("KERNELS_") or name == "LOCAL_KERNELS":
            monkeypatch.delenv(name)
    monkeypatch.setenv("KERNELS_CACHE", str(base / "kernels-cache"))
    monkeypatch.setenv("KERNELS_CONFIG", str(base / "kernels-config.toml"))  # absent: empty config
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_ENDPOINT", HUB_URL)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        for name, sub in _HF_PATH_CONSTANTS.items():
            if hasattr(constants, name):
                monkeypatch.setattr(constants, name, str(hf_home / sub) if sub else str(hf_home))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

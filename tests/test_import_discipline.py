"""What a warm load imports: only what it uses (issue 15's warm-load time bound).

A warm `get_kernel` in a new process is mostly import time: every module, dataclass and regex
it pulls in is paid on each start. The modules below serve cold or rare paths only, and are
imported on first use; these tests hold them off the warm path, and check that the names they
define are still reachable where they used to live.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.kernel_repos import kernel_files, run_python

# Modules a warm load of a pure-Python kernel without kernel-depends, provenance, kernels-minver,
# Python dependencies or a status file has no use for, and what each is needed for instead.
COLD_ONLY = (
    "huggingface_hub",  # talking to a Hub
    "kernels.hub",  # talking to a Hub
    "kernels.versions",  # the newer-version check, on a cache's first resolve
    "kernels.python_deps",  # a kernel that declares Python dependencies
    "kernels.local_kernels",  # LOCAL_KERNELS is set
    "kernels.status_file",  # a repo whose kernel-status.toml redirects
    "kernels.metadata_extras",  # kernel-depends or provenance in metadata.json
    "kernels.elf",  # a variant that ships native libraries
    "kernels.cache.locks",  # a write to the cache
    "kernels.cache.reports",  # `kernels du` / `kernels prune`
    "packaging.version",  # kernels-minver in metadata.json
    "secrets",  # a staging folder, for a write to the cache
    "kernels.diskspace",  # a download (free space) or a full disk
    "kernels.exposure",  # refusing a path others can write (the check itself is in the cache)
    "kernels.safe_text",  # printing a notice or a CLI line
    "kernels.signatures",  # a signature policy other than off
    "kernels.bundled",  # the one-line switch's fallback when the repo is not served
)

# Prints the modules the warm load added to those `import torch` had already brought in (so a
# torch that imports one of them itself does not fail the test), and whether a warm load could
# have done without sysconfig (it needs it only where sys.abiflags is missing).
WARM_LOAD = """
import json, sys
import torch
before = set(sys.modules)
import kernels
value = kernels.get_kernel("kernels-test/relu", version=1).VALUE
print(json.dumps({"value": value, "new": sorted(set(sys.modules) - before)}))
"""


@pytest.fixture
def relu(hub):
    hub.trust("kernels-test")
    hub.writer("kernels-test/relu").commit(kernel_files(value=1), branch="v1")


def _warm_load_modules(hub) -> set[str]:
    import kernels

    assert kernels.get_kernel("kernels-test/relu", version=1).VALUE == 1  # cold: fills the cache
    hub.reset_requests()
    out = run_python(WARM_LOAD)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["value"] == 1
    assert [r for r in hub.requests if "/api/agent-harnesses" not in r[1]] == []
    return set(result["new"])


def test_warm_load_imports_no_cold_path_module(hub, relu):
    new = _warm_load_modules(hub)
    assert "kernels.api" in new  # the load did run in the child
    imported = sorted(m for m in new if any(m == c or m.startswith(c + ".") for c in COLD_ONLY))
    assert imported == [], f"a warm load imported cold-path modules: {imported}"
    if hasattr(sys, "abiflags"):
        assert "sysconfig" not in new


def test_lazy_names_resolve_where_they_lived():
    """Moving a type off the warm path keeps its old import path working."""
    from kernels import (
        cache,
        elf,
        hub,
        metadata,
        metadata_extras,
        native_abi,
        remote_file,
        status,
        status_file,
    )
    from kernels.cache import reports

    assert hub.RemoteFile is remote_file.RemoteFile
    assert hub.is_commit_id is remote_file.is_commit_id
    for name in ("KernelDependency", "GitStatus", "KernelBuilderVersion", "Provenance"):
        assert getattr(metadata, name) is getattr(metadata_extras, name)
    assert status.Redirect is status_file.Redirect
    assert status.parse is status_file.parse
    assert native_abi.read_elf is elf.read_elf
    assert native_abi.ElfInfo is elf.ElfInfo
    assert cache.Usage is reports.Usage
    assert cache.PruneReport is reports.PruneReport
    for module in (metadata, status, cache, native_abi):
        with pytest.raises(AttributeError):
            module.nope  # noqa: B018


def test_lazy_paths_still_work(tmp_path):
    """The lazily imported code runs when it is needed: kernels-minver, provenance,
    kernel-depends and a status file."""
    from kernels import Metadata, status
    from kernels.select import check_metadata
    from kernels.variants import detect_system

    raw = {
        "name": "relu",
        "id": "_relu",
        "version": 1,
        "license": "MIT",
        "backend": {"type": "cpu"},
        "python-depends": [],
        "kernels-minver": "99.0.0",
        "kernel-depends": [{"repo-id": "org/dep", "version": 2}],
        "provenance": {"kernel-builder": {"version": "0.1", "commit": "abc", "dirty": True}},
    }
    meta = Metadata.from_dict(raw)
    assert meta.kernel_depends[0].repo_id == "org/dep"
    assert meta.provenance.dirty and meta.provenance.dirty_sources() == ["kernel-builder"]
    reason = check_metadata(meta, detect_system("cpu"), check_arch=False)
    assert reason is not None and "needs kernels >= 99.0.0" in reason
    redirect = status.parse('kind = "redirect"\ndestination = "org/new"\n')
    assert (redirect.destination, redirect.revision) == ("org/new", "main")

"""Issue 28 item 6: pathological TOML from a server or a mirror folder is a typed error.

A repo's `kernel-status.toml` is the publisher's (or a hostile mirror's) text. Nested arrays or
inline tables a few thousand deep made tomllib raise RecursionError, which ended a load untyped;
a deep dotted key as `kind` did the same inside the error message's repr, and a 60 kB `kind` or
`destination` went into the message whole. Now each is a KernelStatusError of one short line
with the class's hint, and a refused status file is not recorded in the cache. The same inputs
in `kernels-mirror.toml` (which `kernels serve` reads) and in a project's pyproject.toml
(`kernels lock`) are InvalidSpec and LockfileError.
"""

from __future__ import annotations

import os

import kernels
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernels.cache import Cache
from kernels.errors import InvalidSpec, KernelStatusError, LockfileError
from kernels.lockfile import read_dependencies
from kernels.serve.mirror import read_trusted_publishers
from kernels.status_file import parse

from tests.reliability.helpers import fuzz
from tests.security.conftest import marker_files

DEPTH = 1_900  # 3.8 kB of brackets: under the status file's 4 KiB cap, far past tomllib's stack


def _nested(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


PATHOLOGICAL = {
    "nested arrays": "kind = " + _nested(DEPTH),
    "nested arrays as destination": 'kind = "redirect"\ndestination = ' + _nested(DEPTH),
    "nested inline tables": "kind = " + "{a = " * 700 + "1" + "}" * 700,
    "deep dotted key as kind": "kind" + ".a" * DEPTH + " = 1",
    "deep table header": "[kind" + ".a" * DEPTH + "]",
    "table as revision": 'kind = "redirect"\ndestination = "o/x"\nrevision' + ".a" * DEPTH + "=1",
    "long kind": 'kind = "' + "x" * 4000 + '"',
    "long destination": 'kind = "redirect"\ndestination = "' + "o" * 4000 + '/x"',
    "long revision": 'kind = "redirect"\ndestination = "o/x"\nrevision = "' + "r" * 3000 + '"',
    "over the cap": 'kind = "redirect"\ndestination = "o/x"\n# ' + "x" * 60_000,
    "escape in kind": 'kind = "\\u001b[2Jgone"',
    "escape in destination": 'kind = "redirect"\ndestination = "a/\\u001b[2J"',
    "escape in revision": 'kind = "redirect"\ndestination = "a/b"\nrevision = "\\r\\u001b[1A"',
}


def _check_message(exc: KernelStatusError) -> None:
    assert len(exc.message) < 400, exc.message[:200]
    assert exc.message.isprintable(), repr(exc.message[:200])
    assert exc.hint and "\n" not in exc.hint


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_status_files_are_one_line_typed_errors(name):
    with pytest.raises(KernelStatusError) as err:
        parse(PATHOLOGICAL[name], where="evil/k@abc/kernel-status.toml")
    _check_message(err.value)


PREFIX = {
    "kind": "",
    "destination": 'kind = "redirect"\n',
    "revision": 'kind = "redirect"\ndestination = "o/x"\n',
}


@fuzz(ci=100, soak=2000)
@given(
    depth=st.integers(1, DEPTH),
    kinds=st.lists(st.sampled_from(["array", "table"]), min_size=1, max_size=3),
    key=st.sampled_from(sorted(PREFIX)),
)
def test_any_nesting_is_a_typed_error(depth, kinds, key):
    levels = [kinds[i % len(kinds)] for i in range(depth)]
    opening = "".join("[" if kind == "array" else "{a = " for kind in levels)
    closing = "".join("]" if kind == "array" else "}" for kind in reversed(levels))
    with pytest.raises(KernelStatusError) as err:
        parse(f"{PREFIX[key]}{key} = {opening}1{closing}")
    _check_message(err.value)


@fuzz(ci=300, soak=5000)
@given(st.text(max_size=300))
def test_any_text_is_a_typed_error_or_a_redirect(text):
    try:
        parse(text)
    except KernelStatusError as exc:
        _check_message(exc)


def test_a_nested_status_file_ends_a_load_typed_and_is_not_recorded(hub, tmp_path):
    marker = tmp_path / "ran"
    files = {**marker_files("k", marker), "kernel-status.toml": "kind = " + _nested(DEPTH)}
    hub.writer("evil/k").commit(files, branch="v1")
    for _ in range(2):  # the second load asks again: nothing was recorded
        with pytest.raises(KernelStatusError) as err:
            kernels.get_kernel("evil/k", version=1, trust_remote_code=True)
        _check_message(err.value)
    assert not marker.exists()
    cache = Cache(os.environ["KERNELS_CACHE"], endpoint=os.environ["HF_ENDPOINT"])
    status = cache.status / "evil--k"
    assert not status.exists() or not any(status.iterdir())
    for bucket in ("objects", "trees", "snapshots"):
        folder = cache.base / bucket
        assert not folder.exists() or not any(folder.rglob("*.py")), bucket
    assert sum(1 for m, p in hub.requests if p.endswith("/kernel-status.toml")) == 2


@pytest.mark.parametrize("name", ["nested arrays", "nested inline tables"])
def test_pathological_mirror_config_and_pyproject_are_typed(tmp_path, name):
    body = PATHOLOGICAL[name].replace("kind = ", "")
    config = tmp_path / "kernels-mirror.toml"
    config.write_text(f"trusted_publishers = {body}\n")
    with pytest.raises(InvalidSpec) as err:
        read_trusted_publishers(config)
    assert len(err.value.message) < 400
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f"[tool.kernels.dependencies]\n'o/x' = {body}\n")
    with pytest.raises(LockfileError) as lock_err:
        read_dependencies(pyproject)
    assert len(lock_err.value.message) < 400

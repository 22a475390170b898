"""LOCAL_KERNELS: serve a Hub repo id from a local folder while developing a kernel.

`LOCAL_KERNELS="org/repo=/path/to/kernel:org/other=/path/to/other"` makes `get_kernel`,
`has_kernel` and `LayerRepository` (and a kernel's kernel-depends) load `org/repo` from the
folder with `get_local_kernel` instead of the Hub: no request, no trust check and no version
resolution, as in the reference. The folder may be a repo root, its build/ or one variant.
Entries are separated by ':' (the reference's separator; a Windows drive letter therefore cannot
be used, see docs/compatibility.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LocalKernelsError

ENV = "LOCAL_KERNELS"


def parse(value: str) -> dict[str, Path]:
    """{repo_id: path} from a LOCAL_KERNELS value; LocalKernelsError for an entry without '='."""
    overrides: dict[str, Path] = {}
    for entry in value.split(":"):
        if not entry:
            continue  # tolerate "a=b:" and "::" left by shell concatenation
        repo_id, sep, path = entry.partition("=")
        if not sep or not repo_id or not path:
            raise LocalKernelsError(
                f"Invalid LOCAL_KERNELS entry: {entry}. Expected format: "
                "repo_id_1=path_1:repo_id_2=path_2"
            )
        overrides[repo_id] = Path(path).expanduser()
    return overrides


def override_for(repo_id: str) -> Path | None:
    """The local folder LOCAL_KERNELS maps `repo_id` to, or None. Read on every call, so a
    test or a notebook can change the variable between loads."""
    value = os.environ.get(ENV)
    if not value:
        return None
    return parse(value).get(repo_id)

"""LOCAL_KERNELS: serve a Hub repo id from a local folder while developing a kernel.

`LOCAL_KERNELS="org/repo=/path/to/kernel:org/other=/path/to/other"` makes `get_kernel`,
`has_kernel` and `LayerRepository` (and a kernel's kernel-depends) load `org/repo` from the
folder with `get_local_kernel` instead of the Hub: no request, no trust check and no version
resolution, as in the reference. The folder may be a repo root, its build/ or one variant.
Entries are separated by ':' (the reference's separator; a Windows drive letter therefore cannot
be used, see docs/compatibility.md).

The folder's code runs, so it is held to the rule of the cache, the config and the lock
(kernels.cache.safety, docs/security.md): `checked_folder` refuses, with UnsafePermissions, a
folder that a user other than this one and root could write, or any folder above it or file or
folder below it. A relative entry is resolved against the working directory only when that
folder passes the same rule (itself not sticky: in /tmp whoever comes first would name it).
"""

from __future__ import annotations

import os
import stat
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


def checked_folder(given: Path | str, what: str = "the local kernel") -> Path:
    """`given` as an absolute, resolved path, once no user but this one and root can write the
    working directory (for a relative `given`), the folder or a folder above it (through a link,
    its target's folders too); else UnsafePermissions naming the first such path and the fix."""
    from kernels.cache.safety import check_path

    from .exposure import unsafe

    raw = os.path.expanduser(os.fspath(given))
    if not os.path.isabs(raw):
        exposure = check_path(os.getcwd())
        if exposure is not None:
            raise unsafe(exposure, f"{what} {raw!r}, a path relative to the working directory,")
    exposure = check_path(raw)
    if exposure is not None:
        raise unsafe(exposure, f"{what} {raw}")
    return Path(os.path.realpath(raw))


def check_imported(folder: Path, what: str = "the local kernel") -> None:
    """UnsafePermissions unless `folder` (the variant about to be imported), every folder above
    it and every file and folder below it can be written by this user and root only."""
    from kernels.cache.safety import check_path

    from .exposure import unsafe

    exposure = check_path(folder) or _check_below(str(folder))
    if exposure is not None:
        raise unsafe(exposure, f"{what} {folder}")


def _check_below(root: str):
    """The first file or folder below `root` that others could write (a link: its target's
    chain; a linked folder is walked too), or None."""
    from kernels.cache.safety import check_path, exposure_of

    seen = {root}
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            names = os.listdir(folder)
        except OSError:
            continue  # not a folder (or gone): the load reports it
        for name in names:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found = check_path(path)
                real = os.path.realpath(path)
                if found is None and os.path.isdir(real) and real not in seen:
                    seen.add(real)
                    pending.append(real)
            else:
                found = exposure_of(path, st)
                if found is None and stat.S_ISDIR(st.st_mode):
                    pending.append(path)
            if found is not None:
                return found
    return None

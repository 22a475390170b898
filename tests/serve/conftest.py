"""A fixture repo shaped like the research notes' `kernels-test/relu`, served by `hub`."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from kernels.serve import GitRepoWriter

REPO = "kernels-test/relu"


@dataclass
class Relu:
    """Commits of the fixture repo and the bytes of its LFS and large files."""

    writer: GitRepoWriter
    v09: str  # lightweight tag v0.9.0
    v1: str  # branch v1 and annotated tag v1.0.0
    main: str  # branch main: adds an LFS file and a large plain file
    lfs_data: bytes
    big_data: bytes
    repo_id: str = REPO


@pytest.fixture(scope="session")
def _relu_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Relu]:
    """Built once per session (git calls are the slow part); each test gets a copy."""
    rng = random.Random(0)
    lfs_data = rng.randbytes(300_000)
    big_data = rng.randbytes(600_000)  # above the in-memory blob limit: streamed from git
    path = tmp_path_factory.mktemp("relu-template") / "relu"
    w = GitRepoWriter(path)
    readme = "# relu\n"
    v09 = w.commit(
        {"README.md": readme, "build/torch-universal/relu/__init__.py": 'VERSION = "0.9.0"\n'},
        message="initial",
    )
    w.tag("v0.9.0", v09)
    v1_files = {
        "README.md": readme,
        "build/torch-universal/relu/__init__.py": 'VERSION = "1.0.0"\n',
        "build/torch-universal/relu/_ops.py": "OPS = 1\n",
        "build/torch28-cxx11-cu128-x86_64-linux/relu/__init__.py": 'VERSION = "1.0.0-cu"\n',
    }
    v1 = w.commit(v1_files, message="v1.0.0")
    w.branch("v1", v1)
    w.tag("v1.0.0", v1, message="release 1.0.0")
    main = w.commit(
        {
            **v1_files,
            "build/torch-universal/relu/__init__.py": 'VERSION = "1.1.0-dev"\n',
            "weights.bin": w.lfs(lfs_data),
            "big.bin": big_data,
        },
        message="dev",
    )
    return path, Relu(writer=w, v09=v09, v1=v1, main=main, lfs_data=lfs_data, big_data=big_data)


@pytest.fixture
def relu(hub, _relu_template: tuple[Path, Relu]) -> Relu:
    """The fixture repo, copied into this test's hub root as kernels-test/relu."""
    template, built = _relu_template
    shutil.copytree(template, hub.root / REPO)
    return replace(built, writer=hub.writer(REPO))

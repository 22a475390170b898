"""Item 4: `trust_remote_code=True` covers the repo it is passed with, not its dependencies."""

from __future__ import annotations

import kernels
import pytest
from kernels.errors import UntrustedPublisher

from tests.security.conftest import marker_files

PARENT = "nice-org/parent"
DEP = "evil-org/dep"


@pytest.fixture
def markers(hub, tmp_path):
    hub.trust("someone-else")  # the Hub vouches for neither org
    parent, dep = tmp_path / "parent-ran", tmp_path / "dep-ran"
    hub.writer(DEP).commit(marker_files("dep", dep), branch="v1")
    meta = {"kernel-depends": [{"repo-id": DEP, "version": 1}]}
    hub.writer(PARENT).commit(marker_files("parent", parent, meta=meta), branch="v1")
    return parent, dep


def test_trusting_a_kernel_does_not_trust_its_dependencies(markers):
    parent, dep = markers
    with pytest.raises(UntrustedPublisher, match="evil-org"):
        kernels.get_kernel(PARENT, version=1, trust_remote_code=True)
    assert not parent.exists() and not dep.exists()  # dependencies load first: nothing ran


@pytest.mark.parametrize("how", ["list", "allowlist"])
def test_a_dependency_runs_once_it_is_trusted_itself(markers, monkeypatch, how):
    parent, dep = markers
    if how == "list":
        trust = ["nice-org", "evil-org/dep"]
    else:
        monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "evil-org")
        trust = True
    assert kernels.get_kernel(PARENT, version=1, trust_remote_code=trust).VALUE == 1
    assert parent.exists() and dep.exists()

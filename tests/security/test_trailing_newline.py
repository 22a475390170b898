"""Names, revisions and digests are matched whole: a trailing newline is not part of a valid
value. Python's ``$`` also matches just before a final newline, so every pattern that validates
a value from a user, a lock, metadata or a server ends in ``\\Z``; these values become URLs,
folder names and lines of output."""

from __future__ import annotations

import pytest
from kernels.errors import InvalidSpec
from kernels.fetch import valid_install_key
from kernels.spec import is_commit, parse_spec, validate_repo_id, validate_revision

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_spec_is_stripped_or_refused_never_kept_with_a_newline():
    # Surrounding whitespace (a spec read from a file) is stripped; inside, a newline is refused.
    spec = parse_spec("kernels-lab/training@v1:RMSNorm\n")
    assert (spec.repo_id, spec.version, spec.layer) == ("kernels-lab/training", 1, "RMSNorm")
    for text in ("kernels-lab/training\n@v1", "kernels-lab/training@main\n:RMSNorm"):
        with pytest.raises(InvalidSpec):
            parse_spec(text)


def test_repo_ids_revisions_and_commits_with_a_trailing_newline_are_refused():
    with pytest.raises(InvalidSpec):
        validate_repo_id("kernels-lab/training\n")
    with pytest.raises(InvalidSpec):
        validate_revision("main\n")
    assert is_commit(COMMIT) and not is_commit(COMMIT + "\n")


def test_a_listed_variant_folder_with_a_newline_is_not_an_install_key():
    assert valid_install_key("kernels-lab/training", COMMIT, "torch-universal")
    assert not valid_install_key("kernels-lab/training", COMMIT, "torch-universal\n")

"""`kernels serve`: the Hugging Face Hub's read protocol over a folder of git repos.

A mirror for machines without internet, and the Hub the test suite talks to. Standard library
plus the `git` binary; huggingface_hub clients need only HF_ENDPOINT pointed at it.

    MirrorServer(root, host="127.0.0.1", port=0, lfs_redirect=True)   serve root/<org>/<name>
    build_mirror(src, dest, trusted_publishers=None) -> [BuiltRepo]  Hub-layout folders -> git repos
    GitRepoWriter(path)                                                write fixture repos
    main(argv) -> int                                                  the `kernels serve` command
"""

from .build import BuiltRepo, build_mirror
from .cli import main
from .server import MirrorServer
from .writer import GitRepoWriter

__all__ = ["BuiltRepo", "GitRepoWriter", "MirrorServer", "build_mirror", "main"]

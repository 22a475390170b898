"""The `kernels` command line (entry point: kernels.cli.main:main)."""

from __future__ import annotations


def download_kernels(args: object) -> None:
    """The reference's `kernels.cli.download_kernels(args)`: `kernels download` for callers
    that import it (its tests do); see kernels.cli.download."""
    from .download import download_kernels as run

    run(args)

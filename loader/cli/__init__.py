"""The `kernels` command line (entry point: kernels.cli.main:main)."""

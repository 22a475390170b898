"""The distribution version. It tracks the API level of the `kernels` API that transformers checks."""

__version__ = "0.18.2"

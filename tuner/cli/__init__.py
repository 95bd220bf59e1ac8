"""The ``offload-tuner`` command line (``tuner.cli.main``), and its ``profile`` group."""

from .main import cli, main

__all__ = ["cli", "main"]

"""The median of synchronizing runs, shared with benchmarks/kernel_transfer.py."""

from kernel_transfer import timed  # (benchmarks/ is on sys.path: transfer.py's directory)

__all__ = ["timed"]

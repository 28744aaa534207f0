"""evalpipe: prove that a speculative-decoding change did not move accuracy."""

__version__ = "0.1.0"

"""The padded lengths of training batches (torch-free, so the script checks `--short-buckets` before importing
torch): a batch holds examples of one length bucket, padded to its bound."""

from __future__ import annotations

SHORT_BUCKETS = (192, 256, 320, 384, 448, 512, 640, 768, 1024)  # padded lengths of short batches
LONG_BUCKETS = (1536, 2560, 4096)


def parse_short(text: str) -> tuple[int, ...]:
    """`--short-buckets` ("256,512,1024") as a checked tuple; ValueError names what is wrong."""
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated lengths, got {text!r}") from None
    check_short(lengths)
    return lengths


def check_short(short_buckets: tuple) -> None:
    """Raise ValueError unless `short_buckets` rise strictly and the largest is the default's largest or more (a
    short example longer than every bucket would be dropped, which changes the data)."""
    if not short_buckets or short_buckets[0] <= 0 or list(short_buckets) != sorted(set(short_buckets)):
        raise ValueError(f"expected rising positive lengths, got {list(short_buckets)}")
    if short_buckets[-1] < SHORT_BUCKETS[-1]:
        raise ValueError(f"the largest must be at least {SHORT_BUCKETS[-1]}, got {short_buckets[-1]}")


def batch_shapes(
    batch_tokens: int, long_tokens: int, long_every: int, short_buckets: tuple = SHORT_BUCKETS
) -> list[tuple[int, int]]:
    """Every (rows, width) a BatchStream of these settings can yield: a bucket's batch is cut once its rows fill the
    budget, so each bucket has one row count (what `--step compiled` compiles a graph for)."""
    shapes = [(-(-batch_tokens // b), b) for b in short_buckets]
    if long_every:
        shapes += [(-(-long_tokens // b), b) for b in LONG_BUCKETS]
    return shapes

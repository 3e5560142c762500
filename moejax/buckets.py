"""Shape buckets: a handful of compiled shapes serve every request length."""


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def rows_bucket(n: int, multiple: int = 1) -> int:
    """A batch's padded row count: bucket(n) rounded up to a multiple of the devices that split rows (a layout's
    data-parallel attention), so every device gets as many rows (uneven splits make XLA reshard around norms)."""
    return -(-bucket(n) // multiple) * multiple

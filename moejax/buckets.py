"""Shape buckets: a handful of compiled shapes serve every request length."""


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def rows_bucket(n: int, multiple: int = 1, fine: bool = False) -> int:
    """A batch's padded row count: bucket(n) (fine: fine_bucket(n)) rounded up to a multiple of the devices that
    split rows (a layout's data-parallel attention), so every device gets as many rows (uneven splits make XLA
    reshard around norms)."""
    return -(-(fine_bucket(n) if fine else bucket(n)) // multiple) * multiple


def fine_bucket(n: int, minimum: int = 1) -> int:
    """Smallest of the powers of two and their 1.5x (16, 24, 32, 48, ...) that is >= max(n, minimum): at most a
    third padding where pow2 buckets pay up to a half, for twice the shapes."""
    p = bucket(n, minimum)
    three_quarters = 3 * p // 4
    return three_quarters if p % 4 == 0 and three_quarters >= max(int(n), minimum, 1) else p

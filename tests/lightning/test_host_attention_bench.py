"""moejax.lightning.host_attention_bench.measure_paged on tiny shapes: it runs each host backend over a block pool and
reports the pool's bytes and both rates; bad arguments are refused by name."""
import jax
import pytest

from moejax.lightning.host_attention_bench import measure_against_transfer, measure_paged

TINY = dict(batch=2, context=40, heads=4, kv_heads=2, head_dim=8, rank=16, rope_dim=8, block_size=16, repeats=1)


@pytest.mark.parametrize("kind,backend", [("gqa", "cpu"), ("mla", "cpu"), ("gqa", "xla")])
def test_measure_paged_times_the_pool(kind, backend):
    row = measure_paged(kind, backend=backend, dtype="bfloat16", **TINY)
    blocks = 2 * 3  # 40 tokens in blocks of 16: 3 per row
    per_key = 2 * 2 * 8 if kind == "gqa" else 16 + 8  # k and v over 2 heads of 8; latent and rope
    assert row["cache_bytes"] == blocks * 16 * per_key * 2  # bfloat16
    assert row["seconds"] > 0 and row["gb_per_s"] > 0 and row["read_gb_per_s"] > 0
    assert (row["kind"], row["backend"], row["context"]) == (kind, backend, 40)


def test_measure_paged_refuses_bad_arguments():
    with pytest.raises(ValueError, match="backend 'pallas' does not run on the host"):
        measure_paged(backend="pallas", **TINY)
    with pytest.raises(ValueError, match="kind must be"):
        measure_paged("dense", **TINY)


def test_measure_against_transfer_times_host_attention_and_the_copy():
    """Fig. 9's two sides at one context: the pool's bytes and the FLOPs written out, each time positive, the copy
    inside the copy-and-attend time's measure; one CPU device: the copy stays on it and says so."""
    shapes = {k: v for k, v in TINY.items() if k not in ("rank", "rope_dim")}
    row = measure_against_transfer("gqa", dtype="float32", **shapes)
    assert row["kv_bytes"] == 2 * 3 * 16 * 2 * 2 * 8 * 4  # 6 blocks of 16 keys, k and v over 2 heads of 8, float32
    assert row["flops"] == 2 * 2 * 4 * 40 * (8 + 8)  # q.k and p.v for 2 rows of 4 heads over 40 keys
    assert min(row["host_s"], row["move_s"], row["copy_s"]) > 0 and row["device_backend"] == "xla"
    assert row["host_gb_per_s"] == pytest.approx(row["kv_bytes"] / row["host_s"] / 1e9)
    assert row["move_over_host"] == pytest.approx(row["move_s"] / row["host_s"])
    assert row["copy_crosses_devices"] == (len(jax.devices()) > 1)
    with pytest.raises(ValueError, match="host_backend 'pallas' does not run on the host"):
        measure_against_transfer(host_backend="pallas", **shapes)

"""`python -m launch.bench host-attention`: MoE-Lightning's Fig. 9, decode attention on the host CPU over the KV in
host memory against copying that KV to the device and attending there, by context length
(moejax.lightning.host_attention_bench.measure_against_transfer: one step's paged attention for --batch rows, each
row's KV --context tokens).

Per context the record has the KV bytes, the attention's FLOPs, the median seconds of the host's attention (the
query there and the output back included), of the copy and attention on the device, and of the copy alone, with
GB/s = KV bytes / seconds for the host's attention and for the copy. `move_over_host` > 1: the host's attention is
the faster, the paper's case for attention on the CPU (its Fig. 9 compares the two on its GPU machine, the KV
crossing PCIe). On a CPU machine the "device" is a second simulated CPU device (XLA_FLAGS is set
before JAX starts), so the copy is a memcpy in one memory, not a link: compare the orders of magnitude, not the
paper's ratios."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax

from launch.bench.provenance import device_tag
from launch.bench.results import no_file
from launch.bench.util import second_cpu_device
from moejax.lightning.host_attention_bench import PAGED_BACKENDS, measure_against_transfer


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("host-attention", help="MoE-Lightning Fig. 9: host attention against KV copied to the device, "
                                              "by context length")
    p.add_argument("--contexts", default="128,256,512,1024,2048,4096,8192", help="KV tokens per row, comma-separated")
    p.add_argument("--batch", type=int, default=4, help="rows of one decode step")
    p.add_argument("--kind", default="gqa", choices=["gqa", "mla"])
    p.add_argument("--heads", type=int, default=32, help="query heads (default Mixtral 8x7B's, the paper's model)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--host-backend", default="cpu", choices=PAGED_BACKENDS,
                   help="the host's paged attention kernel (placement lightning's: cpu)")
    p.add_argument("--device-backend", default="auto", help="the device's paged attention kernel (auto: the default)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plot", default=None, help="PNG (default beside --out, else bench/results/host-attention-"
                                                "<device>.png; needs matplotlib, else no plot)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/host-attention-<device>.json)")
    p.set_defaults(before_start=second_cpu_device)  # a second CPU device to copy to where the accelerator is a CPU
    return p


def host_attention(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    contexts = [int(c) for c in args.contexts.split(",")]
    if min(contexts) < 1 or min(args.batch, args.repeats) < 1:
        raise ValueError("--contexts, --batch and --repeats must be >= 1")
    record = dict(env, benchmark="host-attention", batch=args.batch, kind=args.kind, dtype=args.dtype,
                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, repeats=args.repeats,
                  figure="MoE-Lightning (arXiv 2411.11217) Fig. 9: CPU attention vs KV transfer + GPU attention",
                  rows=[])
    print(f"  {'context':>7s} {'KV MB':>8s} {'host ms':>8s} {'GB/s':>6s} {'copy+attn ms':>12s} {'copy GB/s':>9s} "
          f"{'ratio':>6s}")
    for context in contexts:
        row = measure_against_transfer(args.kind, batch=args.batch, context=context, heads=args.heads,
                                       kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                                       repeats=args.repeats, host_backend=args.host_backend,
                                       device_backend=args.device_backend)
        record["rows"].append(row)
        print(f"  {context:7d} {row['kv_bytes'] / 1e6:8.1f} {row['host_s'] * 1e3:8.2f} {row['host_gb_per_s']:6.1f} "
              f"{row['move_s'] * 1e3:12.2f} {row['copy_gb_per_s']:9.1f} {row['move_over_host']:6.2f}", flush=True)
        partial(record, f"context {context}")
    beside_out = os.path.splitext(args.out)[0] + ".png" if args.out else None  # a record elsewhere: its plot too
    path = args.plot or beside_out or os.path.join("bench", "results",
                                                   f"host-attention-{device_tag(env['device']['kind'])}.png")
    record["plot"] = _plot(record, path)
    return record


def _plot(record: dict, path: str) -> str | None:
    """Seconds per step against context, host attention and copy + device attention -> the PNG's path, or None
    without matplotlib."""
    try:
        import matplotlib  # optional dependency: the record is complete without the plot
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency, as above
    except ImportError:
        return None
    rows = record["rows"]
    x = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["host_s"] * 1e3 for r in rows], "o-", label=f"attention on the host ({rows[0]['host_backend']})")
    ax.plot(x, [r["move_s"] * 1e3 for r in rows], "s-", label="KV copied to the device + attention there")
    ax.plot(x, [r["copy_s"] * 1e3 for r in rows], ":", label="the copy alone")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens per row)", ylabel="ms per decode step",
           title=f"{record['kind']} {record['dtype']}, batch {record['batch']}, {jax.devices()[0].device_kind}\n"
                 f"(cf. MoE-Lightning Fig. 9; {record['heads']} heads, {record['kv_heads']} KV heads of "
                 f"{record['head_dim']}: Mixtral 8x7B's by default)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""CGOPipe's launch order (MoE-Lightning Alg. 1, Figs. 5-6) as data: the sequence of tasks the host thread
dispatches for one pass over the layers with `micro_batches` micro-batches. The executor
(moejax.lightning.cgopipe_steps) walks this list and runs each task; nothing else decides the order.

Per layer i and micro-batch j (0-based here, 1-based in the paper):
    LOADH(i, j)       the attention output of (i, j) back to the device (D2)
    W_PINTOG(i+1, j)  page j of the next MoE layer's paged experts to the device (D3)
    POSTATTN(i, j)    output projection, residual, router and FFN of (i, j) on the device
    PREATTN(k)        norm and QKV projection on the device, for the task `ahead` micro-batches later
    OFFLOADQKV(k)     its query and new KV to the host (D1)
    CPUATTN(k)        its KV stored in the host cache and attention over it, on the host
The paper's W_CTOPIN (host memory -> pinned buffer) has no task here: moejax keeps the paged experts in pinned host
memory from load on (moejax.offload.host_store), so that stage of the page's journey is already done.

`PREATTN(i, j + 2)` of Alg. 1 runs past the layer's last micro-batch into the next layer's first ones: with micro-
batches numbered k = i * micro_batches + j through the pass, the pre-attention of k + ahead follows the
post-attention of k, with ahead = min(2, micro_batches) (micro-batch k + ahead of the next layer needs the post-
attention of the same micro-batch of this layer, which is k + ahead - micro_batches <= k). The prologue launches
the first `ahead` pre-attentions.

`flexgen_order` is the §6.1 ablation's baseline, FlexGen's schedule (arXiv 2303.06865) run with MoE-Lightning's
policy: per layer, its pages first, then each micro-batch's pre-attention, offload, host attention, load and post-
attention, one after another, with nothing launched ahead. Each task then waits on the one before it (the device runs
its tasks in order, and POSTATTN of a micro-batch needs its LOADH): the host's attention, the device's work and the
copies do not overlap across micro-batches, which is what CGOPipe's order adds."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

PRE, OFFLOAD, ATTN, LOAD, PAGE, POST = "PREATTN", "OFFLOADQKV", "CPUATTN", "LOADH", "W_PINTOG", "POSTATTN"
LOOKAHEAD = 2  # Alg. 1 launches CPU attention two micro-batches ahead


class Task(NamedTuple):
    op: str
    layer: int
    micro_batch: int


def cgopipe_order(layers: int, micro_batches: int) -> list[Task]:
    """Every task of one pass, in launch order. W_PINTOG tasks name the layer whose page moves (layer + 1; after the
    last layer, layer `layers`: the first layer of the next pass)."""
    if layers < 1 or micro_batches < 1:
        raise ValueError(f"cgopipe_order: layers and micro_batches must be >= 1, got {layers}, {micro_batches}")
    ahead = min(LOOKAHEAD, micro_batches)
    total = layers * micro_batches
    at = lambda k: divmod(k, micro_batches)  # noqa: E731  (layer, micro-batch) of the k-th in the pass
    tasks: list[Task] = []

    def launch_attention(k: int) -> None:
        i, j = at(k)
        tasks.extend(Task(op, i, j) for op in (PRE, OFFLOAD, ATTN))

    for k in range(ahead):  # the prologue
        launch_attention(k)
    for k in range(total):
        i, j = at(k)
        tasks += [Task(LOAD, i, j), Task(PAGE, i + 1, j), Task(POST, i, j)]
        if k + ahead < total:
            launch_attention(k + ahead)
    return tasks


def flexgen_order(layers: int, micro_batches: int) -> list[Task]:
    """Every task of one pass in FlexGen's order: per layer i, W_PINTOG(i, j) of every page (the layer's weights to
    the device before it runs; layer 0's pages are on their way from the pass's start, and a layer without paged
    experts starts the next MoE layer's), then per micro-batch j its PREATTN, OFFLOADQKV, CPUATTN, LOADH and
    POSTATTN."""
    if layers < 1 or micro_batches < 1:
        raise ValueError(f"flexgen_order: layers and micro_batches must be >= 1, got {layers}, {micro_batches}")
    tasks: list[Task] = []
    for i in range(layers):
        tasks += [Task(PAGE, i, j) for j in range(micro_batches)]
        for j in range(micro_batches):
            tasks += [Task(op, i, j) for op in (PRE, OFFLOAD, ATTN, LOAD, POST)]
    return tasks


# the launch orders the executor runs, by the name lightning's `pipeline_schedule` option gives
ORDERS: dict[str, Callable[[int, int], list[Task]]] = {"cgopipe": cgopipe_order, "flexgen": flexgen_order}

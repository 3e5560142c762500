"""Several processes (hosts) as one set of devices: join them with jax.distributed, turn a host batch that every
process holds into one global array split by rows, and bring a global result back to numpy on every process.

Every process runs the same program on the same inputs (the batch runner reads the same file everywhere), so the
collectives line up; only process 0 should write results (`is_main`). A program may also run on the devices of some
processes only (DEP's attention and expert groups, moejax.sharding.dep): the others dispatch it too and get arrays
without local data, which `to_host` brings to every process."""
from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jax._src import distributed  # the client of jax.distributed's coordination service (orbax uses it so too)
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def initialize(coordinator: str, num_processes: int, process_id: int, *, init_timeout_s: int = 300,
               heartbeat_timeout_s: int = 100, shutdown_timeout_s: int = 300, transfer_address: str | None = None
               ) -> None:
    """Join `num_processes` processes through the coordinator "HOST:PORT" (process 0 serves it). Call before any
    other JAX work. Nothing waits forever: the JAX runtime ends the process (SIGABRT, a "Terminating process because
    the JAX distributed service detected fatal errors" line on stderr) when the others have not all joined within
    `init_timeout_s` (DEADLINE_EXCEEDED ... RegisterTask), when a peer stops sending heartbeats for
    `heartbeat_timeout_s` (killed, hung), or when a peer that exits (an exception) waits `shutdown_timeout_s` at
    the shutdown barrier for the others. No Python exception comes out of those.

    `transfer_address` "HOST:PORT" (HOST: this machine's address that the others reach; a fixed port, its own per
    process): where this process serves JAX's socket transfers, which carry `jax.device_put` between devices of
    different processes on backends that cannot copy between processes themselves (CPU). experts=dep with its
    groups in different processes needs it there (moejax.sharding.dep)."""
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"multihost: coordinator must be HOST:PORT, got {coordinator!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"multihost: num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"multihost: process_id must be in [0, {num_processes}), got {process_id!r}")
    if transfer_address is not None:
        t_host, t_sep, t_port = str(transfer_address).rpartition(":")
        if not t_sep or not t_host or not t_port.isdigit() or int(t_port) == 0:
            # port 0 would bind a port the peers are never told (their transfers wait forever)
            raise ValueError(f"multihost: transfer_address must be HOST:PORT with a fixed port, got "
                             f"{transfer_address!r}")
        jax.config.update("jax_cross_host_transfer_socket_address", str(transfer_address))
    # Collectives between CPU devices of different processes need gloo (jax 0.10's default; set so that a version
    # with another default still works). The option configures only the CPU client: harmless on GPU machines.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=init_timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   shutdown_timeout_seconds=shutdown_timeout_s)
    except Exception as e:  # e.g. called twice, or after JAX already started its backends
        raise RuntimeError(f"multihost: process {process_id} of {num_processes} could not join the coordinator "
                           f"at {coordinator}: {e}") from e


def is_main() -> bool:
    """Whether this process is the one that writes results (process 0; also true in a single process)."""
    return jax.process_index() == 0


def main_says(flag: bool) -> bool:
    """Process 0's `flag`, on every process (a collective: every process must call it)."""
    return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(flag))))


def main_number(value: int) -> int:
    """Process 0's `value` (an int in [0, 2**62)), on every process (a collective). Sent as two int32 halves:
    without jax_enable_x64 an int64 would be cut to 32 bits."""
    high, low = multihost_utils.broadcast_one_to_all(np.array([value >> 31, value & (2**31 - 1)], np.int32))
    return (int(high) << 31) | int(low)


def same_everywhere(data: bytes) -> bool:
    """Whether every process passed the same bytes; the same answer on every process (a collective)."""
    digest = np.frombuffer(hashlib.blake2b(data, digest_size=16).digest(), np.uint8)
    return bool((multihost_utils.process_allgather(digest) == digest).all())


def transfers_between_processes() -> bool:
    """Whether `jax.device_put` can copy between devices of different processes here: the backend does it itself
    (NVLink / network on GPUs that support it), or `initialize(transfer_address=...)` started JAX's socket
    transfers."""
    return bool(getattr(jax.devices()[0].client, "supports_cross_host_transfers", False)
                or jax.config.values.get("jax_cross_host_transfer_socket_address"))


def place(array: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array, the same in every process, placed by `sharding`: `jax.device_put` in one process; with several,
    each process places the parts its own devices hold (none where the sharding leaves it out, as a DEP group may;
    device_put would first check that every process holds the same array)."""
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def group_rows(batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host batch [B, ...] with B a multiple of the mesh's devices, the same in every process, as one array split
    by rows over a 1-D `mesh` that may leave out some processes (a DEP group): each process places the rows of its
    own devices in the mesh, if any."""
    batch = np.asarray(batch)
    if batch.shape[0] % mesh.size:
        raise ValueError(f"multihost: {batch.shape[0]} rows do not split over the {mesh.size} devices of the mesh")
    return place(batch, NamedSharding(mesh, P(mesh.axis_names[0])))


def shard_rows(batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host batch [B, ...], the same in every process, as one global array split by rows over the 1-D `mesh`.
    Rows are padded with zeros to a multiple of the mesh's devices (a global array splits only evenly); each
    process passes just the rows its own devices hold."""
    owners = sorted({d.process_index for d in mesh.devices.flat})
    if len(owners) != jax.process_count():  # a process without devices in the mesh could not take part
        raise ValueError(f"multihost: the layout's {mesh.size} devices belong to processes {owners} of "
                         f"{jax.process_count()}; a multi-process layout needs devices of every process (drop "
                         "devices=, or raise it)")
    batch = np.asarray(batch)
    rows = -(-batch.shape[0] // mesh.size) * mesh.size
    padded = np.zeros((rows, *batch.shape[1:]), batch.dtype)
    padded[: batch.shape[0]] = batch
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    # The rows of this process's devices, in global order (make_array_from_process_local_data's local layout).
    indices = sharding.addressable_devices_indices_map(padded.shape).values()
    starts = sorted({idx[0].start or 0 for idx in indices if idx is not None})  # a NamedSharding's are never None
    per_device = rows // mesh.size
    local = np.concatenate([padded[s: s + per_device] for s in starts])
    return jax.make_array_from_process_local_data(sharding, local, padded.shape)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly global) array as numpy, on every process. Each process receives it once,
    split by rows over its own devices (one all-gather between processes), and copies those shards to host memory.
    On 2 processes x 4 CPU devices (gloo) that took 4 / 14 / 78 ms for 0.1 / 8 / 32 MiB of logits, against 10 /
    25 / 211 ms for process_allgather, which replicates the value on every device (and needs that much memory on
    each); process_allgather remains the fallback for shapes and shardings that do not split so. An array on the
    devices of some processes only comes from them (`_from_owners`)."""
    devices: Iterable[Any] = x.sharding.device_set
    if len({d.process_index for d in devices}) < jax.process_count():  # the same answer on every process
        return _from_owners(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    mesh = _per_process_mesh(x.sharding)
    if mesh is None or x.ndim == 0 or x.shape[0] % mesh.shape["local"]:
        return multihost_utils.process_allgather(x, tiled=True)
    y = _copy_to(NamedSharding(mesh, P("local")))(x)
    shards = sorted(y.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def _from_owners(x: jax.Array) -> np.ndarray:
    """The value of an array whose devices leave out some processes, on every process (a collective: every process
    calls it). Each part of the value has one owner, its first device in the sharding's map (the same on every
    process); each process fills in the parts its devices own, and one all-gather between processes brings every
    process's parts to all of them."""
    owners: dict[tuple, tuple[jax.Device, tuple]] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        owners.setdefault(tuple((s.start, s.stop, s.step) for s in index), (device, index))
    local = np.zeros(x.shape, x.dtype)
    mine = {shard.device: shard for shard in x.addressable_shards}
    for device, index in owners.values():
        if device in mine:
            local[index] = np.asarray(mine[device].data)
    _wait_for_every_process()
    every = multihost_utils.process_allgather(local)  # [processes, *shape]
    out = np.empty(x.shape, x.dtype)
    for device, index in owners.values():
        out[index] = every[device.process_index][index]
    return out


_barriers = itertools.count()


def _wait_for_every_process(timeout_s: int = 600) -> None:
    """A barrier of the coordination service, which uses no device: the processes that receive the value of
    `_from_owners` have waited for it (and so for every copy between processes it came from) before they arrive, so
    past it no copy is in flight. A process that enters a CPU collective while a peer still copies from it never
    leaves it (gloo holds the threads the copy needs): 2 processes x 4 CPU devices hung in about half of the runs
    there, none of 6 with this barrier."""
    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"moejax_from_owners_{next(_barriers)}", timeout_s * 1000)


def _per_process_mesh(sharding: jax.sharding.Sharding) -> Mesh | None:
    """The devices of a NamedSharding as a (processes, local) mesh, when each process owns one row of it."""
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size % jax.process_count():
        return None
    devices = np.asarray(sharding.mesh.devices).reshape(jax.process_count(), -1)
    if any(d.process_index != p for p, row in enumerate(devices) for d in row):
        return None
    return Mesh(devices, ("processes", "local"), axis_types=(AxisType.Auto, AxisType.Auto))


@functools.cache
def _copy_to(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda a: a, out_shardings=sharding)  # one jit per target: cached, not retraced per call

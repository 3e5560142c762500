"""Expert offloading on one device: routed expert weights in host memory, streamed or cached on the device."""
from moejax.offload.host_store import HOST_LIMIT_ENV, HostStore, is_routed_expert, pinned_host_limit_bytes

__all__ = ["HOST_LIMIT_ENV", "HostStore", "is_routed_expert", "pinned_host_limit_bytes"]

"""Datasheet profiles: a GPU's published peaks with a stated host CPU and link, so plans can be made without the
hardware. Every number here is a vendor figure or an assumption named in `notes`; nothing is measured. Peaks are
dense 16-bit tensor-core FLOP/s (no sparsity); bandwidths are per direction. Link latencies (α) are not on any
datasheet: 10 µs per transfer between devices and 10 µs per host copy are assumptions of the order NCCL and
cudaMemcpyAsync show, stated as such. Host CPU FLOP/s: cores x clock x 32 float32 FLOP/cycle (two AVX2/AVX-512
FMA ports), the figure MoE-Lightning §6.4 uses for its base CPU (1.6 TFLOP/s). `load_profile` reads one of these
by name, or a measured profile's JSON."""
from __future__ import annotations

import json
import os

from moejax.plan.hardware import GB, GiB, Link, Processor, Profile

_ALPHA = 10e-6
_COLLECTIVE = "collectives: ring over NVLink at its per-direction bandwidth"


def _host(name: str, cores: int, ghz: float, memory_gb: float, bandwidth_gb: float) -> Processor:
    return Processor(name, memory_gb * GB, cores * ghz * 1e9 * 32, bandwidth_gb * GB, launch_s=5e-6)


def _gpu(name: str, memory_gib: float, tflops: float, hbm_gb_s: float, launch_s: float = 5e-6) -> Processor:
    return Processor(name, memory_gib * GiB, tflops * 1e12, hbm_gb_s * GB, launch_s=launch_s)


def _profile(name: str, device: Processor, host: Processor, h2d_gb_s: float, nvlink_gb_s: float,
             network_gb_s: float, notes: str, gpus: int = 8) -> Profile:
    nv = Link(_ALPHA, nvlink_gb_s * GB)
    return Profile(name=name, source="datasheet", device=device, host=host, gpus=gpus, h2d=Link(_ALPHA, h2d_gb_s * GB),
                   d2d=nv, all_to_all=nv, all_gather=nv, reduce_scatter=nv, network=Link(2 * _ALPHA, network_gb_s * GB),
                   notes=notes)


# DGX H100/H200: 2 x Xeon Platinum 8480C (56 cores, 2.0 GHz, 8 channels DDR5-4800 each = 307 GB/s a socket), 2 TB;
# PCIe Gen5 x16 to each GPU (64 GB/s a direction), NVLink 4 (900 GB/s both directions), 400 Gb/s InfiniBand per GPU.
_DGX_HOST = _host("2 x Intel Xeon Platinum 8480C (DGX)", 112, 2.0, 2048, 614)
# DGX A100: 2 x AMD EPYC 7742 (64 cores, 2.25 GHz, 8 channels DDR4-3200 = 205 GB/s a socket), 1 TB; PCIe Gen4 x16
# (32 GB/s a direction), NVLink 3 (600 GB/s both directions), 200 Gb/s HDR InfiniBand per GPU.
_DGX_A100_HOST = _host("2 x AMD EPYC 7742 (DGX A100)", 128, 2.25, 1024, 410)

DATASHEETS = {
    "h100": _profile("h100", _gpu("NVIDIA H100 SXM5 80GB", 80, 989.4, 3350), _DGX_HOST, 64, 450, 50,
                     f"DGX H100 as the host; {_COLLECTIVE}; α assumed"),
    "h200": _profile("h200", _gpu("NVIDIA H200 SXM 141GB", 141, 989.4, 4800), _DGX_HOST, 64, 450, 50,
                     f"DGX H200 as the host; {_COLLECTIVE}; α assumed"),
    "a100": _profile("a100", _gpu("NVIDIA A100 SXM4 80GB", 80, 312, 2039), _DGX_A100_HOST, 32, 300, 25,
                     f"DGX A100 as the host; {_COLLECTIVE}; α assumed"),
    # MoE-Lightning's S2 (Table 2): one L4 on a GCP g2 instance, Xeon @ 2.20 GHz, 24 cores, 192 GB; PCIe Gen4 x16.
    # Host DRAM bandwidth is not stated: 100 GB/s assumed (half of the paper's §6.4 base CPU, 200 GB/s).
    "l4": _profile("l4", _gpu("NVIDIA L4 24GB", 24, 121, 300), _host("Intel Xeon @ 2.20GHz, 24 cores (S2)", 24, 2.2,
                                                                     192, 100), 32, 32, 12.5,
                   "MoE-Lightning S2 host; host DRAM bandwidth assumed 100 GB/s; no NVLink: devices meet over PCIe; "
                   "α assumed", gpus=1),
    # MoE-Lightning's S1: one T4 on a GCP n1 instance, Xeon @ 2.30 GHz, 24 cores, 192 GB; PCIe Gen3 x16 (16 GB/s).
    "t4": _profile("t4", _gpu("NVIDIA T4 16GB", 16, 65, 320), _host("Intel Xeon @ 2.30GHz, 24 cores (S1)", 24, 2.3,
                                                                  192, 100), 16, 16, 4,
                   "MoE-Lightning S1 host; host DRAM bandwidth assumed 100 GB/s; no NVLink: devices meet over PCIe; "
                   "α assumed", gpus=1),
}


def load_profile(name_or_path: str, overrides: dict | None = None) -> Profile:
    """A datasheet profile by name (h100, h200, a100, l4, t4) or a JSON file written by `launch.profile_devices`."""
    if name_or_path in DATASHEETS:
        profile = DATASHEETS[name_or_path]
    elif os.path.isfile(name_or_path):
        try:
            with open(name_or_path) as f:
                profile = Profile.from_dict(json.load(f))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"profile {name_or_path!r}: not a profile JSON written by launch.profile_devices "
                             f"({e})") from None
    else:
        raise ValueError(f"profile {name_or_path!r} is neither a datasheet profile ({', '.join(DATASHEETS)}) nor a "
                         "file; measure one with `python -m launch.profile_devices --out FILE`")
    return profile.with_overrides(overrides or {})

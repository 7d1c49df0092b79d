"""A GPU's peak memory bandwidth (bytes per second), the ceiling of a weight-reading decode step.

The vendor's figure for datacenter GPUs known by name comes first; any other CUDA device's is
computed from the memory clock and bus width the driver reports (double data rate), when it
reports both. Unknown (a CPU, a driver reporting neither): None, and no share is shown.
"""

from __future__ import annotations

import re

import torch

TB = 1e12
# (pattern searched in the device name, case-insensitive; TB/s): the first match wins, so a
# variant comes before its family's plain name
KNOWN_PEAKS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 2.0),
    (r"H100.*NVL", 3.9),
    (r"H100", 3.35),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H200", 4.8),
    (r"A100.*80GB", 2.0),
    (r"A100", 1.6),  # the 40 GB boards
    (r"L40S", 0.864),
    (r"RTX 4090", 1.008),
)


def peak_from_name(name: str) -> float | None:
    """The vendor's peak for a known device name, in bytes per second; else None."""
    for pattern, tbs in KNOWN_PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return tbs * TB
    return None


def peak_from_clock(memory_clock_khz: int, bus_width_bits: int) -> float | None:
    """2 transfers per clock × bus width: bytes per second; None when either is not reported."""
    if memory_clock_khz <= 0 or bus_width_bits <= 0:
        return None
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth in bytes per second; None on CPU or when unknown."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    known = peak_from_name(props.name)
    if known is not None:
        return known
    return peak_from_clock(int(getattr(props, "memory_clock_rate", 0) or 0),
                           int(getattr(props, "memory_bus_width", 0) or 0))

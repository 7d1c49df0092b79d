"""engine.bandwidth: the vendor's peak by device name, and the same figure from the memory clock
and bus width the CUDA driver reports for those boards (their published cudaDeviceProp values):
the two sources agree within 3%."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.bandwidth import peak_bandwidth, peak_from_clock, peak_from_name

# device name as torch reports it, the driver's memory clock (kHz) and bus width (bits)
BOARDS = [
    ("NVIDIA H100 80GB HBM3", 2_619_000, 5120),
    ("NVIDIA H100 PCIe", 1_593_000, 5120),
    ("NVIDIA A100-SXM4-80GB", 1_593_000, 5120),
    ("NVIDIA A100-SXM4-40GB", 1_215_000, 5120),
    ("NVIDIA L40S", 9_001_000, 384),
    ("NVIDIA GeForce RTX 4090", 10_501_000, 384),
]


@pytest.mark.parametrize("name,clock,bus", BOARDS)
def test_name_and_clock_agree(name, clock, bus):
    by_name, by_clock = peak_from_name(name), peak_from_clock(clock, bus)
    assert by_name is not None and by_clock is not None
    assert abs(by_name / by_clock - 1) < 0.03, (name, by_name, by_clock)


def test_named_figures():
    assert peak_from_name("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_from_name("NVIDIA H100 PCIe") == 2.0e12
    assert peak_from_name("NVIDIA H200") == 4.8e12
    assert peak_from_name("NVIDIA A100 80GB PCIe") == 2.0e12
    assert peak_from_name("NVIDIA A100-PCIE-40GB") == 1.6e12
    assert peak_from_name("Some Future GPU") is None


def test_unknown():
    assert peak_from_clock(0, 5120) is None and peak_from_clock(2_619_000, 0) is None
    assert peak_bandwidth(torch.device("cpu")) is None


@pytest.mark.gpu
def test_this_gpu():
    props = torch.cuda.get_device_properties(0)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    peak = peak_bandwidth(torch.device("cuda", 0))
    print(f"{props.name}: peak {peak and peak / 1e12} TB/s; driver: clock {clock} kHz, bus {bus} bits "
          f"-> {(peak_from_clock(clock, bus) or 0) / 1e12:.3f} TB/s")
    assert peak is not None

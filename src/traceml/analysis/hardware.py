"""What the hardware can do: each known device's peak compute, against which MFU is measured."""
from __future__ import annotations

from typing import Optional

# Dense bf16/fp16 tensor-core peaks, TFLOP/s, by a part of the device name (first match wins).
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0))


def device_peak_tflops(device_name: str) -> Optional[float]:
    """The peak of a device by its name ("NVIDIA H100 80GB HBM3"); None for one not in the table."""
    return next((peak for part, peak in PEAK_TFLOPS if part in device_name), None)

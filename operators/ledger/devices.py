"""Peak dense 16-bit tensor FLOP/s per accelerator, for MFU (torchtitan's definition).

    mfu_pct = 100 x flops_per_token x tokens/s per device / peak FLOP/s of one device

The figures are the vendors' dense (no sparsity) BF16 peaks, as torchtitan uses them. A device
not in the table (a CPU, an unlisted GPU) has no peak: MFU is left out and a tag says why.
"""

from __future__ import annotations

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name(), dense BF16 TFLOP/s); first match wins
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.5),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("MI300X", 1307.4),
)


def peak_tflops(device: str) -> float | None:
    """The peak of one ``device`` (its name as the trainer recorded it), or None when unknown."""
    for name, peak in PEAK_TFLOPS:
        if name.lower() in device.lower():
            return peak
    return None


def mfu_pct(flops_per_token: float, tps_per_device: float, device: str) -> float | None:
    """Model FLOPs utilisation in percent, or None without a known peak for ``device``."""
    peak = peak_tflops(device)
    if peak is None:
        return None
    return 100.0 * flops_per_token * tps_per_device / (peak * 1e12)

"""Peak dense matmul throughput of common GPUs, the denominator of MFU.

Figures are the vendors' datasheet numbers without structured sparsity (datasheets often print
the 2:4-sparse figure, twice these). fp32 matmuls run on the tensor cores as TF32 only when
torch allows it (`torch.backends.cuda.matmul.allow_tf32` or a float32 matmul precision other
than 'highest'); otherwise the plain fp32 figure applies.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import torch

# (name pattern, {precision: FLOP/s}); the first pattern that matches the device name wins,
# so more specific names come first (e.g. 'H100 PCIe' before 'H100', 'A100' before 'A10').
PEAK_FLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    (r"H100.*PCIe", {"half": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (r"H100.*NVL|H200.*NVL", {"half": 835e12, "tf32": 418e12, "fp32": 60e12}),
    (r"H100|H200|GH200", {"half": 989e12, "tf32": 495e12, "fp32": 67e12}),
    (r"A100", {"half": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # NVIDIA publishes no A10G datasheet; these are the A10's figures.
    (r"A10G?\b", {"half": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"L40S", {"half": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bL4\b", {"half": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    # Volta and Turing have fp16 tensor cores but no bf16 ones: no 'bf16' entry, no MFU.
    (r"V100.*PCIE", {"fp16": 112e12, "fp32": 14e12}),
    (r"V100", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}),
)

_HALF = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def precision_key(dtype: torch.dtype) -> str:
    """'fp16', 'bf16', 'tf32' or 'fp32': which column of the table a compute dtype uses."""
    if dtype in _HALF:
        return _HALF[dtype]
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of one device for matmuls in `dtype`, or None if the device is not listed."""
    key = precision_key(dtype)
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if key in peaks:
                return peaks[key]
            if key == "tf32":  # no TF32 on this device: fp32 matmuls run as fp32
                return peaks.get("fp32")
            return peaks.get("half") if key in ("fp16", "bf16") else None
    return None


def device_name(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3' for a CUDA device, 'cpu' otherwise."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type

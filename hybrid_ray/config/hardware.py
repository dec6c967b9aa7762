"""What this machine computes natively, for config values that depend on it ("auto").

bf16 on a CPU without bf16 instructions is emulated: on a 2-core AVX2 EPYC a bf16 matmul of the
CPU example's shapes took 97 ms against 16 ms in fp32, so a bf16 run there is several times
slower than the same run in fp32, for no gain in memory that a CPU run needs.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def native_bf16(device_type: str = "") -> bool:
    """Whether bf16 runs at hardware speed on `device_type` ("cuda" or "cpu"; "": CUDA when
    this process sees a GPU, else the CPU): a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (oneDNN's bf16 kernels)."""
    import torch  # deferred: config parsing on a Ray driver need not pay for torch

    if not device_type:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN's query
        return False

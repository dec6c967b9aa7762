"""`deepspeed.accelerator.get_accelerator()`: the device this process trains on, CUDA or CPU.

One class over both: the methods DeepSpeed scripts call to place tensors, seed, synchronise
and read memory. The device is the one the engine picks (hybrid_ray/engine/topology.py): CUDA
when a GPU is visible, else the CPU. Custom kernels (`create_op_builder`) do not exist here.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from ..config import NotSupportedError


class Accelerator:
    """DeepSpeed's accelerator interface for the device torch finds: 'cuda' or 'cpu'."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"
        self._cpu_peak = 0

    # ---- device -------------------------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        """'cuda' / 'cpu', or 'cuda:N' with an index (the CPU has no index)."""
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        """The current device's index (the CPU: LOCAL_RANK, as DeepSpeed's CPU accelerator)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True  # the CPU always is; with CUDA, torch found a GPU

    def get_compile_backend(self) -> str:
        """torch.compile's backend for this device, as DeepSpeed's accelerators answer."""
        return "inductor"

    def is_synchronized_device(self) -> bool:
        """True when work runs in program order (the CPU), so synchronize() is a no-op."""
        return not self._cuda

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # ---- dtypes -------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # the engine trains in fp16 on CUDA and on the CPU

    def supported_dtypes(self) -> list:
        out = [torch.float32, torch.float16]
        return out + [torch.bfloat16] if self.is_bf16_supported() else out

    # ---- random numbers -----------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds CUDA as well

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def random(self) -> Any:
        return torch.random

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Bytes held by tensors on the device; on the CPU, this process's resident memory."""
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        import psutil

        rss = psutil.Process().memory_info().rss
        self._cpu_peak = max(self._cpu_peak, rss)
        return rss

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return max(self._cpu_peak, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        self._cpu_peak = 0

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        import psutil

        return psutil.virtual_memory().available

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    # ---- streams, events, markers -------------------------------------------------------
    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def create_op_builder(self, class_name: str) -> Any:
        raise NotSupportedError(f"get_accelerator().create_op_builder({class_name!r}): DeepSpeed's "
                                "custom kernels are not part of hybrid_ray (the engine uses torch's "
                                "fused optimizers and kernels)")

    get_op_builder = create_op_builder


_ACCELERATOR: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """The process's accelerator, made on first use (after CUDA_VISIBLE_DEVICES is final)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR

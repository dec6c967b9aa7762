"""The `fault_tolerance` section: copies of each rank's ZeRO shard in another rank's memory."""
from __future__ import annotations

from dataclasses import dataclass

from hybrid_ray.config.errors import config_error
from hybrid_ray.config.loader import checked


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Buddy replicas: every rank's optimizer shard (fp32 masters, optimizer state, loss-scaler
    and schedule state, data position, RNG) also lives in the host memory of the next rank, so
    that a lost worker's shard is rebuilt from memory instead of read from a checkpoint."""

    replicas: int = checked(0, choices=(0, 1))
    """1: keep one copy of each rank's shard on its buddy; 0: none (recovery reads checkpoints)."""
    mode: str = checked("copy", choices=("copy", "replay"))
    """copy: every `copy_interval` steps each rank sends its updated shard to its buddy, in the
    background (host memory: up to four shard copies per rank). replay: each step's reduced
    gradient shard is sent before the update and the buddy applies the same optimizer step to
    its copy (one shard copy per rank; bitwise equal when both step on the CPU)."""
    replay_on: str = checked("host", choices=("host", "device"))
    """Mode replay: where the buddy keeps and steps its copy. host: in host memory with the
    CPU's optimizer (bitwise equal to a CPU or offloaded owner; on a GPU the CPU step is the
    bottleneck). device: where the owner's masters lie (the GPU; host memory for offloaded
    spaces), stepped with the owner's kernel on a side stream, the gradients sent over the
    training group (NCCL): 16/N bytes per parameter more device memory (the copy and one
    step's gradient), and one optimizer step over 1/N of the parameters per step."""
    copy_interval: int = checked(1, ge=1)
    """Steps between copies (mode copy): a recovery redoes at most this many steps."""
    spare_workers: int = checked(0, ge=0)
    """Actors the Ray driver keeps started and waiting, so a lost worker is replaced at once;
    a group of one worker with replicas keeps its copies on them (in shared memory when one
    spare is on its node: 2 x 12 bytes per parameter of /dev/shm with Adam)."""
    timeout_s: float = checked(60.0, gt=0)
    """Seconds a copy waits for its buddy before the exchange counts as failed."""

    def validate(self, path: str) -> None:
        if self.replay_on != "host" and self.mode != "replay":
            raise config_error(f"{path}.replay_on", "applies to mode 'replay' only", self.replay_on,
                               "leave it at 'host' or set mode 'replay'")
        if self.mode == "replay" and self.copy_interval != 1:
            raise config_error(f"{path}.copy_interval", "applies to mode 'copy' only (replay sends every "
                               "step)", self.copy_interval, "leave it at 1 or use mode 'copy'")

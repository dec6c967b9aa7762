"""The engine: mixed-precision ZeRO training over torch.distributed, without Ray or MLflow.

Callers outside the engine import these names from here; the modules below are its parts:

    engine.py                 the Engine facade (accessors.py: DeepSpeed-compatible getters;
                              lifecycle.py: close, destroy, `with engine:`, interpreter exit)
    build.py                  the assembly steps of `hybrid_ray.initialize`
    topology.py               Topology: this process's place in the data-parallel group
    precision.py              dtypes per module (FP16Layer, FP16Module, norms in fp32)
    loss_scaler.py            fp16 loss scaling
    schedulers.py             DeepSpeed's warm-up learning-rate schedules
    activation_checkpointing.py  recompute blocks in backward
    comm.py                   collectives under the installed torch's names, bandwidth probe
    zero/                     flat buffers, gradient reducer, sharded optimizer, stage 3, offload
    compression/              gradient compression: top-k, PowerSGD, half-precision reduction
    checkpoint/               resharding, crash-safe, asynchronous checkpoints; offline tools
    flops/                    flop counter, the step profiler, the text report
"""
from .activation_checkpointing import checkpoint_activations
from .checkpoint import CheckpointError, Checkpointer, StepCounters, TrainState
from .engine import Engine, NonFiniteGradientError
from .loss_scaler import LossScaleUnderflowError
from .precision import FP16Layer, FP16Module
from .topology import Topology, gloo_on_loopback
from .warm import warm_up
from .zero.stage3 import register_external_parameter

__all__ = ["CheckpointError", "Checkpointer", "Engine", "FP16Layer", "FP16Module",
           "LossScaleUnderflowError", "NonFiniteGradientError", "StepCounters", "Topology", "gloo_on_loopback",
           "TrainState", "checkpoint_activations", "register_external_parameter", "warm_up"]

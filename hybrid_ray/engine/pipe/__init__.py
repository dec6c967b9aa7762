"""Pipeline parallelism in DeepSpeed's API: a model given as a list of layers (PipelineModule)
and `engine.train_batch()` / `eval_batch()` driving the micro-batches of one step, one stage or
several (torch.distributed.pipelining's GPipe and 1F1B, each stage data-parallel with ZeRO 0-2
over its replicas)."""
from .batches import PipelineBatches, RepeatingLoader
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineBatches", "RepeatingLoader"]

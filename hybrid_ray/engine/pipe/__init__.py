"""Pipeline parallelism in DeepSpeed's API: a model given as a list of layers (PipelineModule)
and `engine.train_batch()` / `eval_batch()` driving the micro-batches of one step. Today a
PipelineModule runs as one stage (pipeline_model_parallel_size 1): the same script runs
unchanged when more stages come."""
from .batches import PipelineBatches, RepeatingLoader
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineBatches", "RepeatingLoader"]

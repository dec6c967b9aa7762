"""DeepSpeed's names over the engine: what a DeepSpeed script calls, so that it runs with only
`import deepspeed` changed to `import hybrid_ray as deepspeed`.

The logic lives here; the modules at DeepSpeed's import paths (hybrid_ray.comm, .accelerator,
.zero, .checkpointing, .runtime, .utils, .moe) only re-export it. docs/deepspeed.md lists every
name provided, what it does here and what is refused.
"""

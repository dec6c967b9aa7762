"""`deepspeed.runtime.fp16`: see layer.py."""

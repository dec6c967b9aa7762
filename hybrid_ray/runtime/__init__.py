"""`deepspeed.runtime`: the seed document's import paths (fp16.layer, utils) and DeepSpeed's
activation_checkpointing.checkpointing."""

"""`deepspeed.moe`: importable; layer.MoE refuses to be built (hybrid_ray/compat/moe.py)."""

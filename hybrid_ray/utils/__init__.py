"""`deepspeed.utils`: zero_to_fp32 (a checkpoint's consolidated fp32 weights)."""

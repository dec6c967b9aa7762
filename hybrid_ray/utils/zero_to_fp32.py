"""`deepspeed.utils.zero_to_fp32` (hybrid_ray/compat/zero_to_fp32.py); also a script:
`python -m hybrid_ray.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [-t TAG]`."""
import sys

from ..compat.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                   get_fp32_state_dict_from_zero_checkpoint,
                                   load_state_dict_from_zero_checkpoint, main)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())

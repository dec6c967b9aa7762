"""Former name of jobs/train_lm.py, kept as an alias (`hybrid-ray train`'s help still names it).

    python jobs/train_local.py --config jobs/configs/small_cpu.json   # same as train_lm.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybrid_ray.lm.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="train_local.py"))

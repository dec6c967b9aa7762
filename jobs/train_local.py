"""The main job: a short, real training run of the engine on this machine.

    python jobs/train_local.py --config jobs/configs/small_cpu.json [--nproc 2]

Trains a byte-level GPT on the Python standard library's .py sources with 2 data-parallel
processes (torchrun, gloo on CPU; the script re-launches itself under torchrun), logs loss, lr,
loss scale, grad norm and tokens/s, evaluates on held-out files, compares the final validation
loss with the unigram baseline and prints a generated sample. The job file holds three sections:
"engine" (the DeepSpeed-style config given to hybrid_ray.initialize unchanged), "model" and
"train" (see hybrid_ray/lm/job.py for every key). Under torchrun or Ray it trains as one rank.
Exit code: 0 trained and beat the baseline, 1 training failed, 2 bad job file.
"""
from __future__ import annotations

import os
import sys

# Runnable from a bare checkout as well as from the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybrid_ray.lm.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

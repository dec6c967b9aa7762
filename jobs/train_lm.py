"""The main job: train a GPT with the hybrid_ray engine on a token dataset, end to end.

    python jobs/train_lm.py --config jobs/configs/small_cpu.json [--nproc 2] [--resume]

Prepares the dataset named in the job file's "data" section when it is missing (Arrow shards
and a BPE tokenizer built from the Python standard library by default; jobs/prepare_data.py does
the same on its own), then trains with N data-parallel processes (the script re-launches itself
under torchrun: gloo on CPU, one GPU per process on CUDA; under torchrun or Ray it trains as one
rank). Logs training and validation loss (and train.out_dir/metrics.jsonl), writes checkpoints to
train.out_dir/checkpoints, resumes from the newest with --resume (at any number of processes),
compares the final validation loss with the unigram baseline and prints a generated sample.
Sections and every key: hybrid_ray/lm/job.py. Exit code: 0 trained and beat the baseline,
1 training failed, 2 bad job file or data source.
"""
from __future__ import annotations

import os
import sys

# Runnable from a bare checkout as well as from the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybrid_ray.lm.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""The local language-model job: byte-level GPT on the Python standard library's sources.

    jobs/train_local.py --config jobs/configs/small_cpu.json    # or: hybrid-ray train CONFIG

stdlib_bytes.py builds the data, job.py reads the job file, loop.py trains (one rank), launch.py
validates and starts the ranks with torchrun.
"""

"""Build a token dataset (Arrow shards + tokenizer.json + meta.json) from a folder of text.

    python jobs/prepare_data.py --config jobs/configs/small_cpu.json    # the job's data section
    python jobs/prepare_data.py --out data/mine --source ~/notes --tokenizer bytes --max-bytes 2e6

Without --source the text is this Python's standard library (sources and the reference docs in
pydoc_data/): nothing to download. Options and defaults: hybrid_ray/data/corpus.py (CorpusSpec).
An existing complete dataset with the same settings is kept; --force rebuilds it. Exit code 0,
or 2 with a one-line error.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybrid_ray.lm.prepare_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

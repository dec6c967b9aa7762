"""Data for the engine: Arrow token datasets and a sampler resumable by global sample index.

    shards.py     token shards as Arrow IPC files, memory-mapped; TokenDataset (fixed windows)
    sampler.py    GlobalBatchSampler: seeded per-epoch order, split by rank, {epoch, position, seed}
    dataloader.py ResumableLoader and build_dataloader (what initialize(training_data=) returns)
    corpus.py     CorpusSpec and the files of a source folder (default: Python's stdlib), split
    tokenizer.py  byte-level BPE (Hugging Face `tokenizers`) or raw bytes
    prepare.py    corpus -> tokenizer -> shards -> meta.json (jobs/prepare_data.py)
"""
from .corpus import CorpusSpec
from .dataloader import ResumableLoader, build_dataloader
from .prepare import ensure_prepared, load_tokenizer, open_split, prepare, read_meta
from .sampler import GlobalBatchSampler, split_global_batch
from .shards import ShardRef, TokenDataset

__all__ = ["build_dataloader", "ResumableLoader", "GlobalBatchSampler", "split_global_batch",
           "TokenDataset", "ShardRef", "CorpusSpec", "prepare", "ensure_prepared", "read_meta",
           "open_split", "load_tokenizer"]

"""Reference models used by the jobs, the benchmark and the tests."""
from .gpt import GPT, GPTConfig, GPT_SIZES

__all__ = ["GPT", "GPTConfig", "GPT_SIZES"]

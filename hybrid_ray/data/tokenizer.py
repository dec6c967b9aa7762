"""Tokenizers: byte-level BPE trained locally with Hugging Face `tokenizers`, or raw bytes.

Both work on bytes in and text out and reserve one end-of-text token, placed between documents
so the model learns where a file ends. BPE is trained on the training split only, so validation
text is never part of the tokenizer either.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Sequence, Union

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """Token = byte value (0-255); 256 is end-of-text."""

    kind = "bytes"
    vocab_size = 257
    eot_id = 256

    def encode_batch(self, docs: Sequence[bytes]) -> List[List[int]]:
        return [list(d) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A trained `tokenizers.Tokenizer` (byte-level BPE); text is decoded from UTF-8 first."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(EOT)

    @classmethod
    def train(cls, docs: Sequence[bytes], vocab_size: int) -> "BPETokenizer":
        """GPT-2-style byte-level BPE: every byte is in the initial alphabet, so any text encodes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((_text(d) for d in docs), trainer, length=len(docs))
        return cls(tok)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def to_str(self) -> str:
        return self.tok.to_str()

    def encode_batch(self, docs: Sequence[bytes]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch([_text(d) for d in docs])]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([i for i in ids if i != self.eot_id])


def _text(doc: bytes) -> str:
    # Byte-level BPE encodes str as UTF-8 bytes; the rare invalid byte becomes U+FFFD.
    return doc.decode("utf-8", errors="replace")


Tokenizer = Union[ByteTokenizer, BPETokenizer]

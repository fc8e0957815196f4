"""The tokenizer a run uses: the model folder's own, else memkit's byte-level tokenizer.

memkit's tokenizer needs no download and no training: token id == byte value (0-255) plus
two special tokens, built with the `tokenizers` library (a byte-level BPE with no merges).
Any text round-trips exactly, and every model whose vocabulary has >= 258 entries can use it.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from memkit.errors import MemkitError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTE_VOCAB_SIZE = 258
"""256 byte tokens + <|endoftext|> (256) + <|pad|> (257)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable unicode character, the table GPT-2's byte-level BPE uses
    (openai/gpt-2: src/encoder.py, bytes_to_unicode); the `tokenizers` ByteLevel
    pre-tokenizer applies the same table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(ch) for byte, ch in zip(printable, chars)}


@lru_cache(maxsize=1)
def byte_tokenizer():
    """memkit's byte-level tokenizer as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                  bos_token=EOS_TOKEN, model_max_length=1 << 30)
    if len(tok) != BYTE_VOCAB_SIZE:  # a tokenizers release that numbers specials differently
        raise RuntimeError(f"byte tokenizer has {len(tok)} tokens, expected {BYTE_VOCAB_SIZE}")
    return tok


def has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in _TOKENIZER_FILES)


def load_tokenizer(model_source: Path | None, *, vocab_size: int, require_eos: bool = True):
    """The model folder's tokenizer when it has one, else memkit's byte tokenizer.

    `vocab_size` is the model's embedding rows: every token id must index one. require_eos=False: a
    classifier's (BERT's WordPiece tokenizer has [CLS]/[SEP] and no eos; nothing is closed by one).
    """
    if model_source is not None and has_tokenizer(model_source):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_source))
        if tok.pad_token_id is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
    else:
        tok = byte_tokenizer()
    if len(tok) > vocab_size:
        raise MemkitError(
            f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab_size}; "
            f"use a model with vocab_size >= {len(tok)} or put a matching tokenizer in the model folder")
    if tok.eos_token_id is None and require_eos:
        raise MemkitError(f"the tokenizer in {model_source} has no eos token; set eos_token in its "
                          "tokenizer_config.json")
    return tok

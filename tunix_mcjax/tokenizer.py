"""Tokenizers that load offline: a char-level one for tiny tasks, or a local HF tokenizer dir."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character. Ids: pad=0, bos=1, eos=2 (BOS must be non-zero)."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD
    )


def load_tokenizer(tokenizer_type: str, tokenizer_path: str = ""):
    """`tokenizer_path` is a local HF tokenizer dir, or the name of one shipped in MaxText's wheel
    (`qwen3-tokenizer`), as MaxText's own `tokenizer_path` takes it."""
    if tokenizer_type == "char":
        return char_tokenizer()
    from tunix_mcjax.maxtext.data import resolve_tokenizer_path

    return AutoTokenizer.from_pretrained(resolve_tokenizer_path(tokenizer_path))

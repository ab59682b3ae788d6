"""Tokenizers that load offline: a char-level one for tiny tasks, or a local HF tokenizer dir."""

from __future__ import annotations

import os
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tunix_mcjax.config import ConfigError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
UNK = "<unk>"  # not in the char vocabulary: an unknown character is an error, never pad
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character. Ids: pad=0, bos=1, eos=2 (BOS must be non-zero). Encoding a
    character outside CHARS raises (see `unknown_characters` for a message naming them)."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS)


def unknown_characters(tokenizer, text: str) -> str:
    """The characters of `text` a vocabulary-only tokenizer (the char one) has no token for."""
    vocab = tokenizer.get_vocab()
    return "".join(sorted({c for c in text if c not in vocab}))


def resolve_tokenizer_path(path: str) -> str:
    """`path` as given, or the tokenizer of that name shipped in MaxText's wheel.

    MaxText looks names such as `qwen3-tokenizer` up under MAXTEXT_ASSETS_ROOT, which points
    outside the package in a wheel install; this looks in the package's own `assets/tokenizers`.
    """
    if os.path.exists(path):
        return path
    import maxtext

    shipped = os.path.join(os.path.dirname(maxtext.__file__), "assets", "tokenizers",
                           os.path.basename(path))
    return shipped if os.path.isdir(shipped) else path


def load_tokenizer(tokenizer_type: str, tokenizer_path: str = ""):
    """`tokenizer_path` is a local HF tokenizer dir, or the name of one shipped in MaxText's wheel
    (`qwen3-tokenizer`), as MaxText's own `tokenizer_path` takes it."""
    if tokenizer_type == "char":
        return char_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(resolve_tokenizer_path(tokenizer_path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer_path={tokenizer_path!r} does not load as a Hugging Face "
                          f"tokenizer ({e}). Point it at a local directory holding "
                          "tokenizer.json or tokenizer_config.json.") from e

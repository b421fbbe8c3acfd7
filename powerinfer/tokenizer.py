"""Tokenizer and chat template, from GGUF metadata or an HF directory, through transformers.

For GGUF files transformers converts the embedded vocabulary into a fast `tokenizers`
tokenizer (no hand-written BPE here). That conversion takes seconds, so the result is
saved once per model content hash under the cache directory and reloaded from there.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterable

from .errors import BadArgumentError, ModelFileError
from .paths import cache_dir, content_hash


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end a generation."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()):
        self.hf = hf_tokenizer
        ids = set(int(i) for i in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the prompt")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a conversation, ending where the assistant's reply begins."""
        if not self.has_chat_template:
            raise BadArgumentError("this model has no chat template; use `generate` with a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already holds the special tokens (BOS etc.).
        return self.encode(self.chat_prompt(messages), add_special_tokens=False)


def check_text(text: str, what: str) -> None:
    """Refuse text that is not Unicode: bytes that were not UTF-8 (Python hands them over as
    lone surrogates, from argv or stdin) or a lone surrogate from a JSON escape."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            code = ord(ch)
            detail = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
            raise BadArgumentError(f"{what} is not valid UTF-8 text ({detail} at character {i})")


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


# `tokenizer.ggml.pre` values whose text llama.cpp cuts into single digits before the GPT-2
# split (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA),
# as these models' own tokenizer.json do with a Digits pre-tokenizer; transformers' GGUF
# conversion leaves the digits with the GPT-2 split alone (" 2007" one piece instead of " ", "2", ...)
DIGIT_SPLIT_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"})


def _gguf_model_type(metadata: dict) -> str:
    """The transformers model type of a GGUF file's architecture, as transformers'
    `load_gguf_checkpoint` names it for the architectures the loader takes (the same name, but
    llama.cpp files Mistral as llama)."""
    arch = str(metadata.get("general.architecture", ""))
    if "llama" in arch and "mistral" in str(metadata.get("general.name", "")):
        return "mistral"
    return arch


def _tokenizer_from_gguf(model_path: str, metadata: dict) -> Any:
    """The tokenizer transformers builds from the GGUF's vocabulary, of the class AutoTokenizer
    picks for the model type. Why not AutoTokenizer itself: to pick that class it reads the
    model's whole config with gguf's pure-Python reader (every vocabulary entry a numpy view),
    ~5 s of a ~5.5 s build for a 49k vocabulary; the tokenizer class reads only its fields
    (tests/test_tokenizer_gguf.py checks both give the same saved tokenizer)."""
    from transformers import AutoConfig, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    config = AutoConfig.for_model(_gguf_model_type(metadata))
    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return tokenizer_class.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                           gguf_file=os.path.basename(model_path))


def _match_llama_cpp_split(hf: Any, metadata: dict) -> None:
    """Make `hf` (built by transformers from a GGUF file with `metadata`) split text as llama.cpp
    does with the same metadata, where transformers' conversion does not:
    - `tokenizer.ggml.pre` naming a digit-splitting pre-tokenizer (DIGIT_SPLIT_PRE);
    - a sentencepiece vocabulary with the space prefix (the default): sentencepiece and
      llama.cpp always prepend it, transformers' Metaspace not to text that starts with a
      space ("  GNU" must be three spaces' worth of pieces, not two)."""
    from tokenizers import normalizers, pre_tokenizers

    backend = hf.backend_tokenizer
    if metadata.get("tokenizer.ggml.model") == "gpt2" and metadata.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if (metadata.get("tokenizer.ggml.model") == "llama" and metadata.get("tokenizer.ggml.add_space_prefix", True)
            and isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace)):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None


def load_tokenizer(model_path: str, eos_token_ids: Iterable[int] = ()) -> Tokenizer | None:
    """The model's tokenizer, or None for an HF directory that ships none."""
    # AutoTokenizer only where it is used: its import (the auto classes' tables) took 1.3 s of
    # a 5 s `generate` on a GGUF file whose tokenizer is saved already
    from transformers import PreTrainedTokenizerFast

    _quiet_transformers()
    if os.path.isdir(model_path):
        if not any(os.path.isfile(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        from transformers import AutoTokenizer

        try:
            return Tokenizer(AutoTokenizer.from_pretrained(model_path), eos_token_ids)
        except Exception as e:  # transformers raises JSON, OS, value and key errors on bad files
            detail = " ".join(str(e).split())[:200]
            raise ModelFileError(f"{model_path}: cannot load the tokenizer ({type(e).__name__}: {detail})") from None
    # v3: split as llama.cpp splits (_match_llama_cpp_split); earlier saves split otherwise
    saved = cache_dir() / "tokenizers-v3" / content_hash(model_path)
    if (saved / "tokenizer.json").is_file():
        # the saved pipeline as it is: AutoTokenizer would pick the architecture's class
        # (Qwen2Tokenizer), which rebuilds its own pre-tokenizer over a sentencepiece vocabulary
        return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(saved)), eos_token_ids)
    from .formats.gguf_check import read_header

    metadata = read_header(model_path, os.path.getsize(model_path)).metadata
    try:
        hf = _tokenizer_from_gguf(model_path, metadata)
    except (ValueError, KeyError, OSError) as e:
        raise ModelFileError(f"{model_path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    _match_llama_cpp_split(hf, metadata)
    tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
    hf.save_pretrained(str(tmp))
    if saved.exists():  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, saved)
    return Tokenizer(hf, eos_token_ids)

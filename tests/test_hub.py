"""`-m org/name` through huggingface_hub's cache, offline, with the cache laid out the way
huggingface_hub lays it out (blobs, snapshot symlinks, refs/main)."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
from cli_helpers import assert_clean_error, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(hub: os.PathLike, repo: str, model_dir) -> None:
    """models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/main}."""
    root = os.path.join(hub, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(root, "blobs"))
    os.makedirs(os.path.join(root, "refs"))
    snapshot = os.path.join(root, "snapshots", COMMIT)
    os.makedirs(snapshot)
    for name in os.listdir(model_dir):
        with open(os.path.join(model_dir, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(root, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)


def run_with(env: dict, *args: str):
    """run_cli with `env` set (a None value: unset)."""
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        return run_cli(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


FLAGS = ("-p", "Hello", "-n", "6", "--temperature", "0")


@pytest.fixture(scope="module")
def direct_output(chat_model_dir) -> str:
    """What the model generates when named by its path (each hub case must print the same)."""
    return run_cli("generate", "-m", str(chat_model_dir), *FLAGS).stdout


@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_loads_from_the_cache_offline(chat_model_dir, direct_output, tmp_path, where):
    hub = tmp_path / "hub" if where == "HF_HUB_CACHE" else tmp_path / "home" / "hub"
    lay_out_cache(hub, "tiny-org/tiny-chat", chat_model_dir)
    env = {"HF_HUB_OFFLINE": "1", where: str(hub if where == "HF_HUB_CACHE" else tmp_path / "home")}
    if where == "HF_HOME":
        env["HF_HUB_CACHE"] = None  # let HF_HOME decide
    r = run_with(env, "generate", "-m", "tiny-org/tiny-chat", *FLAGS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == direct_output
    if where == "HF_HUB_CACHE":  # the refusal is the same whichever variable names the cache
        assert_clean_error(run_with(env, "generate", "-m", "tiny-org/not-cached", "-p", "hi"),
                           "not in the Hugging Face cache")


def test_a_repository_without_config_says_how_to_name_a_gguf_file(chat_model_dir, tmp_path):
    files = tmp_path / "files"
    shutil.copytree(chat_model_dir, files)
    os.remove(files / "config.json")
    lay_out_cache(tmp_path / "hub", "org/gguf-only", files)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    assert_clean_error(run_with(env, "generate", "-m", "org/gguf-only", "-p", "hi"), "-m org/gguf-only/FILE.gguf")

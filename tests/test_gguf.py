"""GGUF paths (grpokit/policy/gguf.py) without a real model: which path names a GGUF file, where the cache is,
what resolve() returns, that a converted folder is reused, and the error when the gguf packages are missing.
The real conversion and the model it gives are tests/test_real_model.py's."""

import importlib.util
import json
import stat
import subprocess
import sys
import textwrap

import pytest

import grpokit.policy.gguf as gguf
from grpokit.policy import ModelLoadError, load_model, load_tokenizer
from grpokit.policy.gguf import (
    SOURCE_FILE,
    GGUFError,
    cache_root,
    complete,
    file_sha256,
    gguf_file,
    resolve,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty GGUF cache of this test's own ($GRPOKIT_CACHE)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("GRPOKIT_CACHE", str(root))
    return root


def fake_gguf(path, content=b"not a real model", tensor=None):
    """A GGUF file that is no model: its metadata holds `content` (two contents hash apart), and `tensor`
    (a numpy array) when given."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("test.content", content.decode())
    if tensor is not None:
        writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cut(path, size: int):
    """The file cut to its first `size` bytes, as an interrupted download leaves it."""
    path.write_bytes(path.read_bytes()[:size])
    return path


def never_convert(gguf_path, out, *, key="model.name_or_path"):
    raise AssertionError(f"converted {gguf_path} again")


# --------------------------------------------------------------------------- gguf_file


def test_a_gguf_file_is_itself_and_another_file_is_none(tmp_path):
    model = fake_gguf(tmp_path / "SmolLM2.Q4_1.gguf")
    upper = fake_gguf(tmp_path / "other" / "MODEL.GGUF")
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    assert gguf_file(str(model)) == model
    assert gguf_file(str(upper)) == upper
    assert gguf_file(str(tmp_path / "weights.safetensors")) is None


def test_a_folder_with_one_gguf_file_is_that_file(tmp_path):
    model = fake_gguf(tmp_path / "m" / "SmolLM2.Q4_1.gguf")
    (tmp_path / "m" / "README.md").write_text("a model")
    assert gguf_file(str(tmp_path / "m")) == model


def test_a_hugging_face_folder_a_folder_without_gguf_and_a_hub_id_are_none(tmp_path):
    fake_gguf(tmp_path / "hf" / "model.gguf")
    (tmp_path / "hf" / "config.json").write_text("{}")  # a model folder that also holds a GGUF file
    (tmp_path / "empty").mkdir()
    assert gguf_file(str(tmp_path / "hf")) is None
    assert gguf_file(str(tmp_path / "empty")) is None
    assert gguf_file("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def test_a_folder_with_two_gguf_files_names_both_and_asks_to_name_one(tmp_path):
    fake_gguf(tmp_path / "m" / "a.Q4_1.gguf")
    fake_gguf(tmp_path / "m" / "b.Q8_0.gguf")
    with pytest.raises(GGUFError) as err:
        gguf_file(str(tmp_path / "m"), key="reward_model.name_or_path")
    message = str(err.value)
    assert "reward_model.name_or_path=" in message
    assert "a.Q4_1.gguf" in message and "b.Q8_0.gguf" in message
    assert "name one of them" in message


# --------------------------------------------------------------------------- cache_root


def test_cache_root_is_grpokit_cache_then_xdg_cache_home_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GRPOKIT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "grpokit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "grpokit"
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.setenv("GRPOKIT_CACHE", "")  # set but empty: as if unset
    assert cache_root() == tmp_path / "xdg" / "grpokit"


# --------------------------------------------------------------------------- resolve


def test_resolve_returns_a_hub_id_and_a_hugging_face_folder_unchanged(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(gguf, "convert", never_convert)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve(str(tmp_path / "hf")) == str(tmp_path / "hf")
    assert not cache.exists()


def test_resolve_reuses_a_converted_folder_without_converting_again(tmp_path, cache, monkeypatch):
    model = fake_gguf(tmp_path / "m" / "model.gguf")
    folder = cache / "gguf" / file_sha256(model)[:16]
    folder.mkdir(parents=True)
    (folder / SOURCE_FILE).write_text(json.dumps({"source": str(model)}) + "\n")
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w")
    monkeypatch.setattr(gguf, "convert", never_convert)
    assert resolve(str(model)) == str(folder)
    assert resolve(str(tmp_path / "m")) == str(folder)  # the folder holding it: the same copy


def test_a_cached_folder_without_its_weights_is_converted_again_and_replaced(tmp_path, cache, monkeypatch):
    """As a rank other than 0 once left it (transformers wrote the model on rank 0 only): the tokenizer and
    the source record, no config or weights."""
    model = fake_gguf(tmp_path / "model.gguf")
    folder = cache / "gguf" / file_sha256(model)[:16]
    folder.mkdir(parents=True)
    (folder / SOURCE_FILE).write_text(json.dumps({"source": str(model)}) + "\n")
    (folder / "tokenizer.json").write_text("{}")

    def fake_convert(gguf_path, out, *, key="model.name_or_path"):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(gguf, "convert", fake_convert)
    assert resolve(str(model)) == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", SOURCE_FILE, "model.safetensors"]
    assert [p.name for p in (cache / "gguf").iterdir()] == [folder.name]


SAVE_ON_RANK_1 = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch.distributed as dist
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from grpokit.policy.gguf import complete, save

    dist.init_process_group("gloo")
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    out = Path(sys.argv[1]) / f"rank{dist.get_rank()}"
    save(LlamaForCausalLM(config), AutoTokenizer.from_pretrained(sys.argv[2]), out)
    assert complete(out, record=False), sorted(p.name for p in out.iterdir())
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_every_rank_of_a_torchrun_writes_its_converted_folder_whole(tmp_path, tiny_model_dir):
    """Two ranks resolving an unconverted file both convert; rank 1's folder may be the one kept, so it must
    hold the weights (transformers' save_pretrained writes them on rank 0 only under torch.distributed)."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_ON_RANK_1)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*launch, str(script), str(tmp_path), str(tiny_model_dir)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert complete(tmp_path / "rank0", record=False) and complete(tmp_path / "rank1", record=False)


def test_resolve_converts_once_into_a_folder_keyed_by_the_hash_that_others_can_read(
    tmp_path, cache, monkeypatch
):
    """The first resolve converts (into a temporary folder, renamed into place with its source record);
    the second finds it. Another file (another hash) gets a folder of its own."""
    calls = []

    def fake_convert(gguf_path, out, *, key="model.name_or_path"):
        calls.append(gguf_path)
        (out / "config.json").write_text("{}")
        weights = out / "model.safetensors"
        weights.write_bytes(b"w")
        weights.chmod(0o600)  # as transformers writes it (a temporary file renamed)

    monkeypatch.setattr(gguf, "convert", fake_convert)
    model = fake_gguf(tmp_path / "model.gguf")
    sha = file_sha256(model)
    folder = resolve(str(model))
    assert folder == str(cache / "gguf" / sha[:16])
    assert resolve(str(model)) == folder and calls == [model]
    record = json.loads((cache / "gguf" / sha[:16] / SOURCE_FILE).read_text())
    assert record["sha256"] == sha and record["source"] == str(model.resolve())
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [sha[:16]]  # no temporary folder left
    for path in [cache / "gguf" / sha[:16], *(cache / "gguf" / sha[:16]).iterdir()]:
        assert path.stat().st_mode & stat.S_IROTH, path  # a shared cache: readable by every user

    other = fake_gguf(tmp_path / "other.gguf", b"another model")
    assert resolve(str(other)) == str(cache / "gguf" / file_sha256(other)[:16]) != folder
    assert calls == [model, other]


# --------------------------------------------------------------------------- a file cut short


def test_a_file_cut_inside_its_header_or_its_tensors_is_named_truncated(tmp_path, cache, monkeypatch):
    """An interrupted download: transformers' reader would raise struct.error (cut in the metadata) or a
    reshape error that blames the architecture (cut in the tensor data); resolve names the file truncated."""
    import numpy as np

    monkeypatch.setattr(gguf, "convert", never_convert)
    whole = fake_gguf(tmp_path / "whole.gguf", tensor=np.zeros((16, 4), np.float32))
    size = whole.stat().st_size
    header = cut(fake_gguf(tmp_path / "header.gguf", tensor=np.zeros((16, 4), np.float32)), 40)
    with pytest.raises(GGUFError) as err:
        resolve(str(header))
    assert str(err.value) == (
        f"model.name_or_path={str(header)!r} is truncated or damaged: its header (metadata and tensor list) "
        "cannot be read in its 40 bytes; download or copy it again"
    )
    data = cut(fake_gguf(tmp_path / "data.gguf", tensor=np.zeros((16, 4), np.float32)), size - 100)
    with pytest.raises(GGUFError) as err:
        resolve(str(data), key="reward_model.name_or_path")
    assert str(err.value) == (
        f"reward_model.name_or_path={str(data)!r} is truncated: its tensors end at byte {size:,} but the "
        f"file has {size - 100:,} bytes ({(size - 100) / size:.0%}); download or copy it again"
    )
    assert not cache.exists()  # nothing converted, nothing left in the cache


# --------------------------------------------------------------------------- missing packages


def test_missing_gguf_package_is_a_model_load_error_naming_the_extra(tmp_path, cache, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def without_gguf(name, *args, **kwargs):
        return None if name == "gguf" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_gguf)
    monkeypatch.setattr(gguf, "convert", never_convert)
    model = fake_gguf(tmp_path / "model.gguf")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError) as err:
            load(str(model))
        assert "needs gguf: pip install 'grpokit[gguf]'" in str(err.value)  # only the missing one

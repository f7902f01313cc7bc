"""Shared fixtures: a tiny real Llama model + character tokenizer, saved and loaded with from_pretrained."""

from collections import Counter

import pytest
import torch

# Tiny models are overhead-bound: one thread is faster than two, and steadier on a busy machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The modules with the most slow tests first, each module's tests in their order. make test splits the
    suite over processes a module at a time (pytest-xdist, --dist loadscope): the long modules start early
    and the short ones fill in at the end, so the processes finish together."""
    slow = Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])  # stable: ties keep collection order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialized ~100k-parameter Llama with the built-in tasks' tokenizer, on disk."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_model")
    tok = build_tokenizer(get_task("countdown"), path)
    model = build_tiny_llama(tok, size="test", seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny Llama with head size 64 (vLLM's CPU attention has no 24) and the same tokenizer, on disk; one
    per test module, as the vLLM and server tests build their engines on it."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama_hd64")
    tok = build_tokenizer(get_task("countdown"), path)
    build_tiny_llama(tok, size="test", seed=0, config={"head_dim": 64}).save_pretrained(path)
    tok.save_pretrained(path)
    return path

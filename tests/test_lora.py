"""LoRA with the real peft package (model.lora, docs/lora.md): pi_ref is the base model with the adapter off,
only the adapters train, checkpoints hold the adapter and resume exactly, final/ (and final/merged/) load.

Run: .venv/bin/python -m pytest tests/test_lora.py
"""

import pytest
import torch

from tests.helpers import read_metrics, require, tiny_config

require("peft")  # in the test extra: make test installs it

from peft import PeftModel  # noqa: E402 (after require("peft"))
from transformers import AutoModelForCausalLM  # noqa: E402 (after require("peft"))

from grpokit.checkpoint import list_checkpoints  # noqa: E402 (after require("peft"))
from grpokit.data.batch import pack_sequences  # noqa: E402 (after require("peft"))
from grpokit.data.micro_batches import MicroBatching  # noqa: E402
from grpokit.policy import AdapterOff, batched_logprobs, build_reference, load_policy  # noqa: E402 (after require("peft"))
from grpokit.trainer import Trainer  # noqa: E402 (after require("peft"))

# The LM head among the targets: a random tiny model learns count_sevens in a few steps through it; all-linear
# (every Linear but the head) learns it too, more slowly (docs/lora.md).
LORA = [
    "model.lora.r=8",
    "model.lora.alpha=16",
    "model.lora.target_modules=[q_proj,v_proj,down_proj,lm_head]",
]


def config(model_dir, out, *extra):
    return tiny_config(model_dir, out, "optim.learning_rate=1e-2", "algorithm.beta=0.04", *LORA, *extra)


def some_tokens(tokenizer):
    prompts = [tokenizer("3 4 5>12=")["input_ids"], tokenizer("1 2>3=")["input_ids"]]
    completions = [
        tokenizer("3+4+5", add_special_tokens=False)["input_ids"],
        tokenizer("1+2", add_special_tokens=False)["input_ids"],
    ]
    return pack_sequences(prompts, completions, tokenizer.pad_token_id)


def lora_params(model):
    return {n for n, p in model.named_parameters() if "lora_" in n}


def test_reference_is_the_base_model_with_the_adapter_off(tiny_model_dir):
    cfg = config(tiny_model_dir, "unused")
    model, tok = load_policy(cfg.model)
    assert isinstance(model, PeftModel)
    with torch.no_grad():  # B starts at 0 (the adapter is a no-op): make it change the model
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    ref = build_reference(model, cfg.algorithm)
    assert isinstance(ref, AdapterOff) and ref.policy is model  # no second copy of the weights
    tokens = some_tokens(tok)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref_logp = batched_logprobs(ref, tokens, MicroBatching(2))
    base_logp = batched_logprobs(base, tokens, MicroBatching(2))
    policy_logp = batched_logprobs(model, tokens, MicroBatching(2))
    mask = tokens.completion_mask.bool()
    torch.testing.assert_close(ref_logp[mask], base_logp[mask], rtol=0, atol=1e-6)
    assert (
        policy_logp[mask] - base_logp[mask]
    ).abs().max() > 1e-2  # the adapter is on outside the reference pass
    with model.disable_adapter():  # the context gives the adapter back on the way out
        pass
    torch.testing.assert_close(batched_logprobs(model, tokens, MicroBatching(2)), policy_logp, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_lora_learns_trains_only_the_adapter_and_saves_loadable_models(tiny_model_dir, tmp_path, engine):
    out = tmp_path / "run"
    trainer = Trainer(
        config(
            tiny_model_dir,
            out,
            "optim.max_steps=20",
            "checkpoint.save_every=0",
            f"rollout.engine={engine}",
            "model.lora.merge_on_save=true",
        )
    )
    trained = {
        n
        for g in trainer.optimizer.adamw.param_groups
        for p in g["params"]
        for n, q in trainer.model.named_parameters()
        if p is q
    }
    assert trained == lora_params(trainer.model) and trained  # the optimizer holds the adapters only
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rewards = [r["reward/mean"] for r in read_metrics(out) if "reward/mean" in r]
    assert len(rewards) == 20
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)
    kl = [r["policy/kl"] for r in read_metrics(out) if "policy/kl" in r]
    assert kl[0] == 0 and max(kl) > 0  # pi_ref (adapter off) == pi_theta at the start, then they part
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= lora_params(trainer.model), sorted(changed - lora_params(trainer.model))[:3]

    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    tokens = some_tokens(trainer.tokenizer)
    want = batched_logprobs(trainer.model, tokens, MicroBatching(2))
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final)
    auto = AutoModelForCausalLM.from_pretrained(
        final
    )  # transformers reads adapter_config.json: base + adapter
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")  # a plain transformers model
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    mask = tokens.completion_mask.bool()
    for loaded in (adapter, auto, merged):
        torch.testing.assert_close(
            batched_logprobs(loaded, tokens, MicroBatching(2))[mask], want[mask], rtol=0, atol=1e-5
        )


class Crash(Exception):
    pass


@pytest.mark.slow
def test_lora_resume_continues_exactly(tiny_model_dir, tmp_path):
    steps = [
        "optim.max_steps=5",
        "checkpoint.save_every=2",
        "checkpoint.keep_last=5",
        "algorithm.num_iterations=2",
    ]
    straight = Trainer(config(tiny_model_dir, tmp_path / "a", *steps))
    straight.train()

    def crash_at_3(step, metrics):
        if step == 3:
            raise Crash

    with pytest.raises(Crash):
        Trainer(config(tiny_model_dir, tmp_path / "b", *steps)).train(on_log=crash_at_3)
    ckpt = tmp_path / "b" / "checkpoints" / "step-000002"
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [2]
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    saved = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert len(saved["optimizer"]["state"]) == len(
        lora_params(straight.model)
    )  # moments of the adapters only

    resumed = Trainer(config(tiny_model_dir, tmp_path / "b", *steps))
    resumed.train()
    assert resumed.step == 5
    for (n, p), (_, q) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n  # bit for bit the uninterrupted run
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]

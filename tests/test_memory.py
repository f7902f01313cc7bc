"""model.gradient_checkpointing=auto (grpokit/policy/memory.py): the activation estimate against what a
training forward really saves for its backward, the plan's choice of layers with worked numbers, and runs
where it turns checkpointing on (same numbers) or leaves it off."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.policy.memory import GIB, Plan, checkpointing_plan, sizes
from grpokit.trainer import Trainer
from tests.helpers import read_metrics
from tests.helpers import tiny_config as config

# SmolLM2-135M's shape: 30 layers, hidden 576, MLP 1536, vocabulary 49,152
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, vocab_size=49152)


def llama(device: str = "cpu", **sizes_) -> LlamaForCausalLM:
    cfg = dict(num_attention_heads=4, num_key_value_heads=2, **sizes_)
    if sizes_["hidden_size"] == 576:
        cfg.update(num_attention_heads=9, num_key_value_heads=3)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**cfg))


def saved_activation_bytes(model, ids: torch.Tensor) -> int:
    """What a training forward (logits, then their log-softmax) keeps for its backward: the bytes of every
    distinct storage autograd saves, the parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, use_cache=False).logits.log_softmax(-1).mean()
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("every_n_layers", [0, 1, 2])  # 0: no checkpointing
def test_the_estimate_bounds_what_the_forward_saves_from_above_within_a_third(every_n_layers):
    model = llama(hidden_size=64, num_hidden_layers=4, intermediate_size=176, vocab_size=100).train()
    if every_n_layers:
        model.gradient_checkpointing_enable(every_n_layers=every_n_layers)
    rows, tokens = 4, 64
    saved = saved_activation_bytes(model, torch.randint(0, 100, (rows, tokens)))
    s = sizes(model, rows, tokens)
    assert s is not None
    checkpointed = 0 if not every_n_layers else -(-4 // every_n_layers)
    estimate = s.kept(rows, tokens, checkpointed)
    assert saved <= estimate <= 1.34 * saved, (saved, estimate)


def test_sizes_worked_numbers_for_smollm2():
    """A layer keeps (12 x 576 + 5 x 1536) x 4 = 58,368 bytes a token (fp32), its input 576 x 4 = 2,304; 32
    rows of 316 tokens: 10,112 tokens; their logits (497M elements) take the fused path, so the whole-logits
    term stops at its threshold, 3 x 64 Mi x 4 bytes."""
    s = sizes(llama("meta", **SMOLLM2), 32, 316)
    assert s is not None
    assert (s.layers, s.layer, s.layer_input, s.logits) == (30, 58368, 2304, 805_306_368)
    assert s.kept(32, 316, 0) == 10112 * 30 * 58368 + 805_306_368 == 18_511_822_848  # 17.2 GiB
    assert s.kept(32, 316, 15) == 10112 * 15 * (58368 + 2304) + 805_306_368 == 10_008_035_328


@pytest.mark.parametrize(
    "left, every_n_layers",
    [
        (40_000_000_000, None),  # 18.5 GB <= 20 GB: it fits
        (21_000_000_000, 2),  # 15 layers checkpointed: 10.01 GB <= 10.5 GB; 10 layers (n = 3): 12.8 GB
        (20_000_000_000, 1),  # 10.01 GB > 10 GB: every layer
        (0, 1),  # nothing fits: every layer, the least that can be kept
    ],
)
def test_the_plan_checkpoints_the_fewest_layers_that_fit(left, every_n_layers):
    plan = checkpointing_plan(llama("meta", **SMOLLM2), 32, 316, left=left)
    if every_n_layers is None:
        assert plan is None
        return
    assert plan is not None and plan.every_n_layers == every_n_layers
    assert plan.whole == 18_511_822_848 and plan.left == left
    if every_n_layers == 2:
        assert plan.kept == 10_008_035_328
        assert str(plan) == (
            "checkpointing 1 decoder layer in 2: a micro-batch of 32 sequences x 316 tokens would keep about "
            "17.2 GiB of activations, more than 50% of the 19.6 GiB left; now about 9.3 GiB"
        )


def test_no_plan_for_a_model_whose_config_does_not_say_its_sizes():
    model = torch.nn.Linear(4, 4)
    assert sizes(model, 8, 8) is None and checkpointing_plan(model, 8, 8, left=0) is None


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow
def test_auto_checkpoints_only_when_memory_is_short_and_changes_no_numbers(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Two steps of the tiny run three ways. auto with the machine's memory: nothing to checkpoint, nothing
    printed. auto with no memory left: every layer checkpointed, one line says why, and the weights are
    those of model.gradient_checkpointing=true bit for bit; its gradient norms are those of the run without
    checkpointing up to float rounding (the shared-prompt pass, which checkpointing turns off, sums in
    another order)."""
    import grpokit.components

    def run(name: str, *overrides: str) -> tuple[Trainer, dict[str, torch.Tensor]]:
        trainer = Trainer(config(tiny_model_dir, tmp_path / name, "optim.max_steps=2", *overrides))
        trainer.train()
        return trainer, weights(trainer)

    plain, plain_w = run("auto")
    assert not plain.model.is_gradient_checkpointing
    assert "gradient_checkpointing" not in capsys.readouterr().out
    forced, forced_w = run("true", "model.gradient_checkpointing=true")
    monkeypatch.setattr(grpokit.components, "memory_left", lambda model: 0)
    short, short_w = run("short")
    out = capsys.readouterr().out
    assert "model.gradient_checkpointing=auto: checkpointing every decoder layer: a micro-batch of" in out
    assert "0.0 GiB left" in out
    layers = short.model.model.layers
    assert short.model.is_gradient_checkpointing and all(layer.gradient_checkpointing for layer in layers)
    for k in plain_w:
        assert torch.equal(short_w[k], forced_w[k]), k
    # the gradient norms of both steps against the run without checkpointing (weights after AdamW are not
    # compared: its steps are about lr an element whatever the gradient's size, so rounding in a gradient
    # near zero moves a weight as much as a real difference would)
    norms = [[row["policy/grad_norm"] for row in read_metrics(tmp_path / name)] for name in ("short", "auto")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0][0] > 0.1


def test_every_n_layers_checkpoints_one_layer_in_n(tiny_model_dir):
    from grpokit.config import load_config
    from grpokit.policy import enable_checkpointing, is_checkpointing, load_policy

    model, _ = load_policy(load_config(None, [f"model.name_or_path={tiny_model_dir}"]).model)
    assert not is_checkpointing(model)
    enable_checkpointing(model, every_n_layers=2)
    assert is_checkpointing(model) and model.config.use_cache is False
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_plan_line_in_gib():
    plan = Plan(every_n_layers=1, rows=8, tokens=100, whole=3 * GIB, kept=GIB // 2, left=4 * GIB)
    assert str(plan) == (
        "checkpointing every decoder layer: a micro-batch of 8 sequences x 100 tokens would keep about "
        "3.0 GiB of activations, more than 50% of the 4.0 GiB left; now about 0.5 GiB"
    )

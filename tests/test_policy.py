"""Per-token log-probs of a padded batch equal those of each sequence alone."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.algo.fused import linear_logprobs
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11], [1, 2]]
COMPS = [[3, 4, 2], [12], [13, 14, 15, 16, 17]]


def test_pack_layout():
    b = pack_sequences(PROMPTS, COMPS, pad_id=0)
    assert b.input_ids.shape == (3, 6 + 5)
    assert b.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    # Row 0: 3 pads on the left, positions start at 0 on the first real token and never skip.
    assert b.attention_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    assert b.position_ids[0, 3:9].tolist() == [0, 1, 2, 3, 4, 5]


def test_padded_logprobs_equal_unpadded():
    model = tiny_llama()
    batch = pack_sequences(PROMPTS, COMPS, pad_id=0)
    logp, ent = completion_logprobs(model, batch, with_entropy=True)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPS, strict=True)):
        # Reference: the sequence alone, no padding, full log-softmax.
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        torch.testing.assert_close(logp[i, : len(c)], ref, rtol=1e-5, atol=1e-5)
        p_ = torch.softmax(logits.float(), -1)
        torch.testing.assert_close(ent[i, : len(c)], -(p_ * p_.log()).sum(-1), rtol=1e-4, atol=1e-5)


def test_row_subset_trims_padding_and_keeps_values():
    model = tiny_llama()
    batch = pack_sequences(PROMPTS, COMPS, pad_id=0)
    full, _ = completion_logprobs(model, batch)
    sub = batch.rows(torch.tensor([0, 2]))
    assert sub.input_ids.shape[1] < batch.input_ids.shape[1]
    part, _ = completion_logprobs(model, sub)
    torch.testing.assert_close(part, full[[0, 2], : part.shape[1]], rtol=1e-5, atol=1e-5)


def test_temperature_scales_logits():
    model = tiny_llama()
    batch = pack_sequences(PROMPTS[:1], COMPS[:1], pad_id=0)
    lp, _ = completion_logprobs(model, batch, temperature=0.7)
    ids = torch.tensor([PROMPTS[0] + COMPS[0]])
    logits = model(input_ids=ids).logits[0, 2:-1] / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(COMPS[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(lp[0], ref, rtol=1e-5, atol=1e-5)


def _grouped_batch(G=4):
    """3 prompts of different lengths x G completions of different lengths (some end early)."""
    g = torch.Generator().manual_seed(1)
    prompts, comps = [], []
    for p in PROMPTS:
        for _ in range(G):
            n = int(torch.randint(1, 7, (1,), generator=g))
            prompts.append(p)
            comps.append(torch.randint(3, 40, (n,), generator=g).tolist())
    return pack_sequences(prompts, comps, pad_id=0)


def _logp_and_grads(model, batch, share, fused=None, temperature=1.0):
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(
        model, batch, with_entropy=True, share_prompts=share, fused=fused, temperature=temperature
    )
    (logp * batch.completion_mask).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prompts_give_the_plain_pass_values_and_gradients(monkeypatch):
    """Each distinct prompt through the model once, its KV cache gathered to its G rows: same log-probs,
    entropies and parameter gradients as running every row's prompt + completion."""
    import grpokit.policy.logprobs as policy  # the module whose names the kernels look up

    model = tiny_llama().train()
    batch = _grouped_batch()
    plain = _logp_and_grads(model, batch, share=False)
    calls = []
    real = policy.shared_prompt_logits
    monkeypatch.setattr(
        policy, "shared_prompt_logits", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k)
    )
    shared = _logp_and_grads(model, batch, share=True)
    assert calls == [
        (3, batch.input_ids.shape[1] - batch.completion_width)
    ]  # 3 distinct prompts, run once each
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(shared[0][mask], plain[0][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1][mask], plain[1][mask], rtol=1e-5, atol=1e-5)
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prompts_with_one_token_completions_and_a_shuffled_subset():
    model = tiny_llama()
    batch = pack_sequences([p for p in PROMPTS for _ in range(2)], [[5]] * 6, pad_id=0)
    torch.testing.assert_close(
        completion_logprobs(model, batch)[0], completion_logprobs(model, batch, share_prompts=False)[0]
    )
    sub = _grouped_batch().rows(torch.randperm(12, generator=torch.Generator().manual_seed(0))[:8])
    plain, _ = completion_logprobs(model, sub, share_prompts=False)
    shared, _ = completion_logprobs(model, sub)
    mask = sub.completion_mask.bool()
    torch.testing.assert_close(shared[mask], plain[mask], rtol=1e-5, atol=1e-5)


# -- fused log-probs: from hidden states and the LM head in chunks (grpokit/algo/fused.py) --------


def test_linear_logprobs_worked_numbers():
    # logits z = h W^T = [1, 0, 0]; logp(0) = 1 - log(e + 2); d logp / dz = onehot - softmax.
    h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    logp, ent = linear_logprobs(h, W, torch.tensor([0]), with_entropy=True)
    e = torch.e
    assert abs(logp.item() - (1 - math.log(e + 2))) < 1e-6  # -0.551445
    p = torch.tensor([e, 1.0, 1.0]) / (e + 2)
    assert abs(ent.item() - float(-(p * p.log()).sum())) < 1e-6
    logp.sum().backward()
    dz = torch.tensor([1.0, 0.0, 0.0]) - p  # [0.4239, -0.2119, -0.2119]
    torch.testing.assert_close(W.grad, dz[:, None] * h.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, (dz @ W.detach())[None], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, True)])
def test_linear_logprobs_equal_the_plain_log_softmax(temperature, bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    targets, weights = (
        torch.randint(0, 50, (3, 5), generator=g),
        torch.randn(3, 5, dtype=torch.float64, generator=g),
    )
    leaves = [x for x in (h, W, b) if x is not None]
    logp, ent = linear_logprobs(h, W, targets, bias=b, temperature=temperature, with_entropy=True, chunk=4)
    grads = torch.autograd.grad((logp * weights).sum(), leaves)
    logits = torch.nn.functional.linear(h, W, b).float() / temperature  # the direct reference
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    ref_grads = torch.autograd.grad((ref * weights).sum(), leaves)
    torch.testing.assert_close(logp, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        ent,
        -(ref.new_tensor(0) + (logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)),
        rtol=1e-5,
        atol=1e-5,
    )
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_fused_path_gives_the_plain_values_and_gradients(tied, share):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg).train()
    batch = _grouped_batch()
    plain = _logp_and_grads(model, batch, share, fused=False, temperature=0.8)
    fused = _logp_and_grads(model, batch, share, fused=True, temperature=0.8)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(fused[0][mask], plain[0][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1][mask], plain[1][mask], rtol=1e-4, atol=1e-5)
    assert set(fused[2]) == set(plain[2])
    for name, grad in plain[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


class _ScaledLogits(LlamaForCausalLM):
    """A model whose logits are not head(backbone(x)): like Gemma 2's soft-capping or Cohere's logit_scale."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_fused_path_is_taken_only_where_it_gives_the_models_logits(monkeypatch):
    import grpokit.policy.logprobs as policy  # the module whose names the kernels look up

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    plain_model, scaled = LlamaForCausalLM(cfg), _ScaledLogits(cfg)
    assert policy.fused_head(plain_model) is plain_model.lm_head and policy.fused_head(scaled) is None
    monkeypatch.setattr(policy, "FUSED_MIN_LOGITS", 8)  # auto picks fused from 8 logits up
    calls = []
    real = policy.linear_logprobs
    monkeypatch.setattr(policy, "linear_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = pack_sequences(PROMPTS, COMPS, pad_id=0)
    completion_logprobs(plain_model, batch)
    assert calls == [1]
    logp, _ = completion_logprobs(scaled, batch)  # the plain path: its own (doubled) logits
    assert calls == [1]
    ids = torch.tensor([PROMPTS[0] + COMPS[0]])
    ref = torch.log_softmax(scaled(input_ids=ids).logits[0, 2:-1], -1).gather(
        -1, torch.tensor(COMPS[0])[:, None]
    )
    torch.testing.assert_close(logp[0, :3], ref.squeeze(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fused log-probs need"):
        completion_logprobs(scaled, batch, fused=True)


# -- mixed precision: model.autocast=bfloat16 ----------------------------------------------------


def test_autocast_runs_matmuls_in_bf16_and_keeps_fp32_weights_and_grads():
    import copy

    from grpokit.policy import enable_autocast

    model = tiny_llama().train()
    enable_autocast(model, torch.bfloat16)
    batch = _grouped_batch()
    assert model(input_ids=batch.input_ids[:2]).logits.dtype == torch.bfloat16
    plain = _logp_and_grads(model, batch, share=False, fused=False)
    fused = _logp_and_grads(model, batch, share=True, fused=True)
    mask = batch.completion_mask.bool()
    assert all(
        p.dtype == torch.float32 and g.dtype == torch.float32
        for p, g in zip(model.parameters(), plain[2].values(), strict=False)
    )
    torch.testing.assert_close(fused[0][mask], plain[0][mask], rtol=0.05, atol=0.05)  # bf16 both ways
    fp32 = _logp_and_grads(tiny_llama().train(), batch, share=False, fused=False)
    assert (plain[0][mask] - fp32[0][mask]).abs().max() < 0.1  # close to fp32, not equal: bf16 matmuls
    assert (plain[0][mask] - fp32[0][mask]).abs().max() > 0
    ref = copy.deepcopy(model)  # pi_ref: its forward is bound to the copy, not to the policy
    assert ref.forward.__self__ is ref and ref.model.forward.__self__ is ref.model
    with torch.no_grad():
        ref.lm_head.weight.zero_()
    assert model(input_ids=batch.input_ids[:1]).logits.abs().sum() > 0
    assert ref(input_ids=batch.input_ids[:1]).logits.abs().sum() == 0


# -- the entropy bonus's gradient and model.cast_lm_head_to_fp32 ------------------------------------


def test_entropy_gradient_same_on_the_plain_and_the_fused_path():
    """entropy_grad: d(sum H)/d params is the same through the plain log-softmax and through the fused
    kernel's backward (-p (log p + H) per chunk); without it the entropy carries no gradient."""
    batch = _grouped_batch()
    mask = batch.completion_mask

    def grads(fused, share):
        model = tiny_llama().train()
        logp, ent = completion_logprobs(
            model, batch, with_entropy=True, entropy_grad=True, share_prompts=share, fused=fused
        )
        ((ent * mask).sum() + 0.5 * (logp * mask).sum()).backward()
        return ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, fused = grads(False, False), grads(True, True)
    torch.testing.assert_close(fused[0][mask.bool()], plain[0][mask.bool()], rtol=1e-4, atol=1e-5)
    for name, g in plain[1].items():
        torch.testing.assert_close(fused[1][name], g, rtol=1e-3, atol=1e-5)
    _, ent = completion_logprobs(tiny_llama().train(), batch, with_entropy=True, fused=True)
    assert not ent.requires_grad


def test_cast_lm_head_to_fp32_under_autocast():
    """model.cast_lm_head_to_fp32 under autocast=bfloat16: the logits come out in float32, the plain and the
    fused paths agree (both run the head in fp32), and the log-probs are closer to the all-fp32 model's than
    with the head in bf16."""
    from grpokit.policy import enable_autocast
    from grpokit.policy.loading import cast_lm_head_to_fp32

    batch = _grouped_batch()
    mask = batch.completion_mask.bool()
    bf16 = tiny_llama().train()
    enable_autocast(bf16, torch.bfloat16)
    head32 = tiny_llama().train()
    enable_autocast(head32, torch.bfloat16)
    cast_lm_head_to_fp32(head32)
    assert head32(input_ids=batch.input_ids[:2]).logits.dtype == torch.float32
    fp32 = _logp_and_grads(tiny_llama().train(), batch, share=False, fused=False)[0][mask]
    plain = _logp_and_grads(head32, batch, share=False, fused=False)
    fused = _logp_and_grads(head32, batch, share=True, fused=True)
    torch.testing.assert_close(fused[0][mask], plain[0][mask], rtol=1e-3, atol=1e-3)
    assert all(g.dtype == torch.float32 for g in plain[2].values())
    err32 = (plain[0][mask] - fp32).abs().mean()
    err16 = (_logp_and_grads(bf16, batch, share=False, fused=False)[0][mask] - fp32).abs().mean()
    assert err32 < err16

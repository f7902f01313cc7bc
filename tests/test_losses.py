"""policy_loss (grpokit/algo/losses.py): seed worked numbers, a token-by-token reference, gradients.

Run: .venv/bin/python -m pytest tests/test_losses.py
`ref_policy_loss` is written from the formulas (DeepSeekMath eq. 3 and App. A.1.6, DAPO §3.1/§3.3,
Dr. GRPO §3, GSPO's sequence ratio, dual clip of Ye et al. 2020), one token at a time with python
control flow, not from the code under test. Everything is float64 so values and gradients agree
to ~1e-12.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpokit.algo import LossOptions, group_advantages, policy_loss

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]
RATIO_LEVELS = ["token", "sequence"]


def ref_policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    ref_logp=None,
    beta=0.0,
    eps_low=0.2,
    eps_high=None,
    loss_type="grpo",
    ratio_level="token",
    kl_estimator="k3",
    dual_clip=None,
    max_completion_length=None,
    num_sequences=None,
    num_tokens=None,
):
    """-J as a sum of weighted per-token terms, and the metrics, token by token."""
    N, T = logp.shape
    eps_high = eps_low if eps_high is None else eps_high
    valid = [[t for t in range(T) if mask[i, t]] for i in range(N)]
    n_seq = num_sequences if num_sequences is not None else N
    n_tok = num_tokens if num_tokens is not None else sum(len(v) for v in valid)
    L = max_completion_length if max_completion_length is not None else T

    def weight(i):  # the normalizer of each loss type, per token of sequence i
        if loss_type == "grpo":  # 1/N sum_i 1/|o_i| sum_t
            return 1.0 / (n_seq * len(valid[i]))
        if loss_type in ("bnpo", "dapo"):  # 1/sum_i |o_i| sum_i sum_t
            return 1.0 / n_tok
        return 1.0 / (n_seq * L)  # dr_grpo: 1/(N * max_completion_length) sum_i sum_t

    loss = torch.zeros((), dtype=logp.dtype)
    n_low = n_high = 0
    ratios, kls, count = [], [], 0
    for i in range(N):
        if not valid[i]:
            continue
        if ratio_level == "sequence":
            # GSPO: s_i = (pi_theta(y_i) / pi_old(y_i)) ** (1/|y_i|)
            s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in valid[i]) / len(valid[i]))
        for t in valid[i]:
            A = adv[i] if adv.dim() == 1 else adv[i, t]
            rho = s if ratio_level == "sequence" else torch.exp(logp[i, t] - old_logp[i, t])
            if rho < 1 - eps_low:
                clipped = torch.tensor(1 - eps_low, dtype=logp.dtype)
            elif rho > 1 + eps_high:
                clipped = torch.tensor(1 + eps_high, dtype=logp.dtype)
            else:
                clipped = rho
            obj = rho * A if rho * A <= clipped * A else clipped * A  # min: the pessimistic bound (seed Q11)
            if dual_clip is not None and A < 0 and obj < dual_clip * A:
                obj = dual_clip * A + 0 * rho  # dual clip: never below c * A when A < 0 (a constant in logp)
            term = -obj
            if ref_logp is not None:
                d = ref_logp[i, t].detach() - logp[i, t]  # log(pi_ref / pi_theta)
                kl = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[kl_estimator]
                kls.append(kl.item())
                term = term + beta * kl  # the KL is added after clipping
            loss = loss + weight(i) * term
            n_low += bool(rho < 1 - eps_low and A < 0)
            n_high += bool(rho > 1 + eps_high and A > 0)
            ratios.append(rho.item())
            count += 1
    metrics = {
        "clip_frac_low": n_low / max(count, 1),
        "clip_frac_high": n_high / max(count, 1),
        "clip_frac": (n_low + n_high) / max(count, 1),
        "ratio_mean": sum(ratios) / max(count, 1),
        "kl": sum(kls) / max(count, 1) if ref_logp is not None else 0.0,
    }
    return loss, metrics


def make_batch(seed, N=5, T=7, *, holes=False, empty_row=True, process=False):
    """Random log-probs with ragged masks; ratios spread enough that both clip sides and dual clip are hit."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (
        old
        + 0.35 * torch.randn(N, 1, generator=g, dtype=torch.float64)
        + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)
    )
    ref = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    if holes:
        mask = torch.rand(N, T, generator=g) < 0.7
    else:
        lengths = torch.randint(1, T + 1, (N,), generator=g)
        mask = torch.arange(T) < lengths[:, None]
    if empty_row:
        mask[1] = False
    mask[0] = True  # at least one full row
    adv = (
        torch.randn(N, T, generator=g, dtype=torch.float64)
        if process
        else torch.randn(N, generator=g, dtype=torch.float64)
    )
    if not process:
        adv[-1] = 0.0
    return logp, old, ref, mask, adv


CONFIGS = {
    "plain": dict(),
    "k3_clip_higher": dict(ref=True, beta=0.04, eps_high=0.28),
    "k1_dual_clip": dict(ref=True, beta=0.1, kl_estimator="k1", eps_low=0.1, eps_high=0.3, dual_clip=1.5),
    "k2_process_holes": dict(
        ref=True, beta=0.2, kl_estimator="k2", eps_low=0.15, eps_high=0.25, holes=True, process=True
    ),
    "ref_beta0_overrides": dict(ref=True, beta=0.0, num_sequences=9, num_tokens=40, max_completion_length=11),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_reference_values_gradients_metrics(loss_type, ratio_level, config):
    cfg = dict(CONFIGS[config])
    use_ref = cfg.pop("ref", False)
    holes, process = cfg.pop("holes", False), cfg.pop("process", False)
    for seed in range(2):
        logp, old, ref, mask, adv = make_batch(seed, holes=holes, process=process)
        kw = dict(cfg, loss_type=loss_type, ratio_level=ratio_level, ref_logp=ref if use_ref else None)
        per_call = {k: v for k, v in kw.items() if k in ("ref_logp", "num_sequences", "num_tokens")}
        options = LossOptions(**{k: v for k, v in kw.items() if k not in per_call})
        lp = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(lp, old, adv, mask, options=options, **per_call)
        (grad,) = torch.autograd.grad(loss, lp)

        lp_ref = logp.clone().requires_grad_(True)
        want, want_metrics = ref_policy_loss(lp_ref, old, adv, mask, **kw)
        (want_grad,) = torch.autograd.grad(want, lp_ref)

        assert loss.shape == ()
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
        assert (grad[~mask] == 0).all()
        for k, v in want_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        assert all(isinstance(v, float) for v in metrics.values())


def test_reference_batches_exercise_every_clip_branch():
    # Guard against a vacuous comparison: the random batches above do clip on both sides and dual clip.
    for ratio_level in RATIO_LEVELS:
        low = high = dual = 0
        for seed in range(2):
            logp, old, ref, mask, adv = make_batch(seed)
            _, m = ref_policy_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.3, ratio_level=ratio_level)
            low, high = low + m["clip_frac_low"], high + m["clip_frac_high"]
            log_ratio = (logp - old) * mask
            if ratio_level == "sequence":
                log_ratio = (
                    log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
                ).expand_as(logp)
            dual += int(((log_ratio.exp() > 1.5) & (adv[:, None] < 0) & mask).sum())
        assert low > 0 and high > 0 and dual > 0, ratio_level


# --------------------------------------------------------------------------- seed worked numbers


def _one_token(ratio: float, A: float, **kw):
    old = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    logp = (old + math.log(ratio)).requires_grad_(True)
    adv = torch.tensor([A], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 1), options=LossOptions(**kw))
    (g,) = torch.autograd.grad(loss, logp)
    return loss.item(), -g.item(), m  # loss, dJ/dlogp, metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_seed_q11_clipped_objective(loss_type, ratio_level):
    kw = dict(eps_low=0.2, loss_type=loss_type, ratio_level=ratio_level, max_completion_length=1)
    # A = 1, ratio = 1.5, eps = 0.2: min(1.5, 1.2) = 1.2 -> objective 1.2, loss -1.2; clipped so no gradient.
    loss, dj, m = _one_token(1.5, 1.0, **kw)
    assert loss == pytest.approx(-1.2, abs=1e-12) and dj == 0.0
    assert m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0 and m["ratio_mean"] == pytest.approx(1.5)
    # A = -1, ratio = 0.5: min(-0.5, -0.8) = -0.8 -> loss 0.8; clipped so no gradient.
    loss, dj, m = _one_token(0.5, -1.0, **kw)
    assert loss == pytest.approx(0.8, abs=1e-12) and dj == 0.0
    assert m["clip_frac_low"] == 1.0 and m["clip_frac"] == 1.0
    # The other sides are not clipped (the pessimistic min): A = 1, ratio = 0.5 -> 0.5, dJ/dlogp = ratio * A.
    loss, dj, m = _one_token(0.5, 1.0, **kw)
    assert loss == pytest.approx(-0.5, abs=1e-12) and dj == pytest.approx(0.5) and m["clip_frac"] == 0.0
    # A = -1, ratio = 1.5 -> -1.5, dJ/dlogp = -1.5.
    loss, dj, _ = _one_token(1.5, -1.0, **kw)
    assert loss == pytest.approx(1.5, abs=1e-12) and dj == pytest.approx(-1.5)


def test_seed_numbers_in_one_batch_and_clip_higher_and_dual_clip():
    # The two seed tokens as two one-token completions: grpo loss = mean(-1.2, 0.8) = -0.2.
    old = torch.log(torch.tensor([[0.4], [0.4]], dtype=torch.float64))
    logp = old + torch.log(torch.tensor([[1.5], [0.5]], dtype=torch.float64))
    loss, m = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    assert loss.item() == pytest.approx(-0.2, abs=1e-12)
    assert (m["clip_frac_low"], m["clip_frac_high"], m["clip_frac"]) == (0.5, 0.5, 1.0)
    # Clip-higher (DAPO): eps_high = 0.28 lets A > 0 tokens reach 1.28: objective 1.28.
    loss, _, _ = _one_token(1.5, 1.0, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx(-1.28, abs=1e-12)
    # eps_high=None means eps_low.
    assert _one_token(1.5, 1.0, eps_low=0.1)[0] == pytest.approx(-1.1, abs=1e-12)
    # Dual clip c = 3: A = -1, ratio = 5 -> min(-5, -1.2) = -5, floored at -3 (no gradient); ratio 2 is
    # untouched.
    loss, dj, _ = _one_token(5.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0, abs=1e-12) and dj == 0.0
    loss, dj, _ = _one_token(2.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(2.0, abs=1e-12) and dj == pytest.approx(-2.0)
    # Dual clip never touches A > 0.
    assert _one_token(5.0, 1.0, dual_clip=3.0)[0] == pytest.approx(-1.2, abs=1e-12)


def test_seed_q32_pseudocode_equals_group_advantages_plus_grpo_loss():
    # The seed's hand-written loss (Q32), transcribed for [B, G, T], against the library's two calls.
    g = torch.Generator().manual_seed(30)
    B, G, T, beta, eps_clip = 3, 4, 6, 0.04, 0.2
    rewards = (torch.rand(B, G, generator=g) < 0.5).double()
    rewards[1] = 1.0  # one zero-variance group
    logp_old = -torch.rand(B, G, T, generator=g, dtype=torch.float64) * 2
    logp_new = (logp_old + 0.3 * torch.randn(B, G, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp_ref = logp_old + 0.2 * torch.randn(B, G, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B, G, 1), generator=g)).double()

    mu = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, correction=0, keepdim=True)
    adv = (rewards - mu) / (std + 1e-6)
    adv = adv.unsqueeze(-1)
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    log_r = logp_ref - logp_new
    kl = torch.exp(log_r) - log_r - 1
    per_response = ((-surrogate + beta * kl) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    seed_loss = per_response.mean()
    (seed_grad,) = torch.autograd.grad(seed_loss, logp_new)

    ours_adv = group_advantages(rewards.reshape(-1), G)
    lp = logp_new.detach().reshape(B * G, T).requires_grad_(True)
    ours, _ = policy_loss(
        lp,
        logp_old.reshape(B * G, T),
        ours_adv,
        mask.reshape(B * G, T),
        ref_logp=logp_ref.reshape(B * G, T),
        beta=beta,
        eps_low=eps_clip,
    )
    (ours_grad,) = torch.autograd.grad(ours, lp)
    torch.testing.assert_close(ours, seed_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, seed_grad.reshape(B * G, T), rtol=1e-10, atol=1e-14)


# --------------------------------------------------------------------------- normalizers


def test_bnpo_and_dapo_are_the_same_formula():
    logp, old, ref, mask, adv = make_batch(40)
    kw = dict(ref_logp=ref, beta=0.04, eps_high=0.28)
    a, ma = policy_loss(logp, old, adv, mask, loss_type="bnpo", **kw)
    b, mb = policy_loss(logp, old, adv, mask, loss_type="dapo", **kw)
    assert a.item() == b.item() and ma == mb


def test_loss_type_normalizers_worked_example():
    # Two completions of lengths 1 and 3 whose every token has per-token loss -A (ratio 1, no KL):
    # token sum = -(2*1 + 1*3) = -5 with A = [2, 1].
    logp = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    adv = torch.tensor([2.0, 1.0], dtype=torch.float64)

    def loss(**kw):
        return policy_loss(logp, logp, adv, mask, **kw)[0].item()

    assert loss(loss_type="grpo") == pytest.approx(-(2 / 1 + 3 / 3) / 2)  # 1/N sum_i 1/|o_i| sum_t
    assert loss(loss_type="dapo") == pytest.approx(-5 / 4)  # 1/sum|o_i|
    assert loss(loss_type="bnpo") == pytest.approx(-5 / 4)
    assert loss(loss_type="dr_grpo", max_completion_length=10) == pytest.approx(-5 / 20)  # 1/(N * L)
    # Without max_completion_length, dr_grpo falls back on the padded width (4 here).
    assert loss(loss_type="dr_grpo") == pytest.approx(-5 / 8)
    # Explicit whole-batch counts replace this call's own.
    assert loss(loss_type="grpo", num_sequences=4) == pytest.approx(-3 / 4)
    assert loss(loss_type="dapo", num_tokens=10) == pytest.approx(-5 / 10)
    assert loss(loss_type="dr_grpo", num_sequences=5, max_completion_length=10) == pytest.approx(-5 / 50)


# --------------------------------------------------------------------------- gradient accumulation


def _trim(x, mask):
    """A minibatch padded only to its own longest completion (as a collator would)."""
    width = int(mask.nonzero()[:, 1].max()) + 1 if mask.any() else 1
    return x[:, :width]


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_accumulation_equals_full_batch(loss_type, ratio_level):
    logp, old, ref, mask, adv = make_batch(50, N=8, T=9)
    kw = dict(
        beta=0.05, eps_low=0.2, eps_high=0.28, dual_clip=3.0, loss_type=loss_type, ratio_level=ratio_level
    )
    N, T = logp.shape
    options = LossOptions(max_completion_length=T, **kw)
    lp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(lp, old, adv, mask, ref_logp=ref, options=options)
    (full_grad,) = torch.autograd.grad(full, lp)

    whole = dict(num_sequences=N, num_tokens=int(mask.sum()))
    acc_grad = torch.zeros_like(logp)
    acc_loss = 0.0
    for rows in ([0, 1, 2], [3], [4, 5, 6, 7]):  # uneven minibatches, each trimmed to its own width
        m = _trim(mask[rows], mask[rows])
        w = m.shape[1]
        lp_mb = logp[rows, :w].clone().requires_grad_(True)
        loss, _ = policy_loss(
            lp_mb, old[rows, :w], adv[rows], m, ref_logp=ref[rows, :w], options=options, **whole
        )
        (g,) = torch.autograd.grad(loss, lp_mb)
        acc_grad[rows, :w] += g
        acc_loss += loss.item()
    assert acc_loss == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(acc_grad, full_grad, rtol=1e-10, atol=1e-14)


def test_token_mean_without_whole_batch_count_is_not_the_full_batch_loss():
    # Why the trainer must pass num_tokens: each minibatch's own token count gives a different loss.
    logp, old, ref, mask, adv = make_batch(51, N=8, T=9)
    full, _ = policy_loss(logp, old, adv, mask, loss_type="dapo")
    parts = [
        policy_loss(logp[r], old[r], adv[r], mask[r], loss_type="dapo", num_sequences=8)[0].item()
        for r in ([0, 1, 2], [3], [4, 5, 6, 7])
    ]
    assert sum(parts) != pytest.approx(full.item(), rel=1e-3)


# -------------------------------------------------------------------------- DeepSeekMath gradient coefficient


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_deepseekmath_gradient_coefficient_on_policy(loss_type, ratio_level):
    # DeepSeekMath App. A.1.6: with pi_theta = pi_old (ratio 1) and the k3 KL, the gradient of J w.r.t.
    # log pi_theta(o_t) is GC = A + beta * (pi_ref / pi_theta - 1), times the loss type's normalizer.
    logp, _, ref, mask, adv = make_batch(60, N=6, T=8)
    beta, L = 0.04, 10
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(
        lp,
        logp,
        adv,
        mask,
        ref_logp=ref,
        beta=beta,
        loss_type=loss_type,
        ratio_level=ratio_level,
        max_completion_length=L,
    )
    (grad,) = torch.autograd.grad(-loss, lp)  # dJ/dlogp

    lengths = mask.sum(-1, keepdim=True).double()
    norm = {
        "grpo": 1.0 / (mask.shape[0] * lengths.clamp_min(1)),
        "bnpo": 1.0 / lengths.sum(),
        "dapo": 1.0 / lengths.sum(),
        "dr_grpo": torch.tensor(1.0 / (mask.shape[0] * L), dtype=torch.float64),
    }[loss_type]
    gc = adv[:, None] + beta * (torch.exp(ref - logp) - 1)
    want = torch.where(mask, gc * norm, torch.zeros_like(gc))
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14)
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0


# --------------------------------------------------------------------------- plumbing and robustness


def test_gradient_flows_only_through_logp():
    logp, old, ref, mask, adv = make_batch(70)
    tensors = [t.clone().requires_grad_(True) for t in (logp, old, ref, adv)]
    for ratio_level in RATIO_LEVELS:
        loss, _ = policy_loss(
            tensors[0], tensors[1], tensors[3], mask, ref_logp=tensors[2], beta=0.1, ratio_level=ratio_level
        )
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        assert grads[0] is not None and grads[0].abs().sum() > 0
        for g in grads[1:3]:
            assert g is None or (g == 0).all()


def test_beta_zero_ignores_ref_in_loss_but_reports_kl():
    logp, old, ref, mask, adv = make_batch(71)
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.0)
    assert a.item() == b.item() and ma["kl"] == 0.0 and mb["kl"] > 0


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_garbage_in_padding_changes_nothing(loss_type, ratio_level):
    # Padding log-probs may be anything (-inf, NaN, huge); loss, metrics and gradients must not see them.
    logp, old, ref, mask, adv = make_batch(72)
    kw = dict(
        beta=0.1,
        eps_high=0.28,
        dual_clip=3.0,
        loss_type=loss_type,
        ratio_level=ratio_level,
        max_completion_length=7,
    )
    options = LossOptions(**kw)
    lp = logp.clone().requires_grad_(True)
    clean, m_clean = policy_loss(lp, old, adv, mask, ref_logp=ref, options=options)
    (g_clean,) = torch.autograd.grad(clean, lp)
    bad = [t.clone() for t in (logp, old, ref)]
    for t, v in zip(bad, [float("-inf"), float("nan"), 1e4], strict=True):
        t[~mask] = v
    bad[0][~mask & (torch.arange(7) % 2 == 0)] = -1e4  # ref - logp = 2e4 where both are garbage
    lp = bad[0].requires_grad_(True)
    dirty, m_dirty = policy_loss(lp, bad[1], adv, mask, ref_logp=bad[2], options=options)
    (g_dirty,) = torch.autograd.grad(dirty, lp)
    assert torch.isfinite(g_dirty).all()
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(g_dirty, g_clean)
    assert m_dirty == pytest.approx(m_clean)


def test_float32_inputs_and_bool_or_float_masks():
    logp, old, ref, mask, adv = make_batch(73)
    a, _ = policy_loss(logp.float(), old.float(), adv.float(), mask, ref_logp=ref.float(), beta=0.04)
    b, _ = policy_loss(logp.float(), old.float(), adv, mask.float(), ref_logp=ref.float(), beta=0.04)
    c, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.04)
    assert a.dtype == torch.float32
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert a.item() == pytest.approx(c.item(), rel=1e-5)


def test_argument_errors():
    logp, old, ref, mask, adv = make_batch(74)
    with pytest.raises(ValueError, match=r"must match"):
        policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match=r"ref_logp"):
        policy_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"eps_low=-0.1"):
        policy_loss(logp, old, adv, mask, eps_low=-0.1)
    with pytest.raises(ValueError, match=r"dual_clip.*1"):
        policy_loss(logp, old, adv, mask, options=LossOptions(dual_clip=1.0))
    with pytest.raises(ValueError, match=r"'ppo'.*grpo.*bnpo.*dapo.*dr_grpo"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match=r"'word'.*token.*sequence"):
        policy_loss(logp, old, adv, mask, ratio_level="word")
    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        policy_loss(logp, old, adv, mask, ref_logp=ref, options=LossOptions(beta=0.1, kl_estimator="k9"))


def test_options_are_the_keywords_in_one_object_and_never_a_second_copy():
    logp, old, ref, mask, adv = make_batch(75)
    kw = dict(
        beta=0.04,
        eps_low=0.1,
        eps_high=0.3,
        loss_type="dapo",
        ratio_level="sequence",
        max_completion_length=9,
    )
    a, ma = policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    b, mb = policy_loss(logp, old, adv, mask, ref_logp=ref, options=LossOptions(**kw))
    assert a.item() == b.item() and ma == mb
    with pytest.raises(ValueError, match="as keywords or as options=, not both"):
        policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.04, options=LossOptions(beta=0.04))
    # Options are checked where they are made, with the messages of the keywords; and they stay as made.
    with pytest.raises(ValueError, match=r"dual_clip must be > 1, got 0.5"):
        LossOptions(dual_clip=0.5)
    with pytest.raises(ValueError, match=r"'word'.*token.*sequence"):
        LossOptions(ratio_level="word")
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossOptions().beta = 1.0


def test_any_loss_option_is_also_a_keyword_of_policy_loss():
    """The extra keywords a caller used before LossOptions (dual_clip=, kl_estimator=, ...) still work, and
    give what the same options object gives; an unknown keyword names the problem."""
    from grpokit.algo import LossOptions

    torch.manual_seed(0)
    logp, old, ref = (torch.randn(4, 5) * 0.3 for _ in range(3))
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -2.0]), torch.ones(4, 5)
    knobs = {"dual_clip": 1.5, "kl_estimator": "k2", "delta": 2.0}
    by_keyword, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1, **knobs)
    by_options, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, options=LossOptions(beta=0.1, **knobs))
    assert torch.equal(by_keyword, by_options)
    plain, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    assert not torch.equal(plain, by_keyword)  # the knobs did something
    with pytest.raises(TypeError, match=r"unknown keywords \['dual_clipp'\]"):
        policy_loss(logp, old, adv, mask, dual_clipp=1.5)

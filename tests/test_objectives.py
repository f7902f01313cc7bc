"""The objectives of docs/algorithm.md §10 (grpokit/algo/losses.py through policy_loss, GDPO's
decoupled_advantages, the geometric sequence mask): for each one, numbers worked by hand from its paper's
definition, a comparison of values and gradients with a reference written token by token with python loops
(not from the code under test), and the property that makes it what it is.

Run: .venv/bin/python -m pytest tests/test_objectives.py
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algo import LossOptions, decoupled_advantages, group_advantages, policy_loss
from grpokit.algo.importance import importance_weights

# --------------------------------------------------------------------------- worked numbers


def _one_token(ratio: float, A: float, p_old: float = 0.4, **kw):
    """loss, dJ/dlogp of a one-token batch with pi_old = p_old and pi_theta = ratio * p_old."""
    old = torch.tensor([[math.log(p_old)]], dtype=torch.float64)
    logp = (old + math.log(ratio)).requires_grad_(True)
    adv = torch.tensor([A], dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 1), options=LossOptions(**kw))
    (g,) = torch.autograd.grad(loss, logp)
    return loss.item(), -g.item()


def test_cispo_worked_numbers():
    # pi_old = 0.4, ratio 1.5 (pi = 0.6), A = 1, eps 0.2: weight sg(clip(1.5, 0.8, 1.2)) = 1.2,
    # J = 1.2 * 1 * log 0.6 = 1.2 * -0.5108256 = -0.6129908; dJ/dlogp = 1.2 although the ratio is clipped.
    loss, dj = _one_token(1.5, 1.0, loss_type="cispo")
    assert loss == pytest.approx(0.6129908, abs=1e-7) and dj == pytest.approx(1.2, abs=1e-12)
    # ratio 0.5 (pi = 0.2), A = -1: weight 0.8, J = 0.8 * -1 * log 0.2 = 0.8 * 1.6094379 = 1.2875503,
    # dJ/dlogp = -0.8 (the clipped PPO token would have 0).
    loss, dj = _one_token(0.5, -1.0, loss_type="cispo")
    assert loss == pytest.approx(-1.2875503, abs=1e-7) and dj == pytest.approx(-0.8, abs=1e-12)
    # Token-level normalization: lengths 1 and 3 on-policy (weight 1), A = [2, 1], log pi = log 0.5:
    # J = (2 log 0.5 + 3 * 1 * log 0.5) / 4 = 5/4 * -0.6931472 = -0.8664340.
    logp = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    loss, _ = policy_loss(logp, logp, torch.tensor([2.0, 1.0]), mask, loss_type="cispo")
    assert loss.item() == pytest.approx(0.8664340, abs=1e-7)


def test_sapo_worked_numbers():
    # ratio 1.5, A = 1, tau_pos = 1: f = sigmoid(0.5) * 4 = 0.6224593 * 4 = 2.4898373;
    # dJ/dlogp = 4 sigma (1 - sigma) r = 4 * 0.6224593 * 0.3775407 * 1.5 = 1.4100223.
    loss, dj = _one_token(1.5, 1.0, loss_type="sapo")
    assert loss == pytest.approx(-2.4898373, abs=1e-7) and dj == pytest.approx(1.4100223, abs=1e-7)
    # ratio 1, A = -1, tau_neg = 1.05: f = sigmoid(0) * 4 / 1.05 = 2 / 1.05 = 1.9047619, J = -1.9047619;
    # dJ/dlogp = 4 * 0.25 * 1 * -1 = -1: the vanilla gradient, whatever tau.
    loss, dj = _one_token(1.0, -1.0, loss_type="sapo")
    assert loss == pytest.approx(1.9047619, abs=1e-7) and dj == pytest.approx(-1.0, abs=1e-12)


def test_gmpo_worked_numbers():
    # One sequence, log ratios [0.5, -0.1], eps 0.4 in log space. A = 1: the pessimistic side of each is
    # min(0.5, 0.4) = 0.4 and min(-0.1, -0.1) = -0.1, mean 0.15: J = e^0.15 = 1.1618342. Token 0 is clipped
    # (dJ = 0); token 1: dJ/dlogp = e^0.15 / 2 = 0.5809171.
    old = torch.log(torch.tensor([[0.3, 0.2]], dtype=torch.float64))
    lr = torch.tensor([[0.5, -0.1]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    for A, want_loss, want_grad in [
        (1.0, -1.1618342, [0.0, 0.5809171]),
        # A = -1: max(0.5, 0.4) = 0.5 and max(-0.1, -0.1) = -0.1, mean 0.2: J = -e^0.2 = -1.2214028, and
        # neither token is clipped: dJ/dlogp = -e^0.2 / 2 = -0.6107014 each.
        (-1.0, 1.2214028, [-0.6107014, -0.6107014]),
    ]:
        logp = (old + lr).requires_grad_(True)
        loss, _ = policy_loss(logp, old, torch.tensor([A]), mask, loss_type="gmpo", eps_low=0.4)
        (g,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(want_loss, abs=1e-7)
        torch.testing.assert_close(-g[0], torch.tensor(want_grad, dtype=torch.float64), atol=1e-7, rtol=0)


def test_two_sided_clip_worked_numbers():
    # A = -1, ratio 5, delta 4, eps 0.2: min(min(5, 4) * -1, clip(5) * -1) = min(-4, -1.2) = -4: loss 4, no
    # gradient. Without delta: -5, dJ/dlogp = -5. Ratio 3 < delta: -3, dJ/dlogp = -3 either way.
    assert _one_token(5.0, -1.0, delta=4.0) == pytest.approx((4.0, 0.0), abs=1e-12)
    assert _one_token(5.0, -1.0) == pytest.approx((5.0, -5.0), abs=1e-12)
    assert _one_token(3.0, -1.0, delta=4.0) == pytest.approx((3.0, -3.0), abs=1e-12)
    # A > 0 is not changed: min(4, 1.2) = 1.2, as without delta.
    assert _one_token(5.0, 1.0, delta=4.0) == pytest.approx((-1.2, 0.0), abs=1e-12)


def test_high_entropy_tokens_worked_numbers():
    # Entropies [0.1, 0.5, 2.0, 1.0, 3.0], rho = 0.4: the 0.6 quantile of [0.1, 0.5, 1.0, 2.0, 3.0] is at
    # position 0.6 * 4 = 2.4: 1.0 + 0.4 * (2.0 - 1.0) = 1.4. Tokens 2 and 4 (H >= 1.4) keep their gradient.
    # On-policy, A = 1, dapo over 5 tokens: J = (1 + 1) / 5 = 0.4; dJ/dlogp = 0.2 on tokens 2, 4, else 0.
    logp = torch.full((1, 5), math.log(0.3), dtype=torch.float64, requires_grad=True)
    H = torch.tensor([[0.1, 0.5, 2.0, 1.0, 3.0]], dtype=torch.float64)
    loss, _ = policy_loss(
        logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 5), entropy=H,
        options=LossOptions(loss_type="dapo", top_entropy_quantile=0.4),
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-0.4, abs=1e-12)
    torch.testing.assert_close(-g[0], torch.tensor([0.0, 0.0, 0.2, 0.0, 0.2], dtype=torch.float64))


def _cov_batch():
    # log pi [[-1, -3], [-2, -2]], A [2, -2]: mean log pi -2, mean A 0, cov = (log pi + 2) A =
    # [[2, -2], [0, 0]]. Token (0, 0) has log ratio 0.1, the others 0.
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.1, 0.0], [0.0, 0.0]], dtype=torch.float64)
    return logp, old, torch.tensor([2.0, -2.0], dtype=torch.float64), torch.ones(2, 2)


def test_clip_cov_and_kl_cov_worked_numbers():
    from grpokit.algo.losses import token_covariance

    logp, old, adv, mask = _cov_batch()
    cov = token_covariance(logp, adv.unsqueeze(-1), mask)
    torch.testing.assert_close(cov, torch.tensor([[2.0, -2.0], [0.0, 0.0]], dtype=torch.float64))
    # Clip-Cov, ratio 0.25 of 4 tokens = 1, from cov in [1, 5]: only token (0, 0) qualifies. Its term
    # min(e^0.1 2, clip 2) = 2.2103418 stays in the value, its gradient goes (dapo over 4 tokens):
    # J = (2.2103418 + 2 * 1 * -... ) -> the others on-policy: 2 + (-2) + (-2) = -2, J = 0.2103418 / 4.
    loss, _ = policy_loss(logp, old, adv, mask, options=LossOptions(loss_type="dapo", clip_cov_ratio=0.25))
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-(2.2103418 + 2 - 2 - 2) / 4, abs=1e-7)
    torch.testing.assert_close(-g, torch.tensor([[0.0, 0.5], [-0.5, -0.5]], dtype=torch.float64))
    # KL-Cov, top 0.25 of 4 = token (0, 0) (cov 2): its objective 2.2103418 - 1 * |0.1| = 2.1103418, its
    # gradient r A - kappa sign(log r) = 2.2103418 - 1 = 1.2103418, / 4 tokens.
    options = LossOptions(loss_type="dapo", kl_cov_ratio=0.25, kl_cov_coef=1.0)
    loss, _ = policy_loss(logp, old, adv, mask, options=options)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-(2.1103418 + 2 - 2 - 2) / 4, abs=1e-7)
    torch.testing.assert_close(
        -g, torch.tensor([[1.2103418 / 4, 0.5], [-0.5, -0.5]], dtype=torch.float64), atol=1e-7, rtol=0
    )


def test_off_policy_mask_and_unbiased_kl_worked_numbers():
    # DeepSeek-V3.2: A = -1 and mean log(pi_old / pi) = mean(0.6, 0.6) = 0.6 > delta = 0.5: masked, loss 0,
    # no gradient. The same sequence with A = +1, or with mean 0.4, keeps its loss.
    logp = torch.full((1, 2), math.log(0.3), dtype=torch.float64, requires_grad=True)
    for A, shift, masked in [(-1.0, 0.6, True), (1.0, 0.6, False), (-1.0, 0.4, False)]:
        old = logp.detach() + shift
        options = LossOptions(off_policy_mask_threshold=0.5)
        loss, _ = policy_loss(logp, old, torch.tensor([A]), torch.ones(1, 2), options=options)
        (g,) = torch.autograd.grad(loss, logp)
        assert (loss.item() == 0.0 and (g == 0).all()) == masked
    # Unbiased KL: pi = 0.5, pi_old = 0.25 (r = 2), pi_ref = 0.25: k3 = 0.5 - log 0.5 - 1 = 0.1931472,
    # times r: 0.3862944. d(r k3)/dlogp = r k3 + r (1 - pi_ref / pi) = 0.3862944 + 2 * 0.5 = 1.3862944.
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    quarter = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    loss, m = policy_loss(
        logp, quarter, torch.tensor([0.0]), torch.ones(1, 1), ref_logp=quarter,
        options=LossOptions(beta=1.0, use_bias_correction_kl=True),
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.3862944, abs=1e-7) and g.item() == pytest.approx(
        1.3862944, abs=1e-7
    )
    assert m["kl"] == pytest.approx(0.3862944, abs=1e-7)


def test_entropy_bonus_worked_numbers():
    # A = 0, c = 0.1, entropies [0.5, 1.0] of one sequence, dapo: J = 0.1 (0.5 + 1.0) / 2 = 0.075 and
    # dJ/dH = 0.05 per token.
    logp = torch.full((1, 2), -1.0, dtype=torch.float64)
    H = torch.tensor([[0.5, 1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp,
        logp,
        torch.tensor([0.0]),
        torch.ones(1, 2),
        entropy=H,
        options=LossOptions(loss_type="dapo", entropy_coef=0.1),
    )
    (g,) = torch.autograd.grad(loss, H)
    assert loss.item() == pytest.approx(-0.075, abs=1e-12)
    torch.testing.assert_close(-g, torch.tensor([[0.05, 0.05]], dtype=torch.float64))


def test_gdpo_worked_numbers():
    # G = 2. r1 = [1, 0 | 0, 1] -> group z-scores [1, -1 | -1, 1];
    # r2 = [0, 200 | 100, 300] -> [-1, 1 | -1, 1]. Sum: [0, 0, -2, 2]; batch mean 0, population std
    # sqrt(8 / 4) = 1.4142136: A = [0, 0, -1.4142136, 1.4142136].
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 200.0, 100.0, 300.0]], dtype=torch.float64)
    got = decoupled_advantages(r, torch.tensor([1.0, 1.0]), 2, eps=0.0)
    s = math.sqrt(2)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -s, s], dtype=torch.float64))
    # Summing first: totals [1, 200 | 100, 301] -> [-1, 1 | -1, 1]: r2 alone decides.
    summed = group_advantages(r.sum(0), 2, eps=0.0)
    torch.testing.assert_close(summed, torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64))
    # Weights [2, 1]: 2 [1, -1, -1, 1] + [-1, 1, -1, 1] = [1, -1, -3, 3]; mean 0, std sqrt(5) = 2.2360680.
    got = decoupled_advantages(r, torch.tensor([2.0, 1.0]), 2, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, -3.0, 3.0], dtype=torch.float64) / math.sqrt(5))


def test_geometric_mask_worked_numbers():
    # log(pi_old / pi_sampler) per token: [0.1, 0.3] (geometric mean e^0.2 = 1.2214 > 1.1: dropped) and
    # [0.05, -0.05] (e^0 = 1, kept with weight 1); bounds [0.9, 1.1]. The padding of row 1 does not count.
    sampler = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[0.1, 0.3, 0.0], [0.05, -0.05, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = importance_weights(old, sampler, mask, "geometric_mask", c_min=0.9, c_max=1.1)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64))


# --------------------------------------------------------------------------- loop references


def _quantile(xs, q):  # linear interpolation between order statistics (numpy's / torch's default)
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (pos - lo) * (s[lo + 1] - s[lo])


def ref_loss(logp, old, adv, mask, *, ref_logp=None, beta=0.0, eps_low=0.2, eps_high=None, loss_type="grpo",
             delta=None, tau_pos=1.0, tau_neg=1.05, entropy=None, rho=1.0, entropy_coef=0.0, clip_cov=None,
             kl_cov=None, off_policy=None, unbiased_kl=False, seed=0):  # fmt: skip
    """-J one token at a time, from the papers' formulas."""
    N, T = logp.shape
    eps_high = eps_low if eps_high is None else eps_high
    toks = [[t for t in range(T) if mask[i, t]] for i in range(N)]
    flat = [(i, t) for i in range(N) for t in toks[i]]
    A = lambda i, t: float(adv[i]) if adv.dim() == 1 else float(adv[i, t])  # noqa: E731 (a short helper)
    # The token selections.
    keep = {(i, t): True for i, t in flat}
    if rho < 1.0:
        thr = _quantile([entropy[i, t].item() for i, t in flat], 1 - rho)
        keep = {(i, t): entropy[i, t].item() >= thr for i, t in flat}
    if off_policy is not None:
        for i in range(N):
            if toks[i]:
                d = sum((old[i, t] - logp[i, t]).item() for t in toks[i]) / len(toks[i])
                for t in toks[i]:
                    if A(i, t) < 0 and d > off_policy:
                        keep[(i, t)] = False
    mlp = sum(logp[i, t].item() for i, t in flat) / len(flat)
    ma = sum(A(i, t) for i, t in flat) / len(flat)
    cov = {(i, t): (logp[i, t].item() - mlp) * (A(i, t) - ma) for i, t in flat}
    detached, penalized = set(), set()
    if clip_cov is not None:
        ratio, lb, ub = clip_cov
        cands = [k for k in flat if lb <= cov[k] <= ub]
        n = min(max(1, math.floor(ratio * len(flat))), len(cands))
        perm = torch.randperm(len(cands), generator=torch.Generator().manual_seed(seed))
        detached = {cands[j] for j in perm[:n].tolist()}
    if kl_cov is not None:
        ratio, _ = kl_cov
        n = max(1, math.floor(ratio * len(flat)))
        penalized = set(sorted(flat, key=lambda k: -cov[k])[:n])
    # The objective.
    loss = torch.zeros((), dtype=logp.dtype)
    n_tok = len(flat)
    for i in range(N):
        if not toks[i]:
            continue
        if loss_type == "gmpo":
            s = 0.0
            for t in toks[i]:
                lr = logp[i, t] - old[i, t]
                c = lr.clamp(-eps_low, eps_high)
                sg = 1.0 if A(i, t) > 0 else (-1.0 if A(i, t) < 0 else 0.0)
                s = s + sg * min(sg * lr, sg * c)
            geo = torch.exp(s / len(toks[i]))
        seq = torch.zeros((), dtype=logp.dtype)
        for t in toks[i]:
            a = A(i, t)
            lr = logp[i, t] - old[i, t]
            r = torch.exp(lr)
            if loss_type == "cispo":
                w = min(max(r.item(), 1 - eps_low), 1 + eps_high)
                obj = w * a * logp[i, t]
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                obj = torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            elif loss_type == "gmpo":
                obj = a * geo
            else:
                rc = r.clamp(1 - eps_low, 1 + eps_high)
                ru = r if delta is None or r < delta else delta + 0 * r
                obj = ru * a if ru * a <= rc * a else rc * a
            if not keep[(i, t)]:
                obj = 0 * obj
            if (i, t) in detached:
                obj = obj.detach()
            if (i, t) in penalized:
                obj = obj - kl_cov[1] * abs(lr)
            term = -obj
            if ref_logp is not None and beta:
                d = ref_logp[i, t] - logp[i, t]
                kl = torch.exp(d) - d - 1
                term = term + beta * (r * kl if unbiased_kl else kl)
            if entropy_coef:
                term = term - entropy_coef * entropy[i, t]
            seq = seq + term
        if loss_type == "cispo" or loss_type == "dapo":
            loss = loss + seq / n_tok
        else:
            loss = loss + seq / len(toks[i]) / N
    return loss


def make_batch(seed, N=6, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (
        old
        + 0.3 * torch.randn(N, 1, generator=g, dtype=torch.float64)
        + 0.5 * torch.randn(N, T, generator=g, dtype=torch.float64)
    )
    ref = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T) < torch.randint(1, T + 1, (N,), generator=g)[:, None]
    mask[0] = True
    mask[1] = False  # an empty row
    adv = torch.randn(N, generator=g, dtype=torch.float64) * 2
    H = torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    logp = torch.where(mask, logp, torch.full_like(logp, -40.0))  # garbage in the padding
    return logp, old, ref, mask, adv, H


CASES = {
    "cispo": (dict(loss_type="cispo", eps_low=0.2, eps_high=0.3), {}),
    "cispo_kl": (dict(loss_type="cispo", eps_low=1.0, eps_high=4.0, beta=0.05, ref=True), {}),
    "sapo": (dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05), {}),
    "sapo_tau": (dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0), {}),
    "gmpo": (dict(loss_type="gmpo", eps_low=0.4, eps_high=0.4), {}),
    "gmpo_asym": (dict(loss_type="gmpo", eps_low=0.1, eps_high=0.3), {}),
    "two_sided": (dict(delta=1.5, eps_low=0.2), {}),
    "high_entropy": (dict(loss_type="dapo", top_entropy_quantile=0.3, entropy=True), {}),
    "clip_cov": (dict(loss_type="dapo", clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0), {}),
    "kl_cov": (dict(loss_type="dapo", kl_cov_ratio=0.2, kl_cov_coef=0.7), {}),
    "off_policy": (dict(off_policy_mask_threshold=0.05), {}),
    "unbiased_kl": (dict(use_bias_correction_kl=True, beta=0.3, ref=True), {}),
    "entropy_bonus": (dict(loss_type="dapo", entropy_coef=0.01, entropy=True), {}),
}


def _ref_kwargs(kw):
    out = {k: v for k, v in kw.items() if k in ("beta", "eps_low", "eps_high", "loss_type", "delta")}
    out["tau_pos"] = kw.get("sapo_temperature_pos", 1.0)
    out["tau_neg"] = kw.get("sapo_temperature_neg", 1.05)
    out["rho"] = kw.get("top_entropy_quantile", 1.0)
    out["entropy_coef"] = kw.get("entropy_coef", 0.0)
    if kw.get("clip_cov_ratio"):
        out["clip_cov"] = (kw["clip_cov_ratio"], kw["clip_cov_lb"], kw["clip_cov_ub"])
    if kw.get("kl_cov_ratio"):
        out["kl_cov"] = (kw["kl_cov_ratio"], kw["kl_cov_coef"])
    out["off_policy"] = kw.get("off_policy_mask_threshold")
    out["unbiased_kl"] = kw.get("use_bias_correction_kl", False)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_matches_loop_reference_values_and_gradients(case):
    kw, _ = CASES[case]
    kw = dict(kw)
    use_ref, use_entropy = kw.pop("ref", False), kw.pop("entropy", False)
    for seed in range(3):
        logp, old, ref, mask, adv, H = make_batch(seed)
        lp = logp.clone().requires_grad_(True)
        Hg = H.clone().requires_grad_(True)
        extra = dict(ref_logp=ref if use_ref else None, entropy=Hg if use_entropy else None)
        loss, _ = policy_loss(
            lp,
            old,
            adv,
            mask,
            generator=torch.Generator().manual_seed(seed),
            **extra,
            options=LossOptions(**kw),
        )
        grads = torch.autograd.grad(loss, [lp, Hg], allow_unused=True)

        lp2 = logp.clone().requires_grad_(True)
        H2 = H.clone().requires_grad_(True)
        want = ref_loss(lp2, old, adv, mask, ref_logp=ref if use_ref else None, entropy=H2, seed=seed,
                        **_ref_kwargs(kw))  # fmt: skip
        want_grads = torch.autograd.grad(want, [lp2, H2], allow_unused=True)
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[0], want_grads[0], rtol=1e-9, atol=1e-12)
        if use_entropy and kw.get("entropy_coef"):
            torch.testing.assert_close(grads[1], want_grads[1], rtol=1e-9, atol=1e-12)
        assert (grads[0][~mask] == 0).all() and torch.isfinite(loss)


def test_loop_reference_batches_exercise_each_switch():
    """Guard against a vacuous comparison: on the batches above each switch changes the loss."""
    for case, (kw, _) in CASES.items():
        kw = dict(kw)
        use_ref, use_entropy = kw.pop("ref", False), kw.pop("entropy", False)
        base = {k: v for k, v in kw.items() if k in ("loss_type", "eps_low", "beta")}
        if case.startswith(("cispo", "sapo", "gmpo")):  # against the clipped objective at eps 0.2
            base = {"beta": kw.get("beta", 0.0), "loss_type": "dapo" if case.startswith("cispo") else "grpo"}
        logp, old, ref, mask, adv, H = make_batch(0)
        extra = dict(ref_logp=ref if use_ref else None, entropy=H if use_entropy else None)
        lp = logp.clone().requires_grad_(True)
        a, _ = policy_loss(lp, old, adv, mask, **extra, options=LossOptions(**kw))
        b, _ = policy_loss(lp, old, adv, mask, **extra, **base)
        ga, gb = torch.autograd.grad(a, lp)[0], torch.autograd.grad(b, lp)[0]
        # (the value for the bonus, whose gradient is the entropy's; the gradient for Clip-Cov)
        assert abs(a.item() - b.item()) > 1e-9 or not torch.allclose(ga, gb, rtol=0, atol=1e-9), case


# --------------------------------------------------------------------------- defining properties


def _grad(ratio, A, **kw):
    """dJ/dlogp per token for tokens of the given ratios (one completion each) and advantages."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    old = torch.full((ratio.numel(), 1), math.log(0.3), dtype=torch.float64)
    logp = (old + ratio.log().unsqueeze(-1)).requires_grad_(True)
    adv = torch.as_tensor(A, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(old), options=LossOptions(**kw))
    (g,) = torch.autograd.grad(loss, logp)
    return -g.squeeze(-1)


RATIOS = [0.3, 0.7, 0.8, 0.95, 1.0, 1.1, 1.2, 1.5, 3.0]


def test_cispo_every_token_clipped_or_not_has_a_gradient():
    for A in (1.0, -1.0):
        g_cispo = _grad(RATIOS, [A] * len(RATIOS), loss_type="cispo", eps_low=0.2)
        g_clip = _grad(RATIOS, [A] * len(RATIOS), loss_type="dapo", eps_low=0.2)
        assert (g_cispo != 0).all()
        assert (g_clip == 0).any()  # the hard clip does zero some of the same tokens
        # The gradient is the REINFORCE one times the clipped weight: A * clip(r) / N.
        want = A * torch.tensor(RATIOS, dtype=torch.float64).clamp(0.8, 1.2) / len(RATIOS)
        torch.testing.assert_close(g_cispo, want)


def test_sapo_gradient_vanilla_at_one_smaller_but_nonzero_away():
    for A in (1.0, -1.0):
        g_sapo = _grad(RATIOS, [A] * len(RATIOS), loss_type="sapo")
        vanilla = (
            A * torch.tensor(RATIOS, dtype=torch.float64) / len(RATIOS)
        )  # d(r A)/dlogp, 1/N per sequence
        g_clip = _grad(RATIOS, [A] * len(RATIOS), loss_type="grpo", eps_low=0.2)
        at_one = RATIOS.index(1.0)
        assert g_sapo[at_one].item() == pytest.approx(vanilla[at_one].item(), abs=1e-15)
        away = [k for k in range(len(RATIOS)) if k != at_one]
        assert (g_sapo[away].abs() < vanilla[away].abs()).all()
        assert (g_sapo != 0).all()
        assert ((g_clip == 0) & (g_sapo != 0)).any()  # nonzero where the hard clip's is zero


def test_two_sided_clip_bounds_negative_advantage_gradient_beyond_delta():
    big = [3.0, 4.5, 10.0, 100.0]
    g = _grad(big, [-1.0] * len(big), delta=4.0)
    assert g[0].item() == pytest.approx(-3.0 / 4) and (g[1:] == 0).all()  # beyond delta: nothing
    g_plain = _grad(big, [-1.0] * len(big))
    torch.testing.assert_close(g_plain.abs(), torch.tensor(big, dtype=torch.float64) / 4)  # no bound
    # and the loss of such a token is bounded by delta |A|
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, _ = policy_loss(
        old + math.log(1e6), old, torch.tensor([-1.0]), torch.ones(1, 1), options=LossOptions(delta=4.0)
    )
    assert loss.item() == pytest.approx(4.0)


def test_high_entropy_tokens_below_quantile_get_exactly_zero_gradient():
    logp, old, _, mask, adv, H = make_batch(4)
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp,
        old,
        adv,
        mask,
        entropy=H,
        options=LossOptions(loss_type="dapo", top_entropy_quantile=0.2, eps_low=10.0),
    )  # no PPO clip, so the kept tokens' gradients are nonzero
    (g,) = torch.autograd.grad(loss, lp)
    on = mask.bool()
    thr = torch.quantile(H[on], 0.8)
    low, high = on & (H < thr), on & (H >= thr)
    assert low.any() and (g[low] == 0).all()
    assert (g[high] != 0).sum() == (high & (adv[:, None] != 0)).sum()  # and the top ones keep theirs
    assert high.sum().item() == pytest.approx(0.2 * on.sum().item(), abs=1)


def test_gdpo_a_reward_at_100x_scale_no_longer_dominates():
    g = torch.Generator().manual_seed(0)
    N, G = 64, 4
    small = (torch.rand(N, generator=g) < 0.5).double()  # {0, 1}
    large = 100 * (torch.rand(N, generator=g) < 0.5).double()  # {0, 100}
    w = torch.tensor([1.0, 1.0])
    gdpo = decoupled_advantages(torch.stack([small, large]), w, G)
    grpo = group_advantages(small + large, G)

    def corr(a, b):
        return torch.corrcoef(torch.stack([a, b]))[0, 1].item()

    # How much each reward's own within-group ranking shows in the advantage: summed first, the large
    # reward's (0.90) and hardly the small one's (0.01); decoupled, both about alike (0.59, 0.66).
    z_small, z_large = group_advantages(small, G), group_advantages(large, G)
    assert corr(grpo, z_large) > 0.85 and corr(grpo, z_small) < 0.1
    assert min(corr(gdpo, z_small), corr(gdpo, z_large)) > 0.5
    assert corr(gdpo, z_large) == pytest.approx(corr(gdpo, z_small), abs=0.1)
    # Decoupled, the scale of a reward does not matter at all: 100x large and large give one result.
    exact = decoupled_advantages(torch.stack([small, large]), w, G, eps=0.0)
    torch.testing.assert_close(decoupled_advantages(torch.stack([small, large / 100]), w, G, eps=0.0), exact)
    # A pair that disagrees within a group cancels: small prefers the first, large the second.
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 100.0, 100.0, 0.0]])
    torch.testing.assert_close(decoupled_advantages(r, w, 2)[:2], torch.zeros(2, dtype=r.dtype))


def test_clip_cov_tokens_lose_the_gradient_kl_cov_tokens_get_the_penalty():
    logp, old, _, mask, adv, _ = make_batch(5)
    lp = logp.clone().requires_grad_(True)
    kw = dict(clip_cov_ratio=0.2, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    options = LossOptions(loss_type="dapo", eps_low=10.0, **kw)
    loss, _ = policy_loss(lp, old, adv, mask, options=options, generator=torch.Generator())
    (g,) = torch.autograd.grad(loss, lp)
    zero = (g == 0) & mask
    # eps_low = 10: no PPO clip, so exactly the drawn tokens (and zero-advantage rows) have no gradient
    n = math.floor(0.2 * mask.sum().item())
    assert zero.sum().item() == n + (mask & (adv[:, None] == 0)).sum().item()


def test_off_policy_mask_zeroes_only_negative_divergent_sequences():
    logp, old, _, mask, adv, _ = make_batch(6)
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, options=LossOptions(off_policy_mask_threshold=0.0))
    (g,) = torch.autograd.grad(loss, lp)
    d = ((old - logp) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    for i in range(logp.shape[0]):
        if mask[i].any():
            assert (g[i][mask[i]] == 0).all() == bool(adv[i] < 0 and d[i] > 0), i


def test_argument_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="delta must be > 1 \\+ eps_high"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), options=LossOptions(delta=1.1))
    with pytest.raises(ValueError, match="bound the clipped objective"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), options=LossOptions(loss_type="cispo", delta=4.0))
    with pytest.raises(ValueError, match="need the per-token entropy"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), options=LossOptions(top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        decoupled_advantages(torch.zeros(4), torch.ones(1), 2)


def test_config_rejects_bounds_that_do_not_apply():
    from grpokit.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="delta"):
        load_config(None, ["algorithm.delta=1.1"])
    with pytest.raises(ConfigError, match="bound the clipped objective"):
        load_config(None, ["algorithm.preset=cispo", "algorithm.dual_clip=3"])
    assert load_config(None, ["algorithm.preset=intellect2"]).algorithm.delta == 4.0


def test_loss_options_take_every_objective_setting_from_the_config():
    """grpokit.algorithm.loss_options: each LossOptions field is algorithm.<its name>, except the few it sets
    itself; algorithm_loss gives the same loss from the options built once as from the config."""
    from dataclasses import asdict

    from grpokit.algorithm import SET_IN_LOSS_OPTIONS, algorithm_loss, loss_options
    from grpokit.config import load_config

    overrides = [
        "algorithm.epsilon_high=0.28",
        "algorithm.importance_sampling_level=sequence",
        "algorithm.kl_estimator=k2",
        "algorithm.dual_clip=3",
        "algorithm.delta=4",
        "algorithm.top_entropy_quantile=0.5",
        "algorithm.entropy_coef=0.01",
        "algorithm.clip_cov_ratio=0.1",
        "algorithm.kl_cov_ratio=0.2",
        "algorithm.kl_cov_coef=0.7",
        "algorithm.off_policy_mask_threshold=0.05",
        "algorithm.use_bias_correction_kl=true",
        "algorithm.sapo_temperature_neg=2.0",
    ]
    alg = load_config(None, overrides).algorithm
    options = asdict(loss_options(alg, 128))
    set_here = {name: options.pop(name) for name in SET_IN_LOSS_OPTIONS}
    assert set_here == dict(
        eps_low=0.2, eps_high=0.28, ratio_level="sequence", max_completion_length=128, beta=0.04
    )
    assert options == {name: getattr(alg, name) for name in options}
    assert loss_options(alg, 128, beta=0.0).beta == 0.0

    logp, old, ref, mask, adv, H = make_batch(7)
    kw = dict(ref_logp=ref, num_sequences=6, num_tokens=20, entropy=H)
    torch.manual_seed(0)  # Clip-Cov's draw
    from_options, _ = algorithm_loss(loss_options(alg, 128), logp, old, adv, mask, **kw)
    torch.manual_seed(0)
    from_config, _ = algorithm_loss(alg, logp, old, adv, mask, max_completion_length=128, **kw)
    assert from_options.item() == from_config.item()


# ----------------------------------------------------------------------------- adaptive entropy control


def test_adaptive_entropy_coef_worked_numbers():
    """Skywork-OR1's rule with its scripts' values (target 0.2, delta 1e-4, c in [0, 5e-3]), by hand."""
    from grpokit.algo import adaptive_entropy_coef

    step = dict(target=0.2, delta=1e-4, low=0.0, high=5e-3)
    assert adaptive_entropy_coef(0.0, 0.15, **step) == (1e-4, True)  # below: up by delta, bonus on
    assert adaptive_entropy_coef(3e-4, 0.25, **step) == pytest.approx((2e-4, False))  # above: down, off
    assert adaptive_entropy_coef(0.0, 0.25, **step) == (0.0, False)  # never below the lower bound
    assert adaptive_entropy_coef(5e-3, 0.1, **step) == (5e-3, True)  # never above the upper bound
    assert adaptive_entropy_coef(1e-3, 0.2, **step) == pytest.approx((9e-4, False))  # at the target: down


def test_entropy_control_sequence_and_state():
    """EntropyControl: the first step uses algorithm.entropy_coef; each later step the coefficient the
    previous step's entropy gave, times whether that entropy was below the target; its state round-trips."""
    from grpokit.algorithm import EntropyControl
    from grpokit.config import AlgorithmConfig

    alg = AlgorithmConfig(entropy_target=0.2, entropy_coef=0.001, entropy_coef_delta=0.001)
    ctl = EntropyControl(alg)
    used = []
    for entropy in (0.1, 0.1, 0.3, 0.3, 0.1):
        used.append(ctl.update({"policy/entropy": entropy})["policy/entropy_coef"])
    assert used == pytest.approx([0.001, 0.002, 0.003, 0.0, 0.0])
    # c: 0.001 -> 0.002 -> 0.003 -> 0.002 (off) -> 0.001 (off) -> 0.002 (0.1 < 0.2: on again)
    assert ctl.coef == pytest.approx(0.002)
    again = EntropyControl(alg)
    again.load_state_dict(ctl.state_dict())
    assert (again.value, again.on) == (ctl.value, ctl.on)
    # No entropy measured (every update skipped): the coefficient stays; a fixed coefficient logs nothing.
    assert again.update({})["policy/entropy_coef"] == pytest.approx(0.002) and again.coef == ctl.coef
    assert EntropyControl(AlgorithmConfig(entropy_coef=0.01)).update({"policy/entropy": 0.0}) == {}

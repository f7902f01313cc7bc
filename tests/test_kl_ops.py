"""KL estimators (grpokit/algo/kl.py) and masked ops / log-probs (grpokit/algo/ops.py).

Run: .venv/bin/python -m pytest tests/test_kl_ops.py
References are written from the formulas (Schulman 2020, "Approximating KL divergence";
DeepSeekMath eq. 4), not from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algo import kl_penalty, masked_mean, masked_sum, token_entropy, token_logprobs


def _pair(seed: int = 0, shape=(4, 6)):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    ref = logp + torch.randn(shape, generator=g, dtype=torch.float64)
    return logp, ref


# --------------------------------------------------------------------------- KL estimators


def _kl_ref(kind: str, lp: float, rf: float) -> float:
    # With r = pi_ref / pi_theta on a token sampled from pi_theta:
    r = math.exp(rf - lp)
    if kind == "k1":
        return -math.log(r)  # log pi_theta - log pi_ref
    if kind == "k2":
        return 0.5 * math.log(r) ** 2
    return r - math.log(r) - 1  # k3, DeepSeekMath eq. (4), the seed's estimator


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_values_match_formulas(kind):
    logp, ref = _pair(1)
    got = kl_penalty(logp, ref, kind=kind)
    assert got.shape == logp.shape
    want = torch.tensor(
        [
            [_kl_ref(kind, a, b) for a, b in zip(ra, rb, strict=True)]
            for ra, rb in zip(logp.tolist(), ref.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_default_estimator_is_k3():
    logp, ref = _pair(2)
    torch.testing.assert_close(kl_penalty(logp, ref), kl_penalty(logp, ref, kind="k3"))


def test_k3_worked_number():
    # pi_theta = 0.5, pi_ref = 0.25: r = 0.5, k3 = 0.5 - log 0.5 - 1 = log 2 - 0.5.
    got = kl_penalty(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert got.item() == pytest.approx(math.log(2) - 0.5, abs=1e-6)


def test_k3_nonnegative_and_zero_only_when_equal():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(2000, generator=g) * 20
    ref = logp + torch.randn(2000, generator=g) * 10
    ref[::7] = logp[::7]
    k3 = kl_penalty(logp, ref, kind="k3")
    assert (k3 >= 0).all()
    assert (k3[::7] == 0).all()
    # Extreme log-ratios of +-50 stay finite and non-negative.
    ext = kl_penalty(torch.tensor([0.0, -50.0]), torch.tensor([-50.0, 0.0]))
    assert torch.isfinite(ext).all() and (ext >= 0).all()


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_k3_are_unbiased_under_exact_expectation(kind):
    # E_{x ~ p}[k(x)] = KL(p || q) exactly, computed by summing over a small vocabulary.
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(torch.randn(11, generator=g, dtype=torch.float64), 0)
    logq = torch.log_softmax(torch.randn(11, generator=g, dtype=torch.float64), 0)
    exact = (logp.exp() * (logp - logq)).sum()
    expect = (logp.exp() * kl_penalty(logp, logq, kind=kind)).sum()
    torch.testing.assert_close(expect, exact, rtol=1e-10, atol=1e-12)


def test_what_each_estimator_gradient_estimates():
    # As a loss differentiated through log pi_theta on tokens sampled from pi_theta (exact expectation
    # over a small vocabulary): k2's gradient is that of KL(pi_theta || pi_ref), k3's is that of the
    # forward KL(pi_ref || pi_theta), and k1's is 0 in expectation. docs/algorithm.md relies on this.
    g = torch.Generator().manual_seed(11)
    z = torch.randn(9, generator=g, dtype=torch.float64).requires_grad_(True)
    logq = torch.log_softmax(torch.randn(9, generator=g, dtype=torch.float64), 0)

    def grad_of(f):
        (gz,) = torch.autograd.grad(f(torch.log_softmax(z, 0)), z)
        return gz

    def expected(kind):
        return lambda logp: (logp.exp().detach() * kl_penalty(logp, logq, kind=kind)).sum()

    reverse = grad_of(lambda logp: (logp.exp() * (logp - logq)).sum())
    forward = grad_of(lambda logp: (logq.exp() * (logq - logp)).sum())
    torch.testing.assert_close(grad_of(expected("k2")), reverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_of(expected("k3")), forward, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        grad_of(expected("k1")), torch.zeros(9, dtype=torch.float64), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradient_only_through_logp(kind):
    logp, ref = _pair(5)
    logp = logp.clone().requires_grad_(True)
    ref = ref.clone().requires_grad_(True)
    (g_logp, g_ref) = torch.autograd.grad(
        kl_penalty(logp, ref, kind=kind).sum(), (logp, ref), allow_unused=True
    )
    assert g_ref is None or (g_ref == 0).all()
    d = (ref - logp).detach()
    want = {"k1": torch.ones_like(d), "k2": -d, "k3": 1 - d.exp()}[kind]  # d/dlogp of each formula
    torch.testing.assert_close(g_logp, want, rtol=1e-12, atol=1e-12)


def test_kl_unknown_kind_lists_allowed():
    logp, ref = _pair(6)
    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        kl_penalty(logp, ref, kind="k4")


# --------------------------------------------------------------------------- masked ops


def test_masked_mean_empty_mask_is_zero():
    x = torch.randn(3, 4)
    empty = torch.zeros(3, 4)
    assert masked_mean(x, empty).item() == 0.0
    assert masked_sum(x, empty).item() == 0.0
    assert torch.equal(masked_mean(x, empty, dim=-1), torch.zeros(3))
    # One empty row among full ones: that row is 0, the others are their means.
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    got = masked_mean(x, mask, dim=-1)
    want = torch.stack([x[0, :2].mean(), torch.tensor(0.0), x[2].mean()])
    torch.testing.assert_close(got, want)


def test_masked_mean_matches_loop_and_ignores_garbage():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 8, generator=g) < 0.6
    garbage = x.clone()
    garbage[~mask] = float("nan")
    garbage[~mask & (torch.arange(8) % 2 == 0)] = float("inf")
    vals = [x[i, t].item() for i in range(5) for t in range(8) if mask[i, t]]
    assert masked_sum(garbage, mask).item() == pytest.approx(sum(vals), rel=1e-12)
    assert masked_mean(garbage, mask).item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    rows = masked_mean(garbage, mask, dim=-1)
    for i in range(5):
        vs = [x[i, t].item() for t in range(8) if mask[i, t]]
        assert rows[i].item() == pytest.approx(sum(vs) / len(vs) if vs else 0.0, rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------- token_logprobs / entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 1024])
def test_token_logprobs_matches_log_softmax_gather(temperature, chunk_size):
    # 3 x 7 = 21 rows: chunk sizes 4 and 5 cut the rows unevenly, so chunk boundaries are exercised.
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(3, 7, 13, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ids = torch.randint(0, 13, (3, 7), generator=g)
    got = token_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)
    want = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    assert got.shape == ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    w = torch.randn(3, 7, generator=g)
    (g_got,) = torch.autograd.grad((got * w).sum(), logits)
    (g_want,) = torch.autograd.grad((want * w.double()).sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_token_logprobs_low_precision_logits_and_empty():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 5, 17, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 17, (2, 5), generator=g)
    got = token_logprobs(logits, ids, chunk_size=3)
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    empty = token_logprobs(torch.zeros(2, 0, 17), torch.zeros(2, 0, dtype=torch.long))
    assert empty.shape == (2, 0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("chunk_size", [2, 1024])
def test_token_entropy_matches_formula(temperature, chunk_size):
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 2
    got = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)
    p = torch.softmax(logits / temperature, -1)
    want = -(p * p.log()).sum(-1)
    assert got.shape == (3, 5) and not got.requires_grad
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    # Uniform logits: entropy log V; one-hot-like logits: entropy ~ 0.
    assert token_entropy(torch.zeros(1, 11)).item() == pytest.approx(math.log(11), rel=1e-6)
    peaked = torch.full((1, 11), -1e4)
    peaked[0, 3] = 0.0
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)

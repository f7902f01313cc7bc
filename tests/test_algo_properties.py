"""Property tests (Hypothesis) for grpokit/algo: invariances and finiteness on ties and extremes.

Run: .venv/bin/python -m pytest tests/test_algo_properties.py
Values are drawn by Hypothesis where shrinking helps (rewards, shapes, lengths, extremes) and from a
seeded generator where only the bulk matters (log-prob tensors).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.algo import LossOptions, group_advantages, kl_penalty, policy_loss

SETTINGS = settings(max_examples=50, deadline=None)
LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]

# Rewards as real pipelines make them: 0/1 correctness, small integers, continuous scores, with ties.
reward_value = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 0.5]),
    st.integers(-5, 5).map(float),
    # Rounded to 1e-6: differences far below eps (or subnormal) would test float rounding, not the math.
    st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 6)),
)


@st.composite
def grouped_rewards(draw, value=reward_value, max_groups=4, max_g=6):
    G = draw(st.integers(2, max_g))
    B = draw(st.integers(1, max_groups))
    vals = draw(st.lists(value, min_size=B * G, max_size=B * G))
    return torch.tensor(vals, dtype=torch.float64), G


# --------------------------------------------------------------------------- advantages


@SETTINGS
@given(
    data=grouped_rewards(),
    group=st.integers(0, 3),
    c=st.floats(-100.0, 100.0),
    estimator=st.sampled_from(["grpo", "rloo"]),
)
def test_adding_a_constant_to_a_group_changes_nothing(data, group, c, estimator):
    r, G = data
    g = group % (r.numel() // G)
    shifted = r.clone()
    shifted[g * G : (g + 1) * G] += c
    for scale in ["group", "none"]:
        a = group_advantages(r, G, scale=scale, estimator=estimator)
        b = group_advantages(shifted, G, scale=scale, estimator=estimator)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    # The batch scale uses the std of all N rewards, so shift the whole batch.
    a = group_advantages(r, G, scale="batch", estimator=estimator)
    b = group_advantages(r + c, G, scale="batch", estimator=estimator)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(
    data=grouped_rewards(),
    group=st.integers(0, 3),
    k=st.floats(1e-3, 1e3),
    estimator=st.sampled_from(["grpo", "rloo"]),
)
def test_group_scale_is_invariant_to_scaling_a_group(data, group, k, estimator):
    r, G = data
    g = group % (r.numel() // G)
    scaled = r.clone()
    scaled[g * G : (g + 1) * G] *= k
    # With eps = 0 the z-score is exactly scale free; with the default eps only up to eps / (k * std).
    a = group_advantages(r, G, scale="group", estimator=estimator, eps=0.0)
    b = group_advantages(scaled, G, scale="group", estimator=estimator, eps=0.0)
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    # "none" (Dr. GRPO) is homogeneous instead: the scaled group's advantages scale by k.
    a = group_advantages(r, G, scale="none", estimator=estimator)
    b = group_advantages(scaled, G, scale="none", estimator=estimator)
    torch.testing.assert_close(b[g * G : (g + 1) * G], k * a[g * G : (g + 1) * G], rtol=1e-9, atol=1e-9)


@SETTINGS
@given(
    data=grouped_rewards(),
    scale=st.sampled_from(["group", "batch", "none"]),
    estimator=st.sampled_from(["grpo", "rloo"]),
)
def test_advantages_centered_and_bounded(data, scale, estimator):
    r, G = data
    adv = group_advantages(r, G, scale=scale, estimator=estimator).view(-1, G)
    torch.testing.assert_close(adv.sum(1), torch.zeros(adv.shape[0], dtype=adv.dtype), rtol=0, atol=1e-9)
    if scale == "group" and estimator == "grpo":
        # A population z-score never exceeds sqrt(G - 1) in magnitude.
        assert (adv.abs() <= math.sqrt(G - 1) + 1e-9).all()
    constant = (r.view(-1, G) == r.view(-1, G)[:, :1]).all(1)
    assert (adv[constant] == 0).all()


extreme_value = st.one_of(
    st.sampled_from([0.0, 1.0, 1e-30, -1e-30, 1e-300, 1e12, -1e12, 1e30]),
    st.floats(-1e15, 1e15, allow_nan=False, allow_infinity=False),
)


@SETTINGS
@given(
    data=grouped_rewards(value=extreme_value),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    scale=st.sampled_from(["group", "batch", "none"]),
    estimator=st.sampled_from(["grpo", "rloo"]),
    eps=st.sampled_from([1e-6, 0.0]),
)
def test_advantages_finite_on_ties_and_extremes(data, dtype, scale, estimator, eps):
    r, G = data
    r = r.to(dtype)
    adv = group_advantages(r, G, scale=scale, estimator=estimator, eps=eps)
    assert torch.isfinite(adv).all(), (r, adv)
    tied = (r.view(-1, G) == r.view(-1, G)[:, :1]).all(1)
    assert (adv.view(-1, G)[tied] == 0).all()


# --------------------------------------------------------------------------- policy loss


@st.composite
def loss_batch(draw, max_n=5, max_t=6, spread=0.5, dtype=torch.float64):
    N = draw(st.integers(1, max_n))
    T = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, T), min_size=N, max_size=N))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=dtype) * 5
    logp = old + spread * torch.randn(N, T, generator=g, dtype=dtype)
    ref = old + spread * torch.randn(N, T, generator=g, dtype=dtype)
    adv = torch.randn(N, generator=g, dtype=dtype)
    mask = torch.arange(T) < torch.tensor(lengths)[:, None]
    return logp, old, ref, adv, mask


loss_options = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(LOSS_TYPES),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "beta": st.sampled_from([0.0, 0.04]),
        "eps_high": st.sampled_from([None, 0.28]),
        "dual_clip": st.sampled_from([None, 3.0]),
        "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
    }
)


@SETTINGS
@given(batch=loss_batch(), opts=loss_options, pad=st.integers(1, 4), junk=st.floats(-50.0, 50.0))
def test_policy_loss_unchanged_by_extra_right_padding(batch, opts, pad, junk):
    logp, old, ref, adv, mask = batch
    N, T = logp.shape
    # dr_grpo's constant must be given: without it the padded width stands in for max_completion_length.
    options = LossOptions(**opts, max_completion_length=T)
    lp = logp.clone().requires_grad_(True)
    a, ma = policy_loss(lp, old, adv, mask, ref_logp=ref, options=options)
    (ga,) = torch.autograd.grad(a, lp)

    def padded(x, value):
        return torch.cat([x, torch.full((N, pad), value, dtype=x.dtype)], dim=1)

    lp2 = padded(logp, junk).requires_grad_(True)
    b, mb = policy_loss(
        lp2, padded(old, -junk), adv, padded(mask, False), ref_logp=padded(ref, 2 * junk), options=options
    )
    (gb,) = torch.autograd.grad(b, lp2)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb[:, :T], ga, rtol=1e-12, atol=1e-14)
    assert (gb[:, T:] == 0).all()
    for k in ma:
        assert math.isclose(mb[k], ma[k], rel_tol=1e-12, abs_tol=1e-14), k


@SETTINGS
@given(
    batch=loss_batch(spread=0.0, dtype=torch.float32),
    opts=loss_options,
    extremes=st.lists(st.sampled_from([-50.0, 50.0, 0.0, 1e-7]), min_size=2, max_size=2),
    adv_value=st.sampled_from([None, 0.0, 1e3, -1e3]),
    all_masked_row=st.booleans(),
)
def test_policy_loss_finite_on_extremes(batch, opts, extremes, adv_value, all_masked_row):
    logp, old, ref, adv, mask = batch
    # Log-ratios of +-50 to pi_old and to pi_ref on alternating tokens; ties (ratio exactly 1) elsewhere.
    alt = (torch.arange(logp.shape[1]) % 2 == 0).float()
    logp = old + extremes[0] * alt
    ref = logp + extremes[1] * (1 - alt)
    if adv_value is not None:
        adv = torch.full_like(adv, adv_value)
    if all_masked_row:
        mask = mask.clone()
        mask[0] = False
    lp = logp.clone().requires_grad_(True)
    options = LossOptions(**opts, max_completion_length=logp.shape[1])
    loss, metrics = policy_loss(lp, old, adv, mask, ref_logp=ref, options=options)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert (grad[~mask] == 0).all()
    if not mask.any():
        assert loss.item() == 0.0


@SETTINGS
@given(d=st.floats(-50.0, 50.0), base=st.floats(-30.0, 0.0))
def test_kl_estimators_finite_and_k3_nonnegative(d, base):
    logp = torch.tensor([base])
    ref = torch.tensor([base + d])
    for kind in ["k1", "k2", "k3"]:
        assert torch.isfinite(kl_penalty(logp, ref, kind=kind)).all()
    assert kl_penalty(logp, ref, kind="k3").item() >= 0.0
    assert kl_penalty(logp, ref, kind="k2").item() >= 0.0

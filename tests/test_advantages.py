"""Advantage estimators (grpokit/algo/advantages.py): seed worked numbers and loop references.

Run: .venv/bin/python -m pytest tests/test_advantages.py
The references below are written from the formulas (seed Q5 / Q15 / Q17, RLOO 2402.14740,
DeepSeekMath §4.1.3), one reward at a time, not from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algo import group_advantages, step_advantages

SCALES = ["group", "batch", "none"]
ESTIMATORS = ["grpo", "rloo"]


def ref_group_advantages(rewards: list[float], G: int, scale: str, estimator: str, eps: float) -> list[float]:
    """A_i = (r_i - baseline_i) / s, one reward at a time, population std everywhere."""
    N = len(rewards)
    batch_mean = sum(rewards) / N
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in rewards) / N)
    out = []
    for g in range(N // G):
        grp = rewards[g * G : (g + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / G)  # 1/G, not 1/(G-1): seed Q5
        for i, r in enumerate(grp):
            if max(grp) == min(grp):  # seed Q15: no signal, exactly 0
                out.append(0.0)
                continue
            others = [grp[j] for j in range(G) if j != i]
            baseline = mean if estimator == "grpo" else sum(others) / (G - 1)
            centered = r - baseline
            if scale == "group":
                out.append(centered / (std + eps))
            elif scale == "batch":
                out.append(centered / (batch_std + eps))
            else:
                out.append(centered)
    return out


def _random_rewards(seed: int, B: int, G: int) -> torch.Tensor:
    """Continuous groups, 0/1 groups and constant groups, mixed."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for b in range(B):
        kind = b % 3
        if kind == 0:
            groups.append(torch.randn(G, generator=g, dtype=torch.float64) * 2 + 1)
        elif kind == 1:
            groups.append((torch.rand(G, generator=g) < 0.5).double())
        else:
            groups.append(torch.full((G,), torch.randn(1, generator=g).item(), dtype=torch.float64))
    return torch.cat(groups)


# --------------------------------------------------------------------------- seed worked numbers


def test_seed_q5_worked_example():
    # Seed Q5: rewards [1, 0, 0], mean 1/3, population std 0.471 -> [1.414, -0.707, -0.707].
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
    assert [round(a, 3) for a in adv.tolist()] == [1.414, -0.707, -0.707]
    # Exactly (2/3) / (sqrt(2)/3 + 1e-6) etc.
    s = math.sqrt(2 / 9)
    torch.testing.assert_close(
        adv, torch.tensor([(2 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6)])
    )
    # Bessel's std (what torch.std defaults to, and TRL uses) would give 1.155, not the seed's 1.414.
    assert abs(adv[0].item() - (2 / 3) / math.sqrt(1 / 3)) > 0.2


def test_worked_examples_of_each_scale_and_estimator():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    # Dr. GRPO ("none"): r - group mean.
    none = group_advantages(r, 3, scale="none")
    torch.testing.assert_close(none, torch.tensor([2, -1, -1, 1, 1, -2], dtype=torch.float64) / 3)
    # Batch: same numerators over the std of all six rewards (mean 0.5, std 0.5).
    batch = group_advantages(r, 3, scale="batch", eps=0.0)
    torch.testing.assert_close(batch, torch.tensor([4, -2, -2, 2, 2, -4], dtype=torch.float64) / 3)
    # RLOO: r_i - mean of the other two: [1, -0.5, -0.5], i.e. G/(G-1) = 1.5 times the group-mean numerator.
    rloo = group_advantages(r[:3], 3, estimator="rloo", scale="none")
    torch.testing.assert_close(rloo, torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64))
    rloo_group = group_advantages(r[:3], 3, estimator="rloo", scale="group", eps=0.0)
    torch.testing.assert_close(
        rloo_group,
        1.5 * torch.tensor([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], dtype=torch.float64),
    )


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_rewards_give_exactly_zero(scale, estimator, dtype):
    # Seed Q15: [1,1,1,1] or [0,0,0,0] gives no signal. Exactly 0 (no NaN, no float noise),
    # also for values whose mean is not exactly representable, and with eps = 0. (5 * (1/3) three
    # times has a torch std of 2e-16, not 0: a test on the std alone would give ~1e-10, or +-1 at eps = 0.)
    randoms = (torch.rand(20, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 10).tolist()
    for value in [0.0, 1.0, 0.1, 1 / 3, 5 * (1 / 3), -2.7, 1e6 + 0.1, *randoms]:
        for G in [2, 3, 4, 7, 16]:
            for eps in [1e-6, 0.0]:
                r = torch.full((3 * G,), value, dtype=dtype)
                adv = group_advantages(r, G, scale=scale, estimator=estimator, eps=eps)
                assert torch.equal(adv, torch.zeros_like(adv)), (value, G, eps, adv)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_zero_variance_group_is_zero_next_to_informative_groups(scale, estimator):
    r = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.25, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 3, scale=scale, estimator=estimator, eps=0.0)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
    assert (adv[3:6] != 0).all() and torch.isfinite(adv).all()


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_eps_zero_with_underflowing_std_is_zero_not_inf(scale):
    # The spread 1e-300 is real but its square underflows, so the std is 0: with eps = 0 that is 0, not x/0.
    adv = group_advantages(torch.tensor([0.0, 1e-300], dtype=torch.float64), 2, scale=scale, eps=0.0)
    assert torch.equal(adv, torch.zeros(2, dtype=torch.float64))


# --------------------------------------------------------------------------- loop references


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("B,G", [(1, 2), (3, 3), (5, 4), (4, 8)])
def test_group_advantages_match_loop_reference(scale, estimator, B, G):
    for seed in range(3):
        r = _random_rewards(seed * 100 + B * 10 + G, B, G)
        for eps in [1e-6, 0.1]:
            got = group_advantages(r, G, scale=scale, estimator=estimator, eps=eps)
            want = torch.tensor(
                ref_group_advantages(r.tolist(), G, scale, estimator, eps), dtype=torch.float64
            )
            assert got.dtype == torch.float64 and got.shape == r.shape
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_float32_matches_float64_reference_and_int_rewards_accepted():
    r = _random_rewards(11, 4, 5)
    got = group_advantages(r.float(), 5)
    want = torch.tensor(ref_group_advantages(r.tolist(), 5, "group", "grpo", 1e-6))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ints = group_advantages(torch.tensor([1, 0, 0, 2, 2, 2]), 3)
    assert ints.is_floating_point()
    torch.testing.assert_close(
        ints, torch.tensor(ref_group_advantages([1, 0, 0, 2, 2, 2], 3, "group", "grpo", 1e-6))
    )


def test_defaults_are_group_scale_and_grpo_estimator():
    r = _random_rewards(12, 3, 4)
    torch.testing.assert_close(
        group_advantages(r, 4), group_advantages(r, 4, scale="group", estimator="grpo", eps=1e-6)
    )


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_sum_to_zero_per_group(scale, estimator):
    # Both baselines are centered: sum_i (r_i - mean) = 0 and sum_i (r_i - mean_{-i}) = G/(G-1) * 0.
    r = _random_rewards(13, 6, 5)
    adv = group_advantages(r, 5, scale=scale, estimator=estimator).view(6, 5)
    torch.testing.assert_close(adv.sum(1), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("G", [1, 0, -2])
def test_group_size_below_two_raises_naming_it(G):
    with pytest.raises(ValueError, match=rf"group_size.*{G}"):
        group_advantages(torch.zeros(6), G)


def test_n_not_multiple_of_group_size_raises_naming_both():
    with pytest.raises(ValueError, match=r"\(7\).*group_size \(3\)"):
        group_advantages(torch.zeros(7), 3)


def test_unknown_names_list_allowed_values():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match=r"'std'.*group.*batch.*none"):
        group_advantages(r, 3, scale="std")
    with pytest.raises(ValueError, match=r"'ppo'.*grpo.*rloo"):
        group_advantages(r, 3, estimator="ppo")


def test_rewards_must_be_one_dimensional():
    with pytest.raises(ValueError, match=r"1-D"):
        group_advantages(torch.zeros(2, 3), 3)


# --------------------------------------------------------------------------- step (process) advantages


def ref_step_advantages(step_rewards, step_ends, G, T, eps):
    """DeepSeekMath §4.1.3: normalize all step rewards of a group together, then
    A_{i,t} = sum over steps j of completion i with index(j) >= t of the normalized reward."""
    out = [[0.0] * T for _ in step_rewards]
    for g in range(len(step_rewards) // G):
        idx = range(g * G, (g + 1) * G)
        flat = [x for i in idx for x in step_rewards[i]]
        if not flat:
            continue
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
        for i in idx:
            norm = [(x - mean) / (std + eps) if std > 0 else 0.0 for x in step_rewards[i]]
            for t in range(T):
                out[i][t] = sum(n for n, end in zip(norm, step_ends[i], strict=True) if end >= t)
    return out


def test_step_advantages_worked_example():
    # Completion 0: steps ending at tokens 1 and 3 with rewards 1, 0. Completion 1: one step ending at 2,
    # reward 1. All step rewards [1, 0, 1]: mean 2/3, std sqrt(2)/3 -> normalized [0.707, -1.414, 0.707].
    rewards = [torch.tensor([1.0, 0.0]), torch.tensor([1.0])]
    ends = [torch.tensor([1, 3]), torch.tensor([2])]
    got = step_advantages(rewards, ends, group_size=2, num_tokens=5, eps=0.0)
    h = 1 / math.sqrt(2)
    want = torch.tensor([[h - 2 * h, h - 2 * h, -2 * h, -2 * h, 0.0], [h, h, h, 0.0, 0.0]])
    torch.testing.assert_close(got, want)


def test_step_advantages_match_reference_on_random_steps():
    g = torch.Generator().manual_seed(20)
    G, B, T = 3, 4, 12
    rewards, ends = [], []
    for _ in range(G * B):
        K = int(torch.randint(0, 5, (1,), generator=g))
        # Increasing step ends, sometimes running past T (truncated to the tensor width).
        e = torch.randperm(T + 3, generator=g)[:K].sort().values
        rewards.append(torch.randn(K, generator=g, dtype=torch.float64))
        ends.append(e)
    rewards[6:9] = [
        torch.full((len(ends[i]),), 0.5, dtype=torch.float64) for i in range(6, 9)
    ]  # a zero-variance group
    for eps in [1e-6, 0.0]:
        got = step_advantages(rewards, ends, group_size=G, num_tokens=T, eps=eps)
        want = ref_step_advantages([r.tolist() for r in rewards], [e.tolist() for e in ends], G, T, eps)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[6:9], torch.zeros(3, T))


def test_step_advantages_with_one_step_equal_outcome_advantages():
    # One step ending at the last token = outcome supervision: every token gets the group z-score.
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 0.0])
    lengths = [4, 2, 5, 3, 1, 5]
    got = step_advantages(
        [r[i : i + 1] for i in range(6)], [torch.tensor([L - 1]) for L in lengths], group_size=3, num_tokens=5
    )
    outcome = group_advantages(r, 3)
    for i, L in enumerate(lengths):
        torch.testing.assert_close(got[i, :L], outcome[i].expand(L))
        assert (got[i, L:] == 0).all()


def test_step_advantages_errors():
    one = [torch.tensor([1.0])]
    with pytest.raises(ValueError, match=r"2 step reward lists but 1"):
        step_advantages(one * 2, [torch.tensor([0])], group_size=2, num_tokens=3)
    with pytest.raises(ValueError, match=r"group_size.*1"):
        step_advantages(one * 2, [torch.tensor([0])] * 2, group_size=1, num_tokens=3)
    with pytest.raises(ValueError, match=r"\(3\).*\(2\)"):
        step_advantages(one * 3, [torch.tensor([0])] * 3, group_size=2, num_tokens=3)
    with pytest.raises(ValueError, match=r"increasing"):
        step_advantages(
            [torch.tensor([1.0, 0.0]), torch.tensor([0.0])],
            [torch.tensor([2, 2]), torch.tensor([0])],
            group_size=2,
            num_tokens=3,
        )
    with pytest.raises(ValueError, match=r"2 step rewards but 1 step ends"):
        step_advantages(
            [torch.tensor([1.0, 0.0]), torch.tensor([0.0])],
            [torch.tensor([2]), torch.tensor([0])],
            group_size=2,
            num_tokens=3,
        )

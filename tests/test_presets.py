"""Each algorithm preset against its paper: the trainer's path from rewards and log-probs to the
loss (grpokit.trainer.outcome_advantages / make_loss_mask / algorithm_loss, the functions
Trainer.rollout and Trainer.update call) gives the value and the gradient of the paper's
objective, written here again with explicit loops over sequences and tokens.

    grpo          DeepSeekMath eq. 3 / 21: (r - mean) / (std + eps), token ratio clip 0.2,
                  1/G sum_i 1/|o_i| sum_t, beta = 0.04 k3 KL
    dapo          DAPO eq. 8: clip 0.2 / 0.28, 1 / sum_i |o_i| sum_i sum_t, no KL, truncated completions
                  masked
    dr_grpo       Dr. GRPO: r - mean, sum over tokens / (N x max_completion_length), no KL
    gspo          GSPO eq. 5-7: sequence ratio exp(mean_t log ratio), clip 3e-4 / 4e-4, one term per sequence
    rloo          RLOO: r_i - mean of the other G - 1, REINFORCE token sum / (N x L)
    reinforce_pp  REINFORCE++-baseline: r - group mean, whitened over the batch, token mean,
                  beta = 0.001 k2 KL
    cispo, sapo, gmpo, intellect2, high_entropy, clip_cov, kl_cov, gdpo, deepseek_v32: the objectives of
                  docs/algorithm.md §10, against tests/test_objectives.py's token-by-token reference
"""

import math

import pytest
import torch

from grpokit.algorithm import algorithm_loss, make_loss_mask, needs_entropy, outcome_advantages
from grpokit.config import PRESETS, load_config
from tests.test_objectives import ref_loss

G, B, T, L = 4, 3, 7, 10  # group size, prompts, padded width, max_completion_length
EPS = 1e-6  # algorithm.std_eps


# ---------------------------------------------------------------- references, one number at a time


def mean(xs):
    return sum(xs) / len(xs)


def pop_std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def groups(r):
    return [r[g * G : (g + 1) * G] for g in range(len(r) // G)]


def adv_group_zscore(r):  # DeepSeekMath §4.1.2, DAPO eq. 9, GSPO eq. 6
    out = []
    for grp in groups(r):
        for x in grp:
            out.append(0.0 if max(grp) == min(grp) else (x - mean(grp)) / (pop_std(grp) + EPS))
    return out


def adv_mean_only(r):  # Dr. GRPO: no std
    return [x - mean(grp) for grp in groups(r) for x in grp]


def adv_leave_one_out(r):  # RLOO: the mean of the other G - 1
    out = []
    for grp in groups(r):
        for i, x in enumerate(grp):
            out.append(x - sum(grp[j] for j in range(G) if j != i) / (G - 1))
    return out


def adv_reinforce_pp(
    r,
):  # REINFORCE++-baseline: A' = r - mean_group, A'' = (A' - mean_batch A') / std_batch A'
    centered = adv_mean_only(r)
    m, s = mean(centered), pop_std(centered)
    return [(a - m) / (s + EPS) for a in centered]


def clipped_obj(ratio, a, lo, hi):  # min(rho A, clip(rho, 1 - lo, 1 + hi) A), on 0-d tensors
    return torch.minimum(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)


def k3(logp, ref):  # DeepSeekMath eq. 4: pi_ref/pi - log(pi_ref/pi) - 1
    return torch.exp(ref - logp) - (ref - logp) - 1


def k2(logp, ref):  # REINFORCE++: (log pi - log pi_ref)^2 / 2
    return 0.5 * (logp - ref) ** 2


def tokens_of(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def ref_token_level(adv, logp, old, ref, mask, *, lo, hi, beta, kl, norm):
    """-J of a token-ratio objective; norm: 'seq' (1/N sum_i 1/|o_i|), 'tok' (1/sum|o_i|)
    or 'const' (1/(N L))."""
    N = logp.shape[0]
    total_tokens = sum(len(tokens_of(mask, i)) for i in range(N))
    J = torch.zeros((), dtype=logp.dtype)
    for i in range(N):
        toks = tokens_of(mask, i)
        seq = torch.zeros((), dtype=logp.dtype)
        for t in toks:
            term = clipped_obj(torch.exp(logp[i, t] - old[i, t]), adv[i], lo, hi)
            if beta:
                term = term - beta * kl(logp[i, t], ref[i, t])
            seq = seq + term
        if norm == "seq":
            J = J + (seq / len(toks) if toks else seq) / N
        elif norm == "tok":
            J = J + seq / total_tokens
        else:
            J = J + seq / (N * L)
    return -J


def ref_gspo(adv, logp, old, mask, *, lo, hi):
    """GSPO eq. 5: -1/N sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(1/|o_i| sum_t log ratio) (eq. 7)."""
    N = logp.shape[0]
    J = torch.zeros((), dtype=logp.dtype)
    for i in range(N):
        toks = tokens_of(mask, i)
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
        J = J + clipped_obj(s, adv[i], lo, hi) / N
    return -J


# ---------------------------------------------------------------- a random ragged batch


def make_batch(seed, *, ratio_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    N = B * G
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0], lengths[1] = T, 1  # the longest and the shortest completion
    mask = (torch.arange(T) < lengths[:, None]).double()  # [N, T]
    rewards = torch.randint(0, 3, (N,), generator=g).double() / 2  # {0, 0.5, 1}
    rewards[G : 2 * G] = 1.0  # a zero-variance group
    rewards[2 * G] += 0.25  # so the others are not all ties
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3  # [N, T] log-probs
    logp = old + torch.randn(N, T, generator=g, dtype=torch.float64) * ratio_scale
    ref = old + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3
    # Garbage in the padding: must change neither the value nor the gradient.
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, -50.0))
    truncated = torch.zeros(N, dtype=torch.bool)
    truncated[[0, 5]] = True  # hit max_completion_length without EOS (masked out by DAPO)
    return rewards, logp, old, ref, mask, truncated


def entropies(logp):  # the batch's per-token entropies (the trainer's come from the policy's logits)
    g = torch.Generator().manual_seed(7)
    return torch.rand(logp.shape, generator=g, dtype=torch.float64) * 3


class Scored:
    """Two reward functions for GDPO: the batch's rewards and a second one on a 100x scale."""

    def __init__(self, rewards):
        g = torch.Generator().manual_seed(11)
        self.per_function = {
            "a": rewards,
            "b": 100 * torch.randint(0, 2, rewards.shape, generator=g).double(),
        }
        self.weights = {"a": 1.0, "b": 0.5}


def grpokit_loss(cfg, rewards, logp, old, ref, mask, truncated):
    """The trainer's path: rewards -> advantages -> loss mask -> loss over the whole batch."""
    alg = cfg.algorithm
    adv = outcome_advantages(alg, rewards, G, scored=Scored(rewards))
    loss_mask = make_loss_mask(alg, mask, truncated)
    logp = logp.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's draw: the global generator, as in the trainer
    loss, _ = algorithm_loss(
        alg,
        logp,
        old,
        adv,
        loss_mask,
        ref_logp=ref if alg.beta > 0 else None,
        max_completion_length=L,
        num_sequences=logp.shape[0],
        num_tokens=loss_mask.sum().item(),
        entropy=entropies(logp) if needs_entropy(alg) else None,
    )
    loss.backward()
    return adv, loss.detach(), logp.grad


def adv_gdpo(rewards):  # GDPO: each reward's group z-score, weighted sum, whitened over the batch
    sc = Scored(rewards)
    za, zb = (adv_group_zscore(sc.per_function[k].tolist()) for k in ("a", "b"))
    summed = [1.0 * a + 0.5 * b for a, b in zip(za, zb, strict=True)]
    m, s = mean(summed), pop_std(summed)
    return [(x - m) / (s + EPS) for x in summed]


def paper_loss(preset, rewards, logp, old, ref, mask, truncated):
    r = rewards.tolist()
    logp = logp.clone().requires_grad_(True)
    if preset == "grpo":
        adv = adv_group_zscore(r)
        loss = ref_token_level(adv, logp, old, ref, mask, lo=0.2, hi=0.2, beta=0.04, kl=k3, norm="seq")
    elif preset == "dapo":
        adv = adv_group_zscore(r)
        kept = mask * (~truncated).double()[:, None]  # overlong filtering (DAPO §3.4)
        loss = ref_token_level(adv, logp, old, ref, kept, lo=0.2, hi=0.28, beta=0.0, kl=None, norm="tok")
    elif preset == "dr_grpo":
        adv = adv_mean_only(r)
        loss = ref_token_level(adv, logp, old, ref, mask, lo=0.2, hi=0.2, beta=0.0, kl=None, norm="const")
    elif preset == "gspo":
        adv = adv_group_zscore(r)
        loss = ref_gspo(adv, logp, old, mask, lo=3e-4, hi=4e-4)
    elif preset == "rloo":
        adv = adv_leave_one_out(r)
        loss = ref_token_level(adv, logp, old, ref, mask, lo=0.2, hi=0.2, beta=0.0, kl=None, norm="const")
    elif preset == "reinforce_pp":
        adv = adv_reinforce_pp(r)
        loss = ref_token_level(adv, logp, old, ref, mask, lo=0.2, hi=0.2, beta=0.001, kl=k2, norm="tok")
    else:
        adv = adv_gdpo(rewards) if preset == "gdpo" else adv_group_zscore(r)
        kept = mask * (~truncated).double()[:, None] if preset == "high_entropy" else mask
        A = torch.tensor(adv, dtype=torch.float64)
        loss = ref_loss(logp, old, A, kept, ref_logp=ref, entropy=entropies(logp), **OBJECTIVE_REFS[preset])
    loss.backward()
    return torch.tensor(adv, dtype=torch.float64), loss.detach(), logp.grad


# tests/test_objectives.py's reference with each paper's numbers
OBJECTIVE_REFS = {
    "cispo": dict(loss_type="cispo", eps_low=1.0, eps_high=4.0),
    "sapo": dict(loss_type="sapo", tau_pos=1.0, tau_neg=1.05),
    "gmpo": dict(loss_type="gmpo", eps_low=0.4, eps_high=0.4),
    "intellect2": dict(loss_type="grpo", eps_low=0.2, delta=4.0),
    "high_entropy": dict(loss_type="dapo", eps_low=0.2, eps_high=0.28, rho=0.2),
    "clip_cov": dict(loss_type="dapo", eps_low=0.2, clip_cov=(2e-4, 1.0, 5.0)),
    "kl_cov": dict(loss_type="dapo", eps_low=0.2, kl_cov=(2e-3, 1.0)),
    "gdpo": dict(loss_type="grpo", eps_low=0.2, beta=0.04),
    "deepseek_v32": dict(loss_type="grpo", eps_low=0.2, beta=0.04, off_policy=0.5, unbiased_kl=True),
}
# the presets whose switches need ratios far from 1 to act (delta = 4, the masking threshold 0.5)
RATIO_SCALE = {"gspo": 2e-3, "intellect2": 1.5, "deepseek_v32": 3.0}


def preset_config(name, *extra):
    return load_config(None, [f"algorithm.preset={name}", f"rollout.max_completion_length={L}", *extra])


# ---------------------------------------------------------------- tests


def test_every_preset_is_tested():
    assert set(PRESETS) == {"grpo", "dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp"} | set(OBJECTIVE_REFS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("seed", [0, 1])
def test_preset_loss_matches_paper(preset, seed):
    # GSPO's sequence ratios live within ~1e-3 of 1, so its batch moves the policy that little.
    batch = make_batch(seed, ratio_scale=RATIO_SCALE.get(preset, 0.3))
    adv, loss, grad = grpokit_loss(preset_config(preset), *batch)
    want_adv, want_loss, want_grad = paper_loss(preset, *batch)
    torch.testing.assert_close(adv.double(), want_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["grpo", "dapo", "gspo"])
def test_clipping_is_exercised(preset):
    """The batches above have tokens (sequences, for GSPO) on both sides of the clip range, so the
    comparison covers the clipped branch (zero gradient) as well as the unclipped one."""
    cfg = preset_config(preset).algorithm
    _, logp, old, _, mask, _ = make_batch(0, ratio_scale=2e-3 if preset == "gspo" else 0.3)
    log_ratio = logp - old
    if preset == "gspo":
        log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1)
        inside = (log_ratio.exp() - 1).abs() < 3e-4
    else:
        inside = ((log_ratio.exp() - 1).abs() < cfg.epsilon)[mask.bool()]
    assert inside.any() and (~inside).any()


def test_rloo_on_policy_is_reinforce_with_leave_one_out_baseline():
    """RLOO (Ahmadian et al. 2024, eq. 5) on-policy: the gradient w.r.t. log pi(o_{i,t}) is
    -(r_i - mean_{j != i} r_j) / (N L) for every token: REINFORCE with the leave-one-out baseline
    (no clipping is active at ratio 1), normalized by the constant N x max_completion_length."""
    rewards, logp, _, ref, mask, truncated = make_batch(3)
    adv, loss, grad = grpokit_loss(preset_config("rloo"), rewards, logp, logp.detach(), ref, mask, truncated)
    N = rewards.numel()
    loo = adv_leave_one_out(rewards.tolist())
    for i in range(N):
        for t in range(T):
            want = -loo[i] / (N * L) if mask[i, t] else 0.0
            assert grad[i, t].item() == pytest.approx(want, abs=1e-12)
    assert loss.item() == pytest.approx(
        -sum(loo[i] * mask[i].sum().item() for i in range(N)) / (N * L), abs=1e-12
    )


def test_reinforce_pp_normalizes_by_the_std_of_the_centered_rewards():
    """Worked: groups [1, 0] and [1, 1] (G = 2). Centered: [0.5, -0.5, 0, 0]; their batch std is
    sqrt(0.5 / 4) = 0.3536, so A = [1.414, -1.414, 0, 0]. The std of the raw rewards (0.433,
    scale_rewards=batch) would give [1.155, -1.155, 0, 0]."""
    from grpokit.algo import group_advantages

    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    got = group_advantages(r, 2, scale="batch_centered", eps=0.0)
    torch.testing.assert_close(
        got, torch.tensor([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], dtype=torch.float64)
    )
    raw = group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(
        raw, torch.tensor([2 / math.sqrt(3), -2 / math.sqrt(3), 0.0, 0.0], dtype=torch.float64)
    )


# The papers' numbers, as each preset sets them.
DOCUMENTED = {
    "grpo": dict(
        beta=0.04,
        kl_estimator="k3",
        epsilon=0.2,
        epsilon_high=None,
        loss_type="grpo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    "dapo": dict(
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        dynamic_sampling=True,
        mask_truncated_completions=True,
        overlong_buffer_frac=0.2,
        scale_rewards="group",
    ),
    "dr_grpo": dict(beta=0.0, scale_rewards="none", loss_type="dr_grpo", advantage_estimator="grpo"),
    "gspo": dict(
        beta=0.0, epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence", loss_type="grpo"
    ),
    "rloo": dict(beta=0.0, advantage_estimator="rloo", scale_rewards="none", loss_type="dr_grpo"),
    "reinforce_pp": dict(
        beta=0.001,
        kl_estimator="k2",
        advantage_estimator="grpo",
        scale_rewards="batch_centered",
        loss_type="dapo",
    ),
    "cispo": dict(beta=0.0, epsilon=1.0, epsilon_high=4.0, loss_type="cispo"),  # r capped at 5, no floor
    "sapo": dict(beta=0.0, loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
    "gmpo": dict(beta=0.0, epsilon=0.4, epsilon_high=0.4, loss_type="gmpo"),  # (e^-0.4, e^0.4)
    "intellect2": dict(beta=0.0, epsilon=0.2, delta=4.0, loss_type="grpo"),
    "high_entropy": dict(
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        dynamic_sampling=True,
        top_entropy_quantile=0.2,
    ),
    "clip_cov": dict(beta=0.0, loss_type="dapo", clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0),
    "kl_cov": dict(beta=0.0, loss_type="dapo", kl_cov_ratio=2e-3, kl_cov_coef=1.0),
    "gdpo": dict(multi_objective_aggregation="normalize_then_sum"),
    "deepseek_v32": dict(kl_estimator="k3", use_bias_correction_kl=True, off_policy_mask_threshold=0.5),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_holds_the_papers_numbers(preset):
    alg = preset_config(preset).algorithm
    for key, value in DOCUMENTED[preset].items():
        assert getattr(alg, key) == value, (preset, key)


# A valid value for each key that differs from any preset's.
OTHER = {
    "beta": 0.123,
    "kl_estimator": "k1",
    "epsilon": 1e-4,
    "epsilon_high": [2.5, 0.31],
    "loss_type": "bnpo",
    "scale_rewards": ["batch", "group"],
    "advantage_estimator": ["rloo", "grpo"],
    "importance_sampling_level": ["sequence", "token"],
    "dynamic_sampling": [False, True],
    "mask_truncated_completions": [False, True],
    "overlong_buffer_frac": 0.1,
    "sapo_temperature_pos": 0.7,
    "sapo_temperature_neg": 1.3,
    "delta": 6.0,
    "top_entropy_quantile": 0.5,
    "clip_cov_ratio": 1e-3,
    "clip_cov_lb": 0.5,
    "clip_cov_ub": 7.0,
    "kl_cov_ratio": 1e-2,
    "kl_cov_coef": 0.3,
    "multi_objective_aggregation": ["sum_then_normalize", "normalize_then_sum"],
    "off_policy_mask_threshold": 0.9,
    "use_bias_correction_kl": [False, True],
}


@pytest.mark.parametrize("preset, key", [(p, k) for p in sorted(PRESETS) for k in PRESETS[p]])
def test_every_preset_key_can_be_overridden(preset, key):
    base = preset_config(preset).algorithm
    choices = OTHER[key] if isinstance(OTHER[key], list) else [OTHER[key]]
    value = next(v for v in choices if v != getattr(base, key))
    alg = preset_config(preset, f"algorithm.{key}={value}").algorithm
    assert getattr(alg, key) == value
    for other in PRESETS[preset]:  # the rest of the preset still applies
        if other != key:
            assert getattr(alg, other) == getattr(base, other)


def test_override_example_from_the_docs():
    alg = load_config(None, ["algorithm.preset=dapo", "algorithm.epsilon_high=0.3"]).algorithm
    assert alg.epsilon_high == 0.3 and alg.epsilon == 0.2 and alg.loss_type == "dapo" and alg.beta == 0.0


@pytest.mark.parametrize(
    "preset, off",
    [
        ("intellect2", "algorithm.delta=null"),
        ("high_entropy", "algorithm.top_entropy_quantile=1.0"),
        ("clip_cov", "algorithm.clip_cov_ratio=0"),
        ("kl_cov", "algorithm.kl_cov_ratio=0"),
        ("gdpo", "algorithm.multi_objective_aggregation=sum_then_normalize"),
        ("deepseek_v32", "algorithm.off_policy_mask_threshold=null"),
        ("deepseek_v32", "algorithm.use_bias_correction_kl=false"),
    ],
)
def test_new_preset_switches_are_exercised(preset, off):
    """The comparison above is not vacuous: on its batches each preset's own switch changes the gradient."""
    batch = make_batch(0, ratio_scale=RATIO_SCALE.get(preset, 0.3))
    _, _, grad = grpokit_loss(preset_config(preset), *batch)
    _, _, grad_off = grpokit_loss(preset_config(preset, off), *batch)
    assert not torch.allclose(grad, grad_off, rtol=0, atol=1e-12)

"""Sampler-trainer mismatch and truncated importance sampling (grpokit/algo/importance.py), with worked
numbers.

The batch used throughout: two completions, d = log pi_old - log pi_sampler per token,
    row 0: d = [ln 4, ln 1, ln 0.5]             (3 tokens)
    row 1: d = [ln 0.1, ln 2, <padding>]        (2 tokens; the padding holds garbage that must not matter)
so the token ratios rho_t = exp(d_t) are [4, 1, 0.5] and [0.1, 2], and the sequence ratios (products) are
4 * 1 * 0.5 = 2 and 0.1 * 2 = 0.2.
"""

import math

import pytest
import torch

from grpokit.algo import policy_loss
from grpokit.algo.importance import MODES, importance_weights, sampler_mismatch, weight_stats
from tests.helpers import read_metrics, tiny_config

LN = math.log


def batch():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.25, -7.0]])
    d = torch.tensor([[LN(4), 0.0, LN(0.5)], [LN(0.1), LN(2), 55.0]])  # 55: garbage in the padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return sampler + d, sampler, mask  # old_logp, sampler_logp, mask


@pytest.mark.parametrize(
    "mode, c_min, c_max, expected",
    [
        # token_truncate, TRL's default bounds (no C_min, C_max = 3): 4 -> 3, the rest as they are
        ("token_truncate", None, 3.0, [[3, 1, 0.5], [0.1, 2, 1]]),
        # with C_min = 0.2 too: 0.1 -> 0.2
        ("token_truncate", 0.2, 3.0, [[3, 1, 0.5], [0.2, 2, 1]]),
        # token_mask [0.2, 3]: 4 and 0.1 are outside, their tokens get weight 0
        ("token_mask", 0.2, 3.0, [[0, 1, 0.5], [0, 2, 1]]),
        # sequence_truncate [0.25, 3]: row ratios 2 (kept) and 0.2 (-> 0.25), on every token of the row
        ("sequence_truncate", 0.25, 3.0, [[2, 2, 2], [0.25, 0.25, 1]]),
        # sequence_truncate with C_max = 1.5: 2 -> 1.5
        ("sequence_truncate", None, 1.5, [[1.5, 1.5, 1.5], [0.2, 0.2, 1]]),
        # sequence_mask [0.25, 3]: row 1's 0.2 is below C_min, the whole row gets weight 0
        ("sequence_mask", 0.25, 3.0, [[2, 2, 2], [0, 0, 1]]),
        # sequence_mask with C_max = 1.5: row 0's 2 is above, row 1's 0.2 is fine (no C_min)
        ("sequence_mask", None, 1.5, [[0, 0, 0], [0.2, 0.2, 1]]),
    ],
)
def test_importance_weights_worked_numbers(mode, c_min, c_max, expected):
    old, sampler, mask = batch()
    w = importance_weights(old, sampler, mask, mode, c_min=c_min, c_max=c_max)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert not w.requires_grad


def test_weights_carry_no_gradient_and_are_one_when_the_sampler_is_the_trainer():
    old, _, mask = batch()
    old = old.clone().requires_grad_(True)
    for mode in MODES:
        w = importance_weights(old, old.detach(), mask, mode)
        assert not w.requires_grad
        torch.testing.assert_close(w, torch.ones_like(w))


def test_mismatch_metrics_worked_numbers():
    old, sampler, mask = batch()
    stats = sampler_mismatch(old, sampler, mask)
    # |d| on the 5 tokens: ln 4, 0, ln 2, ln 10, ln 2
    assert stats["abs_diff_mean"] == pytest.approx((LN(4) + 0 + LN(2) + LN(10) + LN(2)) / 5, rel=1e-5)
    assert stats["abs_diff_max"] == pytest.approx(LN(10), rel=1e-5)
    # k3 = rho - 1 - ln rho: 4-1-ln4, 0, 0.5-1+ln2, 0.1-1+ln10, 2-1-ln2
    k3 = [4 - 1 - LN(4), 0.0, 0.5 - 1 + LN(2), 0.1 - 1 + LN(10), 2 - 1 - LN(2)]
    assert stats["kl_k3"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert sampler_mismatch(old, old, mask) == {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "kl_k3": 0.0}


def test_weight_stats_count_the_tokens_whose_weight_was_cut():
    old, sampler, mask = batch()
    w = importance_weights(
        old, sampler, mask, "token_truncate", c_min=0.2, c_max=3.0
    )  # [[3, 1, .5], [.2, 2, -]]
    stats = weight_stats(w, "token_truncate", old, sampler, mask)
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # 4 -> 3 and 0.1 -> 0.2
    assert stats["weight_mean"] == pytest.approx((3 + 1 + 0.5 + 0.2 + 2) / 5, rel=1e-6)


def test_policy_loss_multiplies_the_clipped_surrogate_and_not_the_kl():
    """ratio 1 (logp = old_logp), advantages [1, -1], bnpo (token mean over the 5 tokens):
    per-token loss -A * w; token_truncate weights [[3, 1, 0.5], [0.2, 2]] (C_min 0.2, C_max 3) give
    (-(3 + 1 + 0.5) + (0.2 + 2)) / 5 = -0.46; the gradient of token (0, 0) is -A * w / 5 = -0.6.
    With beta = 0.1 and ref_logp = logp - ln 2 on every token, k3 = exp(-ln 2) + ln 2 - 1 = 0.5 - 1 + ln 2 is
    added unweighted."""
    old, sampler, mask = batch()
    logp = old.clone().requires_grad_(True)
    w = importance_weights(old, sampler, mask, "token_truncate", c_min=0.2, c_max=3.0)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo", is_weights=w)
    assert loss.item() == pytest.approx(-0.46, rel=1e-5)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-0.6, rel=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx(0.2 / 5, rel=1e-5)
    assert logp.grad[1, 2].item() == 0.0

    ref = old - LN(2)
    with_kl, _ = policy_loss(old, old, adv, mask, loss_type="bnpo", is_weights=w, ref_logp=ref, beta=0.1)
    assert with_kl.item() == pytest.approx(-0.46 + 0.1 * (0.5 - 1 + LN(2)), rel=1e-5)


def test_policy_loss_with_unit_weights_is_the_plain_loss():
    torch.manual_seed(0)
    logp, old = torch.randn(4, 6) - 2, torch.randn(4, 6) - 2
    mask = (torch.rand(4, 6) > 0.3).long()
    adv = torch.randn(4)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        plain, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type)
        weighted, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, is_weights=torch.ones(4, 6))
        torch.testing.assert_close(plain, weighted)


def test_bad_mode_and_bounds_name_the_allowed_values():
    old, sampler, mask = batch()
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        importance_weights(old, sampler, mask, "token_clip")
    with pytest.raises(ValueError, match="c_min < c_max"):
        importance_weights(old, sampler, mask, "token_mask", c_min=3.0, c_max=2.0)


def test_the_loop_logs_the_mismatch_for_engines_with_logprobs_and_corrects_only_when_asked(
    tiny_model_dir, tmp_path
):
    """fast returns its log-probs: the mismatch is logged (float noise: the same model and code) and, with
    rollout.importance_correction on, the weights' stats; hf returns none: no mismatch metrics."""

    from grpokit.trainer import Trainer

    def run(name, *extra):
        out = tmp_path / name
        cfg = tiny_config(
            tiny_model_dir,
            out,
            "data.task_train_size=50",
            "rewards=[{function: countdown}]",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=6",
            "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
            "optim.max_steps=2",
            "checkpoint.save_every=0",
            *extra,
        )
        Trainer(cfg).train()
        return [row for row in read_metrics(out) if "reward/mean" in row]

    fast = run(
        "fast",
        "rollout.engine=fast",
        "rollout.importance_correction=sequence_mask",
        "rollout.importance_c_min=0.5",
    )
    assert all(
        r["rollout/logp_diff_max"] < 1e-4 and r["rollout/logp_diff_mean"] <= r["rollout/logp_diff_max"]
        for r in fast
    )
    assert all(r["rollout/is_clip_frac"] == 0.0 for r in fast)
    plain = run("plain", "rollout.engine=fast")
    assert "rollout/logp_diff_mean" in plain[0] and "rollout/is_weight_mean" not in plain[0]
    hf = run("hf", "rollout.engine=hf")
    assert not any(k.startswith("rollout/logp_diff") or k == "rollout/sampler_kl" for k in hf[0])

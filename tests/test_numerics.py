"""Numerical guards: a non-finite update is skipped and counted, never saved; and fuzzing of the
reward -> advantage -> loss path on the values reward functions really return.

Run: .venv/bin/python -m pytest tests/test_numerics.py

The trainer skips an optimizer step whose rewards, advantages, loss or gradient norm are not finite
(policy/skipped_updates counts them) and stops with a TrainingError after
optim.max_consecutive_skips in a row; Trainer.save refuses weights holding NaN/inf.
Non-finite rewards from the reward functions themselves are voided by the RewardManager (counted in
reward/errors/<name>); tests/test_errors.py runs those cases through `grpokit train`.
Hypothesis properties of group_advantages and policy_loss alone are in tests/test_algo_properties.py
and of RewardManager alone in tests/test_rewards.py; here they are composed as the trainer composes them.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpokit.algorithm
from grpokit.algo import LossOptions, group_advantages, policy_loss
from grpokit.checkpoint import list_checkpoints
from grpokit.policy.optim import TrainingError
from grpokit.rewards import RewardManager
from grpokit.rewards.manager import RewardSpec
from grpokit.trainer import Trainer
from tests.helpers import NO_TASK, read_metrics, tiny_config

SETTINGS = settings(max_examples=60, deadline=None)


def config(model_dir, out, *extra):
    prompts = Path(out).parent / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a} {b}>{a + b}="}) + "\n" for a in range(1, 5) for b in range(1, 3))
    )
    return tiny_config(
        model_dir,
        out,
        *NO_TASK,
        f"data.train_path={prompts}",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=4",
        "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
        "logging.tensorboard=false",
        *extra,
    )


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    monkeypatch.setattr("grpokit.trainer.plot_run", lambda *a, **k: None)  # plots are not what these test


def nan_loss_on(calls: set[int]):
    """policy_loss, but NaN on the given (1-based) calls: one call per step with the settings above."""
    real, count = policy_loss, [0]

    def loss(*args, **kwargs):
        count[0] += 1
        value, stats = real(*args, **kwargs)
        return (value * math.nan if count[0] in calls else value), stats

    return loss


# ----------------------------------------------------------------------------- the trainer's guards


def test_nan_loss_steps_are_skipped_counted_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(grpokit.algorithm, "policy_loss", nan_loss_on({1, 3}))
    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        "optim.max_steps=3",
        "optim.max_consecutive_skips=2",
        "checkpoint.save_every=0",
    )
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()  # two skips, but not in a row: step 2 reset the count
    rows = read_metrics(tmp_path / "run")
    assert [r["policy/skipped_updates"] for r in rows] == [1, 1, 2]
    assert ["policy/grad_norm" in r for r in rows] == [False, True, False]
    assert any(
        not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True)
    )  # step 2 trained
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3]


class _InfGrad(torch.autograd.Function):
    """Zero in the forward pass, an infinite gradient in the backward pass."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum() * 0

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, math.inf)


def test_non_finite_gradient_stops_with_the_parameter_named(tiny_model_dir, tmp_path, monkeypatch):
    real = policy_loss

    def inf_grad_loss(logp, *args, **kwargs):
        value, stats = real(logp, *args, **kwargs)
        return value + _InfGrad.apply(logp), stats

    monkeypatch.setattr(grpokit.algorithm, "policy_loss", inf_grad_loss)
    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        "optim.max_steps=3",
        "optim.max_consecutive_skips=2",
        "checkpoint.save_every=1",
    )
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingError) as exc:
        trainer.train()
    msg = str(exc.value)
    assert (
        "the gradient norm was non-finite in 2 optimizer steps in a row (last at step 2, pass 1, minibatch "
        "1: first in model." in msg
    )
    assert "\n" not in msg
    assert all(
        torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True)
    )  # no step was taken
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1]


def test_save_refuses_non_finite_weights(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path / "run", "optim.max_steps=1"))
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param[0, 0] = math.inf
    with pytest.raises(
        TrainingError, match=rf"refusing to save step 0: the weights hold NaN/inf \(first in {name}\)"
    ):
        trainer.save()
    assert list_checkpoints(tmp_path / "run") == [] and not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------- fuzzing: rewards -> advantages -> loss

# What reward functions return: numbers, None ("not applicable"), NaN, inf, junk; sometimes they raise
# or return the wrong number of values.
entry = st.one_of(
    st.none(),
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
    st.just("1.0"),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(-1e3, 1e3),
    st.sampled_from([0.0, 1.0]),
)


def _const(values, name):
    def fn(completions, **kwargs):
        if values == "raise":
            raise ValueError("bad reward")
        return values

    fn.__name__ = name
    return fn


@SETTINGS
@given(
    data=st.data(),
    G=st.integers(2, 5),
    B=st.integers(1, 3),
    K=st.integers(1, 3),
    scale=st.sampled_from(["group", "batch", "none"]),
    estimator=st.sampled_from(["grpo", "rloo"]),
)
def test_fuzz_reward_manager_output_gives_finite_advantages(data, G, B, K, scale, estimator):
    N = B * G
    outputs = [
        data.draw(
            st.one_of(
                st.lists(entry, min_size=N, max_size=N),
                st.just("raise"),
                st.lists(entry, min_size=N + 1, max_size=N + 1),
            )
        )
        for _ in range(K)
    ]
    weights = [data.draw(st.floats(-5, 5)) for _ in range(K)]
    manager = RewardManager(
        [
            RewardSpec(_const(o, f"f{i}"), weight=w)
            for i, (o, w) in enumerate(zip(outputs, weights, strict=True))
        ]
    )
    logging.getLogger("grpokit.rewards").disabled = True
    try:
        scored = manager(prompts=["p"] * N, completions=["c"] * N, completion_ids=[[1]] * N)
    finally:
        logging.getLogger("grpokit.rewards").disabled = False
    rewards = scored.total.float()  # exactly what Trainer.rollout feeds group_advantages
    assert torch.isfinite(rewards).all()
    adv = group_advantages(rewards, G, scale=scale, estimator=estimator)
    assert torch.isfinite(adv).all()
    grouped, a = rewards.view(B, G), adv.view(B, G)
    # Centred up to float32 rounding of the totals (|total| reaches 1e3 x weights of 5).
    torch.testing.assert_close(
        a.sum(1), torch.zeros(B), rtol=0, atol=1e-6 * G * (1 + rewards.abs().max().item())
    )
    tied = (grouped == grouped[:, :1]).all(1)
    assert (a[tied] == 0).all()  # a group whose rewards all failed or tie carries no signal
    if scale == "group" and estimator == "grpo":
        assert (a.abs() <= math.sqrt(G - 1) + 1e-4).all()
    # ... and the loss on those advantages is finite, with a finite gradient.
    T = 3
    g = torch.Generator().manual_seed(N * 31 + K)
    old = -torch.rand(N, T, generator=g) * 3
    logp = (old + 0.3 * torch.randn(N, T, generator=g)).requires_grad_(True)
    mask = torch.ones(N, T, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logp=old, beta=0.04, max_completion_length=T)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (
        torch.isfinite(loss) and torch.isfinite(grad).all() and all(math.isfinite(v) for v in stats.values())
    )


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    N=st.integers(1, 5),
    T=st.integers(1, 6),
    pad=st.integers(1, 3),
    junk=st.sampled_from([math.nan, math.inf, -math.inf]),
    loss_type=st.sampled_from(["grpo", "bnpo", "dapo", "dr_grpo"]),
    ratio_level=st.sampled_from(["token", "sequence"]),
    kl=st.sampled_from(["k1", "k2", "k3"]),
    data=st.data(),
)
def test_fuzz_non_finite_padding_never_leaks(seed, N, T, pad, junk, loss_type, ratio_level, kl, data):
    """NaN / inf where the mask is 0 (padding, masked truncated rows) changes neither the loss nor any
    gradient."""
    lengths = data.draw(st.lists(st.integers(0, T), min_size=N, max_size=N))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T + pad, generator=g, dtype=torch.float64) * 5
    logp = old + 0.5 * torch.randn(N, T + pad, generator=g, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(N, T + pad, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.arange(T + pad) < torch.tensor(lengths)[:, None]
    kw = dict(
        beta=0.04,
        loss_type=loss_type,
        ratio_level=ratio_level,
        kl_estimator=kl,
        max_completion_length=T + pad,
    )

    clean = logp.clone().requires_grad_(True)
    options = LossOptions(**kw)
    a, _ = policy_loss(clean, old, adv, mask, ref_logp=ref, options=options)
    (ga,) = torch.autograd.grad(a, clean)
    dirty = [x.masked_fill(~mask, junk) for x in (logp, old, ref)]
    lp = dirty[0].clone().requires_grad_(True)
    b, stats = policy_loss(lp, dirty[1], adv, mask, ref_logp=dirty[2], options=options)
    (gb,) = torch.autograd.grad(b, lp)
    assert torch.isfinite(b) and torch.isfinite(gb).all() and all(math.isfinite(v) for v in stats.values())
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, ga, rtol=1e-12, atol=1e-14)
    assert (gb[~mask] == 0).all()

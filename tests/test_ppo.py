"""The PPO baseline: GAE / value-loss math against loop references and worked numbers, the critic's
positions, and the trainer with its critic (advantage_estimator=gae) end to end on the tiny model (learning,
exact resume of the critic)."""

import pytest
import torch

from grpokit.algo import explained_variance, gae_advantages, masked_whiten, token_rewards, value_loss
from grpokit.checkpoint import list_checkpoints
from grpokit.data.batch import pack_sequences
from tests.helpers import read_metrics, tiny_config


def ragged_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()


# ---------------------------------------------------------------- token rewards


def test_token_rewards_put_the_score_on_the_last_token_and_shape_with_kl():
    mask = ragged_mask([3, 1, 0], 4)
    scores = torch.tensor([1.0, 0.5, 7.0])
    r = token_rewards(scores, mask)
    assert r.tolist() == [
        [0, 0, 1.0, 0],
        [0.5, 0, 0, 0],
        [0, 0, 0, 0],
    ]  # an empty row has no action to credit
    kl = torch.full((3, 4), 0.25)
    r = token_rewards(scores, mask, kl=kl, kl_coef=0.1)
    expected = torch.tensor([[-0.025, -0.025, 0.975, 0], [0.475, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(r, expected)


# ---------------------------------------------------------------- GAE


def gae_reference(rewards, values, mask, gamma, lam):
    """Row by row over the list of real positions, straight from Schulman et al. 2016 eq. 16."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[i, t]]
        last = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = values[i, pos[k + 1]].item() if k + 1 < len(pos) else 0.0
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, torch.where(mask.bool(), adv + values, torch.zeros_like(adv))


def test_gae_worked_numbers():
    # Score 1 on the last of 3 tokens, V = 0.5 everywhere, gamma = 1, lam = 0.5:
    # delta = [0 + 0.5 - 0.5, 0 + 0.5 - 0.5, 1 + 0 - 0.5] = [0, 0, 0.5]
    # A_2 = 0.5, A_1 = 0 + 0.5 * 0.5 = 0.25, A_0 = 0 + 0.5 * 0.25 = 0.125; R = A + V.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])  # 9.0 sits on padding and must not matter
    mask = ragged_mask([3], 4)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.25, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.75, 1.0, 0.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_loop_reference_on_ragged_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    N, T = 7, 9
    mask = ragged_mask([9, 5, 1, 0, 3, 8, 2], T)
    mask[5, 4] = 0  # a hole inside a row: skipped, values carried across it
    rewards = torch.randn(N, T, generator=g)
    values = torch.randn(N, T, generator=g)
    values[~mask.bool()] = float("nan")  # garbage in padding must not leak
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, torch.nan_to_num(values), mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask.bool()] == 0).all()


def test_gae_with_gamma_1_lam_1_is_monte_carlo_return_minus_value():
    g = torch.Generator().manual_seed(1)
    N, T = 5, 6
    mask = ragged_mask([6, 4, 1, 3, 2], T)
    rewards = torch.randn(N, T, generator=g) * mask
    values = torch.randn(N, T, generator=g)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{k >= t} r_k
    torch.testing.assert_close(ret, reward_to_go * mask)
    torch.testing.assert_close(adv, (reward_to_go - values) * mask)


def test_whiten_and_explained_variance():
    g = torch.Generator().manual_seed(2)
    mask = ragged_mask([5, 2, 4], 5)
    x = torch.randn(3, 5, generator=g) * 3 + 2
    w = masked_whiten(x, mask)
    on = mask.bool()
    assert abs(w[on].mean().item()) < 1e-6 and abs(w[on].std(correction=0).item() - 1) < 1e-5
    assert (w[~on] == 0).all()
    assert explained_variance(x, x, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(x, 5.0), x, mask) == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- value loss


def value_loss_reference(v, old, ret, mask, c):
    per = []
    for i in range(v.shape[0]):
        for t in range(v.shape[1]):
            if mask[i, t]:
                clipped = old[i, t] + torch.clamp(v[i, t] - old[i, t], -c, c)
                per.append(0.5 * torch.maximum((v[i, t] - ret[i, t]) ** 2, (clipped - ret[i, t]) ** 2))
    return torch.stack(per).mean()


def test_value_loss_worked_numbers():
    # V_old = 0, V = 1, R = 1, c = 0.2: unclipped error 0, clipped (0.2 - 1)^2 = 0.64 -> the max is
    # the clipped one: loss 0.32, clip_frac 1, and no gradient (the clamp is saturated).
    v = torch.tensor([[1.0]], requires_grad=True)
    loss, m = value_loss(v, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_range=0.2)
    assert loss.item() == pytest.approx(0.32) and m["clip_frac"] == 1.0
    loss.backward()
    assert v.grad.item() == 0.0
    # Moving towards the target within the clip range: the unclipped error is the larger one.
    v = torch.tensor([[0.1]], requires_grad=True)
    loss, m = value_loss(v, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.81) and m["clip_frac"] == 0.0
    loss.backward()
    assert v.grad.item() == pytest.approx(0.1 - 1.0)
    # clip_range 0 (or None) is plain 0.5 * (V - R)^2.
    loss, _ = value_loss(
        torch.tensor([[1.0]]), torch.zeros(1, 1), torch.full((1, 1), 3.0), torch.ones(1, 1), clip_range=0
    )
    assert loss.item() == pytest.approx(2.0)


def test_value_loss_and_gradient_match_reference_on_random_tensors():
    g = torch.Generator().manual_seed(3)
    N, T = 6, 7
    mask = ragged_mask([7, 3, 1, 5, 6, 2], T)
    v = torch.randn(N, T, generator=g).requires_grad_()
    old = v.detach() + 0.3 * torch.randn(N, T, generator=g)
    ret = torch.randn(N, T, generator=g)
    loss, m = value_loss(v, old, ret, mask, clip_range=0.2)
    (grad,) = torch.autograd.grad(loss, v)
    v2 = v.detach().clone().requires_grad_()
    ref = value_loss_reference(v2, old, ret, mask, 0.2)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, v2.grad)
    assert 0.0 < m["clip_frac"] < 1.0


def test_value_loss_accumulates_to_the_whole_minibatch():
    g = torch.Generator().manual_seed(4)
    mask = ragged_mask([4, 1, 3, 2], 4)
    v, old, ret = (torch.randn(4, 4, generator=g) for _ in range(3))
    whole, _ = value_loss(v, old, ret, mask)
    parts = sum(
        value_loss(v[s], old[s], ret[s], mask[s], num_tokens=mask.sum().item())[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, whole)


# ---------------------------------------------------------------- the trainer


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Plots are tested elsewhere (tests/test_logging.py); here they would only cost seconds per run."""
    monkeypatch.setattr("grpokit.trainer.plot_run", lambda *args, **kwargs: [])


def config(model_dir, out, *extra):
    return tiny_config(
        model_dir,
        out,
        "eval.max_samples=8",
        "eval.k=1",
        "algorithm.advantage_estimator=gae",
        "ppo.critic_learning_rate=3e-3",
        "ppo.lam=1.0",
        "logging.tensorboard=false",
        *extra,
    )


def test_critic_values_ignore_padding_and_later_tokens(tiny_model_dir, tmp_path):
    from grpokit.trainer import Trainer

    tr = Trainer(config(tiny_model_dir, tmp_path / "run"))
    torch.nn.init.normal_(tr.critic.model.head.weight)  # a non-zero head, so values depend on the states
    prompts, comps = [[1, 5, 6], [7, 8]], [[9, 10, 11, 12], [13]]
    both = tr.critic.values(pack_sequences(prompts, comps, tr.tokenizer.pad_token_id))  # [2, 4]
    alone = tr.critic.values(pack_sequences(prompts[:1], comps[:1], tr.tokenizer.pad_token_id))
    torch.testing.assert_close(both[0], alone[0], rtol=1e-4, atol=1e-5)
    prefix = tr.critic.values(pack_sequences(prompts[:1], [comps[0][:2]], tr.tokenizer.pad_token_id))
    torch.testing.assert_close(prefix[0], alone[0, :2], rtol=1e-4, atol=1e-5)  # V(s_t) sees only the prefix
    assert both[1, 1:].eq(0).all()


def test_cli_picks_ppo_for_gae(tiny_model_dir, tmp_path):
    from grpokit.policy.critic import Critic
    from grpokit.trainer import Trainer

    tr = Trainer(config(tiny_model_dir, tmp_path / "run", "algorithm.beta=0.04"))
    assert isinstance(tr.critic, Critic)
    # The KL goes into the reward; the policy loss runs with beta = 0 and the reference is kept.
    assert tr.critic.kl_coef == 0.04 and tr.loss_options.beta == 0.0 and tr.cfg.algorithm.beta == 0.04
    assert tr.ref is not None
    assert sum(p.numel() for p in tr.critic.model.parameters()) > 0.9 * sum(
        p.numel() for p in tr.model.parameters()
    )


@pytest.mark.slow
def test_ppo_reward_rises(tiny_model_dir, tmp_path):
    from grpokit.trainer import Trainer  # the one loop, with a critic for advantage_estimator=gae

    cfg = config(tiny_model_dir, tmp_path / "run", "optim.max_steps=10", "checkpoint.save_every=0")
    Trainer(cfg).train()
    rows = read_metrics(tmp_path / "run")
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.25, (first, last)
    # Every documented value metric is logged, and the critic learns to predict the returns.
    for key in (
        "value/loss",
        "value/explained_variance",
        "value/clip_frac",
        "value/mean",
        "perf/peak_rss_mb",
    ):
        assert all(key in r for r in rows), key
    ev = [r["value/explained_variance"] for r in rows[-5:] if r["value/explained_variance"] is not None]
    assert ev and sum(ev) / len(ev) > 0.0, ev
    assert abs(rows[-1]["value/mean"] - rows[-1]["reward/mean"]) < 0.3


class Crash(Exception):
    pass


@pytest.mark.slow
def test_ppo_resume_restores_the_critic_exactly(tiny_model_dir, tmp_path):
    from grpokit.trainer import Trainer  # the one loop, with a critic for advantage_estimator=gae

    steps = [
        "optim.max_steps=3",
        "checkpoint.save_every=2",
        "checkpoint.keep_last=5",
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "optim.micro_batch_size=8",
    ]
    straight = Trainer(config(tiny_model_dir, tmp_path / "a", *steps))
    straight.train()

    def crash_at_3(step, metrics):
        if step == 3:
            raise Crash

    crashed = Trainer(config(tiny_model_dir, tmp_path / "b", *steps))
    with pytest.raises(Crash):
        crashed.train(on_log=crash_at_3)
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [2]

    resumed = Trainer(config(tiny_model_dir, tmp_path / "b", *steps))
    assert resumed.maybe_resume() == 2
    saved = torch.load(
        tmp_path / "b" / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False
    )
    for k, v in saved["critic"].items():
        assert torch.equal(resumed.critic.model.state_dict()[k], v), k
    opt = resumed.critic.optimizer.adamw.state_dict()
    assert opt["state"] and all(
        torch.equal(opt["state"][k]["exp_avg"], st["exp_avg"])
        for k, st in saved["critic_optimizer"]["state"].items()
    )
    resumed.train()
    assert resumed.step == 3
    # Bit for bit the same policy and critic as the uninterrupted run.
    for (n, p), (_, q) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip(
        straight.critic.model.named_parameters(), resumed.critic.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n


def test_ppo_refuses_a_grpo_checkpoint(tiny_model_dir, tmp_path):
    from grpokit.checkpoint import CheckpointError
    from grpokit.trainer import Trainer

    grpo = config(
        tiny_model_dir,
        tmp_path / "run",
        "algorithm.advantage_estimator=grpo",
        "optim.max_steps=1",
        "eval.max_samples=1",
    )
    Trainer(grpo).train()
    with pytest.raises(
        CheckpointError, match=r"another config \(algorithm.advantage_estimator: 'grpo' -> 'gae'"
    ):
        Trainer(
            config(tiny_model_dir, tmp_path / "run", "optim.max_steps=1", "eval.max_samples=1")
        ).maybe_resume()
    # Even when the change is allowed, a checkpoint without a critic cannot resume a run that has one.
    allowed = "checkpoint.allow_changes=[algorithm.advantage_estimator]"
    with pytest.raises(CheckpointError, match="no critic"):
        Trainer(
            config(tiny_model_dir, tmp_path / "run", "optim.max_steps=1", "eval.max_samples=1", allowed)
        ).maybe_resume()


def test_value_mean_is_v_old_and_not_overwritten_by_the_update(tiny_model_dir, tmp_path):
    """value/mean is the critic at rollout time (docs/ppo.md); the update's own mean is value/new_mean.
    Both used to be named value/mean, and the update's silently replaced V_old in the step's metrics."""
    from grpokit.trainer import Trainer

    tr = Trainer(config(tiny_model_dir, tmp_path / "run", "optim.max_steps=1", "algorithm.num_iterations=2"))
    torch.nn.init.normal_(tr.critic.model.head.weight)  # V != 0; the second pass sees the updated critic
    batch, metrics, _ = tr.rollout([tr.train_data[i] for i in tr.sampler.next()])
    v_old = batch.value_targets.values[batch.tokens.completion_mask.bool()].mean().item()
    assert metrics["value/mean"] == pytest.approx(v_old, rel=1e-5)
    stats = tr.update(batch)
    merged = {**metrics, **stats}  # as the loop merges them
    assert merged["value/mean"] == pytest.approx(v_old, rel=1e-5)
    assert stats["value/new_mean"] != pytest.approx(v_old, rel=1e-3)  # the update moved V

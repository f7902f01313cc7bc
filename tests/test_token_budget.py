"""optim.max_tokens_per_micro_batch: micro-batches sized in tokens give the whole minibatch's gradient (every
loss type, padded and padding-free, with the passes that even out the ranks' counts), the pi_old / pi_ref
log-probs and the PPO critic's step; the bin packing, the evening out and the dealing to ranks on worked
numbers. (Two ranks against one process: tests/test_distributed.py, the cases with "tokens".)"""

import logging

import pytest
import torch

from grpokit.algorithm import loss_options
from grpokit.data.batch import pack_sequences
from grpokit.data.micro_batches import (
    MicroBatching,
    balance,
    even_out,
    run_cost,
    sequence_tokens,
    token_micro_batches,
)
from grpokit.metrics.compute import MeanAccumulator
from grpokit.policy import batched_logprobs
from grpokit.trainer import Trainer
from tests.helpers import tiny_config

# prompts of 2, 3, 1, 2 tokens; completions of 6, 1, 3, 2: sequences of 8, 4, 4, 4 tokens
PROMPTS = [[1, 2], [1, 2, 3], [4], [5, 6]]
COMPS = [[7] * 6, [7], [7] * 3, [7] * 2]


@pytest.fixture(scope="module")
def tokens():
    return pack_sequences(PROMPTS, COMPS, pad_id=0)


def lists(runs):
    return [r.tolist() for r in runs]


def test_first_fit_decreasing_in_padded_and_packed_tokens(tokens):
    idx = torch.arange(4)
    # packed (sums): 8 alone fills a run of 9; then 4 + 4 = 8, and the last 4 opens a third run
    assert lists(token_micro_batches(idx, tokens, 9, packed=True)) == [[0], [1, 2], [3]]
    assert lists(token_micro_batches(idx, tokens, 12, packed=True)) == [[0, 1], [2, 3]]
    # padded: rows x (longest prompt + longest completion). Row 0 (2 + 6) with row 1 (3 + 1) is
    # 2 x (3 + 6) = 18 > 12; rows 1, 2, 3 together are 3 x (3 + 3) = 18 > 12, rows 1 and 2 are 2 x 6 = 12
    assert lists(token_micro_batches(idx, tokens, 12, packed=False)) == [[0], [1, 2], [3]]
    assert lists(token_micro_batches(idx, tokens, 100, packed=False)) == [[0, 1, 2, 3]]
    prompt = torch.tensor([len(p) for p in PROMPTS])
    completion = torch.tensor([len(c) for c in COMPS])
    for budget in range(8, 30):
        for packed in (False, True):
            runs = token_micro_batches(idx, tokens, budget, packed)
            assert sorted(sum(lists(runs), [])) == [0, 1, 2, 3]  # every row once
            for r in runs:
                assert run_cost(prompt[r], completion[r], packed) <= budget
            # what the trimmed micro-batch really computes is the padded cost
            assert [tokens.rows(r).input_ids.numel() for r in runs] == [
                run_cost(prompt[r], completion[r], False) for r in runs
            ]


def test_a_sequence_over_the_budget_runs_alone(tokens, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit.data.micro_batches"):
        runs = token_micro_batches(torch.tensor([3, 0, 1]), tokens, 5, packed=True)
    assert lists(runs) == [[0], [3], [1]]  # longest first; ties in the order given
    assert caplog.messages == [
        "a sequence of 8 tokens is over optim.max_tokens_per_micro_batch=5: it runs alone"
    ]


def test_even_out_splits_the_costliest_run_then_adds_fillers(tokens):
    costs = sequence_tokens(tokens)  # [8, 4, 4, 4]
    runs = [torch.tensor([1, 2, 3]), torch.tensor([0])]
    assert even_out(runs, 2, costs, True) == [(runs[0], False), (runs[1], False)]
    out = even_out(runs, 3, costs, True)  # the run of 12 tokens splits: rows 1, 2 | 3
    assert [(r.tolist(), f) for r, f in out] == [([1, 2], False), ([3], False), ([0], False)]
    out = even_out(runs, 6, costs, True)  # every run one row: two fillers, a real row each
    assert [(r.tolist(), f) for r, f in out] == [
        ([1], False),
        ([2], False),
        ([3], False),
        ([0], False),
        ([1], True),
        ([1], True),
    ]


def test_balance_deals_equal_counts_of_about_equal_tokens():
    costs = torch.tensor([9, 1, 8, 2, 7, 3, 1, 1])
    shares = balance(torch.arange(8), costs, 2)
    assert [len(s) for s in shares] == [4, 4]
    assert sorted(sum(lists(shares), [])) == list(range(8))
    # costliest first, each to the lighter share with room: 9 3 2 1 | 8 7 1 1 (cut in order: 20 | 12)
    assert [int(costs[s].sum()) for s in shares] == [15, 17]
    assert [int(costs[s].sum()) for s in torch.arange(8).chunk(2)] == [20, 12]
    three = balance(torch.tensor([0, 2, 4, 6, 1, 3]), costs, 3)  # rows of a minibatch, in any order
    assert [len(s) for s in three] == [2, 2, 2]


def test_rows_and_tokens_are_refused_together(tiny_model_dir, tmp_path):
    both = ("optim.micro_batch_size=4", "optim.max_tokens_per_micro_batch=512")
    with pytest.raises(
        ValueError, match=r"micro_batch_size=4 and optim\.max_tokens_per_micro_batch=512 both"
    ):
        tiny_config(tiny_model_dir, tmp_path, *both)


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """One rollout batch of mixed lengths (beta > 0: pi_ref's log-probs in it) and its trainer."""
    cfg = tiny_config(
        tiny_model_dir, tmp_path_factory.mktemp("budget"), "algorithm.beta=0.04", "checkpoint.save_every=0"
    )
    trainer = Trainer(cfg)
    torch.manual_seed(0)
    batch, _, _ = trainer.rollout([trainer.train_data[i] for i in trainer.sampler.next()])
    lengths = batch.tokens.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and len(lengths) == 32  # mixed lengths
    yield trainer, batch
    trainer.close()


def gradient(trainer, batch, batching, monkeypatch, more=0):
    """The minibatch's loss, gradients and metrics in the micro-batches of `batching`, as if another rank had
    `more` micro-batches more."""
    monkeypatch.setattr(trainer, "batching", batching)
    monkeypatch.setattr(trainer.world, "most", lambda n: n + more)
    trainer.optimizer.zero_grad()
    acc = MeanAccumulator()
    N = batch.rewards.numel()
    loss, why = trainer._accumulate_gradient(batch, torch.arange(N), first_pass=True, acc=acc)
    assert loss is not None, why
    return loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, acc.means()


@pytest.mark.parametrize(
    "loss_type, level",
    [(t, "token") for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "gmpo")]
    + [("grpo", "sequence")],  # GSPO
)
@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_gives_the_whole_minibatch_gradient(run, monkeypatch, loss_type, level, packed):
    trainer, batch = run
    alg = trainer.cfg.algorithm.model_copy(
        update={"loss_type": loss_type, "importance_sampling_level": level}
    )
    monkeypatch.setattr(trainer, "loss_options", loss_options(alg, trainer.cfg.rollout.max_completion_length))
    monkeypatch.setattr(trainer.cfg.model, "padding_free", packed)
    N = batch.rewards.numel()
    whole = gradient(trainer, batch, MicroBatching(N, packed=packed), monkeypatch)
    budget = MicroBatching(N, max_tokens=64, packed=packed)
    runs = budget.split(torch.arange(N), batch.tokens)
    assert len(runs) > 2  # the budget splits the minibatch
    cut = gradient(trainer, batch, budget, monkeypatch)
    # as if another rank had N + 2 micro-batches: every run split down to one row, then two fillers
    evened = gradient(trainer, batch, budget, monkeypatch, more=N + 2 - len(runs))
    assert cut[2]["perf/micro_batches"] == len(runs) and evened[2]["perf/micro_batches"] == N + 2
    for other in (cut, evened):
        assert other[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-7)  # the minibatch's loss
        for k in ("policy/kl", "policy/clip_frac", "policy/entropy"):  # fillers add to no metric
            assert other[2][k] == pytest.approx(whole[2][k], rel=1e-5, abs=1e-7), k
        for name, g in whole[1].items():
            torch.testing.assert_close(other[1][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_anchor_logprobs_in_token_micro_batches(run):
    trainer, batch = run
    N, mask = batch.rewards.numel(), batch.tokens.completion_mask.bool()
    ref = trainer.policy.ref_forward
    whole = batched_logprobs(ref, batch.tokens, MicroBatching(N))
    torch.testing.assert_close(whole[mask], batch.ref_logp[mask], rtol=1e-5, atol=1e-6)
    for packed in (False, True):
        for most in (lambda n: n, lambda n: n + 3):  # fillers' log-probs are dropped
            logp = batched_logprobs(ref, batch.tokens, MicroBatching(N, 48, packed=packed), most=most)
            torch.testing.assert_close(logp[mask], whole[mask], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mu2", "ppo"])
def test_one_step_with_a_token_budget_equals_one_without(tiny_model_dir, tmp_path, case):
    """A whole step (pi_old, pi_ref, mu = 2 passes of 2 minibatches; or PPO with its critic) with
    micro-batches of at most 40 tokens gives the weights of whole minibatches."""
    extra = {
        "mu2": ["algorithm.num_iterations=2", "optim.num_minibatches=2", "algorithm.beta=0.04"],
        "ppo": ["algorithm.advantage_estimator=gae", "ppo.critic_learning_rate=1e-3"],
    }[case]
    weights, metrics = {}, {}
    for budget in (0, 40):
        cfg = tiny_config(
            tiny_model_dir,
            tmp_path / str(budget),
            "optim.max_steps=1",
            "checkpoint.save_every=0",
            "optim.adam_epsilon=1e-4",  # see tests/dist_cases.py: float noise must not flip Adam's sign steps
            f"optim.max_tokens_per_micro_batch={budget}",
            *extra,
        )
        torch.manual_seed(0)
        trainer = Trainer(cfg)
        metrics[budget] = trainer.train()
        modules = [trainer.model] + ([trainer.critic.model] if trainer.critic is not None else [])
        weights[budget] = {
            f"{i}.{n}": p.detach().clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
        }
    assert metrics[40]["perf/micro_batches"] > metrics[0]["perf/micro_batches"] == 1
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[40][name], w, rtol=1e-5, atol=1e-6, msg=name)

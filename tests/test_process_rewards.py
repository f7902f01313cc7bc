"""Process (step) rewards end to end (DeepSeekMath §4.1.3): StepScores from a reward function,
through the reward manager and the character -> token mapping, to the trainer's [N, T] advantages."""

import math
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError
from grpokit.data.batch import process_rewards, step_token_ends, token_char_ends
from grpokit.rewards import RewardManager, RewardSpec, StepScores
from grpokit.tasks import get_task, reward_registry
from grpokit.tasks.countdown import countdown_steps
from grpokit.tasks.tokenizer import build_tokenizer
from grpokit.trainer import Trainer
from tests.helpers import NO_TASK, ScriptedEngine, read_metrics, tiny_config

HERE = Path(__file__)


# Reward functions loaded by file path in the trainer tests below.
def seven_steps(completions, **kwargs):
    """Toy step reward: every character is a step, scoring 1 if it is '7'."""
    return [
        StepScores([float(c == "7") for c in t], list(range(1, len(t) + 1))) if t else None
        for t in completions
    ]


def length_outcome(completions, **kwargs):
    """An outcome (float) reward to mix with step rewards."""
    return [len(c) / 10 for c in completions]


# ---------------------------------------------------------------- the built-in step reward


@pytest.mark.parametrize(
    "text, scores, ends, outcome",
    [
        ("7-3=4,4*2=8,8+9=17", [1, 1, 2], [5, 11, 18], 1),  # right: every step 1, the target +1
        ("7-3=4,4*2=8,8+9=16", [1, 1, 0], [5, 11, 18], 0),  # wrong arithmetic in the last step
        ("7-3=4,4*2=8,8*9=72", [1, 1, 1], [5, 11, 18], 0),  # valid steps, misses the target
        ("7-3=4,4*5=20", [1, 0], [5, 12], 0),  # 5 is not available: stop, the step runs to the end
        ("7-3=4,", [1, 0], [5, 6], 0),  # an empty step after the comma
        ("(7-3)*2+9", [0], [9], 0),  # an expression is not a step
        ("", [0], [0], 0),
        ("9+7=16,16-3=13,13+2=15", [1, 1, 1], [6, 14, 22], 0),  # uses every number, wrong target
    ],
)
def test_countdown_steps_worked(text, scores, ends, outcome):
    (got,) = countdown_steps([text], [[7, 3, 2, 9]], [17])
    assert got == StepScores([float(s) for s in scores], ends, float(outcome))
    # The offsets cut the text into the steps (the separating comma starts the next one).
    assert text[: ends[0]] == text.split(",")[0] or scores[0] == 0


def test_countdown_steps_is_a_builtin_and_the_task_solutions_score_full():
    assert reward_registry()["countdown_steps"] is countdown_steps  # a config's rewards may name it
    task = get_task("countdown")
    rows = type(task)(solution_format="steps").make_rows("train", 20, seed=0)
    out = countdown_steps(
        [r["completion"] for r in rows], [r["numbers"] for r in rows], [r["target"] for r in rows]
    )
    for r, s in zip(rows, out, strict=True):
        assert s.outcome == 1.0 and s.scores == [1.0] * (len(s.scores) - 1) + [2.0], r
        assert s.ends[-1] == len(r["completion"])


# ---------------------------------------------------------------- StepScores and the manager


def test_step_scores_reject_bad_shapes():
    for scores, ends in [
        ([1.0], [1, 2]),
        ([], []),
        ([1.0, 0.0], [3, 3]),
        ([float("nan")], [1]),
        ([1.0], [-1]),
        ([1.0], [1.5]),
    ]:
        with pytest.raises(ValueError, match="StepScores"):
            StepScores(scores, ends)
    assert StepScores([1.0, 2.0], [1, 4]).value == 3.0  # default: the sum
    assert StepScores([1.0, 2.0], [1, 4], outcome=0.5).value == 0.5


def test_manager_accepts_step_scores_and_isolates_bad_ones(caplog):
    texts = ["abcd", "abcd", "ab", "abc"]

    def fn(completions, **kwargs):
        return [
            StepScores([1.0, 0.0], [2, 4]),  # fine, value 1.0
            0.5,  # a float from a step function: an outcome reward
            StepScores([1.0], [5]),  # past the end of "ab": invalid, counted
            None,
        ]

    manager = RewardManager([RewardSpec(function=fn, name="steps")])
    out = manager(prompts=[""] * 4, completions=texts, completion_ids=[[0]] * 4)
    assert torch.equal(out.per_function["steps"].isnan(), torch.tensor([False, False, True, True]))
    assert out.per_function["steps"][:2].tolist() == [1.0, 0.5]
    assert out.errors["steps"] == 1
    assert out.steps["steps"][0] == StepScores([1.0, 0.0], [2, 4]) and out.steps["steps"][1:] == [None] * 3
    assert "past the end" in caplog.text
    metrics = out.metrics()
    assert metrics["reward/steps/steps"] == 2.0

    def raises(completions, **kwargs):
        return [StepScores([1.0], [1, 2])] * 4  # built wrong: the function raises, isolated as usual

    out = RewardManager([RewardSpec(function=raises, name="bad"), RewardSpec(function=fn, name="ok")])(
        prompts=[""] * 4, completions=texts, completion_ids=[[0]] * 4
    )
    assert out.errors["bad"] == 4 and out.per_function["bad"].isnan().all()
    assert "bad" not in out.steps and out.total[0].item() == 1.0


# ---------------------------------------------------------------- characters -> tokens


def test_char_tokenizer_step_ends():
    tok = build_tokenizer(get_task("countdown"))
    text = "7-3=4,4*2=8"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert token_char_ends(tok, ids) == list(range(1, 12)) + [11]  # EOS decodes to nothing
    # "7-3=4" ends at character 5 -> its last token is index 4; the final step takes EOS too.
    assert step_token_ends([5, 11], token_char_ends(tok, ids), len(text)) == [4, 11]  # 11: EOS
    assert step_token_ends([0, 1], token_char_ends(tok, ids), len(text)) == [0, 0]


def bpe_tokenizer():
    """A byte-level BPE trained here on countdown solutions (no download), multi-character tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = type(get_task("countdown"))(solution_format="steps").make_rows("train", 300, seed=1)
    tk = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([r["completion"] for r in rows] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>")


@pytest.mark.parametrize("text", ["7-3=4,4*2=8,8+9=17", "12*3=36,36-20=16", "ü+é=ß,10+10=20", "3-1=2, 2*2=4"])
def test_bpe_tokenizer_step_ends(text):
    tok = bpe_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    pieces = [tok.decode([i]) for i in ids]
    if text.isascii():
        assert any(len(p) > 1 for p in pieces), pieces  # really multi-character tokens
    for with_eos in (False, True):
        full = ids + [tok.eos_token_id] if with_eos else ids
        char_ends = list(range(len(text) + 1))  # a step ending at every possible offset
        got = step_token_ends(char_ends, token_char_ends(tok, full), len(text))
        for e, k in zip(char_ends, got, strict=True):
            if e == len(text):
                assert k == len(full) - 1  # the final step owns the last token (EOS included)
                continue
            # k is the first token after which the text up to e is complete.
            assert tok.decode(full[: k + 1], skip_special_tokens=True).startswith(text[:e])
            assert k == 0 or not tok.decode(full[:k], skip_special_tokens=True).startswith(text[:e]) or e == 0


# ---------------------------------------------------------------- the trainer's [N, T] advantages


ROWS = [
    {"prompt": "7 3 2 9>17=", "numbers": [7, 3, 2, 9], "target": 17},
    {"prompt": "1 2 3>9=", "numbers": [1, 2, 3], "target": 9},
]
SCRIPT = {  # prompt -> G completions (text, stopped with EOS?)
    "7 3 2 9>17=": [
        ("7-3=4,4*2=8,8+9=17", True),
        ("7-3=4,4*2=8,8+9=16", True),
        ("7-3=4,4*5=20", True),
        ("9+9=1", False),
    ],
    "1 2 3>9=": [("1+2=3,3*3=9", True), ("1+2=3,3+3=6", True), ("2*3=6,6+1=7", False), ("1+2=3,3*3=9", True)],
}


def scripted_engine(tokenizer):
    """Fixed completions per prompt, so advantages can be checked against a hand reference."""
    return ScriptedEngine(
        tokenizer, lambda prompt, n, _: SCRIPT[tokenizer.decode(prompt, skip_special_tokens=True)][:n]
    )


def trainer_config(model_dir, out, rewards, *extra):
    return tiny_config(
        model_dir,
        out,
        *NO_TASK,
        f"rewards={rewards}",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=24",
        "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
        "checkpoint.save_every=0",
        *extra,
    )


def reference_advantages(weights, eps):
    """DeepSeekMath §4.1.3 by hand on the character tokenizer (token k = character k, EOS after
    the text): step rewards weight x score at their end tokens, an outcome reward at the last
    token, same-token rewards added; all steps of a group normalized together (population std);
    A[i, t] = sum of the normalized rewards of the steps ending at or after t."""
    completions = [c for r in ROWS for c in SCRIPT[r["prompt"]]]
    T = max(len(t) + s for t, s in completions)
    per_completion = []
    for r in ROWS:
        for text, stop in SCRIPT[r["prompt"]]:
            last = len(text) + stop - 1
            at = {}
            (steps,) = countdown_steps([text], [r["numbers"]], [r["target"]])
            for score, end in zip(steps.scores, steps.ends, strict=True):
                k = last if end == len(text) else end - 1
                at[k] = at.get(k, 0.0) + weights[0] * score
            if len(weights) > 1:
                at[last] = at.get(last, 0.0) + weights[1] * len(text) / 10
            per_completion.append(at)
    G = 4
    out = [[0.0] * T for _ in per_completion]
    for g in range(len(per_completion) // G):
        group = per_completion[g * G : (g + 1) * G]
        flat = [v for at in group for v in at.values()]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
        for j, at in enumerate(group):
            for t in range(T):
                out[g * G + j][t] = sum((v - mean) / (std + eps) for k, v in at.items() if k >= t)
    return torch.tensor(out)


@pytest.mark.parametrize("mixed", [False, True])
def test_trainer_advantages_match_the_papers_loop(tiny_model_dir, tmp_path, mixed):
    rewards = "[{function: countdown_steps}" + (
        f", {{function: '{HERE}:length_outcome', weight: 0.5}}]" if mixed else "]"
    )
    trainer = Trainer(trainer_config(tiny_model_dir, tmp_path, rewards), train_rows=list(ROWS), eval_rows=[])
    trainer.pipeline.engine = scripted_engine(trainer.tokenizer)
    batch, metrics, _ = trainer.rollout([trainer.train_data[i] for i in range(2)])
    want = reference_advantages([1.0, 0.5] if mixed else [1.0], eps=trainer.cfg.algorithm.std_eps)
    assert batch.advantages.shape == want.shape == batch.tokens.completion_mask.shape
    torch.testing.assert_close(batch.advantages, want, rtol=1e-5, atol=1e-5)
    assert metrics["reward/countdown_steps"] == pytest.approx(3 / 8)  # outcome: 3 right of 8
    assert metrics["reward/countdown_steps/steps"] == pytest.approx(sum([3, 3, 2, 1, 2, 2, 2, 2]) / 8)
    # The loss takes the [N, T] advantages token by token. In this first pass pi_theta = pi_old (ratio 1,
    # nothing clipped) and beta = 0, so the grpo loss is -1/N sum_i 1/|o_i| sum_t A[i, t] over each
    # completion's tokens (EOS included; `want` is 0 past them): an update that broadcast one advantage
    # per completion, or normalized otherwise, would give another number.
    lengths = torch.tensor([len(text) + stop for r in ROWS for text, stop in SCRIPT[r["prompt"]]])  # [N]
    want_loss = -(want.sum(dim=1) / lengths).mean().item()
    stats = trainer.update(batch)
    assert stats["policy/loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-6)


def test_step_rewards_need_the_group_zscore(tiny_model_dir, tmp_path):
    cfg = trainer_config(
        tiny_model_dir, tmp_path, "[{function: countdown_steps}]", "algorithm.scale_rewards=none"
    )
    trainer = Trainer(cfg, train_rows=list(ROWS), eval_rows=[])
    trainer.pipeline.engine = scripted_engine(trainer.tokenizer)
    with pytest.raises(ConfigError, match="scale_rewards=group"):
        trainer.rollout([trainer.train_data[i] for i in range(2)])


def test_process_rewards_merge_same_token_steps():
    tok = build_tokenizer(get_task("countdown"))
    texts = ["1+2=3"]
    ids = [tok(texts[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]

    def a(completions, **kw):
        return [StepScores([1.0, 2.0], [2, 5])]

    def b(completions, **kw):
        return [StepScores([3.0], [2])]  # ends with a's first step: one step of 1 + 0.5 * 3

    out = RewardManager([RewardSpec(function=a, name="a"), RewardSpec(function=b, name="b", weight=0.5)])(
        prompts=[""], completions=texts, completion_ids=ids
    )
    rewards, ends = process_rewards(out, texts, ids, tok)
    assert ends[0].tolist() == [1, 5] and rewards[0].tolist() == [2.5, 2.0]


# ---------------------------------------------------------------- end to end


def test_end_to_end_with_step_rewards(tiny_model_dir, tmp_path):
    rewards = f"[{{function: countdown_steps}}, {{function: '{HERE}:seven_steps'}}]"
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path / "run",
        rewards,
        "data.task=countdown",
        "data.task_train_size=50",
        "data.eval_size=0",
        "rollout.max_completion_length=8",
        "optim.max_steps=3",
        "optim.learning_rate=1e-3",
        "algorithm.num_iterations=2",
        "algorithm.dynamic_sampling=true",  # groups re-assembled with their steps
    )
    trainer = Trainer(cfg)
    seen = []
    update = trainer.update
    trainer.update = lambda b: (seen.append(b), update(b))[1]
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    for key in [
        "reward/countdown_steps",
        "reward/countdown_steps/steps",
        "reward/seven_steps/steps",
        "advantage/std",
        "policy/loss",
    ]:
        assert all(key in r for r in rows if "reward/mean" in r), key
    assert len(seen) == 3
    for b in seen:
        assert b.advantages.shape == b.tokens.completion_mask.shape
        assert torch.isfinite(b.advantages).all()
        assert (b.advantages[~b.tokens.completion_mask.bool()] == 0).all()
    # Token-varying: some completion's tokens get different advantages.
    varying = [
        len(set(b.advantages[i][b.tokens.completion_mask[i].bool()].tolist())) > 1
        for b in seen
        for i in range(b.advantages.shape[0])
    ]
    assert any(varying)
    assert (tmp_path / "run" / "final").is_dir()

"""Reward models (rewards: [{model: PATH}], grpokit/rewards/model.py): a tiny real
LlamaForSequenceClassification built here, its weights set by hand so that its score is the share of '7's in
the text, drives a GRPO run.

Run: .venv/bin/python -m pytest tests/test_reward_model.py
"""

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from grpokit.rewards.model import RewardModel
from grpokit.trainer import Trainer
from tests.helpers import read_metrics, tiny_config

CHAT = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.fixture(scope="module")
def sevens_rm(tiny_model_dir, tmp_path_factory):
    """A one-layer reward model whose score is (about) 10 x the share of '7' among the tokens of the text.

    The token embeddings are 0 in dims 0 and 1, except '7', which has 4 in dim 0. q = k = 0, so attention is a
    uniform mean over the prefix; v reads dim 0 into head 0 and o writes it to dim 1; the MLP is off. The last
    token's hidden state then holds the prefix's share of '7's (scaled by the norms) in dim 1, which the score
    head reads."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg)
    seven = tok.convert_tokens_to_ids("7")
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_()
        emb[:, :2] = 0
        emb[seven, 0] = 4.0
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        for w in (
            attn.q_proj.weight,
            attn.k_proj.weight,
            attn.v_proj.weight,
            attn.o_proj.weight,
            mlp.down_proj.weight,
        ):
            w.zero_()
        attn.v_proj.weight[0, 0] = 1.0
        attn.o_proj.weight[1, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 1] = 10.0
    path = tmp_path_factory.mktemp("sevens_rm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_the_reward_model_scores_sevens_in_batches(sevens_rm):
    rm = RewardModel(str(sevens_rm), batch_size=2)
    prompts = ["3 4 5>12="] * 4
    scores = rm(prompts=prompts, completions=["1+2", "7+2", "77+7", "7777"])
    assert scores == sorted(scores) and scores[0] == pytest.approx(0.0, abs=1e-6) and scores[-1] > 1.0, scores
    alone = [
        RewardModel(str(sevens_rm), batch_size=1)(prompts=[p], completions=[c])[0]
        for p, c in zip(prompts, ["1+2", "77+7"], strict=False)
    ]
    assert alone == pytest.approx([scores[0], scores[2]], abs=1e-5)  # right padding does not change a score
    assert rm.model.dtype == torch.float32 and not any(
        p.requires_grad for p in rm.model.parameters()
    )  # its own dtype, frozen


def test_the_reward_models_chat_template_renders_prompt_and_completion(sevens_rm):
    rm = RewardModel(str(sevens_rm))
    assert rm.render(["2+2="], ["4"]) == ["2+2=4"]  # no chat template: plain prompt + completion
    rm.tokenizer.chat_template, rm.chat = CHAT, True
    chat_prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    assert rm.render(["2+2=", chat_prompt], ["4", [{"role": "assistant", "content": "4"}]]) == [
        "<u>2+2=<a>4",
        "<s>be brief<u>2+2=<a>4",
    ]


@pytest.mark.slow
def test_a_reward_model_drives_learning(tiny_model_dir, sevens_rm, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_model_dir,
        out,
        f"rewards=[{{model: '{sevens_rm}', kwargs: {{batch_size: 8}}}}]",
        "optim.max_steps=30",
        "checkpoint.save_every=0",
    )
    trainer = Trainer(cfg)
    assert trainer.rewards.names == [sevens_rm.name]
    trainer.train()
    rows = read_metrics(out)
    scores = [r[f"reward/{sevens_rm.name}"] for r in rows if f"reward/{sevens_rm.name}" in r]
    assert len(scores) == 30 and all(
        r["reward/mean"] == r[f"reward/{sevens_rm.name}"] for r in rows if "reward/mean" in r
    )
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > 2 * first and last > first + 0.5, (first, last)  # the reward model's score rises


def test_a_missing_reward_model_folder_gets_the_model_loaders_error(tmp_path):
    """The reward model loads through the one model loader: a local path that does not exist is named with
    its config key, as model.name_or_path's is, before transformers could take it for a hub id."""
    from grpokit.policy import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"rewards\[1\]\.model='\./no/such/rm': no such folder"):
        RewardModel("./no/such/rm", key="rewards[1].model")

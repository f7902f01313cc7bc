"""Conversational data as TRL has it: `prompt` a list of messages, rendered once with the tokenizer's chat
template; reward functions then get each completion as a list of messages ([{"role": "assistant", "content":
...}]), so a reward function written for TRL on chat data runs unchanged.

Run: .venv/bin/python -m pytest tests/test_chat_data.py
"""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from grpokit.data import PromptDataset
from grpokit.rewards import RewardManager
from grpokit.trainer import Trainer
from tests.helpers import NO_TASK, read_metrics, tiny_config

# A small Jinja chat template in the tiny tokenizer's characters: the system turn, then "(" user ")" per user
# turn, an assistant turn as its text followed by ",", and "=" as the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}>"
    "{% elif m['role'] == 'user' %}({{ m['content'] }}){% else %}{{ m['content'] }},{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)

REWARD_FILE = '''
import re

SEEN = []


def sevens_reward_func(completions, **kwargs):
    """Written as TRL documents conversational reward functions: the text is completion[0]["content"]."""
    SEEN.append((kwargs["prompts"][0], completions[0]))
    contents = [completion[0]["content"] for completion in completions]
    return [len(re.findall("7", c)) / max(len(c), 1) for c in contents]
'''


def chat_rows(n=64):
    return [
        {
            "prompt": [
                {"role": "system", "content": "1"},
                {"role": "user", "content": f"{a} {b}"},
                {"role": "assistant", "content": f"{a + b}"},
                {"role": "user", "content": f"{a} {b} {a}"},
            ],
            "target": a + b,
        }
        for a in range(8)
        for b in range(n // 8)
    ]


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_chat_prompts_are_rendered_once_with_the_chat_template(chat_model_dir):
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    ds = PromptDataset(chat_rows(8), tok)
    row = ds[3]
    assert (
        row.prompt_text == "<s>1>(3 0)3,(3 0 3)="
    )  # system, user, assistant, user turns, then the generation prompt
    assert (
        row.prompt_ids == tok(row.prompt_text, add_special_tokens=False)["input_ids"]
    )  # one BOS: the template's
    assert row.prompt_ids.count(tok.bos_token_id) == 1


def test_reward_functions_get_chat_completions_as_messages():
    seen = {}

    def trl_style(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"] == "7") for c in completions]

    def plain(completions, **kwargs):
        seen["plain"] = completions
        return [0.0] * len(completions)

    chat = [[{"role": "user", "content": "3 4"}]] * 2
    out = RewardManager([trl_style, plain])(prompts=chat, completions=["7", "8"], completion_ids=[[19], [20]])
    assert out.per_function["trl_style"].tolist() == [1.0, 0.0]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "7"}],
        [{"role": "assistant", "content": "8"}],
    ]
    assert seen["prompts"] == chat
    RewardManager([plain])(prompts=["3 4", "3 4"], completions=["7", "8"], completion_ids=[[19], [20]])
    assert seen["plain"] == ["7", "8"]  # plain-text prompts: strings, as TRL


@pytest.mark.slow
def test_a_trl_chat_reward_function_runs_unchanged_and_drives_learning(chat_model_dir, tmp_path):
    data, rewards_py, out = tmp_path / "chat.jsonl", tmp_path / "trl_rewards.py", tmp_path / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    rewards_py.write_text(REWARD_FILE)
    cfg = tiny_config(
        chat_model_dir,
        out,
        *NO_TASK,
        f"data.train_path={data}",
        f"rewards=[{{function: '{rewards_py}:sevens_reward_func'}}]",
        "optim.max_steps=30",
        "checkpoint.save_every=0",
    )
    trainer = Trainer(cfg)
    assert trainer.train_data[0].prompt_text.endswith(")=")  # rendered with the chat template
    trainer.train()
    import sys

    module = next(m for name, m in sys.modules.items() if name.startswith("grpokit_user_trl_rewards"))
    prompt, completion = module.SEEN[0]
    assert isinstance(prompt, list) and prompt[0] == {"role": "system", "content": "1"}
    assert isinstance(completion, list) and len(completion) == 1 and completion[0]["role"] == "assistant"
    assert isinstance(completion[0]["content"], str)
    rows = read_metrics(out)
    scores = [r["reward/sevens_reward_func"] for r in rows if "reward/sevens_reward_func" in r]
    assert len(scores) == 30
    first, last = sum(scores[:8]) / 8, sum(scores[-8:]) / 8
    assert last > first + 0.15, (first, last)

"""Threads: the count every command uses (threads=N / --threads N; 0 = auto), and the helpers a user brings
their own vocabulary with (grpokit.tasks.tokenizer / tiny_model parameters)."""
import pytest
import torch

from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer
from grpokit.threads import choose_threads, use_threads


@pytest.mark.parametrize(
    "requested,env,cores,load,expected",
    [
        (3, {"OMP_NUM_THREADS": "4"}, 2, 0.0, 3),  # the setting wins
        (0, {"OMP_NUM_THREADS": "4"}, 2, 0.0, 4),  # then OMP_NUM_THREADS
        (0, {"OMP_NUM_THREADS": "x"}, 2, 0.0, 2),  # a value that is not a count is ignored
        (0, {}, 2, 0.1, 2),  # an idle machine: every core
        (0, {}, 2, 1.0, 1),  # one other busy process on 2 cores: 1 thread
        (0, {}, 2, 7.5, 1),  # never below 1
        (0, {}, 16, 3.2, 13),
    ],
)
def test_choose_threads(requested, env, cores, load, expected):
    n, why = choose_threads(requested, environ=env, cores=cores, load=load)
    assert n == expected and why


def test_use_threads_sets_torch_and_says_so():
    before = torch.get_num_threads()
    try:
        line = use_threads(1)
        assert torch.get_num_threads() == 1 and line.startswith("threads: 1 (threads setting")
    finally:
        torch.set_num_threads(before)


def test_trainer_takes_the_threads_setting_and_logs_it(tiny_model_dir, tmp_path):
    import json

    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "data.task=countdown", "data.task_train_size=50",
                                 "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=4",
                                 "optim.max_steps=1", "algorithm.beta=0", "eval.at_start=false", "data.eval_size=0",
                                 "threads=1", "checkpoint.save_every=0", "logging.tensorboard=false", f"output_dir={tmp_path}"])
        Trainer(cfg).train()
        assert torch.get_num_threads() == 1
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["perf/threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_tokenizer_takes_special_tokens_order_and_bos():
    tok = build_tokenizer("cab+=", special_tokens={"pad_token": "[PAD]", "eos_token": "[EOS]"}, sort=False, add_bos=False)
    assert [tok.convert_ids_to_tokens(i) for i in range(len(tok))] == ["[PAD]", "[EOS]", "c", "a", "b", "+", "="]
    assert tok("ab=")["input_ids"] == [3, 4, 6]  # no BOS in front
    assert tok.bos_token_id is None and tok.unk_token_id is None and tok.eos_token_id == 1
    default = build_tokenizer("ba")
    assert [default.convert_ids_to_tokens(i) for i in range(len(default))] == ["<pad>", "<s>", "</s>", "<unk>", "a", "b"]
    with pytest.raises(ValueError, match="eos_token"):
        build_tokenizer("ab", special_tokens={"pad_token": "[PAD]"}, add_bos=False)
    with pytest.raises(ValueError, match="bos_token"):
        build_tokenizer("ab", special_tokens={"eos_token": "[EOS]"})
    with pytest.raises(ValueError, match="distinct"):
        build_tokenizer("ab", special_tokens={"eos_token": "a"}, add_bos=False)


def test_tiny_llama_takes_any_config_field():
    tok = build_tokenizer("ab")
    model = build_tiny_llama(tok, size="test", max_position_embeddings=64, tie_word_embeddings=False,
                             config={"rms_norm_eps": 1e-6, "num_key_value_heads": 2})
    c = model.config
    assert (c.max_position_embeddings, c.tie_word_embeddings, c.rms_norm_eps, c.num_key_value_heads) == (64, False, 1e-6, 2)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()

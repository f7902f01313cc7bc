"""One GRPO step on a fixed global batch, for tests/test_distributed.py: the same function runs in one process
(the reference) and, under torchrun, on every rank of a 2-process gloo world, for each strategy and case:

    torchrun --standalone --nproc_per_node 2 tests/dist_cases.py MODEL_DIR OUT_DIR

Rank 0 saves, per strategy and case, the whole parameters after the step and the step's metrics to OUT_DIR.
Completions come from FixedEngine: each is a function of its prompt and its index in the group, so
every world size trains on the same global batch (the rollout engine is the only stand-in; the model,
rewards, advantages, log-prob passes, losses, FSDP2 / DDP and the optimizer are the real ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from grpokit.config import load_config
from grpokit.rollout import Completions, RolloutEngine
from grpokit.trainer import Trainer

REWARD = f"{Path(__file__).parent / 'reward_fns.py'}:count_sevens"
CONSTANT_IF_EVEN = f"{Path(__file__).parent / 'reward_fns.py'}:even_target_constant"
STRATEGIES = ("fsdp2", "ddp")
#: every loss type; scale_rewards group and batch (and batch_centered); beta > 0; mu = 2 with 2 minibatches
CASES: dict[str, list[str]] = {
    "grpo-group-beta": ["algorithm.loss_type=grpo", "algorithm.scale_rewards=group", "algorithm.beta=0.04"],
    "bnpo-batch-mu2": [
        "algorithm.loss_type=bnpo",
        "algorithm.scale_rewards=batch",
        "algorithm.beta=0.0",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
    ],
    "dapo-batch_centered-beta-mu2-micro": [
        "algorithm.loss_type=dapo",
        "algorithm.scale_rewards=batch_centered",
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "optim.micro_batch_size=2",
    ],
    "dr_grpo-batch-beta-mu2": [
        "algorithm.loss_type=dr_grpo",
        "algorithm.scale_rewards=batch",
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "algorithm.mask_truncated_completions=true",
    ],
    # half the prompts (even targets) give groups of equal rewards: dropped, more rounds drawn, the batch
    # topped up
    "dapo-dynamic_sampling": [
        "algorithm.loss_type=dapo",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=3",
        "algorithm.beta=0.04",
        f"rewards=[{{function: '{CONSTANT_IF_EVEN}'}}]",
    ],
}
#: metrics that must not depend on the world size (whole-batch values)
SAME_METRICS = (
    "reward/mean",
    "reward/std",
    "reward/zero_std_frac",
    "reward/count_sevens",
    "reward/count_sevens/std",
    "advantage/mean",
    "advantage/std",
    "rollout/completion_len_min",
    "rollout/completion_len_max",
    "rollout/truncated_frac",
    "rollout/tokens",
    "policy/loss",
    "policy/kl",
    "policy/clip_frac",
    "policy/grad_norm",
    "policy/entropy",
    "policy/skipped_updates",
    "reward/even_target_constant",
    "rollout/sampling_rounds",
    "rollout/groups_drawn",
    "rollout/groups_dropped",
    "rollout/groups_topped_up",
)


class FixedEngine(RolloutEngine):
    """Completions decided by (prompt, index in the group): 1 to max_tokens characters of digits, some without
    EOS."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def sync_weights(self, model, version=None) -> None:
        pass

    def generate(self, prompt_token_ids, n, sampling) -> Completions:
        ids, texts, reasons = [], [], []
        for prompt in prompt_token_ids:
            for j in range(n):
                rng = np.random.default_rng([sum(prompt) * 131 + len(prompt), j])
                length = int(rng.integers(1, sampling.max_tokens + 1))
                text = "".join(str(d) for d in rng.choice([1, 7, 3, 7, 5], size=length))
                row = self.tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens]
                stop = length < sampling.max_tokens
                row = row + [self.tokenizer.eos_token_id] if stop else row
                ids.append(row)
                texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
                reasons.append("stop" if stop else "length")
        return Completions(ids, texts, reasons)


def config(model_dir, out, strategy: str, case: list[str]):
    return load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            "data.task=countdown",
            "data.task_train_size=64",
            "data.eval_size=0",
            f"rewards=[{{function: '{REWARD}'}}]",
            "rollout.prompts_per_step=4",
            "rollout.num_generations=4",
            "rollout.max_completion_length=6",
            "optim.learning_rate=1e-3",
            "checkpoint.save_every=0",
            "eval.at_start=false",
            # AdamW's first steps move each parameter by about lr x g / (|g| + eps): at eps = 1e-8 an element
            # whose gradient is float rounding (a sum that cancels) moves by up to +-lr whichever way the
            # rounding falls, so any change of summation order (one process with another micro-batch size too)
            # parts the weights by ~5e-6 relative. At 1e-4 the update is smooth in g and the weights show what
            # the gradients show (which are compared as well).
            "optim.adam_epsilon=1e-4",
            "logging.sample_every=0",
            f"output_dir={out}",
            f"distributed.strategy={strategy}",
            *case,
        ],
    )


def one_step(model_dir, out, strategy: str, case: list[str]) -> dict:
    """{"params": whole parameters after one step, "metrics": the step's metrics}, as every rank sees them."""
    trainer = Trainer(config(model_dir, out, strategy, case))
    trainer.pipeline.engine = FixedEngine(trainer.tokenizer)
    grads, step = {}, trainer.optimizer.step

    def first_step_grads(
        **kwargs,
    ):  # the gradient of the first optimizer step, whole (FSDP2: gathered on every rank)
        if not grads:
            grads.update(
                {
                    n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    for n, p in trainer.model.named_parameters()
                }
            )
        return step(**kwargs)

    trainer.optimizer.step = first_step_grads
    metrics, _ = trainer._step()
    full = trainer.world.full_model()
    return {
        "params": {k: v.detach().clone() for k, v in full.named_parameters()},
        "grads": grads,
        "metrics": metrics,
        "world": trainer.world,
    }


#: the case of the checkpoint test: beta > 0 with pi_ref reset to the policy after every step (so the
#: checkpoint holds pi_ref), mu = 2 and 2 minibatches (rank 0's generator draws the split)
RESUME_CASE = [*CASES["dr_grpo-batch-beta-mu2"], "algorithm.ref_policy=reset", "algorithm.ref_reset_every=1"]
#: FSDP2's memory switches, against one process without them: activation checkpointing (the same math) and
#: bf16 parameters and compute with fp32 reductions (MixedPrecisionPolicy; one process runs fp32)
FSDP2_CASES: dict[str, list[str]] = {
    "grpo-activation_checkpointing": [*CASES["grpo-group-beta"], "model.gradient_checkpointing=true"],
    "grpo-bf16": [*CASES["grpo-group-beta"], "distributed.mixed_precision=bf16"],
}


def train(model_dir, out, strategy: str, case: list[str], *extra: str) -> dict:
    """Trainer.train() to optim.max_steps=2 with a checkpoint after every step (resuming from `out` when it
    holds one): the whole parameters at the end, and the world."""
    trainer = Trainer(
        config(
            model_dir,
            out,
            strategy,
            [*case, "optim.max_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=5", *extra],
        )
    )
    trainer.pipeline.engine = FixedEngine(trainer.tokenizer)
    trainer.train()
    return {
        "params": {k: v.detach().clone() for k, v in trainer.world.full_model().named_parameters()},
        "world": trainer.world,
    }


def checkpoints(model_dir: str, out_dir: str) -> None:
    """Per strategy, at world size 2: a run of 2 steps (checkpoints at steps 1 and 2), then a copy of it cut
    back to step 1 and resumed to step 2; and the step-1 checkpoint of a one-process run (OUT_DIR/one-whole,
    written by tests/test_distributed.py before this launch) resumed to step 2. Rank 0 saves the final
    parameters of the three; tests/test_distributed.py resumes the first run's step-1 checkpoint in one
    process."""
    import shutil

    import torch.distributed as dist

    out = Path(out_dir)
    for strategy in STRATEGIES:
        run = out / f"{strategy}-whole"
        whole = train(model_dir, run, strategy, RESUME_CASE)
        main = whole["world"].is_main
        for source, cut in (
            (run, out / f"{strategy}-resumed"),
            (out / "one-whole", out / f"{strategy}-from-one"),
        ):
            if main:
                shutil.copytree(source / "checkpoints" / "step-000001", cut / "checkpoints" / "step-000001")
            dist.barrier()
        resumed = train(model_dir, out / f"{strategy}-resumed", strategy, RESUME_CASE)
        from_one = train(model_dir, out / f"{strategy}-from-one", strategy, RESUME_CASE)
        if main:
            torch.save(
                {"whole": whole["params"], "resumed": resumed["params"], "from_one": from_one["params"]},
                out / f"{strategy}.pt",
            )
    from_one["world"].teardown()


def main(model_dir: str, out_dir: str, mode: str = "steps") -> None:
    torch.set_num_threads(1)
    if mode == "checkpoints":
        return checkpoints(model_dir, out_dir)
    world = None
    for strategy in STRATEGIES:
        for name, case in (CASES | FSDP2_CASES if strategy == "fsdp2" else CASES).items():
            result = one_step(model_dir, Path(out_dir) / "runs" / f"{strategy}-{name}", strategy, case)
            world = result.pop("world")
            if world.is_main:
                torch.save(result, Path(out_dir) / f"{strategy}-{name}.pt")
    world.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])

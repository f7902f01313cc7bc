"""One GRPO step on a fixed global batch, for tests/test_distributed.py: the same function runs in one process
(the reference) and, under torchrun, on every rank of a 2-process gloo world, for each strategy and case:

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 tests/dist_cases.py MODEL_DIR OUT_DIR

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

from grpokit.rollout import Completions, RolloutEngine
from grpokit.trainer import Trainer
from tests.helpers import tiny_config

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
    # micro-batches of at most 32 tokens (padded: rows x longest): the ranks' counts differ and are evened out
    "dapo-tokens": [
        "algorithm.loss_type=dapo",
        "optim.max_tokens_per_micro_batch=32",
        "model.padding_free=false",
    ],
    # padding-free, mu = 2 with 2 minibatches: every minibatch's rows dealt to the ranks by tokens
    "grpo-tokens-mu2-packed": [
        "algorithm.loss_type=grpo",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "model.padding_free=true",
        "optim.max_tokens_per_micro_batch=32",
    ],
    # sequence parallelism over both ranks: each rank's micro-batches run as rows split over the two, in the
    # pi_old, pi_ref and training passes (beta > 0, mu = 2 with 2 minibatches)
    "grpo-sp2-beta-mu2": [
        "algorithm.loss_type=grpo",
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "model.padding_free=true",
        "distributed.sequence_parallel=2",
    ],
    # with micro-batches sized in tokens: the ranks' counts evened out, then each one's run in turn
    "dapo-sp2-tokens": [
        "algorithm.loss_type=dapo",
        "model.padding_free=true",
        "optim.max_tokens_per_micro_batch=34",
        "distributed.sequence_parallel=2",
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
    return tiny_config(
        model_dir,
        out,
        "data.task_train_size=64",
        "rollout.num_generations=4",
        "rollout.max_completion_length=6",
        "optim.learning_rate=1e-3",
        "algorithm.beta=0.04",  # the default (TINY_RUN's is 0.0); the cases set their own
        "checkpoint.save_every=0",
        # AdamW's first steps move each parameter by about lr x g / (|g| + eps): at eps = 1e-8 an element
        # whose gradient is float rounding (a sum that cancels) moves by up to +-lr whichever way the
        # rounding falls, so any change of summation order (one process with another micro-batch size too)
        # parts the weights by ~5e-6 relative. At 1e-4 the update is smooth in g and the weights show what
        # the gradients show (which are compared as well).
        "optim.adam_epsilon=1e-4",
        f"distributed.strategy={strategy}",
        *case,
    )


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole (FSDP2's DTensor shards gathered: every rank calls it)."""
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()


def _record_first_grads(module: torch.nn.Module, optimizer, grads: dict) -> None:
    """Fill `grads` with the whole gradients of the first step of `optimizer` (a grpokit Optimizer), by
    parameter name (the trainable ones: LoRA's base has none)."""
    step = optimizer.step

    def first_step_grads(**kwargs):
        if not grads:
            grads.update({n: _whole(p.grad) for n, p in module.named_parameters() if p.grad is not None})
        return step(**kwargs)

    optimizer.step = first_step_grads


def engine_bytes(trainer: Trainer) -> int:
    """The bytes of the parameters of the module the rollout engine generates with (FSDP2: its copy)."""
    return sum(p.numel() * p.element_size() for p in trainer.policy.whole.parameters())


def _record_update_bytes(trainer: Trainer, seen: list) -> None:
    """Append engine_bytes at each optimizer step of the policy (inside the update)."""
    step = trainer.optimizer.step

    def recording_step(**kwargs):
        seen.append(engine_bytes(trainer))
        return step(**kwargs)

    trainer.optimizer.step = recording_step


def whole_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A trained module's whole parameters, in their own dtype (every rank calls it)."""
    if hasattr(model, "reshard"):  # FSDP2: the sharded parameters, whatever the last forward left
        model.reshard()
    return {n: _whole(p) for n, p in model.named_parameters()}


def critic_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The PPO critic's whole parameters (every rank calls it)."""
    return whole_params(trainer.critic.model)


def one_step(model_dir, out, strategy: str, case: list[str]) -> dict:
    """{"params": whole parameters after one step, "grads": the first optimizer step's gradient, "metrics":
    the step's metrics; with the PPO critic also "critic_params" and "critic_grads"; "engine_bytes": the
    engine's parameter bytes in the update and after it (full_model)}, as every rank sees them."""
    trainer = Trainer(config(model_dir, out, strategy, case))
    trainer.pipeline.engine = FixedEngine(trainer.tokenizer)
    grads: dict[str, torch.Tensor] = {}
    _record_first_grads(trainer.model, trainer.optimizer, grads)
    critic_grads: dict[str, torch.Tensor] = {}
    if trainer.critic is not None:
        _record_first_grads(trainer.critic.model, trainer.critic.optimizer, critic_grads)
    in_update: list[int] = []
    _record_update_bytes(trainer, in_update)
    counts: list[int] = []  # this rank's micro-batch counts before they are evened out (token budgets)
    most = trainer.world.most
    trainer.world.most = lambda n: counts.append(n) or most(n)
    metrics, _ = trainer._step()
    trainer.world.parallel.full_model()
    out = {
        "engine_bytes": {"update": max(in_update), "after": engine_bytes(trainer)},
        "params": whole_params(trainer.model),
        "grads": grads,
        "metrics": metrics,
        "world": trainer.world,
        "micro_batch_counts": trainer.world.gather(counts),  # [rank][pass]
        "compiled": hasattr(trainer.policy.forward, "_orig_mod"),  # torch.compile's OptimizedModule
    }
    if trainer.critic is not None:
        out.update(critic_params=critic_params(trainer), critic_grads=critic_grads)
    return out


#: the case of the checkpoint test: beta > 0 with pi_ref reset to the policy after every step (so the
#: checkpoint holds pi_ref), mu = 2 and 2 minibatches (rank 0's generator draws the split)
RESUME_CASE = [*CASES["dr_grpo-batch-beta-mu2"], "algorithm.ref_policy=reset", "algorithm.ref_reset_every=1"]
#: FSDP2's memory switches, against one process without them: activation checkpointing (the same math) and
#: bf16 parameters and compute with fp32 reductions (MixedPrecisionPolicy; one process runs fp32)
FSDP2_CASES: dict[str, list[str]] = {
    "grpo-activation_checkpointing": [*CASES["grpo-group-beta"], "model.gradient_checkpointing=true"],
    "grpo-bf16": [*CASES["grpo-group-beta"], "distributed.mixed_precision=bf16"],
    "grpo-engine_bf16": [*CASES["grpo-group-beta"], "distributed.engine_copy=bf16"],
}


#: LoRA's B matrices start at 0, so after a step they are AdamW's first update alone, lr x g / (|g| + eps) per
#: element: at eps = 1e-4 the elements whose gradient is near eps weigh in the tensor's norm far more than in
#: the gradient's, and a 5e-7 difference of the gradient parts B by 2e-6. At eps = 1e-2 the update is about
#: linear in g, and the adapters' weights show what their gradients show (which are compared as well).
LORA = ["model.lora={r: 4, alpha: 8, target_modules: all-linear}", "optim.adam_epsilon=1e-2"]
PPO = ["algorithm.advantage_estimator=gae", "ppo.critic_learning_rate=1e-3"]
#: model.lora, the PPO critic and model.compile at W = 2, fsdp2 and ddp, against one process: one minibatch,
#: and mu = 2 with 2 minibatches (rows of both ranks in each) and micro-batches
COMBO_CASES: dict[str, list[str]] = {
    "lora-grpo-beta": [*CASES["grpo-group-beta"], *LORA],
    "lora-dapo-beta-mu2-micro": [*CASES["dapo-batch_centered-beta-mu2-micro"], *LORA],
    "critic-beta": [*PPO, "algorithm.beta=0.04"],
    "critic-mu2-micro": [
        *PPO,
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "optim.micro_batch_size=2",
    ],
    "critic-tokens-mu2": [
        *PPO,
        "algorithm.num_iterations=2",
        "optim.num_minibatches=2",
        "optim.max_tokens_per_micro_batch=32",
    ],
    # beta > 0 (pi_ref's forward compiled too), mu = 2 and 2 minibatches: every compiled graph in one case
    "compile-dr_grpo-beta-mu2": [*CASES["dr_grpo-batch-beta-mu2"], "model.compile=true"],
}
#: the resume cases of LoRA (the adapter checkpoint, from rank 0) and of the critic (in the sharded one)
COMBO_RESUME_CASES: dict[str, list[str]] = {
    "lora": [*CASES["dapo-batch_centered-beta-mu2-micro"], *LORA],
    "critic": [*PPO, "algorithm.num_iterations=2", "optim.num_minibatches=2"],
    "sp": CASES["grpo-sp2-beta-mu2"],  # sequence parallelism over both ranks
    # rollout.max_policy_lag=1 on the fast engine (DDP only: FSDP2 refuses lag), 3 steps: the step-1
    # checkpoint holds each rank's batch 1, generated ahead, and its sampler's generators (rank states)
    "lag": ["rollout.engine=fast", "rollout.max_policy_lag=1", "optim.max_steps=3"],
    # partial rollouts on the fast engine, chunks of 2 of 6 tokens, 4 steps: the step-1 checkpoint holds each
    # rank's groups in flight (rank states); the ranks draw and run rounds in step
    "partial": [
        "rollout.engine=fast",
        "rollout.partial_rollouts=true",
        "rollout.partial_chunk_tokens=2",
        "rollout.max_staleness=2",
        "rollout.temperature=1.5",
        "optim.max_steps=4",
    ],
}
#: the cases a strategy cannot run
UNSUPPORTED = {("fsdp2", "lag")}


def lagged(case: list[str]) -> bool:
    """Whether a case samples from older weights (rollout.max_policy_lag > 0, or partial rollouts): it keeps
    the engine that gives log-probs."""
    return "rollout.partial_rollouts=true" in case or any(
        c.startswith("rollout.max_policy_lag=") and c != "rollout.max_policy_lag=0" for c in case
    )


def train(model_dir, out, strategy: str, case: list[str], *extra: str) -> dict:
    """Trainer.train() to optim.max_steps=2 (unless the case says) with a checkpoint after every step
    (resuming from `out` when it holds one): the whole parameters at the end, and the world. The completions
    are FixedEngine's, except at lag (the run's own engine: lag needs its log-probs)."""
    trainer = Trainer(
        config(
            model_dir,
            out,
            strategy,
            ["optim.max_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=5", *case, *extra],
        )
    )
    if not lagged(case):
        trainer.pipeline.engine = FixedEngine(trainer.tokenizer)
    trainer.train()
    return {
        "params": {k: v.detach().clone() for k, v in trainer.world.parallel.full_model().named_parameters()},
        "critic_params": critic_params(trainer) if trainer.critic is not None else {},
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


def combo_checkpoints(model_dir: str, out_dir: str, names: list[str]) -> None:
    """Per strategy and COMBO_RESUME_CASES case (but UNSUPPORTED), at world size 2: a run of 2 steps (the
    case may say more; a checkpoint after each), and a copy of it cut back to step 1 and resumed to the end.
    Rank 0 saves both ends' parameters (and the critic's) to OUT_DIR/<strategy>-<case>.pt."""
    import shutil

    import torch.distributed as dist

    out, world = Path(out_dir), None
    for strategy in STRATEGIES:
        for name in names:
            if (strategy, name) in UNSUPPORTED:
                continue
            case = COMBO_RESUME_CASES[name]
            run, cut = out / f"{strategy}-{name}-whole", out / f"{strategy}-{name}-resumed"
            whole = train(model_dir, run, strategy, case)
            world = whole.pop("world")
            if world.is_main:
                shutil.copytree(run / "checkpoints" / "step-000001", cut / "checkpoints" / "step-000001")
            dist.barrier()
            resumed = train(model_dir, cut, strategy, case)
            resumed.pop("world")
            if world.is_main:
                torch.save({"whole": whole, "resumed": resumed}, out / f"{strategy}-{name}.pt")
    world.teardown()


def nodes(model_dir: str, out_dir: str, names: list[str]) -> None:
    """tests/test_distributed.py's two-node test, on each node (one rank each): per strategy, one step of each
    CASES case in `names` (rank 0 saves OUT_DIR/<strategy>-<case>.pt, as the `steps` mode does), and a run of
    RESUME_CASE to step 2 with a checkpoint after each step into OUT_DIR/<strategy>-whole (rank 0 saves its
    final weights to OUT_DIR/<strategy>-whole.pt); and where each rank ran (OUT_DIR/nodes.pt: per rank its
    network namespace, torchrun's GROUP_RANK and the MASTER_ADDR it was given)."""
    import os

    import torch.distributed as dist

    out, world = Path(out_dir), None
    for strategy in STRATEGIES:
        for name in names:
            result = one_step(model_dir, out / "runs" / f"{strategy}-{name}", strategy, CASES[name])
            world = result.pop("world")
            if world.is_main:
                torch.save(result, out / f"{strategy}-{name}.pt")
        whole = train(model_dir, out / f"{strategy}-whole", strategy, RESUME_CASE)
        if world.is_main:
            torch.save(whole["params"], out / f"{strategy}-whole.pt")
    where = [None] * world.size
    here = {"netns": os.readlink("/proc/self/ns/net")}
    dist.all_gather_object(where, here | {k: os.environ.get(k) for k in ("GROUP_RANK", "MASTER_ADDR")})
    if world.is_main:
        torch.save(where, out / "nodes.pt")
    world.teardown()


def main(model_dir: str, out_dir: str, mode: str = "steps", names: str = "") -> None:
    torch.set_num_threads(1)
    if mode == "checkpoints":
        return checkpoints(model_dir, out_dir)
    if mode == "combo_checkpoints":
        return combo_checkpoints(model_dir, out_dir, names.split(","))
    if mode == "nodes":
        return nodes(model_dir, out_dir, names.split(","))
    cases = {n: COMBO_CASES[n] for n in names.split(",")} if mode == "combos" else None
    world = None
    for strategy in STRATEGIES:
        for name, case in (cases or (CASES | FSDP2_CASES if strategy == "fsdp2" else CASES)).items():
            result = one_step(model_dir, Path(out_dir) / "runs" / f"{strategy}-{name}", strategy, case)
            world = result.pop("world")
            if world.is_main:
                torch.save(result, Path(out_dir) / f"{strategy}-{name}.pt")
    world.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])

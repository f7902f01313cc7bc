"""Optimizers: AdamW, the learning-rate schedules, and the guard that skips non-finite updates.

    opt = Optimizer(model.named_parameters(), cfg.optim, lr=cfg.optim.learning_rate, total_steps=1000)
    opt.zero_grad(); loss.backward()
    stats = opt.step(where="pass 1, minibatch 1")   # clip, then step + schedule; or skip a non-finite update

One schedule table (SCHEDULES) serves GRPO, the PPO critic and SFT. A non-finite loss or gradient
norm skips that optimizer step (counted in `skipped`); `max_consecutive_skips` in a row stop the run
with a TrainingError that says what was non-finite, where, and what to change.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. updates non-finite too many times in a row); the message says why."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, the CPU allocator's "can't allocate memory"
    (a RuntimeError), Python's MemoryError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


@contextlib.contextmanager
def out_of_memory_said(key: str, size: int, checkpointing: bool, rows: int, width: int):
    """An out-of-memory error inside a micro-batch's forward / backward (`rows` completions x `width`
    tokens) becomes a TrainingError that names the micro-batch and the settings that make it smaller
    (`key`, the config key that sizes micro-batches, now `size`; and, when the model does not checkpoint
    yet, checkpointing), instead of the allocator's message. (On Linux, a process past the machine's memory
    is usually killed by the kernel before the allocator fails: this is the case where it fails first, as on
    a GPU.)"""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        fixes = [f"{key}={size // 2} (now {size})"] if rows > 1 else []  # one completion: nothing to halve
        if not checkpointing:
            fixes.append("model.gradient_checkpointing=true")
        fixes.append("a lower rollout.max_completion_length")
        raise TrainingError(
            f"the training pass ran out of memory on a micro-batch of {rows} completions x {width} tokens: "
            f"set {' or '.join(fixes)}; checkpoints already saved are untouched and the same command resumes "
            "from the newest"
        ) from exc


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return max(0.0, 1.0 - progress)


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


#: LR multiplier after warm-up, as a function of progress in [0, 1] through the remaining steps.
SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier of optimizer step `step` (0-based): linear warm-up over `warmup` steps to 1, then
    SCHEDULES[kind] over the remaining total - warmup steps (clamped at the end)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; allowed: {', '.join(SCHEDULES)}")
    decay = SCHEDULES[kind]

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return decay((step - warmup) / max(1, total - warmup))

    return f


def adamw(
    params,
    *,
    lr: float,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    fused: bool | None = None,
):
    """AdamW. fused=None: one fused kernel over all parameters when they are all on CPU / CUDA (4-5x faster
    steps on CPU than a dozen ops per tensor; TRL's default is adamw_torch_fused too)."""
    params = list(params)
    flat = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    if fused is None:
        fused = all(p.device.type in ("cpu", "cuda") for p in flat) or None
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


class Optimizer:
    """AdamW + LR schedule + gradient clipping + the non-finite guard, for one set of trainable parameters.

    name: what is being trained, for messages ("optimizer" for the policy, "critic"); subject: what the
    loss and gradient are of ("value " for the critic); fix: what to tell the user when updates stay
    non-finite; fused: as adamw's."""

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        optim_cfg,
        *,
        lr: float,
        total_steps: int,
        name: str = "optimizer",
        subject: str = "",
        fix: str = "lower optim.learning_rate, check the rewards for NaN/inf, or use model.dtype=float32",
        fused: bool | None = None,
    ):
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.lr = lr
        self.params = [p for _, p in self.named]
        self.cfg = optim_cfg
        self.name, self.subject, self.fix = name, subject, fix
        self.adamw = adamw(
            self.params,
            lr=lr,
            betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2),
            eps=optim_cfg.adam_epsilon,
            weight_decay=optim_cfg.weight_decay,
            fused=fused,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.adamw,
            lr_lambda(
                optim_cfg.lr_scheduler,
                optim_cfg.warmup_steps or int(optim_cfg.warmup_ratio * total_steps),
                total_steps,
            ),
        )
        self.skipped = 0  # optimizer steps skipped over the whole run (checkpointed)
        self.consecutive_skips = 0

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def step(self, *, loss_finite: bool = True, where: str = "", at_step: int = 0) -> dict[str, float] | None:
        """Clip the gradient and take one optimizer + schedule step; returns grad_norm and lr. A non-finite
        loss (the caller stopped before backward) or gradient norm skips the step instead: returns None."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm or float("inf"))
        if not loss_finite or not torch.isfinite(grad_norm):
            if loss_finite:
                bad = [n for n, p in self.named if p.grad is not None and not torch.isfinite(p.grad).all()]
                where += f": first in {bad[0]}" if bad else ""
            self.skip("loss" if not loss_finite else "gradient norm", where, at_step)
            return None
        self.consecutive_skips = 0
        stats = {"grad_norm": grad_norm.item(), "lr": float(self.scheduler.get_last_lr()[0])}
        self.adamw.step()
        self.scheduler.step()
        return stats

    def skip(self, what: str, where: str, at_step: int) -> None:
        """Count a skipped optimizer step; too many in a row raise TrainingError."""
        self.zero_grad()
        self.skipped += 1
        self.consecutive_skips += 1
        limit = self.cfg.max_consecutive_skips
        if self.consecutive_skips >= limit:
            where = f", {where}" if where else ""
            kind = "optimizer" if self.name == "optimizer" else f"{self.name} optimizer"
            raise TrainingError(
                f"the {self.subject}{what} was non-finite in {limit} {kind} steps in a row (last at step "
                f"{at_step}{where}); no checkpoint with these weights was written. "
                f"{self.fix[0].upper() + self.fix[1:]}"
            )

    @property
    def _prefix(self) -> str:
        """The keys of this optimizer's state in a trainer state: the policy's bare, the critic's
        "critic_"."""
        return "" if self.name == "optimizer" else f"{self.name}_"

    def state_dict(self) -> dict:
        """The schedule's position and the skip count (a checkpoint part: grpokit/checkpoint/). AdamW's
        moments are the checkpoint's to save with the weights they belong to (one process, or every rank's
        shards)."""
        return {
            f"{self._prefix}scheduler": self.scheduler.state_dict(),
            f"{self._prefix}skipped_updates": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        """The schedule's position and skips from `state`, after the moments are in place; the hyperparameters
        (learning rate, betas, eps, weight decay) stay this config's, so that a change allowed on resume is
        applied, not silently undone."""
        self.scheduler.load_state_dict(state[f"{self._prefix}scheduler"])
        self.skipped = state.get(f"{self._prefix}skipped_updates", 0)
        cfg, step = self.cfg, self.scheduler.last_epoch
        for group, factor in zip(self.adamw.param_groups, self.scheduler.lr_lambdas, strict=True):
            group.update(
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_epsilon,
                weight_decay=cfg.weight_decay,
                initial_lr=self.lr,
            )
            group["lr"] = self.lr * factor(
                step
            )  # what LambdaLR computes for this step: the same float when nothing changed
        self.scheduler.base_lrs = [self.lr] * len(self.adamw.param_groups)
        self.scheduler._last_lr = [group["lr"] for group in self.adamw.param_groups]


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    """TrainingError "<what>: the weights hold NaN/inf (first in <name>)" when a parameter is not finite."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise TrainingError(f"{what}: the weights hold NaN/inf (first in {name})")


def non_finite(x: Tensor, n: int) -> str | None:
    """'k of n completions, first: completion i' when rows of x ([n] or [n, T]) hold NaN/inf, else None."""
    bad = (~torch.isfinite(x)).view(n, -1).any(1).nonzero().flatten().tolist()
    return f"{len(bad)} of {n} completions, first: completion {bad[0]}" if bad else None

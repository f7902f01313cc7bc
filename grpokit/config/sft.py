"""The config of `grpokit sft`: SFTSection (the `sft:` section, the optimizer fields with SFT's defaults) and
SFTConfig.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from grpokit.config.sections import (
    THREADS_DOC,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerSettings,
    Section,
    _with_defaults,
)

#: where SFT's optimizer defaults differ from training's: a larger learning rate (SFT starts from the
#: data, not from a policy to keep close), a cosine schedule with 5% warm-up, a little weight decay
SFT_OPTIMIZER_DEFAULTS: dict[str, Any] = dict(
    learning_rate=1e-4, lr_scheduler="cosine", warmup_ratio=0.05, weight_decay=0.01
)


@_with_defaults(**SFT_OPTIMIZER_DEFAULTS)
class SFTSection(OptimizerSettings):
    """`grpokit sft`: supervised warm-start on (prompt, completion) pairs (grpokit/sft.py). These are the
    defaults of `grpokit sft` and of grpokit.sft.train_sft alike. The optimizer fields are the same as
    `optim`'s, with SFT's own defaults: learning rate 1e-4, a cosine schedule, 5% warm-up, weight decay
    0.01."""

    epochs: float = Field(1.0, gt=0)
    """Passes over the training pairs (may be fractional); used when max_steps is 0."""
    max_steps: int = Field(0, ge=0)
    """Optimizer steps of batch_size pairs; 0 = as many as `epochs` takes."""
    batch_size: int = Field(32, ge=1)
    """Pairs per optimizer step."""
    max_length: int = Field(1024, ge=2)
    """Prompt + completion tokens per example; longer examples are cut (and counted)."""
    completion_column: str = "completion"
    """Column with the target text the model learns to write after the prompt."""
    log_every: int = Field(10, ge=1)
    """Write the loss to metrics.jsonl every this many steps."""
    eval_every: int = Field(0, ge=0)
    """Held-out loss and exact match every this many steps (0 = before and after training only)."""


class SFTConfig(Section):
    """What `grpokit sft CONFIG [key=value ...]` reads: the same model and data sections as training."""

    output_dir: str = "runs/sft"
    """metrics.jsonl, plots and final/ (the fine-tuned model and tokenizer) go here."""
    seed: int = 0
    """Seeds the order of the pairs and torch."""
    threads: int = Field(0, ge=0, description=THREADS_DOC)
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to fine-tune (the same section as in training; LoRA is refused)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The (prompt, completion) pairs: the same section as in training, plus sft.completion_column."""
    sft: SFTSection = Field(default_factory=SFTSection)
    """The supervised run itself: epochs or steps, batch size, AdamW and its schedule, evaluation."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics and experiment trackers (the same section as in training)."""

    @model_validator(mode="after")
    def _no_lora(self) -> SFTConfig:
        if self.model.lora is not None:
            raise ValueError(
                "model.lora is for `grpokit train`; `grpokit sft` trains every weight: drop model.lora from "
                "the SFT config"
            )
        return self

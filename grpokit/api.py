"""The Python API: what each `grpokit` command does, as one call.

    import grpokit

    last = grpokit.train("examples/config.yaml", ["optim.max_steps=50"])       # the last step's metrics
    scores = grpokit.evaluate("runs/example/final", "examples/config.yaml")    # held-out metrics of a model
                                                                               # folder
    stats = grpokit.sft("examples/sft.yaml", ["sft.max_steps=200"])             # the SFT warm start
    page = grpokit.report("runs/example")                                       # runs/example/report.html

`config` is a YAML path, a dict of sections (what the YAML would hold) or a Config; `overrides` are the
command line's `section.key=value` strings, applied on top. Errors are the same one-line exceptions the
command line prints (ConfigError, CheckpointError, ModelLoadError, TrainingError, DataError). Unlike the
command line, the API leaves torch's thread count alone unless the config sets `threads` (docs/threads.md).
docs/api.md has a whole example; tests/test_api.py runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from grpokit.config import Config, ConfigError, SFTConfig, load_config

ConfigLike = str | Path | Mapping[str, Any] | BaseModel | None


def _config(config: ConfigLike, overrides: list[str] | None, schema: type[BaseModel]) -> Any:
    """A validated config of `schema` from a path, a dict of sections or a config object, plus overrides."""
    if isinstance(config, BaseModel):
        if not isinstance(config, schema):
            raise ConfigError(f"a {type(config).__name__} was given where a {schema.__name__} is needed")
        return load_config(None, overrides, base=config.model_dump(), schema=schema) if overrides else config
    if isinstance(config, Mapping):
        return load_config(None, overrides, base=dict(config), schema=schema)
    return load_config(config, overrides, schema=schema)


def train(
    config: ConfigLike,
    overrides: list[str] | None = None,
    *,
    model=None,
    tokenizer=None,
    train_rows=None,
    eval_rows=None,
) -> dict[str, float]:
    """`grpokit train`: GRPO (or PPO with algorithm.advantage_estimator=gae) as the config says; resumes from
    output_dir's newest checkpoint as the command does. model / tokenizer: an already loaded policy instead of
    model.name_or_path; train_rows / eval_rows: rows instead of data.*. Returns the last step's metrics."""
    from grpokit.checkpoint import ensure_writable_dir
    from grpokit.trainer import Trainer

    cfg = _config(config, overrides, Config)
    ensure_writable_dir(cfg.output_dir)
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows)
    try:
        return trainer.train()
    finally:
        trainer.world.teardown()


NO_HELD_OUT = (
    "no held-out data: set data.eval_path (a .jsonl/.parquet/.csv file), data.task, or data.train_path "
    "with data.eval_size"
)


def held_out_metrics(cfg: Config) -> dict[str, float]:
    """The eval/* metrics of cfg's model on cfg's held-out data ({} when it has none): a Trainer without
    pi_ref or a critic, which evaluation needs neither of, closed with its rollout engine. A config with only
    data.eval_path (no training data) is enough: the held-out file stands in for the training rows."""
    from grpokit.trainer import Trainer

    data = cfg.data
    if not (data.train_path or data.task):
        if not data.eval_path:
            raise ConfigError(NO_HELD_OUT)
        cfg = cfg.model_copy(update={"data": data.model_copy(update={"train_path": data.eval_path})})
    no_kl = cfg.algorithm.model_copy(update={"beta": 0.0, "advantage_estimator": "grpo"})
    # Evaluation draws no training prompts: one per step, so that a held-out file smaller than the training
    # batch (rollout.prompts_per_step rows) still evaluates.
    one_prompt = cfg.rollout.model_copy(update={"prompts_per_step": 1})
    whole = cfg.optim.model_copy(
        update={"num_minibatches": 1, "micro_batch_size": 0, "max_tokens_per_micro_batch": 0}
    )
    trainer = Trainer(cfg.model_copy(update={"algorithm": no_kl, "rollout": one_prompt, "optim": whole}))
    try:
        return trainer.evaluate()
    finally:
        trainer.close()


def evaluate(
    model: str | Path, config: ConfigLike = None, overrides: list[str] | None = None
) -> dict[str, float]:
    """`grpokit eval MODEL -c CONFIG`: the held-out metrics (eval/pass@1, eval/pass@k, ...) of a model folder
    with the config's data, rewards and eval sections."""
    cfg = _config(config, [*(overrides or []), f"model.name_or_path={model}"], Config)
    metrics = held_out_metrics(cfg)
    if not metrics:
        raise ConfigError(NO_HELD_OUT)
    return metrics


def sft(config: ConfigLike = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """`grpokit sft`: supervised fine-tuning on completion tokens (the warm start); the model goes to
    output_dir/final. Returns the run's stats (losses, held-out scores)."""
    from grpokit.sft import run_sft

    return run_sft(_config(config, overrides, SFTConfig))


def report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """`grpokit report`: one self-contained HTML page of a run; returns its path (RUN_DIR/report.html by
    default)."""
    from grpokit.records.report import write_html_report

    return Path(write_html_report(run_dir, out))

"""Resuming a run from its newest complete checkpoint: the config compared with the checkpoint's (what may
change and what may not), the weights (or a LoRA adapter) loaded, the trainer state read, the generators
restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpokit.checkpoint.run import CheckpointError, set_rng_state
from grpokit.checkpoint.save import STATE_FILE, is_sharded_checkpoint, latest_checkpoint


def load_weights(path: Path, model) -> None:
    """Load a checkpoint's weights into model (in place)."""
    from safetensors.torch import load_file

    path = Path(path)
    if hasattr(
        model, "peft_config"
    ):  # model.lora: the checkpoint holds the adapter (PeftModel.save_pretrained)
        model.load_state_dict(read_adapter(path, model), strict=False)
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no safetensors weights; delete it to start from the one before"
        )
    weights = {}
    try:
        for f in files:
            weights.update(load_file(f))
    except Exception as exc:  # SafetensorError, OSError: a damaged file
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None
    refit = "resume with the model it was trained from, or set a new output_dir"
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even with strict=False
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model ({_why(exc)}); {refit}"
        ) from None
    # Tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error.
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if really_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model: missing {really_missing[:3]}, unexpected "
            f"{unexpected[:3]}; {refit}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def read_adapter(path: Path, model) -> dict[str, Any]:
    """A LoRA checkpoint's adapter (peft's adapter_model.safetensors, whose names leave out the adapter's
    name) keyed by `model`'s own parameter names, every trainable parameter of the model named once: what
    load_state_dict takes in one process, and set_model_state_dict at several ranks (the base weights came
    from model.name_or_path)."""
    from safetensors.torch import load_file

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no adapter_model.safetensors, but model.lora is set; "
            "resume with the config it was trained with, or set a new output_dir"
        )
    try:
        saved = load_file(file)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None
    # peft's file leaves the adapter's name out of every key; besides the adapters it may hold frozen weights
    # (the base layer of an adapted head tied to the embeddings): those load as they are, by their own name
    tag = f".{model.active_adapter}"
    names = {n.replace(tag, ""): n for n, _ in model.named_parameters(remove_duplicate=False)}
    trained = {n.replace(tag, "") for n, p in model.named_parameters() if p.requires_grad}
    if not trained <= set(saved) or not set(saved) <= set(names):
        odd = sorted((trained - set(saved)) | (set(saved) - set(names)))[:3]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the adapter ({odd}); resume with the model and "
            "model.lora it was trained with, or set a new output_dir"
        )
    return {names[k]: v for k, v in saved.items()}


def read_state(path: Path) -> dict:
    """The trainer state saved with a checkpoint (optimizer, schedule, sampler, RNG, step, config)."""
    try:
        return torch.load(path / STATE_FILE, weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None


def _why(exc: BaseException) -> str:
    """The telling line of an exception message (torch puts the size mismatch on the second line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "mismatch" in line), lines[0] if lines else type(exc).__name__)


#: Config keys that may change on resume without a word: they change neither the math nor the data stream
#: (the reward time limit and the bad-step guard only decide when to stop waiting, warn or stop; the
#: distributed strategy, the micro-batch size and checkpointing only how the same math is laid out over the
#: ranks and in memory: what an out-of-memory error tells a user to change before resuming).
FREE_ON_RESUME = (
    "output_dir",
    "threads",
    "logging",
    "eval",
    "checkpoint",
    "distributed",
    "optim.micro_batch_size",
    "optim.max_tokens_per_micro_batch",
    "model.gradient_checkpointing",
    "model.release_freed_memory",
    "reward_timeout",
    "reward_slow_warning",
    "reward_error_fraction",
    "stop_after_bad_steps",
    "rollout.vllm_server_url",
    "rollout.vllm_server_timeout",
    "rollout.vllm_weight_sync",
    "rollout.vllm_weight_sync_host",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _defaults() -> dict[str, Any]:
    from grpokit.config import Config, SFTConfig

    return {**_flat(SFTConfig().model_dump()), **_flat(Config().model_dump())}


def config_changes(saved: dict, now: dict, allowed: list[str]) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences between a checkpoint's config and this run's, as "key: old -> new";
    keys under FREE_ON_RESUME are not compared, `allowed` keys (or sections) may change. A key missing
    from the checkpoint's config (saved by an older grpokit) counts only when this run sets it off its
    default."""
    old, new, defaults = _flat(saved), _flat(now), _defaults()

    def under(key, names):
        return any(key == n or key.startswith(n + ".") for n in names)

    diffs = [(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    # A key the checkpoint's grpokit did not have yet, left at its default, is the behaviour of then: no
    # change.
    diffs = [(k, a, b) for k, a, b in diffs if k in old or k not in defaults or b != defaults[k]]
    diffs = [(k, a, b) for k, a, b in diffs if not under(k, FREE_ON_RESUME)]

    def text(d):
        return f"{d[0]}: {d[1]!r} -> {d[2]!r}"

    return [text(d) for d in diffs if not under(d[0], allowed)], [
        text(d) for d in diffs if under(d[0], allowed)
    ]


MAX_STEPS = "optim.max_steps"


def _check_max_steps(path: Path, step: int, saved: dict | None, now: dict) -> list[str]:
    """[MAX_STEPS] when this run trains longer than the checkpoint's (a change allowed by default: "train
    longer"), else []. A max_steps below the checkpoint's step is a CheckpointError: nothing would train."""
    new, old = _flat(now).get(MAX_STEPS), _flat(saved or {}).get(MAX_STEPS)
    if new is not None and step > new:
        raise CheckpointError(
            f"{str(path)!r} is at step {step}, past optim.max_steps={new}: set optim.max_steps above {step} "
            "to train further, or give this run a new output_dir"
        )
    return [MAX_STEPS] if new is not None and old is not None and new > old else []


def schedule_note(step: int, old: int | None, now: dict) -> str:
    """What a resume with another optim.max_steps does to the learning rate: from the checkpoint's step on,
    each step's learning rate is the one a run started with the new max_steps has at that step (the
    schedule, and a warm-up from warmup_ratio, recomputed for the new total; the HF Trainer's behaviour)."""
    optim = now["optim"]
    new, kind = optim["max_steps"], optim["lr_scheduler"]
    head = f"resuming at step {step} with optim.max_steps {old} -> {new}: "
    if kind == "constant" and (optim["warmup_steps"] or not optim["warmup_ratio"]):
        return head + "the learning-rate schedule does not depend on it (optim.lr_scheduler=constant)"
    return (
        head + f"the learning-rate schedule (optim.lr_scheduler={kind}) is now a {new}-step run's, followed "
        f"from step {step}: each step from here has the learning rate a run started with "
        f"optim.max_steps={new} has at that step"
    )


def resume(
    out_dir: Path, model, config: dict, allowed: list[str], load=None
) -> tuple[int, dict, list[str]] | None:
    """Continue from the newest complete checkpoint: compare its config with this run's `config` (a
    difference outside FREE_ON_RESUME and `allowed` is a CheckpointError listing every one), load its
    weights into model and restore the RNGs. Returns (step, the trainer state, the allowed changes as
    "key: old -> new"), or None when out_dir holds no checkpoint. load(path, state): how this process loads
    the weights and generators (World.load_checkpoint: a checkpoint that ranks wrote, or one process's at
    several ranks; the moments too); None: a one-process checkpoint into one process."""
    found = latest_checkpoint(out_dir)
    if found is None:
        return None
    step, path = found
    state = read_state(path)
    saved = state.get("config") or _recorded_config(
        Path(out_dir)
    )  # checkpoints before 0.1.x: the run's config.yaml
    longer = _check_max_steps(path, step, saved, config)
    refused, changed = config_changes(saved, config, [*allowed, *longer]) if saved is not None else ([], [])
    if refused:
        keys = ",".join(r.split(":")[0] for r in refused)
        raise CheckpointError(
            f"{str(path)!r} was saved with another config ({'; '.join(refused)}); resume with the same "
            "config, give this run a new output_dir, or let them change with "
            f"checkpoint.allow_changes=[{keys}]"
        )
    _check_architecture(path, model, saved, config)
    others = [c for c in changed if not c.startswith(f"{MAX_STEPS}:")]
    if others:
        print(f"resuming with changes allowed by checkpoint.allow_changes: {'; '.join(others)}")
    if len(others) < len(changed):
        print(schedule_note(step, _flat(saved).get(MAX_STEPS), config))
    if load is not None:  # the trainer's World: weights, moments and generators, one process or several ranks
        load(path, state)
    elif is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{str(path)!r} holds sharded weights (torch.distributed.checkpoint); resume it with `grpokit "
            "train`"
        )
    else:
        load_weights(path, model)
        set_rng_state(state["rng"])
    return step, state, changed


#: config.json keys that do not change what a model computes (names, versions, dtype, caching, special ids)
NOT_ARCHITECTURE = frozenset(
    {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
     "eos_token_id", "pad_token_id", "quantization_config", "_attn_implementation", "attn_implementation"}
)  # fmt: skip


def architecture_changes(path: Path, model) -> list[str]:
    """The architecture fields ("num_attention_heads 3 -> 2") where the checkpoint's config.json and the
    model's config differ: a model of the same shapes (another head count, head size, RoPE base, norm epsilon)
    would load the weights without an error and compute another function. [] where either has no config (a
    LoRA checkpoint holds the adapter's)."""
    import json

    saved_file, to_dict = Path(path) / "config.json", getattr(getattr(model, "config", None), "to_dict", None)
    if not saved_file.is_file() or to_dict is None:
        return []
    saved, now = json.loads(saved_file.read_text()), to_dict()
    keys = sorted((saved.keys() & now.keys()) - NOT_ARCHITECTURE)
    return [f"{k} {saved[k]!r} -> {now[k]!r}" for k in keys if saved[k] != now[k]]


def _check_architecture(path: Path, model, saved: dict | None, now: dict) -> None:
    """A CheckpointError when checkpoint.allow_changes let model.name_or_path change to a model of another
    architecture: allowing the path is for the same model moved, not for another one."""
    if changes := architecture_changes(path, model):
        was = _flat(saved or {}).get("model.name_or_path")
        raise CheckpointError(
            f"{str(path)!r} holds weights of another architecture than "
            f"model.name_or_path={_flat(now).get('model.name_or_path')!r} ({'; '.join(changes)}): they fit "
            "its shapes but would compute another function; resume with the model it was trained from"
            f"{f' ({was!r})' if was else ''}, or give this run a new output_dir to start from this model"
        )


def _recorded_config(out_dir: Path) -> dict | None:
    import yaml

    try:
        return yaml.safe_load((out_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None

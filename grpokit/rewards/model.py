"""Reward models: a sequence-classification model as one more reward function (`rewards: [{model:
PATH_OR_ID}]`).

    rm = RewardModel("path/to/rm", batch_size=16)                   # AutoModelForSequenceClassification,
                                                                    # num_labels=1
    rm(prompts=["2+2="], completions=["4"])                          # -> [score], one float per completion
    reward_model_spec(RewardSpec(model="path/to/rm"), index=0)       # the RewardSpec the RewardManager calls

As TRL scores with a reward model (GRPOTrainer._calculate_rewards): each (prompt, completion) becomes one
text, the reward model's chat template applied to the conversation [user prompt, assistant completion] when
its tokenizer has one (a conversational prompt keeps its messages), else prompt + completion as plain text;
the texts are padded on the right and the score is the head's logit at the last token (logits[:, 0]). Scores
run in inference mode, in batches of `batch_size`, in the model's own dtype (dtype="auto"). The model loads
through the policy's one loader (grpokit.policy.loading.load_model), with its path check and its errors.
The scores then go through the RewardManager like any function's: weight, reward/<name> metrics, errors and
timeouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpokit.rewards.text import completion_text

#: what a reward model spec's `kwargs` may set
MODEL_KWARGS = {
    "batch_size": "texts per forward pass (default 16)",
    "max_length": "tokens per text at most, the start cut off (default: no limit)",
    "device": "where the model runs (default cuda when available, else cpu)",
}


class RewardModel:
    """A sequence-classification reward model, called as a TRL reward function: fn(prompts=, completions=) ->
    floats."""

    def __init__(
        self,
        name_or_path: str,
        *,
        batch_size: int = 16,
        max_length: int | None = None,
        device: str | None = None,
        key: str = "rewards[0].model",
    ):
        from transformers import AutoTokenizer

        from grpokit.policy.loading import ModelLoadError, load_model, model_folder

        self.name_or_path = name_or_path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # The one model loader: its path check, dtype and remote-code settings and its errors, under `key`.
        self.model = load_model(
            name_or_path, dtype="auto", head="sequence_classification", key=key, device=self.device
        )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_folder(name_or_path, key))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{key}={name_or_path!r}: could not load the reward model's tokenizer: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{key}={name_or_path!r} has num_labels={self.model.config.num_labels}; a reward model "
                "gives one score per text: use a model with num_labels=1"
            )
        if (
            self.tokenizer.pad_token_id is None
        ):  # masks decide what is padding; EOS is a safe pad (as load_tokenizer)
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the head reads the last non-pad token of each row
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side, self.tokenizer.truncation_side = (
            "right",
            "left",
        )  # keep the completion's end
        self.model.eval().requires_grad_(False)
        self.batch_size, self.max_length = batch_size, max_length
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """The texts the model scores: the chat template on [prompt messages..., assistant completion] when
        the tokenizer has one, else prompt + completion as plain text (a conversational prompt: its contents,
        one a line)."""
        texts = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if self.chat:
                messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                reply = (
                    list(completion)
                    if isinstance(completion, list)
                    else [{"role": "assistant", "content": completion}]
                )
                text = self.tokenizer.apply_chat_template(messages + reply, tokenize=False)
                assert isinstance(text, str)  # tokenize=False: the text
                texts.append(text)
            else:
                text = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)
                texts.append(text + completion_text(completion))
        return texts

    @torch.inference_mode()
    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts, scores = self.render(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=not self.chat,  # a chat template writes its own special tokens
                truncation=self.max_length is not None,
                max_length=self.max_length,
            )
            logits = self.model(**enc.to(self.device)).logits  # [B, 1]
            scores += logits[:, 0].float().tolist()
        return scores


def reward_model_spec(spec, *, index: int):
    """The RewardSpec the RewardManager calls for a `{model: ...}` entry of `rewards`: its function a
    RewardModel (loaded now), its name by default the model's folder name; kwargs configure the model
    (MODEL_KWARGS)."""
    from grpokit.config import RewardSpec

    key = f"rewards[{index}]"
    if unknown := sorted(set(spec.kwargs) - set(MODEL_KWARGS)):
        raise ValueError(
            f"{key}.kwargs: {unknown} are not settings of a reward model; allowed: {', '.join(MODEL_KWARGS)}"
        )
    scorer = RewardModel(spec.model, **spec.kwargs, key=f"{key}.model")
    name = spec.name or Path(spec.model.rstrip("/")).name or "reward_model"
    return RewardSpec(
        function=scorer, weight=spec.weight, name=name, timeout=spec.timeout, on_timeout=spec.on_timeout
    )

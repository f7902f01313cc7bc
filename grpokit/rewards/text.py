"""The text a reward scores: one rule for the built-ins, the tasks' rewards and the manager's check of step
offsets.

    completion_text("3*7+2")                                        # -> "3*7+2"
    completion_text([{"role": "assistant", "content": "3*7+2"}])    # -> "3*7+2"
    as_messages(prompts, texts, episodes)   # chat prompts: each completion as TRL passes it, a list of
                                            # messages

A leaf module (no grpokit imports), so any reward or task module can import it at the top.
"""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the last message's content (conversational completions, as TRL)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""


def is_conversation(prompt: Any) -> bool:
    """A prompt given as chat messages (a list of {"role", "content"} dicts), TRL's is_conversational."""
    return (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)
    )


def as_messages(prompts: list[Any], completions: list[Any], episodes: list[Any] | None = None) -> list[Any]:
    """TRL's convention (GRPOTrainer._generate_and_score_completions): when the prompts are conversational,
    each completion reaches the reward functions as a list of messages, [{"role": "assistant", "content":
    text}] (an episode with tools: its assistant and tool messages, Episode.messages); plain-text prompts keep
    their strings."""
    if not prompts or not is_conversation(prompts[0]):
        return completions
    out = []
    for i, c in enumerate(completions):
        episode = episodes[i] if episodes is not None else None
        if isinstance(c, list):  # already messages
            out.append(c)
        elif episode is not None and getattr(episode, "messages", None):
            out.append([dict(m) for m in episode.messages])
        else:
            out.append([{"role": "assistant", "content": c}])
    return out

"""Reward functions for examples/config.yaml, written exactly as for TRL's GRPOTrainer.

grpokit calls each with keyword arguments: prompts, completions, completion_ids and every
dataset column (here `answer`), and expects one float (or None) per completion.
"""


def exact_answer(completions, answer, **kwargs):
    """1.0 when the completion is the expected answer, else 0.0."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def is_a_number(completions, **kwargs):
    """A small shaping reward: 0.1 for an answer made only of digits (and a leading minus)."""
    return [0.1 if c.strip().lstrip("-").isdigit() else 0.0 for c in completions]

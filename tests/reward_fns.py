"""Reward functions for the end-to-end tests, loaded by file path as a user's would be."""


def count_sevens(completions, **kwargs):
    """Fraction of characters that are '7': a random tiny model can learn to raise it in a few dozen steps."""
    return [c.count("7") / max(len(c), 1) for c in completions]


def even_target_constant(completions, target, **kwargs):
    """Constant 1.0 within groups of even targets (no signal), length parity otherwise."""
    return [1.0 if t % 2 == 0 else float(len(c) % 2) for c, t in zip(completions, target)]

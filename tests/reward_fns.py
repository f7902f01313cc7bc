"""Reward functions for the end-to-end tests, loaded by file path as a user's would be."""


def count_sevens(completions, **kwargs):
    """Fraction of characters that are '7': a random tiny model can learn to raise it in a few dozen steps."""
    return [c.count("7") / max(len(c), 1) for c in completions]

"""Reward functions for the end-to-end tests, loaded by file path as a user's would be."""


def count_sevens(completions, **kwargs):
    """Fraction of characters that are '7': a random tiny model can learn to raise it in a few dozen steps."""
    return [c.count("7") / max(len(c), 1) for c in completions]


def even_target_constant(completions, target, **kwargs):
    """Constant 1.0 within groups of even targets (no signal), length parity otherwise."""
    return [1.0 if t % 2 == 0 else float(len(c) % 2) for c, t in zip(completions, target, strict=True)]


_calls = {"n": 0}


def fails_on_rank_1(completions, **kwargs):
    """count_sevens, except that on rank 1 (torchrun's RANK) the second call raises; the time of the raise
    goes to the file named by GRPOKIT_TEST_FAILED_AT."""
    import os
    import time

    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 2:
        with open(os.environ["GRPOKIT_TEST_FAILED_AT"], "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank 1 fails on purpose in its second reward call")
    return count_sevens(completions)


def raises_on_one_in_eight(prompts, completions, **kwargs):
    """0.5 per completion, but raises on the whole call when one of its completions has
    zlib.crc32(prompt|completion) % 8 == 0: about one completion in eight, spread through the batch."""
    import zlib

    for p, c in zip(prompts, completions, strict=True):
        if zlib.crc32((str(p) + "|" + c).encode()) % 8 == 0:
            raise ValueError(f"cannot score {c!r}")
    return [0.5] * len(completions)

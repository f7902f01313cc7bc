"""Process (step) rewards, DeepSeekMath §4.1.3: a reward function may score each step of a completion.

    from grpokit.rewards import StepScores
    def my_reward(completions, **kwargs):
        return [StepScores(scores=[1.0, 0.0], ends=[6, len(c)]) for c in completions]

A reward function returns, for each completion, a float (an outcome reward), None (not
applicable) or a StepScores: one score per step and the character offset in the completion
text where each step ends (`text[:ends[k]]` is the text up to and including step k). Offsets
are characters because reward functions see text; the trainer maps them to completion tokens
with the tokenizer (`token_char_ends`, `step_token_ends` in grpokit/data/batch.py).

How a batch's rewards become the step rewards of each completion (`process_rewards`,
grpokit/data/batch.py), the rule when outcome and step rewards are mixed: every reward function
contributes weight x score at the token where each of its steps ends; an outcome reward (a
float) is a single step ending at the completion's last token. Contributions that land on the
same token add up into one step.
With step rewards present, the trainer normalizes all the steps of a group together and gives
token t the sum of the normalized rewards of the steps ending at or after t
(`grpokit.algo.step_advantages`); with one outcome reward only, that is exactly the outcome
advantage. docs/algorithm.md, "Process rewards end to end", has the details.

StepScores itself is one of the shared containers in grpokit/types.py; this module re-exports it.
"""

from grpokit.types import StepScores

__all__ = ["StepScores"]

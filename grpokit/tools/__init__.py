"""Tool calling for agentic RL: tools from functions and TRL-style environments, call formats, episodes.

    from grpokit.tools import as_tool, ToolBox, calculator, make_format, Episode
    box = ToolBox([as_tool(calculator)], timeout=10.0)
    box.call("calculator", {"expression": "12*34"}).text        # "408"

registry.py   Tool / ToolBox: schemas from type hints + Google docstrings, environments (reset, get_reward),
              calls with a timeout that return an error text instead of raising
schema.py     the JSON schema of a function and the check of a call's arguments against it
builtin.py    `calculator` (exact arithmetic, no eval) and `python` (the code_tests sandbox)
formats.py    the plain `<tool>name(args)</tool>` / `<result>...</result>` format and the chat template's
episode.py    Episode / ToolCall (what reward functions receive as `episodes=`) and the rollout/tools/ metrics
rewards.py    process rewards on episodes (seed Q30): tool_call_valid, tool_args_valid, tool_result_used,
              step_cost
setup.py      the run's tools from the config's `tools:` section
The multi-turn loop itself is in grpokit/rollout/episodes.py; docs/agentic.md has the whole story.
"""

from grpokit.tools.builtin import BUILTIN_TOOLS, calculator, make_python_tool, python
from grpokit.tools.episode import Episode, ToolCall, episode_metrics
from grpokit.tools.formats import ChatTemplateFormat, PlainFormat, make_format
from grpokit.tools.registry import CallOutcome, Tool, ToolBox, as_tool, environment_tools
from grpokit.tools.schema import check_arguments, function_schema

__all__ = [
    "BUILTIN_TOOLS",
    "CallOutcome",
    "ChatTemplateFormat",
    "Episode",
    "PlainFormat",
    "Tool",
    "ToolBox",
    "ToolCall",
    "as_tool",
    "calculator",
    "check_arguments",
    "environment_tools",
    "episode_metrics",
    "function_schema",
    "make_format",
    "make_python_tool",
    "python",
]

"""How a model writes a tool call and reads its result: two formats.

plain (tools.format=plain), for tiny models and base models without a chat template:

    the model writes   <tool>calculator(123*456)</tool>         one call per turn; the turn ends at </tool>
    grpokit appends    <result>56088</result>                  tool tokens: context, never trained on
    the model goes on  56088</s>                               ... or calls again, up to rollout.max_turns
                                                               turns

  Arguments are Python call syntax: keyword literals `name(a=1, b="x")`, positional literals in the order of
  the tool's parameters, or, for a tool with one string parameter, the raw text between the parentheses
  (`calculator(123*456)` passes expression="123*456"). An error comes back the same way:
  `<result>error: unknown tool 'calc'; tools: calculator</result>`.

chat_template (tools.format=chat_template), for chat models trained on tool calls (Qwen2.5 / Qwen3, Hermes):

    the model writes   <tool_call>{"name": "calculator", "arguments": {"expression":
                       "123*456"}}</tool_call><|im_end|> (several calls in one turn are allowed; the turn ends
                       at the model's EOS)
    grpokit appends    the chat template's rendering of the tool messages {"role": "tool", "name", "content"}
                       up to the next assistant generation prompt (e.g. `\\n<|im_start|>user\\n<tool_response>
                       \\n56088\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n` for Qwen): what a
                       rendered conversation holds after the model's turn and its EOS.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from grpokit.tools.registry import ToolBox


@dataclass(frozen=True)
class ParsedCall:
    raw: str
    name: str | None  # None: the call did not parse
    arguments: Any
    problem: str | None = None  # why it did not parse


_PLAIN_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.DOTALL)


def _literal_arguments(text: str) -> tuple[list[Any], dict[str, Any]] | None:
    """(positional, keyword) literals of `f(<text>)`, or None when they are not all literals."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        assert isinstance(call, ast.Call) and not any(isinstance(a, ast.Starred) for a in call.args)
        return [ast.literal_eval(a) for a in call.args], {
            k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg
        }
    except (SyntaxError, ValueError, TypeError, AssertionError, RecursionError, MemoryError):
        return None


class PlainFormat:
    name = "plain"
    ends_turn_at_call = True  # the turn stops right after </tool>

    def __init__(
        self,
        call_open: str = "<tool>",
        call_close: str = "</tool>",
        result_open: str = "<result>",
        result_close: str = "</result>",
    ):
        if not all((call_open, call_close)):
            raise ValueError("PlainFormat: the call markers must not be empty")
        self.call_open, self.call_close, self.result_open, self.result_close = (
            call_open,
            call_close,
            result_open,
            result_close,
        )

    def split_turn(self, text: str) -> tuple[int | None, list[str]]:
        """(characters of the turn to keep, the raw calls in them). None: keep all (no call)."""
        start = text.find(self.call_open)
        if start < 0:
            return None, []
        stop = text.find(self.call_close, start + len(self.call_open))
        if stop < 0:
            return None, []
        return stop + len(self.call_close), [text[start + len(self.call_open) : stop]]

    def parse(self, raw: str, box: ToolBox) -> ParsedCall:
        m = _PLAIN_CALL.match(raw)
        if m is None:
            return ParsedCall(
                raw, None, None, f"expected name(arguments) inside {self.call_open}...{self.call_close}"
            )
        name, inner = m.group(1), m.group(2)
        tool = box.tools.get(name)
        params = list(tool.schema["function"]["parameters"]["properties"]) if tool else []
        literals = _literal_arguments(inner) if inner.strip() else ([], {})
        if literals is not None:
            positional, keyword = literals
            if len(positional) > len(params) and tool is not None:
                return ParsedCall(
                    raw, name, None, f"{name} takes {len(params)} argument(s), got {len(positional)}"
                )
            return ParsedCall(raw, name, {**dict(zip(params, positional, strict=False)), **keyword})
        one_string = (
            tool is not None
            and len(params) == 1
            and tool.schema["function"]["parameters"]["properties"][params[0]].get("type") == "string"
        )
        if (
            one_string or tool is None
        ):  # the raw text is the one string argument (an unknown tool is reported as such)
            return ParsedCall(raw, name, {params[0]: inner.strip()} if params else {"": inner.strip()})
        return ParsedCall(raw, name, None, "arguments must be Python literals, e.g. name(a=1, b='x')")

    def render_results(self, results: list[tuple[str, str]], tokenizer: Any) -> list[int]:
        """Token ids of the results [(tool name, text)] as the model will read them."""
        text = "".join(f"{self.result_open}{content}{self.result_close}" for _, content in results)
        return tokenizer.encode(text, add_special_tokens=False)


class ChatTemplateFormat:
    name = "chat_template"
    call_open, call_close = "<tool_call>", "</tool_call>"
    ends_turn_at_call = False  # several calls per turn; the turn ends at EOS

    def split_turn(self, text: str) -> tuple[int | None, list[str]]:
        pattern = re.escape(self.call_open) + r"(.*?)" + re.escape(self.call_close)
        return None, [m.group(1) for m in re.finditer(pattern, text, re.DOTALL)]

    def parse(self, raw: str, box: ToolBox) -> ParsedCall:
        try:
            call = json.loads(raw.strip())
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except (ValueError, KeyError, TypeError) as exc:
            return ParsedCall(raw, None, None, f'expected {{"name": ..., "arguments": {{...}}}}: {exc}')
        return ParsedCall(
            raw,
            name if isinstance(name, str) else None,
            arguments,
            None if isinstance(name, str) else "name must be a string",
        )

    def render_results(self, results: list[tuple[str, str]], tokenizer: Any) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "tools.format=chat_template needs a tokenizer with a chat template; use tools.format=plain"
            )
        # The assistant turn the tool messages follow, its content a marker to find in the rendering. Only
        # what follows that turn is read: a template may render a turn differently once more messages follow
        # it (Qwen3 drops the empty <think> block it gives the last assistant turn), so the conversation
        # without the tool messages need not be a prefix of the one with them.
        marker = "grpokit-model-turn"
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
        tool_messages = [{"role": "tool", "name": name, "content": content} for name, content in results]
        full = tokenizer.apply_chat_template(
            before + tool_messages, tokenize=False, add_generation_prompt=True
        )
        at = full.rfind(marker)
        if at < 0:
            raise ValueError(
                "the chat template does not render an assistant message's content as it is; grpokit cannot "
                "find the tool messages' tokens: use tools.format=plain"
            )
        rest = full[at + len(marker) :]
        # The model's turn ended at its EOS token; what the template puts after that EOS is the suffix.
        eos = tokenizer.eos_token or ""
        if eos and eos in rest:
            rest = rest[rest.index(eos) + len(eos) :]
        return tokenizer.encode(rest, add_special_tokens=False)


FORMATS = {"plain": PlainFormat, "chat_template": ChatTemplateFormat}


def make_format(name: str) -> PlainFormat | ChatTemplateFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tools.format {name!r}; allowed: {', '.join(FORMATS)}")
    return FORMATS[name]()

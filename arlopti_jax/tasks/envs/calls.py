"""Tool calls in the policy's text: found between markers, parsed with ``json.loads`` only.

    fmt = CallFormat()                                   # Qwen2.5 / Qwen3 / Hermes: JSON in <tool_call>
    parse_calls('... <tool_call>\\n{"name": "calculator", "arguments": {"expression": "2*3"}}\\n</tool_call>',
                fmt, tools={"calculator": "expression"})
      -> [ToolCall(name='calculator', arguments={'expression': '2*3'}, error=None, text='...')]
    CallFormat(style="text", open="<calc>", close="</calc>")   # SmolLM2 and other templates without tools:
      '<calc>2*3</calc>' -> the environment's one tool, its one argument the text between the markers

Two styles, their markers parameters of the environment (nothing is guessed from the model):

  json  between ``open`` and ``close`` a JSON object ``{"name": TOOL, "arguments": {...}}``, the
        format Qwen2.5's and Qwen3's chat templates ask for (``<tool_call>`` / ``</tool_call>``).
        ``arguments`` may also be a JSON string holding that object (some models write it so).
  text  between the markers the tool's single argument as plain text (``<calc>2*3</calc>``): for
        models whose chat template has no tool support; the warm start teaches the markers.

A call that cannot be run (no closing marker, not JSON, not an object, an unknown tool, a missing
or non-string argument, longer than ``max_call_chars``) is a `ToolCall` with ``error`` set: the
environment answers it with that error as the observation, and the episode goes on. The closing
marker is the sampler's stop string (`CallFormat.stop_strings`), so it must not occur inside the
opening one. Text without an opening marker holds no call: it is the final answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

STYLES = ("json", "text")
MAX_CALL_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class CallFormat:
    style: str = "json"
    open: str = "<tool_call>"
    close: str = "</tool_call>"
    max_call_chars: int = MAX_CALL_CHARS

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"tool-call style {self.style!r}: choose from {', '.join(STYLES)}")
        if not self.open.strip() or not self.close.strip():
            raise ValueError(f"tool-call markers {self.open!r}, {self.close!r}: both must be non-blank")
        if self.close in self.open:
            raise ValueError(f"tool-call markers {self.open!r}, {self.close!r}: the closing marker (the sampler's "
                             "stop string) must not occur inside the opening one")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """What ends a turn that calls a tool: the sampler stops its row there."""
        return (self.close,)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call found in an action. ``error`` set: it is malformed and is not run."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None
    text: str  # what stood between the markers (cut at max_call_chars)


def _json_call(inner: str, tools: dict[str, str]) -> ToolCall:
    def bad(reason: str, name: str | None = None) -> ToolCall:
        return ToolCall(name, {}, reason, inner)

    try:
        call = json.loads(inner)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
        return bad(f"the tool call is not valid JSON ({str(e).splitlines()[0][:120]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return bad('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in tools:
        return bad(f"unknown tool {name!r}; the tools are: {', '.join(sorted(tools))}", name)
    if isinstance(arguments, str):  # arguments written as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return bad(f"the arguments of {name!r} are not a JSON object", name)
    if not isinstance(arguments, dict):
        return bad(f"the arguments of {name!r} must be a JSON object", name)
    key = tools[name]
    if not isinstance(arguments.get(key), str):
        return bad(f"{name!r} needs the string argument {key!r}", name)
    return ToolCall(name, arguments, None, inner)


def parse_calls(action: str, fmt: CallFormat, tools: dict[str, str]) -> list[ToolCall]:
    """Every call in ``action``, in order. ``tools`` maps each tool's name to its one string
    argument (``{'calculator': 'expression'}``); the text style calls the first (only) tool."""
    calls, i = [], 0
    while (start := action.find(fmt.open, i)) >= 0:
        body = start + len(fmt.open)
        end = action.find(fmt.close, body)
        inner = action[body: body + fmt.max_call_chars] if end < 0 else action[body:end]
        if end < 0:
            calls.append(ToolCall(None, {}, f"the tool call has no closing {fmt.close}", inner))
            break
        i = end + len(fmt.close)
        if end - body > fmt.max_call_chars:
            calls.append(ToolCall(None, {}, f"the tool call is longer than {fmt.max_call_chars} characters",
                                  inner[: fmt.max_call_chars]))
            continue
        if fmt.style == "json":
            calls.append(_json_call(inner.strip(), tools))
        else:
            name, key = next(iter(tools.items()))
            calls.append(ToolCall(name, {key: inner.strip()}, None, inner))
    return calls

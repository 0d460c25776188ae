"""A tool call an answer was cut in, written as its chat template writes a call: so that the answer goes on from
the call's arguments so far (a trailing assistant message whose text holds them), the way text goes on from its
prefix. Only where generating it again from the start would not give the same answer, or would cost too much (it
samples without a seed llama-server repeats, or ran past `watchdog.replay_tokens`: wrapper/answers/answering.py):
the prefill is read in one batch, whose numbers differ in their last bits from decoding's, so the call may go on
another way.

llama-server streams a call parsed (its name, then its arguments as a string diff), never the markup the model
wrote around them; a trailing assistant message may not carry `tool_calls`. But its text may hold the markup: the
server parses the prefill with what it generates, so the call opens again there (a new id, its name again: the
reader shows only what the client lacks) and its arguments go on where they were cut. The markup that opens a call
is the chat template's own, learnt from the server that serves: a conversation with one call whose arguments are a
marker, rendered by `/apply-template`, read up to the marker. A template that does not render a call that way (or
an older server without the endpoint): None, and the call is generated again from the start.

What the client has is not all the model wrote: llama-server's parser drops the whitespace around the text (the
demo opens its answer with a newline the client never sees) and writes the call's markup as the template does
(`{"name": …`) where the model may have laid it out (`{\n    "name": …`, the way its arguments are laid out). A
prefill that differs from what was generated is another context, and the call goes on another way. When
llama-server counted the tokens generated so far (chat and Responses streams, `timings_per_token`), the prefill
is the way of writing it whose tokens are that count: the model's own text, token for token, as far as the
tokenizer can tell (Llama 3.1's template on the demo, a call cut by its budget: the uncut arguments after 12 of 13
kills with the prefill fed one token at a time, 0 of 30 before; a probe of 22 cut points, 16, and 8 with the
template's markup). Without a count (Messages streams carry none), the markup is laid out as the arguments are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from wrapper.server.llama import LlamaClient, LlamaError

MARKER = "__llama_wrapper_cut_here__"
ASKED = {"role": "user", "content": "?"}


@dataclass(frozen=True)
class Written:
    """An answer so far as its model wrote it, as far as can be told: its text, the markup that opens the call, the
    call's arguments so far (the prefill a continuation sends), and its tokens (what the request's limit is reduced
    by): llama-server's count of what was generated when it counted, else the tokenizer's count of the prefill.
    `counted`: the prefill's tokens are that count (the model's own text, as far as the tokenizer tells)."""

    prefill: str
    tokens: int
    counted: bool = False


async def opening(client: LlamaClient, name: str) -> str | None:
    """The markup the served template writes before a call's arguments (Llama 3.1: `{"name": "NAME",
    "parameters": `; Hermes and Qwen: `<tool_call>\\n{"name": "NAME", "arguments": `); None when it cannot tell."""
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps({MARKER: 0})}}
    try:
        before = str((await client.call("POST", "/apply-template", {"messages": [ASKED], "tools": [tool]}))["prompt"])
        after = str((await client.call("POST", "/apply-template", {
            "messages": [ASKED, {"role": "assistant", "content": "", "tool_calls": [call]}, ASKED],
            "tools": [tool]}))["prompt"])
    except (LlamaError, KeyError, TypeError):
        return None
    return markup(before, after, name)


def markup(before: str, after: str, name: str) -> str | None:
    """What `after` (a conversation rendered with one call, its arguments the marker) writes between the assistant's
    turn opening (`before` ends with it: the generation prompt) and the call's arguments."""
    if not after.startswith(before):
        return None  # the generation prompt is not how an assistant turn opens (a template that opens <think>)
    at = after.find(f'"{MARKER}"', len(before))
    brace = after.rfind("{", len(before), at) if at >= 0 else -1
    written = after[len(before):brace] if brace >= 0 else ""
    return written if name in written else None


LEADS = ("", "\n", "\n\n", " ")  # whitespace the parser may have dropped before the text
JOINTS = ("", "\n", "\n\n", " ")  # ... and between the text and the call


async def written(client: LlamaClient, name: str, text: str, arguments: str,
                  generated: int | None = None) -> Written | None:
    """The answer so far (`text`, then a call to `name` with its `arguments` so far) as its model wrote it, as far as
    can be told: `generated`, the tokens llama-server counted for it, when known."""
    opens = await opening(client, name)
    if opens is None:
        return None
    ways = prefills(text, opens, arguments)
    try:
        if generated is None:
            return Written(ways[0], await _count(client, ways[0]))
        for prefill in ways:
            if await _count(client, prefill) == generated:
                return Written(prefill, generated, counted=True)
    except (LlamaError, KeyError, TypeError):
        return None
    return Written(ways[0], generated)


def prefills(text: str, opens: str, arguments: str) -> list[str]:
    """The ways the model may have written an answer so far, likeliest first: the call's markup laid out as its
    arguments are, then as the template writes it; no whitespace dropped, then some dropped before the text (the
    demo's first newline), then between it and the call."""
    markups = dict.fromkeys([laid_out(opens, arguments), opens])
    joints = JOINTS if text else ("",)
    return list(dict.fromkeys(lead + text + joint + markup + arguments
                              for markup in markups for joint in joints for lead in LEADS))


def laid_out(markup: str, arguments: str) -> str:
    """The template's `markup` (a JSON object opened up to its arguments' key) laid out as the model laid out the
    arguments: `{\n        "path"` (keys two levels in, 8 spaces) is JSON indented by 4; arguments on one line,
    the markup as it is."""
    brace = markup.find("{")
    if brace < 0 or not arguments.startswith("{\n"):
        return markup
    indent = len(arguments[2:]) - len(arguments[2:].lstrip(" "))
    try:
        opened = json.loads(markup[brace:] + "0}")
    except ValueError:
        return markup
    if indent < 2 or indent % 2 or not isinstance(opened, dict):
        return markup
    dumped = json.dumps(opened, indent=indent // 2, ensure_ascii=False)
    end = dumped.rfind("0")
    return markup[:brace] + dumped[:end] if dumped.endswith("0\n}") else markup


async def _count(client: LlamaClient, text: str) -> int:
    tokenized = await client.call("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": True})
    return len(tokenized["tokens"])

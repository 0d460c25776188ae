"""A tool call an answer was cut in, written as its chat template writes a call: so that the answer goes on from
the call's arguments so far (a trailing assistant message whose text holds them), the way text goes on from its
prefix.

llama-server streams a call parsed (its name, then its arguments as a string diff), never the markup the model
wrote around them; a trailing assistant message may not carry `tool_calls`. But its text may hold the markup: the
server parses the prefill with what it generates, so the call opens again there (a new id, its name again: the
reader shows only what the client lacks) and its arguments go on where they were cut. The markup that opens a call
is the chat template's own, learnt from the server that serves: a conversation with one call whose arguments are a
marker, rendered by `/apply-template`, read up to the marker. A template that does not render a call that way (or
an older server without the endpoint): None, and the call is generated again from the start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from wrapper.server.llama import LlamaClient, LlamaError

MARKER = "__llama_wrapper_cut_here__"
ASKED = {"role": "user", "content": "?"}


@dataclass(frozen=True)
class Written:
    """An answer so far as its template writes it: its text, the markup that opens the call, the call's arguments so
    far (the prefill a continuation sends), and how many tokens the tokenizer makes of that (what the request's
    limit is reduced by: a model that wrote the markup otherwise spent a few more or fewer)."""

    prefill: str
    tokens: int


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


async def written(client: LlamaClient, name: str, text: str, arguments: str) -> Written | None:
    """The answer so far (`text`, then a call to `name` with its `arguments` so far) as the template writes it."""
    opens = await opening(client, name)
    if opens is None:
        return None
    prefill = text + opens + arguments
    try:
        tokenized = await client.call("POST", "/tokenize", {"content": prefill, "add_special": False,
                                                            "parse_special": True})
        return Written(prefill, len(tokenized["tokens"]))
    except (LlamaError, KeyError, TypeError):
        return None

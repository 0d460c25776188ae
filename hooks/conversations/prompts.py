"""What llama-server makes of a Responses or an Anthropic Messages request before its chat template runs: the same
chat-completions body its own conversions build (tools/server/server-chat.cpp in the pinned source:
`server_chat_convert_responses_to_chatcmpl`, `server_chat_convert_anthropic_to_oai`), so that `/apply-template`
gives that request's prompt, token for token, and the conversation cache can look it up, restore it and keep it like
a chat request's. A shape the server would refuse, or one carrying media, gives None: the request then goes as the
server places it, unchanged."""

from __future__ import annotations

import json
from typing import Any

from wrapper import paths

Body = dict[str, Any]


class Unconverted(ValueError):
    """A request whose prompt cannot be told here (the server refuses it, or it carries media)."""


def chat_body(path: str, payload: Body) -> Body | None:
    """The chat-completions body llama-server templates for this request; None when it cannot be told."""
    try:
        if path in paths.RESPONSES:
            return _from_responses(payload)
        if path in paths.MESSAGES:
            return _from_messages(payload)
    except (Unconverted, KeyError, TypeError, AttributeError):
        return None
    return None


# -- OpenAI Responses ---------------------------------------------------------------------------------------------


def _from_responses(body: Body) -> Body:
    if "input" not in body or body.get("previous_response_id"):
        raise Unconverted("no input, or a previous response the server does not keep")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "max_output_tokens",
                                                        "reasoning")}
    messages: list[Body] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _str(body.get("instructions"))})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _response_item(dict(item), messages)
    else:
        raise Unconverted("'input' must be a string or a list")
    chat["messages"] = messages
    if "tools" in body:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise Unconverted("'tools' must be a list")
        functions = []
        for tool in tools:
            if tool.get("type") != "function":
                continue  # the server skips what has no chat counterpart
            function = {k: v for k, v in tool.items() if k != "type"}
            function.setdefault("strict", True)
            functions.append({"type": "function", "function": function})
        if functions:
            chat["tools"] = functions
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and "effort" in reasoning:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _response_item(item: Body, messages: list[Body]) -> None:
    after_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    if isinstance(item.get("content"), str):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        parts = []
        for part in item["content"]:
            if part.get("type") != "input_text" or "text" not in part:
                raise Unconverted("media or a part the server refuses")
            parts.append({"text": part["text"], "type": "text"})
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = parts
        messages.append(item)
    elif role == "assistant" and kind == "message":
        parts = []
        content = item.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") in ("output_text", "input_text") and isinstance(part.get("text"), str):
                parts.append({"text": part["text"], "type": "text"})
            elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                parts.append({"refusal": part["refusal"], "type": "refusal"})
            else:
                raise Unconverted("an output part the server refuses")
        if after_assistant:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(parts)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("arguments", "call_id", "name")):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        if after_assistant:
            previous = messages[-1]
            if not isinstance(previous.get("tool_calls"), list):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
        output = item.get("output")
        if isinstance(output, list):
            if any(part.get("type") != "input_text" for part in output):
                raise Unconverted("media in a tool's output")
            output = [{**part, "type": "text"} for part in output]
        elif not isinstance(output, str):
            raise Unconverted("a tool's output that is no string or list")
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        content = item.get("content")
        if not isinstance(content, list) or not content or not isinstance(content[0].get("text"), str):
            raise Unconverted("a reasoning item the server refuses")
        if after_assistant:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise Unconverted("an input item the server cannot tell")


# -- Anthropic Messages ------------------------------------------------------------------------------------------


def _billing(text: str) -> str:
    """Claude Code's `x-anthropic-billing-header` system prompt carries a stamp that changes on every request; the
    server writes it as `fffff` so that the prefix stays the same (normalize_anthropic_billing_header)."""
    head = "x-anthropic-billing-header:"
    if not text.startswith(head):
        return text
    at = text.find("cch=", len(head))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5:]
    return text


def _from_messages(body: Body) -> Body:
    chat: Body = {}
    messages: list[Body] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": _billing(system)})
    elif isinstance(system, list):
        messages.append({"role": "system", "content": "".join(
            _billing(_str(block.get("text"))) for block in system if block.get("type") == "text")})
    elif system is not None:
        messages.append({"role": "system", "content": ""})
    if "messages" not in body:
        raise Unconverted("'messages' is required")
    for message in body["messages"] if isinstance(body["messages"], list) else []:
        _anthropic_message(message, messages)
    chat["messages"] = messages
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [{"type": "function", "function": {
            "name": _str(tool.get("name")), "description": _str(tool.get("description")),
            "parameters": tool.get("input_schema", {})}} for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "auto":
            chat["tool_choice"] = "auto"
        elif choice.get("type") in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", 4096)
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            chat[key] = body[key]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        chat["thinking_budget_tokens"] = thinking.get("budget_tokens", 10000)
    return chat


def _anthropic_message(message: Body, messages: list[Body]) -> None:
    role = _str(message.get("role"))
    if "content" not in message:
        if role != "assistant":
            messages.append(message)
        return
    content = message["content"]
    if not isinstance(content, list):
        messages.append(message)
        return
    calls, parts, results, reasoning = [], [], [], ""
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += _str(block.get("thinking"))
        elif kind == "image":
            raise Unconverted("an image")
        elif kind == "tool_use":
            calls.append({"id": _str(block.get("id")), "type": "function", "function": {
                "name": _str(block.get("name")), "arguments": _dump(block.get("input", {}))}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": _str(block.get("tool_use_id")),
                            "content": _result(block.get("content"))})
    if parts or calls or reasoning:
        said: Body = {"role": role}
        if parts:
            said["content"] = parts
        else:
            said["content"] = ""
        if calls:
            said["tool_calls"] = calls
        if reasoning:
            said["reasoning_content"] = reasoning
        messages.append(said)
    messages.extend(results)


def _result(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(part.get("type") == "image" for part in content):
            raise Unconverted("an image in a tool's result")
        return "".join(_str(part.get("text")) for part in content if part.get("type") == "text")
    return ""


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dump(value: Any) -> str:
    """nlohmann::json's dump(): compact, keys as given, non-ASCII kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

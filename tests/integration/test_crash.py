"""A crash costs nothing on the configs users run: the README's `examples/chat.yaml` as it is (only its folder
changed), the demo model at `-np` 1, 2 and 4, a long conversation and a short one, a warm slot, llama-server
SIGKILLed in the middle of a stream — the stream goes on whole and the next turn reuses the conversation; a tool
call killed at every delta of its arguments ends as one whole call; every generating endpoint (/v1/completions,
/completion, /infill, streamed or not) survives a SIGKILL as one whole answer."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import models
from tests.helpers import Wrapper, chat, chat_yaml, http, running, wait_for
from tests.killing import Events, content, contents, deltas, killed_while_answering, server_pid, streamed

STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
LONG = [{"role": "user", "content": "A long story, to be retold: " + STORY * 100 + "\nTell it again in your words."}]
SHORT = [{"role": "user", "content": "Name three colours."}]
QUESTION = "Tell me a long story about the keeper of a lighthouse."


def argv(server_bin: str, model: str, parallel: int, *more: str) -> list[str]:
    return [server_bin, "-m", model, "-c", "8192", "-np", str(parallel), *more]


def prompt_tokens(wrapper: Wrapper, messages: list[dict[str, Any]]) -> int:
    template = json.loads(http("POST", f"{wrapper.url}/apply-template", {"messages": messages})[2])["prompt"]
    tokens = json.loads(http("POST", f"{wrapper.url}/tokenize", {"content": template, "add_special": True,
                                                                  "parse_special": True})[2])["tokens"]
    return len(tokens)


def one_answer(events: Events) -> None:
    """One chat answer: one role chunk, one final event, one [DONE], no error, one id."""
    assert not any("error" in e for e in events), events[-3:]
    assert sum(1 for d in deltas(events) if d.get("role")) == 1
    assert sum(1 for e in events if e.get("choices") and e["choices"][0].get("finish_reason")) == 1
    assert events[-1] == {"done": True} and sum("done" in e for e in events) == 1
    assert len({e["id"] for e in events if "id" in e}) == 1


@pytest.mark.parametrize("parallel", [1, 2, 4])
@pytest.mark.parametrize("size", ["long", "short"])
def test_the_next_turn_after_a_crash_mid_stream_reuses_the_conversation(
        tmp_path: Path, server_bin: str, demo_path: str, parallel: int, size: str) -> None:
    """The issue's run: a 2.1k-token conversation's first turn (kept while idle: a checkpoint), then a question of a
    few dozen tokens asked twice (its slot warm), then one of the two goes on in a stream and llama-server is
    SIGKILLed 20 text events in — the long conversation's next turn, or the short one's. The stream goes on whole;
    the next turn (the history, the whole answer, "And then?") goes on in the slot that holds it. The short one
    reused 0 of 2,144 tokens at -np 2: its continued stream wrote a slot of the new server whose tokens the book
    did not know, the other conversation's checkpoint might have been a longer state of it, and the lookup pinned
    the next turn to the other slot."""
    with running(tmp_path, argv(server_bin, demo_path, parallel), chat_yaml(tmp_path)) as wrapper:
        answer = chat(wrapper.url, LONG, max_tokens=32)
        wait_for(lambda: wrapper.events("conversations.checkpoint"), 60, "the long conversation kept while idle")
        long_turn = [*LONG, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": QUESTION}]
        short_turn = [{"role": "user", "content": QUESTION}]
        for _ in range(2):
            chat(wrapper.url, short_turn, max_tokens=64)
        turn = long_turn if size == "long" else short_turn
        body = {"messages": turn, "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        events = streamed(wrapper, body, lambda seen: contents(seen) >= 20)
        one_answer(events)
        assert wrapper.events("wrapper.stream_resumed")
        text = content(events)
        history = prompt_tokens(wrapper, turn) + contents(events)
        following = chat(wrapper.url, [*turn, {"role": "assistant", "content": text},
                                       {"role": "user", "content": "And then?"}], max_tokens=8)
        reused = following["timings"]["cache_n"]
        where = [(e["event"], e.get("slot"), e.get("tokens")) for e in wrapper.events()
                 if e.get("event") in ("slots.restored", "conversations.decision", "conversations.saved",
                                       "wrapper.stepped_again")]
        print(f"-np {parallel}, {size}: the next turn reused {reused} of {history}")
        assert reused >= 0.9 * history, (reused, history, where)
        assert wrapper.stop() == 0


# -- a tool call killed at every delta ---------------------------------------------------------------------------

READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _weather_turns() -> list[dict[str, Any]]:
    """An agent's history with calls before (tools on every turn): the Hermes / Qwen 2.5 format's `<tool_call>`."""
    turns: list[dict[str, Any]] = []
    for n, (city, said) in enumerate((("London", "Rain, 12 C"), ("Berlin", "Sun, 20 C")), 1):
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        turns += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": f"call_{n}", "content": said},
                  {"role": "assistant", "content": f"In {city}: {said}."}]
    return [*turns, {"role": "user", "content": "What is the weather in Paris?"}]


CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1's JSON calls, a line of text before the call
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct",
                  {"messages": [{"role": "user", "content": "Read the file README.md please."}], "tools": [READ_FILE]}),
    # the Hermes 2 Pro template: Qwen 2.5's <tool_call> format
    "qwen-style": ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
                   {"messages": _weather_turns(), "tools": [WEATHER]}),
}
RESTARTS = "watchdog: {restarts: 100, window: 10m}\n"  # a kill at every delta: more restarts than the default 3
TRIES = 3  # a kill that came after the answer's end is tried again


def _calls(events: Events) -> list[dict[str, Any]]:
    return [c for d in deltas(events) for c in d.get("tool_calls") or []]


def _arguments(parts: list[dict[str, Any]]) -> str:
    return "".join((c.get("function") or {}).get("arguments") or "" for c in parts)


def _had(parts: list[dict[str, Any]], k: int) -> str:
    """The arguments of a call's first `k` deltas that carried some: what its client had when the kill came."""
    return _arguments([c for c in parts if (c.get("function") or {}).get("arguments")][:k])


@pytest.mark.parametrize("case", sorted(CALLS))
def test_a_tool_call_killed_at_every_delta_ends_as_one_whole_call(tmp_path: Path, server_bin: str, demo_path: str,
                                                                  case: str) -> None:
    """tool_choice required, temperature 0, -np 1. Killed after each of the call's argument deltas in turn, the
    client gets the uncut call — one id, its name once, the uncut arguments, finish_reason tool_calls — and the text
    before it once. It got `{\n    "` and then 243 deltas of plain text (the server started again was given the
    text before the call as a prefix, and answered text), then a call that went on from its arguments but drifted
    from the uncut one (whitespace, another word) after 1 of 11 kills (Llama 3.1) and 1 of 8 (Hermes): now a greedy
    answer is generated again from the start, as the uncut run was, and its client shown only what it lacks.

    The kill comes when the client has read the k-th delta; llama-server may have generated further by then, or
    finished (a busy machine reads late). Every answer must be whole whatever the moment; a kill that came after
    the answer's end is tried again (up to TRIES times), and the kills of the first half of the deltas must have cut
    the answer in the middle, so that what is checked is what a crash in the call does. The uncut call is the
    second run's: the first reads the prompt whole, the later ones (and those after a kill) find it in the slot."""
    template, request = CALLS[case]
    body = {**request, "tool_choice": "required", "max_tokens": 200, "temperature": 0}
    with running(tmp_path, argv(server_bin, demo_path, 1, "--jinja", "--chat-template-file",
                                models.template(server_bin, template)), chat_yaml(tmp_path, RESTARTS)) as wrapper:
        streamed(wrapper, body)
        alone = streamed(wrapper, body)
        whole = _arguments(_calls(alone))
        n_deltas = sum(1 for c in _calls(alone) if (c.get("function") or {}).get("arguments"))
        assert n_deltas >= 3 and json.loads(whole), f"the demo model made no call: {content(alone)[:200]!r}"
        cut: set[int] = set()  # the k whose kill cut the answer in the middle
        for k in range(1, n_deltas + 1):
            for _ in range(TRIES):
                resumed = len(wrapper.events("wrapper.stream_resumed"))

                def at_delta(seen: Events, k: int = k) -> bool:
                    return sum(1 for c in _calls(seen) if (c.get("function") or {}).get("arguments")) >= k

                events = streamed(wrapper, body, at_delta)
                one_answer(events)
                parts = _calls(events)
                assert len({c["id"] for c in parts if "id" in c}) == 1, (k, parts)  # one id, the first
                assert sum(1 for c in parts if (c.get("function") or {}).get("name")) == 1, (k, parts)  # name once
                arguments = _arguments(parts)
                assert arguments.startswith(_had(parts, k)), (k, arguments)  # what the client had stands
                assert arguments == whole, (k, arguments, whole)  # the uncut call
                assert content(events) == content(alone), k  # the text before it once
                final = next(e for e in events if e.get("choices") and e["choices"][0].get("finish_reason"))
                assert final["choices"][0]["finish_reason"] == "tool_calls", (k, final)
                if len(wrapper.events("wrapper.stream_resumed")) > resumed:
                    cut.add(k)
                    break
        print(f"{case}: killed after each of {n_deltas} argument deltas; cut in the middle after {sorted(cut)}; "
              f"the uncut call exactly after every one")
        again = wrapper.events("wrapper.call_made_again")
        assert len(again) >= len(cut) and all("repeatably" in e["why"] for e in again), again
        assert not wrapper.events("wrapper.call_goes_on")
        assert set(range(1, n_deltas // 2 + 1)) <= cut, cut
        assert wrapper.stop() == 0


# -- a tool call cut by max_tokens ------------------------------------------------------------------------------

WRITE_FILE: dict[str, Any] = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}
LENGTH_CUT: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1's JSON call, a line of text before it: a write_file whose content runs on
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct",
                  {"messages": [{"role": "user", "content": "Read the file README.md please."}],
                   "tools": [WRITE_FILE]}),
    "qwen-style": CALLS["qwen-style"],
}


def _budget(wrapper: Wrapper, body: dict[str, Any], path: str, tokens: Callable[[Events], int],
            arguments: Callable[[Events], list[str]]) -> int:
    """A max_tokens that ends the request's call in the middle of its arguments: the whole answer's tokens less
    half of its call's argument deltas and the few that close a call (`}`, `</tool_call>`, the end). Measured on
    the second run: the first reads the prompt whole, the later ones find it in the slot and read its last token
    alone, which computes it another way and may make another answer (the runs that follow are all of that kind)."""
    streamed(wrapper, body, path=path)
    whole = streamed(wrapper, body, path=path)
    pieces = arguments(whole)
    assert len(pieces) >= 6, f"the demo model made no call: {whole[-3:]}"
    return tokens(whole) - len(pieces) // 2 - 4


def _usage(events: Events) -> int:
    return next(int(e["usage"]["completion_tokens"]) for e in events if e.get("usage"))


def _argument_pieces(events: Events) -> list[str]:
    return [a for c in _calls(events) if (a := (c.get("function") or {}).get("arguments"))]


WAYS = {"from the start": RESTARTS,  # the default; and a long call's way:
        "from its arguments": "watchdog: {restarts: 100, window: 10m, replay_tokens: 0}\n"}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("case", sorted(LENGTH_CUT))
def test_a_tool_call_cut_by_max_tokens_killed_at_every_delta_ends_as_the_uncut_call(
        tmp_path: Path, server_bin: str, demo_path: str, case: str, way: str) -> None:
    """An agent's call that meets its max_tokens in its arguments (finish_reason length), llama-server SIGKILLed
    after each of its argument deltas in turn: the client gets what the uncut run gives it — the text before the
    call once, one call (one id, its name once), the uncut arguments, finish_reason length, the same completion
    tokens. It got the call's first part and ~1,000 characters of plain text; then (going on from the call's
    arguments, read in one batch) the uncut call after 0 of 30 kills, then (the prefill's tokens fed one at a time)
    after 12 of 14, not after the first delta, where the client has `{` while the model wrote more. Greedy, the
    answer is now generated again from the start (`watchdog.replay_tokens`, the default): exactly the uncut run.

    With `replay_tokens: 0` (what a call longer than it does) it goes on from its arguments, kills after the first,
    a third and two thirds of the deltas: one call whose arguments begin with what the client had and run to the
    same budget, no text after it; the uncut call is not promised (printed)."""
    template, request = LENGTH_CUT[case]
    body = {**request, "tool_choice": "required", "temperature": 0, "stream_options": {"include_usage": True}}
    with running(tmp_path, argv(server_bin, demo_path, 1, "--jinja", "--chat-template-file",
                                models.template(server_bin, template)), chat_yaml(tmp_path, WAYS[way])) as wrapper:
        budget = _budget(wrapper, {**body, "max_tokens": 200}, "/v1/chat/completions", _usage, _argument_pieces)
        for _ in range(4):  # the prompt in the slot, as for the killed runs after it; a budget that let the call
            body["max_tokens"] = budget  # end (another answer than the one measured) is made smaller
            alone = streamed(wrapper, body)
            whole = _arguments(_calls(alone))
            if whole and not _is_json(whole):
                break
            budget -= max(2, len(_argument_pieces(alone)) // 2)
        finals = [e["choices"][0]["finish_reason"] for e in alone if e.get("choices") and
                  e["choices"][0].get("finish_reason")]
        assert finals == ["length"] and whole and not _is_json(whole), (finals, whole)  # cut in its arguments
        n = len(_argument_pieces(alone))
        kills = range(1, n + 1) if way == "from the start" else sorted({1, n // 3, 2 * n // 3})
        exact = 0
        for k in kills:
            resumed = len(wrapper.events("wrapper.stream_resumed"))

            def at_delta(seen: Events, k: int = k) -> bool:
                return len(_argument_pieces(seen)) >= k

            events = streamed(wrapper, body, at_delta)
            one_answer(events)
            parts = _calls(events)
            arguments = _arguments(parts)
            assert len({c["id"] for c in parts if "id" in c}) == 1, (k, parts)
            assert sum(1 for c in parts if (c.get("function") or {}).get("name")) == 1, (k, parts)
            assert arguments.startswith(_had(parts, k)), (k, arguments)  # what the client had stands ...
            assert arguments.count('"path"') <= 1 and arguments[:1] == "{", (k, arguments)  # ... and goes on
            assert content(events) == content(alone), k  # the text before it, once: no text after the call
            final = next(e for e in events if e.get("choices") and e["choices"][0].get("finish_reason"))
            assert final["choices"][0]["finish_reason"] == "length", (k, final)
            assert not any("timings" in e for e in events if e.get("choices") and
                           not e["choices"][0].get("finish_reason")), k  # asked for by the wrapper, not shown
            exact += arguments == whole
            if way == "from the start":
                assert arguments == whole and _usage(events) == body["max_tokens"], (k, arguments, _usage(events))
            else:  # the budget, counted once in the usage: llama-server counted what the client had; a kill after
                # the budget's last token, before its end came, goes on with one more (it generates at least one)
                assert _usage(events) - body["max_tokens"] in ((0, 1) if k == n else (0,)), (k, _usage(events))
                assert len(wrapper.events("wrapper.stream_resumed")) > resumed, k
        again, going_on = wrapper.events("wrapper.call_made_again"), wrapper.events("wrapper.call_goes_on")
        print(f"{case}, {way}: a call cut by max_tokens {body['max_tokens']}, killed after {len(kills)} of its {n} "
              f"argument deltas: the uncut call exactly after {exact}; generated again {len(again)} times, "
              f"from the arguments {len(going_on)} ({sum(1 for e in going_on if e['as_generated'])} of them the "
              f"model's own tokens)")
        if way == "from the start":
            assert again and all("repeatably" in e["why"] for e in again) and not going_on, (again, going_on)
        else:
            assert not again and sum(1 for e in going_on if e["as_generated"]) >= len(going_on) // 2, going_on
        assert wrapper.stop() == 0


def test_a_sampled_tool_call_with_a_seed_killed_in_its_arguments_ends_as_the_uncut_call(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """An agent that samples (temperature 0.5) with its own seed: its call cut by max_tokens, killed after the first
    argument delta and half way in, is generated again from the start with that seed and comes out as the uncut run
    did. Each run here reads its prompt on a cold server, as the run after the kill does (no checkpoint was saved
    to restore: the prompt is read again in one batch). A sampled token is as sensitive to the prompt's KV as a
    greedy one: the same request whose prompt was found in the slot (its last token read again alone) made
    another call on the demo ("README.md" where a cold read made "file.txt"), and so may the answer after a loss
    when its prompt's KV was not computed that way (docs/lifecycle.md)."""
    template, request = LENGTH_CUT["llama-3.1"]
    body = {**request, "tool_choice": "required", "temperature": 0.5, "seed": 3, "max_tokens": 80}  # a seed and a
    # temperature with which the demo makes a call (at 0.9 it writes text)
    with running(tmp_path, argv(server_bin, demo_path, 1, "--jinja", "--chat-template-file",
                                models.template(server_bin, template)), chat_yaml(tmp_path, RESTARTS)) as wrapper:

        def cold() -> None:  # the server killed while idle and started again: nothing of the prompt in a slot
            pid = server_pid(wrapper)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: wrapper.status()["state"] == "ready" and server_pid(wrapper) != pid, 60,
                     "the server started again")

        cold()
        alone = streamed(wrapper, body)
        whole, n = _arguments(_calls(alone)), len(_argument_pieces(alone))
        assert n >= 4, f"the demo model made no call: {content(alone)[:200]!r}"
        for k in (1, n // 2):
            def at_delta(seen: Events, k: int = k) -> bool:
                return len(_argument_pieces(seen)) >= k

            cold()
            events = streamed(wrapper, body, at_delta)
            one_answer(events)
            assert (_arguments(_calls(events)), content(events)) == (whole, content(alone)), k
        again = wrapper.events("wrapper.call_made_again")
        assert len(again) == 2 and all("repeatably" in e["why"] for e in again), again
        assert wrapper.stop() == 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_responses_and_a_messages_tool_call_cut_by_max_tokens_end_as_the_uncut_call(
        tmp_path: Path, server_bin: str, demo_path: str, way: str) -> None:
    """Llama 3.1's template, the write_file call cut by its budget (Codex's Responses API, Claude Code's Messages
    API), killed after the first of the call's argument deltas, a third of the way in and two thirds in: one
    function_call item / one tool_use block, the uncut run's arguments, no text after it, the uncut run's ending
    (Messages: max_tokens; llama-server's Responses says completed) and its reported token count — greedy, the
    answer is generated again from the start. Going on from the call's arguments instead (`replay_tokens: 0`),
    its arguments begin with what the client had and the tokens reported are the budget's (Messages' stream
    carries no count: the tokenizer's count of the prefill, within 2)."""
    template = models.template(server_bin, "meta-llama-Llama-3.1-8B-Instruct")
    function = WRITE_FILE["function"]
    responses = {"input": "Read the file README.md please.", "temperature": 0, "tool_choice": "required",
                 "tools": [{"type": "function", **function}]}
    messages = {"messages": [{"role": "user", "content": "Read the file README.md please."}], "temperature": 0,
                "tool_choice": {"type": "any"}, "tools": [{"name": function["name"],
                                                          "description": function["description"],
                                                          "input_schema": function["parameters"]}]}

    def of(events: Events, kind: str) -> list[dict[str, Any]]:
        return [e for e in events if e.get("type") == kind]

    def responses_arguments(events: Events) -> list[str]:
        return [e["delta"] for e in of(events, "response.function_call_arguments.delta") if e["delta"]]

    def messages_arguments(events: Events) -> list[str]:
        return [e["delta"]["partial_json"] for e in of(events, "content_block_delta")
                if e["delta"]["type"] == "input_json_delta" and e["delta"]["partial_json"]]

    def responses_end(events: Events) -> tuple[Any, ...]:
        (done,) = of(events, "response.completed")
        items = [i for i in done["response"]["output"] if i["type"] == "function_call"]
        text = "".join(e["delta"] for e in of(events, "response.output_text.delta"))
        return done["response"]["status"], done["response"]["usage"]["output_tokens"], len(items), text

    def messages_end(events: Events) -> tuple[Any, ...]:
        (stopped,) = of(events, "message_delta")
        uses = [e for e in of(events, "content_block_start") if e["content_block"]["type"] == "tool_use"]
        text = "".join(e["delta"].get("text") or "" for e in of(events, "content_block_delta"))
        return stopped["delta"]["stop_reason"], stopped["usage"]["output_tokens"], len(uses), text

    apis = (("/v1/responses", responses, "max_output_tokens", responses_arguments, responses_end),
            ("/v1/messages", messages, "max_tokens", messages_arguments, messages_end))
    with running(tmp_path, argv(server_bin, demo_path, 1, "--jinja", "--chat-template-file", template),
                 chat_yaml(tmp_path, WAYS[way])) as wrapper:
        for path, request, limit_key, arguments_of, end in apis:
            def tokens(events: Events, end: Callable[[Events], tuple[Any, ...]] = end) -> int:
                return int(end(events)[1])

            budget = _budget(wrapper, {**request, limit_key: 200}, path, tokens, arguments_of)
            for _ in range(4):  # as for chat: a budget that let the call end is made smaller
                body = {**request, limit_key: budget}
                alone = streamed(wrapper, body, path=path)
                pieces = arguments_of(alone)
                if pieces and not _is_json("".join(pieces)):
                    break
                budget -= max(2, len(pieces) // 2)
            assert end(alone)[2] == 1 and not _is_json("".join(pieces)), (path, end(alone))
            for k in sorted({1, len(pieces) // 3, 2 * len(pieces) // 3}):
                resumed = len(wrapper.events("wrapper.stream_resumed"))
                def at(seen: Events, k: int = k, of: Callable[[Events], list[str]] = arguments_of) -> bool:
                    return len(of(seen)) >= k

                events = streamed(wrapper, body, at, path=path)
                assert not of(events, "error"), (path, k, events[-3:])
                arguments = "".join(arguments_of(events))
                assert arguments.startswith("".join(pieces[:k])), (path, k, arguments)  # what the client had
                assert arguments.count('"path"') <= 1, (path, k, arguments)
                (ending, tokens_used, calls, text), uncut = end(events), end(alone)
                assert (ending, calls, text) == (uncut[0], uncut[2], uncut[3]), (path, k, end(events), uncut)
                assert not [e for e in events if "timings" in e and e.get("type") != "response.completed"], path
                assert len(wrapper.events("wrapper.stream_resumed")) > resumed, (path, k)
                if way == "from the start":
                    assert (arguments, tokens_used) == ("".join(pieces), uncut[1]), (path, k, arguments, tokens_used)
                elif k > 1:  # Responses: llama-server counted what the client had (its per-token timings, not
                    # shown to the client); Messages' stream carries no count: the tokenizer's count of the prefill
                    assert abs(tokens_used - uncut[1]) <= (0 if path == "/v1/responses" else 2), (path, k)
                print(f"{path}, {way}: cut by {limit_key} {budget}, killed after {k} of {len(pieces)} argument "
                      f"deltas: the uncut call {'exactly' if arguments == ''.join(pieces) else 'not exactly'}")
        again, going_on = wrapper.events("wrapper.call_made_again"), wrapper.events("wrapper.call_goes_on")
        if way == "from the start":
            assert again and all("repeatably" in e["why"] for e in again) and not going_on, (again, going_on)
        else:
            assert going_on and not again, (again, going_on)
        assert wrapper.stop() == 0


# -- every generating endpoint -----------------------------------------------------------------------------------

PROMPT = "Once upon a time, in a lighthouse by the northern sea,"
INFILL = {"input_prefix": "def story():\n    \"\"\"A long story about a lighthouse keeper.\"\"\"\n    text = \"",
          "input_suffix": "\"\n    return text\n", "prompt": ""}


def _text(path: str, events: Events) -> str:
    if path == "/v1/completions":
        return "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))
    return "".join(e.get("content") or "" for e in events if "content" in e)


def _ends(path: str, events: Events) -> int:
    if path == "/v1/completions":
        return sum(1 for e in events if e.get("choices") and e["choices"][0].get("finish_reason"))
    return sum(1 for e in events if e.get("stop") is True)


def _pieces(path: str, events: Events) -> int:
    if path == "/v1/completions":
        return sum(1 for e in events if e.get("choices") and e["choices"][0].get("text"))
    return sum(1 for e in events if e.get("content") and not e.get("stop"))


ENDPOINTS = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 120},
    "/completion": {"prompt": PROMPT, "n_predict": 120},
    "/infill": {**INFILL, "n_predict": 120},
}


@pytest.fixture(scope="module")
def fim_path(tmp_path_factory: pytest.TempPathFactory, demo_path: str) -> str:
    return models.demo_with_fim(demo_path, tmp_path_factory.mktemp("models") / "demo-fim.gguf")


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_generating_endpoint_survives_a_sigkill_as_one_whole_answer(tmp_path: Path, server_bin: str,
                                                                          fim_path: str, path: str) -> None:
    """Streamed, killed 20 pieces in: one stream, one end, the lone run's text (temperature 0) with nothing
    repeated; then, asked for one JSON answer and killed while it is generated, that answer whole. Both were cut
    (left out until now). /infill cannot go on from a prefix: it is generated again and shown only what its
    client lacks."""
    body = {**ENDPOINTS[path], "temperature": 0, "ignore_eos": True}
    with running(tmp_path, argv(server_bin, fim_path, 2), chat_yaml(tmp_path)) as wrapper:
        alone = streamed(wrapper, body, path=path)
        events = streamed(wrapper, body, lambda seen: _pieces(path, seen) >= 20, path=path)
        assert not any("error" in e for e in events), events[-3:]
        assert _ends(path, events) == 1 and (path != "/v1/completions" or events[-1] == {"done": True})
        assert _text(path, events) == _text(path, alone), (_text(path, events)[:300], _text(path, alone)[:300])
        assert wrapper.events("wrapper.stream_resumed")
        pid = server_pid(wrapper)
        status, raw = killed_while_answering(wrapper, path, body, into_s=0.2)
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        text = answer["choices"][0]["text"] if path == "/v1/completions" else answer["content"]
        assert text == _text(path, alone), (text[:300], _text(path, alone)[:300])
        assert server_pid(wrapper) != pid and len(wrapper.events("wrapper.server_lost")) == 2
        assert wrapper.stop() == 0


def test_an_infill_that_samples_is_made_again_the_same(tmp_path: Path, server_bin: str, fim_path: str) -> None:
    """llama.vim samples (top_k 40, temperature > 0): after a loss the infill is generated again, and with the seed
    the request carries — the client's, or one the wrapper gave it — it samples the same tokens."""
    body = {**INFILL, "n_predict": 100, "temperature": 0.8, "top_k": 40, "seed": 1234, "ignore_eos": True}
    with running(tmp_path, argv(server_bin, fim_path, 1), chat_yaml(tmp_path)) as wrapper:
        alone = _text("/infill", streamed(wrapper, body, path="/infill"))
        events = streamed(wrapper, body, lambda seen: _pieces("/infill", seen) >= 15, path="/infill")
        assert _ends("/infill", events) == 1 and _text("/infill", events) == alone
        assert wrapper.stop() == 0

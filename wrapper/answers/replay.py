"""A greedy answer cut in a tool call goes on as the uncut run would: before the request that goes on from the
call's prefill is sent, the tokens of that prefill are fed to the server that serves now one at a time, as
decoding computed them, into the slot the request is pinned to; the request then finds all of its prompt there
and reads only its last token again, alone, as decoding did.

Why: a prefill reads its tokens in one batch, and llama.cpp's kernels do not give a batch the same numbers as one
token at a time. The KV of the same tokens differs in its last bits, and a greedy answer may go another way (the
demo, a 200-token answer cut after 25, 40, 55 and 70 tokens: the next 20 tokens differed at 4 of 12 cut points
after a prefill, at none after the tokens were fed one at a time). It costs a decode step per token (and a request
each): `watchdog.replay_tokens` bounds it, and a longer prefill is read in one batch as before.

Only a chat request pinned to its slot (the conversation cache's steps pin every one) can be fed so: another goes
to the slot the server chooses, which need not be the one fed."""

from __future__ import annotations

import time
from typing import Any

import structlog

from wrapper.server.llama import LlamaClient, LlamaError

log = structlog.get_logger()


async def replay(client: LlamaClient, body: dict[str, Any], tokens: int) -> bool:
    """Feed the last `tokens` of the chat request `body`'s prompt (its assistant prefill) one at a time into the
    slot it is pinned to, after the rest of its prompt in one batch (as the uncut request read it); whether it was
    done (False: not pinned, the prompt is no longer than that, or the server refused: the request is sent as
    it is)."""
    slot = body.get("id_slot")
    if not isinstance(slot, int) or isinstance(slot, bool) or tokens <= 0:
        return False
    began = time.monotonic()
    try:
        prompt = str((await client.call("POST", "/apply-template", body))["prompt"])
        ids = [int(t) for t in (await client.call("POST", "/tokenize", {
            "content": prompt, "add_special": True, "parse_special": True}))["tokens"]]
        if tokens >= len(ids):
            return False
        for end in range(len(ids) - tokens, len(ids) + 1):  # the prompt, then each token of the prefill alone
            await client.call("POST", "/completion", {"prompt": ids[:end], "n_predict": 0, "id_slot": slot,
                                                      "cache_prompt": True})
    except (LlamaError, KeyError, TypeError, ValueError) as exc:
        log.warning("wrapper.replay_failed", slot=slot, tokens=tokens, error=str(exc),
                    hint="the request goes on from a prefill read in one batch")
        return False
    log.info("wrapper.replayed", slot=slot, tokens=tokens, s=round(time.monotonic() - began, 3))
    return True

"""Infill (`POST /infill`): the editors' fill-in-the-middle (llama.vim, llama.vscode). Its events are llama-server's
own completion events (wrapper/answers/apis/completion.py).

It cannot go on from a prefix: llama-server builds the prompt itself — the file's extra chunks, then
`[FIM_PRE] input_prefix prompt [FIM_SUF] input_suffix [FIM_MID]` — and what it generated sits after `[FIM_MID]`,
where no field of the request reaches (`prompt` goes before the suffix). So after a loss the request goes again as
it came and the client is shown only what it lacks: the events it has are generated again and dropped by count.
The wrapper gives a request without a `seed` one of its own (wrapper/answers/answer.py), so that an answer made
again samples the same tokens.
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.apis.api import Said
from wrapper.answers.apis.completion import Completion
from wrapper.answers.part import Part


class Infill(Completion):
    name = "infill"
    paths = ("/infill",)
    growable = False
    pausable = False
    exact = False

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        raise NotImplementedError("an infill goes again from the start")

    def gathered(self, last: Part, said: Said, prompt_tokens: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        answer = copy.deepcopy(last.final or {})
        answer.update(content=said.text, tokens_predicted=said.tokens, stop=True)
        if prompt_tokens is not None:
            answer["tokens_evaluated"] = prompt_tokens
        return answer

    def cut_by_context(self, request: dict[str, Any], answer: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
        return None

    def cannot_go_on(self, request: dict[str, Any]) -> str | None:
        return None  # one answer, whatever its prompt

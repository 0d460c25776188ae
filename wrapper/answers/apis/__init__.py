"""The APIs whose answers the request path reads, goes on with and gathers, one module each; `of` names the one a
path speaks (wrapper/answers/apis/api.py says what each tells)."""

from __future__ import annotations

from wrapper.answers.apis.api import Api, Other
from wrapper.answers.apis.chat import Chat
from wrapper.answers.apis.completion import Completion, TextCompletion
from wrapper.answers.apis.infill import Infill
from wrapper.answers.apis.messages import Messages
from wrapper.answers.apis.responses import Responses

APIS: tuple[Api, ...] = (Chat(), Completion(), TextCompletion(), Infill(), Responses(), Messages())
OTHER = Other()
_BY_PATH = {path: api for api in APIS for path in api.paths}


def of(path: str) -> Api:
    """The API a request path speaks (OTHER: one whose answers are not read, embeddings, tokenize, ...)."""
    return _BY_PATH.get(path, OTHER)

"""llama-server's request paths the wrapper treats apart, named once."""

from __future__ import annotations

NATIVE_COMPLETION = "/completion"  # llama-server's own: a prompt, `n_predict`, `truncated` in its answer
COMPLETIONS = (NATIVE_COMPLETION, "/completions", "/v1/completions")  # a prompt, continued
CHAT = ("/chat/completions", "/v1/chat/completions")  # messages, through the chat template
INFILL = ("/infill",)
GENERATING = (*COMPLETIONS, *CHAT, *INFILL)  # fill a slot's context: a request that overflows it can be grown for
RESPONSES = ("/v1/responses", "/responses")  # OpenAI Responses: `input` items
MESSAGES = ("/v1/messages",)  # Anthropic Messages
CONVERSING = (*COMPLETIONS, *CHAT, *RESPONSES, *MESSAGES)  # a conversation whose tokens can be told before it is
# sent: the cache keeps it (Messages drops `id_slot`: it is prepared where the server's own rule places it)
SLOT_USERS_UNPINNED = (*INFILL, "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
                       "/v1/reranking")  # take a slot the cache does not choose
CARRYING_MEDIA = (*COMPLETIONS, *CHAT, *RESPONSES, *MESSAGES)  # a request here may carry an image or audio
DESCRIBING = ("/props", "/models", "/v1/models")  # what the server says it can do (modalities, capabilities)
ANSWERED_ASLEEP = DESCRIBING  # GETs answered from memory while asleep (and never keeping the server awake)
DECODING = (*GENERATING, *RESPONSES, *MESSAGES)  # a request that decodes tokens in a slot
SEATED = (*DECODING, *SLOT_USERS_UNPINNED)  # takes a slot: waits for a seat in the queue (wrapper/queue/seats.py)

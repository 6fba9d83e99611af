"""What the simulator says: deterministic tokens and the OpenAI response shapes. Pure functions.

Tokens are words drawn from a small vocabulary by a generator seeded with a hash of the prompt, so
the same prompt always yields the same completion (a test can assert on text that crossed a router,
a benchmark can check nothing was reordered) and different prompts yield different ones. A "token"
is one word; prompt tokens are counted the same way, which is all ``usage`` needs to be consistent.

Streaming chunks are built from a per-request prefix and suffix around the JSON-encoded token, so a
chunk costs one small ``json.dumps`` instead of a whole document: the simulator must keep up with
hundreds of concurrent streams on two cores.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

VOCABULARY = (
    "the", "a", "model", "token", "stream", "router", "engine", "shard", "replica", "node",
    "fabric", "latency", "throughput", "request", "response", "quickly", "slowly", "again",
    "simulated", "answer", "question", "about", "with", "from", "into", "over", "under", "and",
    "or", "but", "so", "then", "every", "some", "many", "few", "large", "small", "fast", "steady",
    "bright", "quiet", "loud", "green", "blue", "river", "mountain", "cloud", "signal", "queue",
    "batch", "cache", "prefix", "decode", "prefill", "tensor", "pipeline", "parallel", "memory",
    "kernel", "thread", "socket", "packet", "frame",
)  # fmt: skip

#: Tokens a chat template adds around each message (role markers), roughly as real templates do.
CHAT_TOKENS_PER_MESSAGE = 4


class BadRequest(ValueError):
    """A request the OpenAI API would answer with 400; the message says which field and why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def completion_tokens(prompt: str, count: int) -> list[str]:
    """``count`` deterministic tokens for ``prompt``: the first capitalised, the rest space-led, so
    joined they read as a sentence."""
    seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    words = [rng.choice(VOCABULARY) for _ in range(count)]
    return [w.capitalize() if i == 0 else " " + w for i, w in enumerate(words)]


def count_tokens(text: str) -> int:
    return len(text.split())


#: Token ids below this are the tokenizer's specials (the chat template's role markers).
FIRST_WORD_ID = 1000
#: The simulated vocabulary's size (Llama 3's, so ids look like a real model's).
VOCAB_SIZE = 128256


@functools.lru_cache(maxsize=65536)
def _word_id(word: str) -> int:
    digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
    return FIRST_WORD_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_WORD_ID)


def token_ids(text: str) -> list[int]:
    """The simulator's tokenizer: one id per whitespace-separated word, the same word always the
    same id, so the same text always gives the same ids and a shared prefix of words is a shared
    prefix of tokens (prefix caching across requests is real). The one place text becomes ids:
    swapping in a real tokenizer changes only this function (and :func:`chat_token_ids`)."""
    return [_word_id(w) for w in text.split()]


def _role_ids(role: str) -> list[int]:
    """The chat template's per-message marker tokens (CHAT_TOKENS_PER_MESSAGE of them), as real
    templates add a header around each message; the role decides the middle one."""
    role_id = int.from_bytes(hashlib.blake2b(role.encode(), digest_size=2).digest(), "big") % 900
    return [1, 2, 10 + role_id, 3][:CHAT_TOKENS_PER_MESSAGE]


def _content_text(content: object) -> str:
    """Message content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return " ".join(str(p) for p in parts)
    raise BadRequest("messages[].content must be a string or a list of content parts", "messages")


@attrs.frozen
class Prompt:
    """A request's prompt, reduced to what the simulator needs: text to seed from, and a count."""

    text: str
    tokens: int
    #: The prompt's token ids (``tokens`` of them), from :func:`token_ids`.
    ids: tuple[int, ...] = ()


def chat_prompt(body: Mapping[str, Any]) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    texts: list[str] = []
    ids: list[int] = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message needs a role", "messages")
        text = _content_text(m.get("content"))
        texts.append(f"{m['role']}: {text}")
        ids += _role_ids(str(m["role"]))
        ids += token_ids(text)
    return Prompt(text="\n".join(texts), tokens=len(ids), ids=tuple(ids))


def completion_prompt(body: Mapping[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        # An empty prompt still costs one token (the BOS a real tokenizer adds).
        ids = token_ids(prompt) or [0]
        return Prompt(text=prompt, tokens=len(ids), ids=tuple(ids))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return Prompt(text=" ".join(map(str, prompt)), tokens=len(prompt), ids=tuple(prompt))
    raise BadRequest(
        "prompt must be a string, a list of one string, or a list of token ids "
        "(the simulator serves one prompt per request)",
        "prompt",
    )


def requested_max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{key} must be a positive integer, got {value!r}", key)
        return value
    return None


@attrs.frozen
class Plan:
    """One request's generation: its tokens, why it ends, and the usage it will report."""

    tokens: tuple[str, ...]
    finish_reason: str
    prompt_tokens: int

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The generated tokens' ids, from the same tokenizer as the prompt's."""
        return tuple(_word_id(t.strip().lower()) for t in self.tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def plan(prompt: Prompt, max_tokens: int | None, default_max_tokens: int, max_model_len: int) -> Plan:
    """``max_tokens`` given: exactly that many tokens, finish_reason "length" (the model "would
    have gone on"); not given: the default length, finish_reason "stop". Like vLLM, a prompt that
    leaves no room in the context is a 400, and max_tokens is capped by what room there is."""
    room = max_model_len - prompt.tokens
    if room < 1:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt.tokens} input tokens.",
            "messages",
        )
    if max_tokens is not None and max_tokens > room:
        raise BadRequest(
            f"max_tokens {max_tokens} is too large: this model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt.tokens} input tokens",
            "max_tokens",
        )
    count = max_tokens if max_tokens is not None else min(default_max_tokens, room)
    return Plan(
        tokens=tuple(completion_tokens(prompt.text, count)),
        finish_reason="length" if max_tokens is not None else "stop",
        prompt_tokens=prompt.tokens,
    )


@attrs.frozen
class Shape:
    """The fixed parts of one request's responses: endpoint kind, id, timestamp, model name."""

    chat: bool
    request_id: str
    created: int
    model: str

    def full_response(self, p: Plan) -> dict[str, Any]:
        text = "".join(p.tokens)
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": p.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": p.finish_reason}
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": p.usage(),
        }

    def _head(self) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return (
            f'{{"id":{json.dumps(self.request_id)},"object":"{obj}","created":{self.created},'
            f'"model":{json.dumps(self.model)},'
        )

    def stream(self, p: Plan, include_usage: bool) -> Iterator[tuple[bytes, bool]]:
        """The SSE events of a streamed response, ``data: [DONE]`` last, each paired with whether
        it carries a generated token (the server paces those, and counts them)."""
        head = self._head()
        if self.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            yield _event(f'{head}"choices":[{_dumps({**first, "finish_reason": None})}]}}'), False
            prefix = head + '"choices":[{"index":0,"delta":{"content":'
            suffix = '},"logprobs":null,"finish_reason":null}]}'
        else:
            prefix = head + '"choices":[{"index":0,"text":'
            suffix = ',"logprobs":null,"finish_reason":null}]}'
        for token in p.tokens:
            yield _event(prefix + json.dumps(token) + suffix), True
        if self.chat:
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": p.finish_reason}
        else:
            last = {"index": 0, "text": "", "logprobs": None, "finish_reason": p.finish_reason}
        yield _event(f'{head}"choices":[{_dumps(last)}]}}'), False
        if include_usage:
            yield _event(f'{head}"choices":[],"usage":{_dumps(p.usage())}}}'), False
        yield b"data: [DONE]\n\n", False


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape, which the openai client turns into its typed exceptions."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def models_list(names: Sequence[str], root: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmgw-sim",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
            }
            for name in names
        ],
    }

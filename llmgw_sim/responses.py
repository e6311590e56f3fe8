"""Response bodies in the shapes vLLM's OpenAI-compatible server sends (pure, orjson).

Non-streamed: ``chat.completion`` / ``text_completion`` objects with ``usage``. Streamed:
server-sent events ``data: <chunk>\\n\\n`` of ``chat.completion.chunk`` / ``text_completion``
objects, an optional usage chunk with ``"choices": []`` (OpenAI ``stream_options.include_usage``)
and a final ``data: [DONE]``. ``stop_reason`` is vLLM's extension (the stop string matched, or
null). Errors are ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from llmgw_sim.generate import FinishReason

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one response (OpenAI ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_json(self) -> dict[str, object]:
        """The OpenAI ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: FinishReason
    stop_reason: str | None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The fields every response object and chunk of one request repeats."""

    id: str
    created: int
    model: str


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    """An OpenAI-style error object."""
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}})


def chat_completion(head: ResponseHead, choices: list[ChoiceResult], usage: Usage) -> bytes:
    """A non-streamed ``chat.completion``."""
    return orjson.dumps({
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage.to_json(),
        "prompt_logprobs": None,
    })


def text_completion(head: ResponseHead, choices: list[ChoiceResult], usage: Usage) -> bytes:
    """A non-streamed ``text_completion``."""
    return orjson.dumps({
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": None,
            }
            for c in choices
        ],
        "usage": usage.to_json(),
    })


def _event(obj: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_role_chunk(head: ResponseHead, index: int) -> bytes:
    """The first chunk of a streamed chat choice: the assistant role and empty content."""
    return _event({
        "id": head.id, "object": "chat.completion.chunk", "created": head.created,
        "model": head.model,
        "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
    })


def chat_delta_chunk(head: ResponseHead, index: int, text: str,
                     finish_reason: FinishReason | None, stop_reason: str | None) -> bytes:
    """A streamed chat content delta; the last one of a choice carries ``finish_reason``."""
    choice: dict[str, object] = {"index": index, "delta": {"content": text} if text else {},
                                 "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return _event({"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                   "model": head.model, "choices": [choice]})


def completion_delta_chunk(head: ResponseHead, index: int, text: str,
                           finish_reason: FinishReason | None, stop_reason: str | None) -> bytes:
    """A streamed ``text_completion`` delta."""
    return _event({
        "id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
        "choices": [{"index": index, "text": text, "logprobs": None,
                     "finish_reason": finish_reason, "stop_reason": stop_reason}],
    })


def usage_chunk(head: ResponseHead, object_type: str, usage: Usage) -> bytes:
    """The final streamed chunk when ``stream_options.include_usage`` is set."""
    return _event({"id": head.id, "object": object_type, "created": head.created,
                   "model": head.model, "choices": [], "usage": usage.to_json()})


def embedding_list(head: ResponseHead, embeddings: list[list[float]] | list[str],
                   prompt_tokens: int) -> bytes:
    """A ``/v1/embeddings`` answer: float lists or base64 strings, and usage (vLLM's shape)."""
    return orjson.dumps({
        "id": head.id,
        "object": "list",
        "created": head.created,
        "model": head.model,
        "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(embeddings)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    })


def model_list(models: tuple[str, ...], created: int, max_model_len: int,
               adapters: dict[str, str] | None = None) -> bytes:
    """``GET /v1/models`` as vLLM answers it: one card per served name, ``owned_by: vllm``,
    ``root`` the model the names serve; then one per LoRA adapter (name -> path), with
    ``root`` its path, ``parent`` the base model and no ``max_model_len``."""
    base = models[0]
    return orjson.dumps({
        "object": "list",
        "data": [
            *(_model_card(model, base, None, created, max_model_len) for model in models),
            *(_model_card(name, path, base, created, None) for name, path in (adapters or {}).items()),
        ],
    })


def _model_card(model: str, root: str, parent: str | None, created: int,
                max_model_len: int | None) -> dict[str, object]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{model}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
    }

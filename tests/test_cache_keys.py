"""What keys the response cache: the answer digest (exact) and the context digest (semantic)."""

from __future__ import annotations

from extproc.body import answer_digest, context_digest

CHAT = "/v1/chat/completions"


def _chat(last: str, system: str = "be brief", **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": last}],
            "temperature": 0, **extra}


def test_only_deterministic_requests_have_an_answer_digest_and_delivery_fields_do_not_count() -> None:
    assert answer_digest(CHAT, _chat("hi", temperature=0.7)) is None
    assert answer_digest(CHAT, _chat("hi", temperature=0.7, seed=3)) is not None
    plain = answer_digest(CHAT, _chat("hi"))
    assert plain == answer_digest(CHAT, _chat("hi", stream=True, user="u", model="alias"))
    assert plain != answer_digest(CHAT, _chat("hi", max_tokens=5))
    assert plain != answer_digest("/v1/completions", _chat("hi"))


def test_the_context_digest_leaves_out_the_last_user_turn_only() -> None:
    text, digest = context_digest(CHAT, _chat("What is the capital of France?"))
    assert text == "What is the capital of France?"
    assert digest == context_digest(CHAT, _chat("what's the capital of France"))[1]
    assert digest != context_digest(CHAT, _chat("What is the capital of France?", system="be verbose"))[1]
    assert digest != context_digest(CHAT, _chat("What is the capital of France?", max_tokens=3))[1]
    completion = {"model": "m", "prompt": "Say hi", "temperature": 0}
    assert context_digest("/v1/completions", completion)[0] == "Say hi"
    assert context_digest(CHAT, {"model": "m", "messages": [{"role": "assistant", "content": "x"}]}) == ("", None)

"""End to end: gateway-side batching through Envoy with the openai client. Batchable requests go to
the coordinator, which merges them into one completion call per pod and answers each client in
the shape it asked for, with its own usage; realtime requests, and everything while the
coordinator is down, go direct. A pod dying in the middle of a merged call (the simulated pod's
``--die-after-tokens``) or a client leaving it costs no other client its answer."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml
from openai.types.chat import ChatCompletionChunk

from extproc.coordinator.merge import parse
from extproc.launcher import LocalStack, StackInfo
from extproc.ledger import read_file
from extproc.templates import CHATML
from tests.e2e.conftest import MODEL, small_stack
from tests.helpers import wait_for

BATCHED = {
    "pools": [{"name": "local", "simulate": 1, "batching": {"enabled": True, "max_wait_ms": {"default": 300}}}],
}


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # A static engine (one batch at a time): requests arriving while it runs a batch wait, and the
    # coordinator merges them for the next one.
    with small_stack(tmp_path_factory, "batching", pods=1, extra_config=BATCHED,
                     sim_args=("--engine", "static", "--record", "100")) as info:
        yield info


def _client(info: StackInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{info.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(info: StackInfo, i: int) -> tuple[str, dict[str, str], object]:
    client = _client(info)
    kind, stream = ("chat", "completion")[i % 2], i % 3 == 0
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}: say something"}],
            max_tokens=8, stream=stream, stream_options={"include_usage": True} if stream else None)
    else:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"prompt number {i}", max_tokens=8, stream=stream,
            stream_options={"include_usage": True} if stream else None)
    parsed = raw.parse()
    return kind, dict(raw.headers), (list(parsed) if stream else parsed)


def test_concurrent_clients_are_merged_and_each_gets_its_own_answer(batching: StackInfo) -> None:
    first = threading.Thread(target=_ask, args=(batching, 99))  # keeps the pod's one batch busy
    first.start()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(batching, i), range(8)))
    first.join(60)
    sizes = [int(headers["x-llmgw-batch-size"]) for _, headers, _ in answers]
    assert max(sizes) > 1, sizes  # merged
    for kind, headers, answer in answers:
        assert headers["x-llmgw-batch-id"]
        if isinstance(answer, list):  # streamed: chunks of its own shape, then a usage chunk
            assert {c.object for c in answer} == {"chat.completion.chunk" if kind == "chat" else "text_completion"}
            usage = answer[-1].usage
            text = "".join((c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text
                           for c in answer if c.choices)
        else:
            assert answer.object == ("chat.completion" if kind == "chat" else "text_completion")
            usage = answer.usage
            text = answer.choices[0].message.content if kind == "chat" else answer.choices[0].text
        assert text and usage.completion_tokens == 8 and usage.prompt_tokens > 0


def test_realtime_and_unbatchable_requests_go_direct(batching: StackInfo) -> None:
    raw = _client(batching).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2)
    assert "x-llmgw-batch-id" not in raw.headers and len(raw.parse().choices) == 2


def test_with_the_coordinator_down_requests_go_direct(tmp_path_factory: pytest.TempPathFactory) -> None:
    stack = small_stack(tmp_path_factory, "nocoord", pods=1, extra_config=BATCHED, restart=False)
    with stack as info:
        coordinator = next(c for c in stack.group.children if c.name == "coordinator")
        coordinator.proc.kill()
        coordinator.proc.wait(10)
        deadline = time.monotonic() + 20
        while True:  # until extproc's probe marks it down
            try:
                raw = _client(info).chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                if "x-llmgw-batch-id" not in raw.headers:
                    break
            except openai.APIStatusError:
                pass
            assert time.monotonic() < deadline, "requests still go to a dead coordinator"
        assert raw.parse().choices[0].message.content


def test_requests_with_different_parameters_share_a_batch_protocol_call(batching: StackInfo) -> None:
    coordinator = yaml.safe_load(batching.config_path.read_text())["server"]["coordinator"]

    def protocol_figures(kind: str) -> float:
        text = httpx.get(f"http://{coordinator}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'llmgw_batch_size_{kind}{{') and 'protocol="llmgw.v1"' in line)

    def protocol_batches() -> float:
        return protocol_figures("sum")

    deadline = time.monotonic() + 30
    while protocol_batches() == 0:  # the coordinator learns that the pod speaks it after its first call
        _ask(batching, 100)
        assert time.monotonic() < deadline, "no batch went over the batch protocol"
    client = _client(batching)

    def ask(temperature: float) -> str:
        answer = client.completions.create(model=MODEL, prompt=f"t={temperature}", max_tokens=4,
                                           temperature=temperature)
        return answer.choices[0].text

    # The four must reach the coordinator while the first keeps the pod's one batch busy; on a loaded
    # machine they may come after it is done and each go alone, so the scene is played until they
    # merge (requests that could never share a call, by their parameters, fail every round).
    for _ in range(5):
        before, calls_before = protocol_batches(), protocol_figures("count")
        first = threading.Thread(target=_ask, args=(batching, 99))  # keeps the pod's one batch busy
        first.start()
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, (0.1, 0.4, 0.7, 1.0)))
        first.join(60)
        assert all(texts) and protocol_batches() - before >= 4
        if protocol_figures("count") - calls_before < protocol_batches() - before:  # fewer calls than requests
            break
    else:
        pytest.fail("five rounds of requests with different parameters never shared a batch protocol call")


# -- a pod dying mid-batch -------------------------------------------------------------------------
#
# Every pod of this stack dies (os._exit) as soon as one of its sequences reaches DIE_AT tokens:
# members asking for MEMBER_TOKENS are cut there, and their retries (the MEMBER_TOKENS - DIE_AT
# tokens left) and the keeper (fewer than DIE_AT) never reach it. Only the pod the batch went to
# dies, and its fallback stays up. The pool's picker scores the prompt prefix only and every
# request opens with the same long system prompt, so the keeper and every member go to one pod
# (its home, then the pod it was sent to). With no scraped queues the members queue while the
# keeper's call runs, until their window (adapted to their arrivals) closes: each group of three
# leaves in one or two merged calls.

DIE_AT, MEMBER_TOKENS, KEEPER_TOKENS = 12, 14, 11
FAULT_KEY, TPM = "sk-e2e-faults", 1_000_000
SYSTEM = "You answer questions about the batching coordinator. " * 6  # > one 256-byte prefix block
FAULTY = {
    "pools": [{"name": "local", "simulate": 2,
               "batching": {"enabled": True, "max_wait_ms": {"default": 10_000}, "max_batch_size": 3},
               "picker": {"kind": "scored",
                          "weights": {"queue": 0, "kv_cache": 0, "in_flight": 0, "prefix": 1, "lora": 0}}}],
    "endpoint_picker": {"scrape": {"enabled": False}},
    "tenants": [{"name": "faults", "keys": [{"sha256": hashlib.sha256(FAULT_KEY.encode()).hexdigest()}],
                 "limits": {"tpm": TPM}}],
}


@dataclass
class Seen:
    """What one client sent and got back."""

    name: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)  # a stream's data events, parsed
    done: bool = False  # a stream ended with data: [DONE]
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _ask_and_record(info: StackInfo, seen: Seen, started: threading.Event | None = None,
                    api_key: str = FAULT_KEY) -> Seen:
    """Send ``seen.body`` with the openai client and record the answer (a stream event by event);
    ``started`` is set at a stream's first event."""
    body = dict(seen.body)
    extra = {name: body.pop(name) for name in ("ignore_eos",) if name in body}
    create = _openai(info, api_key).chat.completions
    if not seen.stream:
        raw = create.with_raw_response.create(**body, extra_body=extra, extra_headers={"x-request-id": seen.name})
        seen.headers = dict(raw.headers)
        answer = raw.parse()
        seen.text, seen.finish_reason = answer.choices[0].message.content or "", answer.choices[0].finish_reason
        seen.usage = answer.usage.model_dump() if answer.usage else None
        return seen
    with create.with_streaming_response.create(**body, extra_body=extra,
                                               extra_headers={"x-request-id": seen.name}) as response:
        seen.headers = dict(response.headers)
        _read_stream(response.iter_lines(), seen, lambda: started.set() if started is not None else None)
    return seen


def _openai(info: StackInfo, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{info.base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def _read_stream(lines: Iterator[str], seen: Seen, on_event: Callable[[], object] = lambda: None,
                 until: Callable[[], bool] = lambda: False) -> None:
    """Record a chat stream's events into ``seen``, calling ``on_event`` after each; stop reading
    (the caller then hangs up) as soon as ``until()`` is true after an event."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            seen.done = True
            continue
        assert not seen.done, "an event after [DONE]"
        chunk = ChatCompletionChunk.model_validate_json(line[6:]).model_dump()
        seen.chunks.append(chunk)
        for choice in chunk["choices"]:
            seen.text += choice["delta"].get("content") or ""
            seen.finish_reason = choice["finish_reason"] or seen.finish_reason
        seen.usage = chunk["usage"] or seen.usage
        on_event()
        if until():
            return


def _assert_one_stream(seen: Seen, tokens: int) -> None:
    """One stream: one id, one role delta, text, one finish_reason (the last), usage, [DONE]."""
    chunks = seen.chunks
    assert len({c["id"] for c in chunks}) == 1 and seen.done and seen.text
    assert [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]].count("assistant") == 1
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == tokens


def _chat_body(question: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                            **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _coordinator_metric(info: StackInfo, name: str, **labels: str) -> float:
    coordinator = yaml.safe_load(info.config_path.read_text())["server"]["coordinator"]
    text = httpx.get(f"http://{coordinator}/metrics", timeout=10).text
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(w in line for w in wanted))


@dataclass
class CutBatch:
    """The run of the scenario: every client's answer, the pods, and what the coordinator counted."""

    info: StackInfo
    stack: LocalStack
    keeper: Seen
    members: list[Seen]
    fallback: str  # the pod that did not die
    retries: list[dict[str, Any]]  # the calls the fallback pod received (its --record)
    resumed: float  # llmgw_batch_retries_total{outcome="resumed"} during the scenario
    failed: float


@pytest.fixture(scope="module")
def cut_batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CutBatch]:
    stack = small_stack(tmp_path_factory, "podfault", pods=2, extra_config=FAULTY,
                        sim_args=("--die-after-tokens", str(DIE_AT), "--time-scale", "10", "--record", "50"))
    with stack as info:
        resumed, failed = (_coordinator_metric(info, "llmgw_batch_retries_total", outcome=o)
                           for o in ("resumed", "failed"))
        keeper = Seen("keeper", _chat_body("Keep the pod busy.", KEEPER_TOKENS, stream=True))
        # Two merged calls: one over the batch protocol, one over vLLM's HTTP API (presence_penalty is
        # not a batch-protocol parameter); streamed and plain clients in each.
        members = [Seen(f"member-{i}", _chat_body(f"Question {i}?", MEMBER_TOKENS, stream=i in (0, 2, 3),
                                                  **({"presence_penalty": 0.0} if i >= 3 else {})))
                   for i in range(6)]
        started = threading.Event()
        with ThreadPoolExecutor(len(members) + 1) as pool:
            keeping = pool.submit(_ask_and_record, info, keeper, started)
            assert started.wait(60), "the keeper got no first chunk"  # its call is in flight: members queue
            answered = list(pool.map(lambda seen: _ask_and_record(info, seen), members))
            keeping.result(120)
        (death,) = wait_for("the pod's death", lambda: [e for e in stack.group.exits if e.name.startswith("pod-")],
                            60)
        urls = info.pod_urls["local"]
        index = int(death.name.rsplit("-", 1)[1]) - 1
        fallback = urls[1 - index]
        retries = httpx.get(f"{fallback}/debug/requests", timeout=10).json()["requests"]
        yield CutBatch(info, stack, keeper, answered, fallback, retries,
                       _coordinator_metric(info, "llmgw_batch_retries_total", outcome="resumed") - resumed,
                       _coordinator_metric(info, "llmgw_batch_retries_total", outcome="failed") - failed)


def _prompt_tokens(url: str, body: dict[str, Any]) -> int:
    """What the pod counts for the prompt the coordinator makes of ``body`` (alone, uncut)."""
    prompt = parse(orjson.dumps(body), "", 0, {MODEL: CHATML})[1].prompt  # the simulated pod's template
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30)
    return int(answer.json()["usage"]["prompt_tokens"])


def test_a_batch_cut_by_its_pod_dying_still_answers_every_member(cut_batch: CutBatch) -> None:
    run = cut_batch
    # Only the pod that had the batch died, once, as its fault says (os._exit(1)).
    assert [(e.name.startswith("pod-"), e.returncode) for e in run.stack.group.exits] == [(True, 1)]
    everyone = (run.keeper, *run.members)
    with ThreadPoolExecutor(len(everyone)) as pool:
        prompt_tokens = list(pool.map(lambda seen: _prompt_tokens(run.fallback, seen.body), everyone))
    for seen, own_prompt in zip(everyone, prompt_tokens, strict=True):
        limit = seen.body["max_tokens"]
        assert seen.text and seen.finish_reason == "length", seen
        assert seen.usage is not None and seen.usage["completion_tokens"] == limit, seen.usage
        assert seen.usage["prompt_tokens"] == own_prompt  # not its prompt plus what it had before the cut
        assert not seen.stream or seen.done
        assert seen.headers["x-llmgw-batch-id"]
        assert int(seen.headers["x-ratelimit-limit-tokens"]) == TPM
        assert 0 <= int(seen.headers["x-ratelimit-remaining-tokens"]) <= TPM
    # Every member was cut and retried alone on the fallback pod, at least one of a merged call
    # after it had part of its answer.
    retried = {r["headers"]["baggage"].removeprefix("llmgw.batch_id=") for r in run.retries}
    assert {m.headers["x-llmgw-batch-id"] for m in run.members} == retried
    assert all(len(r["body"]["prompt"]) == 1 for r in run.retries) and len(run.retries) == len(run.members)
    cut = [m for m in run.members if any(_resumed_part(m, r) for r in run.retries)]
    assert any(int(m.headers["x-llmgw-batch-size"]) > 1 for m in cut), [m.headers for m in run.members]
    assert run.keeper.headers["x-llmgw-batch-id"] not in retried  # the keeper's call ended before the death

    # Usage: each request is settled once, with the usage its client saw; the tenant is charged it.
    ledger = run.info.log_dir.parent / "usage.jsonl"
    names = {seen.name: seen for seen in (run.keeper, *run.members)}

    def settled() -> dict[str, Any] | None:
        records = [r for r in read_file(ledger) if r.request_id in names] if ledger.exists() else []
        return {r.request_id: r for r in records} if len(records) == len(names) else None

    records = wait_for("every request in the ledger", settled, 60)
    for name, record in records.items():
        usage = names[name].usage
        assert usage is not None and record.complete and not record.usage_estimated, record
        assert (record.input_tokens, record.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    charged = sum(r.input_tokens + r.output_tokens for r in records.values())
    probe = httpx.post(f"{run.info.base_url}/v1/chat/completions", timeout=60,
                       headers={"authorization": f"Bearer {FAULT_KEY}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert probe.status_code == 200
    assert int(probe.headers["x-ratelimit-remaining-tokens"]) <= TPM - charged


def _resumed_part(member: Seen, retry: dict[str, Any]) -> str:
    """The text ``member`` had from the pod that died, if ``retry`` resumed it after that ("" if not)."""
    prompt = parse(orjson.dumps(member.body), "", 0, {MODEL: CHATML})[1].prompt
    (sent,) = retry["body"]["prompt"]
    return sent[len(prompt):] if sent.startswith(prompt) else ""


def test_a_stream_cut_by_its_pod_dying_simply_continues(cut_batch: CutBatch) -> None:
    run = cut_batch
    streams = [m for m in run.members if m.stream]
    for seen in streams:
        _assert_one_stream(seen, MEMBER_TOKENS)
    # The text from the pod that died, then the fallback's, which went on from it.
    resumed = [(m, part) for m in streams for r in run.retries if (part := _resumed_part(m, r))]
    assert resumed, "no stream was cut mid-answer"
    for seen, part in resumed:
        assert seen.text.startswith(part) and len(seen.text) > len(part)
    assert run.resumed == len(run.retries) and run.failed == 0


def test_a_client_leaving_mid_batch_leaves_the_others_answers_untouched(batching: StackInfo) -> None:
    retries = _coordinator_metric(batching, "llmgw_batch_retries_total")
    tokens = 60  # ~0.8 s of steps: the others go on well after one has left
    # frequency_penalty is not a batch-protocol parameter: these requests get a queue (and an
    # adaptive window) of their own, untouched by the other tests' traffic.
    members = [Seen(f"leave-{i}", {"model": MODEL, "messages": [{"role": "user", "content": f"Topic {i}, please."}],
                                   "max_tokens": tokens, "ignore_eos": True, "seed": 7, "frequency_penalty": 0.0,
                                   "stream": True, "stream_options": {"include_usage": True}})
               for i in range(5)]
    dispatched = [threading.Event() for _ in members]
    chosen = threading.Event()
    leaver: list[Seen] = []

    def run(i: int) -> None:
        seen, body = members[i], dict(members[i].body)
        extra = {"ignore_eos": body.pop("ignore_eos")}
        with _openai(batching, "unused").chat.completions.with_streaming_response.create(
                **body, extra_body=extra) as response:
            seen.headers = dict(response.headers)  # sent when its batch leaves
            dispatched[i].set()
            assert chosen.wait(60)
            # The one leaving hangs up after its first text: its batch runs on without it.
            _read_stream(response.iter_lines(), seen, until=lambda: seen in leaver and bool(seen.text))

    with ThreadPoolExecutor(len(members)) as pool:
        running = [pool.submit(run, i) for i in range(len(members))]
        try:
            assert all(event.wait(60) for event in dispatched)
            batches = Counter(m.headers["x-llmgw-batch-id"] for m in members)
            batch_id, size = batches.most_common(1)[0]
            assert size >= 2, batches  # merged: the first leaves alone at once, the others wait for it
            leaver.append(next(m for m in members if m.headers["x-llmgw-batch-id"] == batch_id))
        finally:
            chosen.set()
        for future in running:
            future.result(120)
    (gone,) = leaver
    assert gone.text and not gone.done and gone.finish_reason is None  # it left mid-answer
    stayed = [m for m in members if m is not gone]
    for seen in stayed:
        _assert_one_stream(seen, tokens)
    # Untouched: word for word what the pod says to the same prompts and seed (a seeded choice's
    # text depends on its own prompt only).
    prompts = [parse(orjson.dumps(m.body), "", 0, {MODEL: CHATML})[1].prompt for m in stayed]
    alone = httpx.post(f"{batching.pod_urls['local'][0]}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompts, "max_tokens": tokens, "ignore_eos": True, "seed": 7,
        "frequency_penalty": 0.0}).json()
    assert [m.text for m in stayed] == [c["text"] for c in sorted(alone["choices"], key=lambda c: c["index"])]
    assert _coordinator_metric(batching, "llmgw_batch_retries_total") == retries  # nothing was retried

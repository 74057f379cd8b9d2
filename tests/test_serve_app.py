"""attnkit.serve.app, live: uvicorn on a free port of 127.0.0.1 and the real ``openai`` client.

Chat and text completions streamed and not, 16 concurrent streams equal to the same requests
one at a time, a prefix-cache hit counted in /metrics, OpenAI-style 400/429/503 errors (never a
500 for a client's mistake), a client that disconnects mid-stream gets its blocks returned, and
the pool is whole after the run."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")

from attnkit.serve.app import create_app  # noqa: E402
from attnkit.serve.engine import Engine  # noqa: E402
from serve_oracles import LiveServer, tiny_llm  # noqa: E402
from serve_oracles import one_thread as one_thread  # noqa: E402

NAME = "tiny-smol"


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(max_len=256)


@pytest.fixture(scope="module")
def server(llm):
    engine = Engine(llm.model, num_blocks=96, block_size=8, max_batch=16, eos_id=llm.eos_id)
    with LiveServer(create_app(llm, engine, model_name=NAME)) as url:
        yield url, engine
    assert not engine.started  # the application's shutdown stopped the engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def settle(url: str) -> dict[str, float]:
    """/metrics once nothing runs or waits (the engine retires at its next step)."""
    deadline = time.monotonic() + 20
    while True:
        m = metrics(url)
        if m["attnkit_running_sequences"] == m["attnkit_queue_length"] == 0 or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.05)


def test_models_health_and_metrics_answer(server) -> None:
    url, _ = server
    assert requests.get(url + "/health", timeout=10).json() == {"status": "ok"}
    models = requests.get(url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    response = requests.get(url + "/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE attnkit_kv_blocks_free gauge" in response.text


def test_chat_streamed_and_not_gives_the_same_text_and_usage(client, llm) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    prompt = llm.encode(llm.chat_prompt(messages))
    assert whole.usage.prompt_tokens == len(prompt) == chunks[-1].usage.prompt_tokens
    assert whole.usage.completion_tokens == 12 == chunks[-1].usage.completion_tokens
    assert whole.choices[0].finish_reason == "length"


def test_text_completions_follow_generate(client, llm) -> None:
    ids = llm.encode("Once upon a time")
    expected = llm.generate(ids, 8)
    got = client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert got.choices[0].text == expected
    streamed = client.completions.create(
        model=NAME, prompt=ids, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    stop = expected[3:6]
    cut = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0, stop=stop)
    assert cut.choices[0].text == expected[: expected.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_equal_each_alone(server, client, llm) -> None:
    prompts = [llm.encode("word " * (1 + 3 * n)) for n in range(16)]

    def ask(ids):
        stream = client.completions.create(
            model=NAME, prompt=ids, max_tokens=6, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)

    alone = [ask(ids) for ids in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_a_cached_system_prompt_skips_its_prefill(server, client) -> None:
    url, _ = server
    system = {"role": "system", "content": "You answer in French. " * 12}
    before = settle(url)
    for question in ("Hello?", "Why?"):
        client.chat.completions.create(
            model=NAME, messages=[system, {"role": "user", "content": question}], max_tokens=2
        )
    after = settle(url)
    hit = (
        after["attnkit_prefix_cache_hit_tokens_total"]
        - before["attnkit_prefix_cache_hit_tokens_total"]
    )
    assert hit >= 64  # the second request found the system prompt's full blocks
    assert after["attnkit_prefill_tokens_total"] - before["attnkit_prefill_tokens_total"] == (
        after["attnkit_prompt_tokens_total"] - before["attnkit_prompt_tokens_total"] - hit
    )


BAD = [
    ({"model": "gpt-4o"}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"messages": [{"role": "user", "content": "long " * 300}]}, "messages"),
]


@pytest.mark.parametrize(("change", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_400_with_an_openai_error(server, client, change, param) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(change)
    response = requests.post(server[0] + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**body)


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", json.dumps({"prompt": ""}).encode()),
        ("/v1/completions", json.dumps({"prompt": [1.5]}).encode()),
        ("/v1/completions", json.dumps({"prompt": [-3]}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
        ("/v1/completions", b"[" * 100_000),  # deeper than the JSON parser goes
        ("/v1/completions", b'{"prompt": "Hi", "stream": true, "stream_options": 5}'),
        ("/v1/completions", b'{"prompt": "Hi", "stream_options": {"include_usage": "yes"}}'),
    ],
)
def test_malformed_bodies_are_400_never_500(server, path, data) -> None:
    response = requests.post(server[0] + path, data=data, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_a_body_past_the_limit_is_413_before_or_as_it_is_read(server) -> None:
    import http.client

    from attnkit.serve.params import MAX_BODY_BYTES

    port = int(server[0].rsplit(":", 1)[1])
    # Declared too large: refused on the header, before a byte of it is read.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    declared = conn.getresponse()
    assert declared.status == 413
    assert json.loads(declared.read())["error"]["code"] == "request_too_large"
    conn.close()
    # Sent in chunks with no length: refused once the bytes read pass the limit.
    piece = b" " * 2**20
    chunks = [b'{"prompt": "Hi", "user": "', *[piece] * (MAX_BODY_BYTES // len(piece)), b'"}']
    response = requests.post(server[0] + "/v1/completions", data=iter(chunks), timeout=60)
    assert response.status_code == 413, response.text
    assert "larger than 8 MiB" in response.json()["error"]["message"]


def test_prompts_are_tokenised_off_the_event_loop(llm) -> None:
    """A long text takes its tokeniser a while; on the event loop that would stall every
    running stream."""
    import asyncio

    on_loop = []

    class Recording:
        def __getattr__(self, name):
            return getattr(llm, name)

        def encode(self, text):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:  # no loop runs in this thread
                on_loop.append(False)
            return llm.encode(text)

    engine = Engine(llm.model, num_blocks=32, block_size=8, eos_id=llm.eos_id)
    with LiveServer(create_app(Recording(), engine, model_name=NAME)) as url:
        text = {"model": NAME, "prompt": "Hi there", "max_tokens": 1}
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert requests.post(url + "/v1/completions", json=text, timeout=30).status_code == 200
        assert requests.post(url + "/v1/chat/completions", json=chat, timeout=30).ok
    assert on_loop == [False, False]


LONE = "\ud800"  # half of a surrogate pair: JSON's escapes spell it, no UTF-8 text holds it


@pytest.mark.parametrize(
    ("path", "data", "param"),
    [
        ("/v1/completions", json.dumps({"prompt": "Hi " + LONE}).encode(), "prompt"),
        ("/v1/completions", b'{"prompt": "Hi \xed\xa0\x80"}', "prompt"),  # the same, as bytes
        ("/v1/completions", json.dumps({"prompt": "Hi", "stop": [LONE]}).encode(), "stop"),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": LONE}]}).encode(),
            "messages",
        ),
    ],
)
def test_text_that_is_not_unicode_is_400_naming_its_parameter(server, path, data, param) -> None:
    response = requests.post(server[0] + path, data=data, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/nowhere", 404, "not_found"),
        ("POST", "/v1/embeddings", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ],
)
def test_unknown_paths_and_methods_answer_an_openai_error(server, method, path, status, code):
    response = requests.request(method, server[0] + path, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert f"{method} {path}" in error["message"]
    if status == 405:  # the methods that are allowed, named as HTTP asks
        assert response.headers["allow"] in error["message"] and response.headers["allow"]


def test_the_openai_client_sees_a_missing_endpoint_as_not_found(server) -> None:
    wrong = openai.OpenAI(base_url=server[0] + "/v2", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no such endpoint"):
        wrong.models.list()


def _reference_logprobs(llm, prompt: list[int], generated: list[int]):
    """log_softmax of the model's own logits (a full forward, float64) before each generated
    token: the oracle of the server's log-probabilities."""
    import torch

    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = llm.model(ids).logits[0, len(prompt) - 1 : -1]  # (n, V): each token's step
    return torch.log_softmax(logits.double(), dim=-1)


def test_chat_logprobs_are_the_models_own_and_the_top_ones_in_order(server, client, llm):
    messages = [{"role": "user", "content": "Count to five."}]
    answer = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    prompt = llm.encode(llm.chat_prompt(messages))  # as the server makes the prompt
    # the generated ids, from the bytes the server gave for each token
    vocab = llm.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    of_bytes = {llm.tokenizer.token_bytes(i): i for i in vocab.values()}
    generated = [of_bytes[bytes(entry.bytes)] for entry in content]
    assert llm.decode(generated) == answer.choices[0].message.content
    want = _reference_logprobs(llm, prompt, generated)
    for k, entry in enumerate(content):
        assert entry.logprob == pytest.approx(want[k, generated[k]].item(), abs=1e-4)
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert top == pytest.approx(want[k].topk(3).values.tolist(), abs=1e-4)
        # greedy: the token taken is the most likely one
        assert entry.top_logprobs[0].bytes == entry.bytes and top[0] == entry.logprob


def test_completion_logprobs_streamed_equal_whole_and_spell_the_text(server):
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "logprobs": 2, "ignore_eos": True}  # fmt: skip
    whole = requests.post(server[0] + "/v1/completions", json=body, timeout=30).json()
    choice = whole["choices"][0]
    scores = choice["logprobs"]
    assert len(scores["tokens"]) == len(scores["token_logprobs"]) == 8
    assert all(len(top) == 2 for top in scores["top_logprobs"])
    offsets = scores["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(choice["text"])
    if not any(t.startswith("bytes:") for t in scores["tokens"]):  # whole characters each
        assert "".join(scores["tokens"]) == choice["text"]
    stream = requests.post(
        server[0] + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=30
    )
    tokens, values, text = [], [], ""
    for line in stream.iter_lines():
        if line.startswith(b"data: {"):
            part = json.loads(line[6:])["choices"][0]
            text += part["text"]
            if part["logprobs"] is not None:
                tokens += part["logprobs"]["tokens"]
                values += part["logprobs"]["token_logprobs"]
    assert text == choice["text"] and tokens == scores["tokens"]
    assert values == pytest.approx(scores["token_logprobs"], abs=1e-9)


def test_logit_bias_steers_and_bans_tokens(server, llm):
    url = server[0] + "/v1/completions"
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    plain = requests.post(url, json=body, timeout=30).json()["choices"][0]
    first = plain["logprobs"]["tokens"][0]
    vocab = llm.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    from attnkit.serve.text import token_label

    of_label = {token_label(llm.tokenizer.token_bytes(i)): i for i in vocab.values()}
    banned = of_label[first]
    steered = requests.post(url, json={**body, "logit_bias": {str(banned): -100}}, timeout=30)
    assert steered.status_code == 200, steered.text
    assert first not in steered.json()["choices"][0]["logprobs"]["tokens"]
    forced = requests.post(url, json={**body, "logit_bias": {"42": 100}}, timeout=30).json()
    label = token_label(llm.tokenizer.token_bytes(42))
    assert forced["choices"][0]["logprobs"]["tokens"] == [label] * 4


def test_penalties_take_off_what_openai_defines():
    """c * frequency_penalty + (c > 0) * presence_penalty off each generated token's logit."""
    import torch

    from attnkit.models.llama_generate import Sampling
    from attnkit.serve.engine import Generation, Scoring

    scoring = Scoring(((3, 2.5),), presence_penalty=0.5, frequency_penalty=-1.25)
    gen = Generation(prompt_len=1, max_tokens=4, sampling=Sampling(), tokens=[0],
                     on_event=lambda t, r: None, scoring=scoring)  # fmt: skip
    logits = torch.randn(1, 10, dtype=torch.float64)
    for token in (5, 5, 7):
        gen.record(logits, token)
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 5] -= 2 * -1.25 + 0.5
    want[0, 7] -= 1 * -1.25 + 0.5
    assert torch.equal(gen.scores(logits), want)
    assert torch.equal(Generation(1, 4, Sampling(), [0], lambda t, r: None).scores(logits), logits)


def test_a_bias_of_every_token_is_made_into_tensors_once(monkeypatch):
    """A request may bias the whole vocabulary: its ids and biases become tensors at its first
    step, not at every step."""
    import torch

    from attnkit.models.llama_generate import Sampling
    from attnkit.serve.engine import Generation, Scoring

    vocab = 1000
    bias = [(i, (i % 7) - 3.3) for i in range(vocab)]
    gen = Generation(1, 4, Sampling(), [0], lambda t, r: None, scoring=Scoring(tuple(bias)))
    logits = torch.randn(1, vocab)  # float32: each bias rounded to it once
    want = logits + torch.tensor([b for _, b in bias], dtype=torch.float32)
    made = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(1) or tensor(*a, **k))
    for _ in range(5):
        assert torch.equal(gen.scores(logits), want)
    assert len(made) == 2  # the ids and the biases, once


BAD_SCORING = [
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"10000000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "a"}, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize(("path", "change", "param"), BAD_SCORING, ids=[p for *_, p in BAD_SCORING])
def test_scoring_parameters_out_of_range_or_unsupported_are_400(server, path, change, param):
    body = {"model": NAME, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    response = requests.post(server[0] + path, json={**body, **change}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_harmless_values_of_unsupported_parameters_are_accepted(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "tool_choice": "none", "response_format": {"type": "text"}, "best_of": 1,
            "logprobs": False}  # fmt: skip
    response = requests.post(server[0] + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_n_choices_greedy_are_each_the_single_answer(server, client) -> None:
    body = {"model": NAME, "prompt": "One, two,", "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "extra_body": {"ignore_eos": True}}  # fmt: skip
    one = client.completions.create(**body)
    three = client.completions.create(**body, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for choice in three.choices:
        assert choice.text == one.choices[0].text
        # the same tokens; the scores to float32's rounding (three sequences in a batch)
        assert choice.logprobs.token_logprobs == pytest.approx(
            one.choices[0].logprobs.token_logprobs, abs=1e-5
        )
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_choices_sampled_are_reproducible_and_streamed_alike(server, client) -> None:
    messages = [{"role": "user", "content": "Tell me a word."}]
    body = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 1.0,
            "seed": 11, "n": 4, "extra_body": {"ignore_eos": True}}  # fmt: skip
    first = [c.message.content for c in client.chat.completions.create(**body).choices]
    again = [c.message.content for c in client.chat.completions.create(**body).choices]
    assert first == again and len(set(first)) > 1  # each choice its own draws, the same ones
    texts = ["", "", "", ""]
    roles = set()
    stream = client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    usage = None
    for part in stream:
        if part.usage is not None:
            usage = part.usage
        for choice in part.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert texts == first and roles == {0, 1, 2, 3}
    assert usage.completion_tokens == 4 * 12


def test_echo_puts_the_prompt_before_each_answer(server, client, llm) -> None:
    body = {"model": NAME, "prompt": "Once upon", "max_tokens": 6, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.completions.create(**body).choices[0].text
    echoed = client.completions.create(**body, echo=True, n=2)
    assert [c.text for c in echoed.choices] == ["Once upon" + plain] * 2
    streamed = ["", ""]
    for part in client.completions.create(**body, echo=True, n=2, stream=True):
        for choice in part.choices:
            streamed[choice.index] += choice.text
    assert streamed == ["Once upon" + plain] * 2
    ids = llm.encode("Once upon")  # a prompt of token ids echoes as their text
    by_ids = client.completions.create(**{**body, "prompt": ids}, echo=True)
    assert by_ids.choices[0].text == llm.decode(ids) + plain


def test_a_developer_message_is_a_system_message(server) -> None:
    def answer(role: str) -> str:
        body = {"model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": role, "content": "Answer in French."},
                             {"role": "user", "content": "Hello"}]}  # fmt: skip
        response = requests.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    assert answer("developer") == answer("system")


@pytest.mark.parametrize("role", ["tool", "function", "narrator", ""])
def test_roles_it_cannot_render_are_400(server, role) -> None:
    body = {"model": NAME, "max_tokens": 2, "messages": [{"role": role, "content": "x"}]}
    response = requests.post(server[0] + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and repr(role) in error["message"]


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_disconnects_mid_stream_gets_its_blocks_returned(llm, monkeypatch, n):
    import attnkit.serve.engine as engine_module

    forward = engine_module.paged_forward

    def slow(*args, **kwargs):  # 20 ms a step: the stream outlives the client's first line
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine_module, "paged_forward", slow)
    # room for every choice's 200 tokens at once: no preemption empties the batch for a step
    engine = Engine(llm.model, num_blocks=32 * n, block_size=8, eos_id=llm.eos_id)
    body = {"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "n": n}  # fmt: skip
    with LiveServer(create_app(llm, engine, model_name=NAME)) as url:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=10) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith(b"data: ")
            # the gauges are replaced after each step, and a token may reach the client first
            deadline = time.monotonic() + 10
            while metrics(url)["attnkit_kv_blocks_used"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert metrics(url)["attnkit_kv_blocks_used"] > 0
        after = settle(url)
        assert after["attnkit_cancelled_total"] == n  # every choice
        assert after["attnkit_kv_blocks_used"] == 0
        assert after["attnkit_generation_tokens_total"] < 200 * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_gives_up_on_a_whole_answer_gets_it_cancelled(llm, monkeypatch, n):
    import attnkit.serve.engine as engine_module

    forward = engine_module.paged_forward

    def slow(*args, **kwargs):  # 20 ms a step: the answer takes seconds, the client waits 0.5 s
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine_module, "paged_forward", slow)
    # room for every choice's 200 tokens at once: no preemption empties the batch for a step
    engine = Engine(llm.model, num_blocks=32 * n, block_size=8, eos_id=llm.eos_id)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "n": n}
    with LiveServer(create_app(llm, engine, model_name=NAME)) as url:
        with pytest.raises(requests.ReadTimeout):
            requests.post(url + "/v1/completions", json=body, timeout=0.5)
        m = settle(url)
        assert m["attnkit_cancelled_total"] == n and m["attnkit_kv_blocks_used"] == 0
        assert m["attnkit_generation_tokens_total"] < 200 * n


def test_a_full_queue_is_429_and_shutting_down_is_503(llm) -> None:
    engine = Engine(llm.model, num_blocks=16, block_size=8, max_waiting=0, eos_id=llm.eos_id)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    with LiveServer(create_app(llm, engine, model_name=NAME)) as url:
        response = requests.post(url + "/v1/completions", json=body, timeout=10)
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        engine.stop()
        response = requests.post(url + "/v1/completions", json=body, timeout=10)
        assert (
            response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
        )
        assert requests.get(url + "/health", timeout=10).status_code == 503
        rejected = metrics(url)
        assert rejected['attnkit_requests_rejected_total{reason="queue_full"}'] == 1
        assert rejected['attnkit_requests_rejected_total{reason="shutting_down"}'] == 1


def test_choices_that_do_not_all_fit_the_queue_are_429_and_none_runs(llm) -> None:
    engine = Engine(llm.model, num_blocks=16, block_size=8, max_waiting=2, eos_id=llm.eos_id)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "n": 3}
    app = create_app(llm, engine, model_name=NAME)
    engine.start = lambda: engine  # the engine does not run: requests wait in its queue
    with LiveServer(app) as url:
        response = requests.post(url + "/v1/completions", json=body, timeout=10)
        assert response.status_code == 429, response.text
        # the two choices that got in were cancelled: nothing of the request is left to run
        assert len(engine.waiting) == 2 and all(gen.cancelled for gen in engine.waiting)
        engine.step()
        assert not engine.waiting and not engine.running


def test_the_event_loop_is_woken_once_a_step_not_once_a_token(llm, monkeypatch) -> None:
    """Eight streams decoding together: the engine hands each step's tokens to the event loop
    in one call (and a request's last event at once), not one call per token."""
    import asyncio
    import functools

    import uvicorn

    calls = []
    wake = asyncio.BaseEventLoop.call_soon_threadsafe

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return wake(self, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", counted)
    # asyncio's own loop, whose method is patched above (uvicorn would take uvloop's)
    monkeypatch.setattr(uvicorn, "Config", functools.partial(uvicorn.Config, loop="asyncio"))
    engine = Engine(llm.model, num_blocks=96, block_size=8, eos_id=llm.eos_id)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 24, "stream": True, "ignore_eos": True}
    with LiveServer(create_app(llm, engine, model_name=NAME)) as url:

        def ask(_):
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as r:
                return [line for line in r.iter_lines() if line][-1]

        steps, tokens = engine.counters["steps"], engine.counters["generated_tokens"]
        before = len(calls)
        with ThreadPoolExecutor(8) as pool:
            ends = list(pool.map(ask, range(8)))
        steps = engine.counters["steps"] - steps
        tokens = engine.counters["generated_tokens"] - tokens
        woken = len(calls) - before
    assert ends == [b"data: [DONE]"] * 8 and tokens == 8 * 24
    assert woken <= steps + 2 * 8, f"{woken} wake-ups for 8 x 24 tokens in {steps} steps"


def test_the_pool_is_whole_after_the_run(server) -> None:
    url, engine = server
    m = settle(url)
    assert m["attnkit_kv_blocks_used"] == 0
    assert (
        m["attnkit_kv_blocks_free"] + m["attnkit_kv_blocks_cached"] == m["attnkit_kv_blocks_total"]
    )
    assert m["attnkit_engine_errors_total"] == 0
    engine.cache.clear()  # the engine is idle: nothing else touches the cache now
    engine.pool.check_whole()


pytestmark = pytest.mark.usefixtures("one_thread")

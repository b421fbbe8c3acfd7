"""The OpenAI-compatible server over real HTTP on loopback, with the official openai client."""

from __future__ import annotations

import functools
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cli_helpers import assert_clean_error, run_cli
from tiny_models import build_tokenized_llama

NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path):
    # wide enough (a 50 MB LM head) that a long generation takes seconds, so tests can catch it running
    return build_tokenized_llama(tmp_path_factory.mktemp("srv") / "m", smollm2_path, max_position_embeddings=2048,
                                 hidden_size=256, intermediate_size=512)


def start_server(model_dir, *extra):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer.cli", "serve", "-m", str(model_dir), "--port", str(port),
                             "--model-name", NAME, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = start_server(model_dir, "--max-batch", "4", "--queue-size", "8", "--prefill-chunk", "32")
    try:
        yield base
    finally:
        stop_server(proc)


def client(base, key="none"):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def wait_idle(base, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = httpx.get(base + "/health").json()
        if h["active"] == 0 and h["admitted"] == 0:
            return h
        time.sleep(0.1)
    raise AssertionError(f"server still busy: {h}")


def test_completions_and_chat_equal_powerinfer_generate(server, model_dir):
    c = client(server)
    prompt = "The weather today is"
    cli = run_cli("generate", "-m", str(model_dir), "-p", prompt, "-n", "12", "--temperature", "0")
    expected = cli.stdout[len(prompt):-1]
    got = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected and got.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                                        temperature=0, stream=True))
    assert streamed == expected
    cli = run_cli("generate", "-m", str(model_dir), "--chat", "-p", "Hi there", "-n", "12", "--temperature", "0")
    expected = cli.stdout[:-1]
    msgs = [{"role": "user", "content": "Hi there"}]
    got = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == expected and got.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.models.retrieve(NAME).id == NAME
    import openai

    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


def test_eight_concurrent_streams_get_their_solo_text(server):
    """Different prompts and lengths, joining at different times and leaving as they finish,
    decoded in batches of up to 4 (the rest queued): each equals its solo output."""
    c = client(server)
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    lengths = [20, 5, 33, 12, 27, 8, 16, 40]
    solo = [c.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0).choices[0].text
            for p, n in zip(prompts, lengths)]
    results = [None] * 8

    def run(i):
        time.sleep(0.15 * (i % 4))
        stream = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                      stream=True)
        results[i] = "".join(ch.choices[0].text for ch in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == solo
    wait_idle(server)


def test_seeded_sampling_does_not_depend_on_the_batch(server):
    c = client(server)
    body = dict(model=NAME, prompt="Tell me something", max_tokens=24, temperature=0.9, seed=99)
    alone = c.completions.create(**body).choices[0].text
    results = {}

    def run(i):
        if i == 0:
            results[i] = c.completions.create(**body).choices[0].text
        else:
            c.completions.create(model=NAME, prompt=f"Other {i}", max_tokens=30, temperature=1.0, seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 0, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results[0] == alone
    wait_idle(server)


def test_disconnect_cancels_and_frees_the_slot(server):
    body = {"model": NAME, "prompt": long_prompt(server), "max_tokens": 1900, "temperature": 0, "stream": True}
    c = client(server)
    other_prompt = "A different client asks:"
    solo = c.completions.create(model=NAME, prompt=other_prompt, max_tokens=30, temperature=0).choices[0].text
    other = {}

    def bystander():
        stream = c.completions.create(model=NAME, prompt=other_prompt, max_tokens=30, temperature=0, stream=True)
        other["text"] = "".join(ch.choices[0].text for ch in stream)

    t = threading.Thread(target=bystander)
    with httpx.Client(timeout=60) as h:
        t.start()
        with h.stream("POST", server + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(l.startswith("data: ") for l in got)
            assert httpx.get(server + "/health").json()["active"] >= 1  # still generating when we leave
    t.join(timeout=60)
    assert other["text"] == solo  # the bystander is not disturbed by the disconnect
    wait_idle(server, timeout=20)  # long before 1900 tokens would have finished
    assert c.completions.create(model=NAME, prompt="Still alive?", max_tokens=3, temperature=0).choices[0].text


def test_a_long_prompt_does_not_stall_the_others(server):
    """A 1500-token prompt arrives while a stream decodes: it is prefilled 32 tokens per step
    between the stream's tokens, so the stream keeps going (its longest gap is a small part
    of the long prompt's wait, not all of it)."""
    c = client(server)
    stamps = []

    def bystander():
        body = dict(model=NAME, prompt=long_prompt(server), max_tokens=400, temperature=0, stream=True)
        for ch in c.completions.create(**body):
            stamps.append(time.perf_counter())

    t = threading.Thread(target=bystander)
    t.start()
    while len(stamps) < 5:
        time.sleep(0.01)
    sent = time.perf_counter()
    r = c.completions.create(model=NAME, prompt=[7] * 1500, max_tokens=1, temperature=0)
    answered = time.perf_counter()
    t.join(timeout=120)
    assert r.usage.prompt_tokens == 1500
    during = [s for s in stamps if sent <= s <= answered]
    assert len(during) >= 10, len(during)  # ~47 chunks, one decode step of the stream after each
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert max(gaps) < 0.5 * (answered - sent), (max(gaps), answered - sent)
    wait_idle(server)


def test_a_non_streaming_client_that_gives_up_frees_its_slot(server):
    body = {"model": NAME, "prompt": long_prompt(server), "max_tokens": 1900, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=1.0)
    wait_idle(server, timeout=10)  # long before 1900 tokens would have finished


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": NAME, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": -4}, 400, ">= 0"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": NAME, "prompt": "x", "n": 2}, 400, "n=1"),
    ({"model": NAME, "prompt": "x", "logprobs": 3}, 400, "unsupported parameter"),
    ({"model": NAME, "prompt": 42}, 400, "prompt"),
    ({"model": NAME, "prompt": [5, 10**9]}, 400, "outside the vocabulary"),
    ({"model": NAME, "prompt": ["a", "b"]}, 400, "only one prompt"),
    ({"model": NAME, "prompt": "word " * 2100}, 400, "context is 2048 tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10**12}, 400, "context is 2048 tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 2048}, 400, "asks for 2049"),
    ({"model": NAME, "prompt": "x", "seed": 2**63}, 400, "64-bit"),
    ({"model": NAME, "prompt": "x", "seed": -2**63 - 1}, 400, "64-bit"),
    ({"model": NAME, "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": NAME, "messages": "hi"}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role must be one of"),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "only text content parts"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, fragment):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, headers={"Content-Type": "application/json"}, timeout=60, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and {"message", "type", "code"} <= set(err)


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/completions", {"model": NAME, "prompt": "caf\udce9"}, "not valid UTF-8"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "\ud800"}]}, "lone surrogate"),
])
def test_text_that_is_not_unicode_is_refused(server, path, body, fragment):
    """JSON may escape a lone surrogate (\\ud800), which no tokenizer can take: 400, not 500."""
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as an escape
    r = httpx.post(server + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_text_parts_developer_role_and_any_seed(server):
    """Newer OpenAI clients send content as text parts and "developer" for "system"; a seed
    is any 64-bit integer (beyond it: 400, as OpenAI answers)."""
    c = client(server)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    a, b = (c.chat.completions.create(model=NAME, messages=m, max_tokens=8, temperature=0).choices[0].message.content
            for m in (plain, parts))
    assert a == b and a
    big = 2**63 - 1
    x, y = (c.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=1, seed=big).choices[0].text
            for _ in range(2))
    assert x == y  # seeded: the same text twice


def test_defaults_clients_send_usage_chunk_and_sampling_extensions(server):
    """Parameters at their no-op default (as LangChain sends them) are served, other values
    refused; stream_options.include_usage ends the stream with the usage; top_k, min_p and
    repetition_penalty (extensions, as in vLLM) reach the sampler."""
    import openai

    c = client(server)
    msgs = [{"role": "user", "content": "Hi there"}]
    plain = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, presence_penalty=0,
                                            frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    for bad in ({"presence_penalty": 0.5}, {"logprobs": True}, {"stream_options": {"include_usage": "yes"}}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, **bad)
    greedy = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    top1 = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1.5, seed=1,
                                extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # only the most likely token is left to sample
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt="Hello", max_tokens=2, extra_body={"top_k": -1})


def test_prompt_as_token_ids_or_a_batch_of_one(server, model_dir):
    from powerinfer.tokenizer import load_tokenizer

    ids = load_tokenizer(str(model_dir)).encode("Hello there")
    c = client(server)
    texts = [c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in ("Hello there", ids, ["Hello there"], [ids])]
    assert texts[0] and texts == [texts[0]] * 4


def long_prompt(base, headers=None) -> str:
    """A prompt the random tiny model does not end early with EOS (so a request stays busy)."""
    return _long_prompt(base, tuple((headers or {}).items()))


@functools.lru_cache(maxsize=None)
def _long_prompt(base, headers: tuple) -> str:
    for p in ["Long:", "Count forever:", "a b c d", "The", "1 2 3 4 5", "Once upon a time"]:
        r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 1500,
                                                       "temperature": 0}, headers=dict(headers), timeout=120).json()
        if r["usage"]["completion_tokens"] == 1500:
            return p
    pytest.fail("every candidate prompt stops early")


def test_full_queue_answers_429_the_api_key_is_required_and_ctrl_c_ends_streams(model_dir):
    proc, base = start_server(model_dir, "--max-batch", "1", "--queue-size", "0", "--api-key", "sekret")
    auth = {"Authorization": "Bearer sekret"}
    try:
        r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        from openai import AuthenticationError

        with pytest.raises(AuthenticationError):
            client(base, "wrong").completions.create(model=NAME, prompt="x", max_tokens=2)
        assert client(base, "sekret").completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0)
        assert httpx.get(base + "/health").status_code == 200
        prompt = long_prompt(base, auth)
        body = {"model": NAME, "prompt": prompt, "max_tokens": 600, "temperature": 0}
        responses = [None] * 4

        def post(i):
            responses[i] = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=120)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.json()["error"]["type"] == "rate_limit_error"
        wait_idle(base)
        # Ctrl-C while a stream runs (the engine loop is on the server's main thread): the
        # stream ends with [DONE] and the server exits 0 within seconds
        lines: list[str] = []

        def stream():
            with httpx.stream("POST", base + "/v1/completions", headers=auth, timeout=120,
                              json={**body, "prompt": "x", "max_tokens": 1500, "stream": True}) as r:
                lines.extend(r.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.time() + 60
        while len(lines) < 3 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        reader.join(timeout=20)
        assert 3 <= len([x for x in lines if x.startswith("data: {")]) < 1500 and "data: [DONE]" in lines
    finally:
        if proc.poll() is None:
            stop_server(proc)


def test_a_busy_port_fails_at_once_with_one_line(tmp_path):
    """Checked before the model loads (uvicorn reported it after loading, with exit 3): the
    model given is a file the loader would refuse, so only the port check answers first."""
    not_a_model = tmp_path / "model.gguf"
    not_a_model.write_bytes(b"not a model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_clean_error(run_cli("serve", "--port", str(port), "-m", str(not_a_model)), "cannot listen")

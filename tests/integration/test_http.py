"""The HTTP front, driven by clients nobody here wrote: the official ``openai`` package,
``curl -N`` for raw server-sent events, and prometheus_client's parser for /metrics."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvasir.wire.client import Finished
from tests.support.daemon import Daemon, free_port, write_plan
from tests.support.http import KEY, OTHER_KEY, SPLITS, sdk


def test_greedy_output_through_http_equals_the_zeromq_clients(http_daemon):
    client = sdk(http_daemon)
    with http_daemon.client() as zmq_client:
        for prompt in ([5, 17, 42, 99, 3], "hello ring"):
            kw = {"token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
            ours = zmq_client.generate(**kw, max_tokens=12, temperature=0, ignore_eos=True)
            http = client.completions.create(
                model="tiny-llama",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choice = http.choices[0]
            assert choice.token_ids == ours.token_ids  # type: ignore[attr-defined]
            assert choice.finish_reason == "length" and http.usage.completion_tokens == 12
            assert http.usage.prompt_tokens == ours.usage.prompt_tokens
            details = http.usage.prompt_tokens_details
            assert details is not None and 0 <= details.cached_tokens < http.usage.prompt_tokens
            if isinstance(prompt, list):  # the ZeroMQ request just before cached its first block in
                assert details.cached_tokens == 0  # the local tenant's namespace, not this key's
        chat = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hello ring"}],
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ours = zmq_client.generate("hello ring", chat=True, max_tokens=10, temperature=0, ignore_eos=True)
        assert chat.choices[0].token_ids == ours.token_ids  # type: ignore[attr-defined]
        assert chat.usage.prompt_tokens == ours.usage.prompt_tokens and chat.choices[0].message.role == "assistant"


def test_the_prefix_cache_is_shared_within_one_api_key_and_one_salt(http_daemon):
    prompt = [11 + 3 * i for i in range(22)]  # five full 4-token blocks before its last token

    def cached(key: str, salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        answer = sdk(http_daemon, key).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        details = answer.usage.prompt_tokens_details
        assert details is not None
        return details.cached_tokens

    assert cached(KEY) == 0
    assert cached(OTHER_KEY) == 0  # another key guessing the prompt learns nothing
    assert cached(KEY) == 20  # the same key: the hit
    assert cached(KEY, "project-a") == 0  # a salt narrows the key's namespace
    assert cached(KEY, "project-a") == 20
    assert cached(OTHER_KEY, "project-a") == 0  # the same salt under another key is another namespace
    assert cached(OTHER_KEY) == 20  # its own first request
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(KEY, "")


def test_streams_through_the_sdk_match_the_whole_answers(http_daemon):
    client = sdk(http_daemon)
    args = dict(model="tiny-llama", max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **args)
    chunks = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}, **args
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    args["temperature"] = 1.0
    plain = client.completions.create(prompt="hello", n=2, seed=7, **args)
    streamed = client.completions.create(prompt="hello", n=2, seed=7, stream=True, **args)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(plain.choices, key=lambda c: c.index)]
    assert plain.usage.completion_tokens == 18


def test_stop_strings_echo_and_prompt_forms(http_daemon):
    client = sdk(http_daemon)
    args = dict(model="tiny-llama", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="hello", **args).choices[0].text
    stop = full[3:5]
    assert stop, full
    cut = client.completions.create(prompt="hello", stop=[stop], **args).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    kept = client.completions.create(
        prompt="hello", stop=[stop], **{**args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    ).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)] and kept.finish_reason == "stop"
    shaped = dict(args, extra_body={"ignore_eos": True, "repetition_penalty": 2.0, "logit_bias": {"5": 3.0}})
    assert client.completions.create(prompt="hello", **shaped).choices[0].text != full  # reaches the sampler
    echoed = client.completions.create(prompt="hello", echo=True, **args).choices[0].text
    assert echoed == "hello" + full
    many = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **args)
    assert sorted(c.index for c in many.choices) == [0, 1] and many.usage.prompt_tokens == 5


def test_errors_surface_as_the_sdks_exceptions(http_daemon):
    with pytest.raises(openai.AuthenticationError):
        sdk(http_daemon, key="wrong").models.list()
    client = sdk(http_daemon)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-llama", prompt=[5, 99999], max_tokens=2)
    assert bad.value.body["code"] == "invalid_request" and "99999" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny-llama", prompt=[5] * 1100, max_tokens=2)
    assert long.value.body["code"] == "too_long"
    with pytest.raises(openai.BadRequestError) as typed:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"top_k": "many"})
    assert typed.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as unserved:  # changes the output, not served: never ignored
        client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"use_beam_search": True},
        )
    assert unserved.value.body["param"] == "use_beam_search"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"temprature": 0})
    assert unknown.value.body["param"] == "temprature" and "no such field" in unknown.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)


def curl(daemon, path: str, body: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    args = ["curl", "-sS", "-N", "-H", f"Authorization: Bearer {KEY}", *extra]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    return subprocess.run([*args, f"http://127.0.0.1:{daemon.port}{path}"], capture_output=True, text=True, timeout=60)


def test_curl_sees_server_sent_events(http_daemon):
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = curl(http_daemon, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert out.returncode == 0, out.stderr
    events = [block for block in out.stdout.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(block.removeprefix("data: ")) for block in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny-llama" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    health = curl(http_daemon, "/health", None, "-i")
    assert health.stdout.startswith("HTTP/1.1 200") and '"serving"' in health.stdout
    unauthorised = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{http_daemon.port}/v1/models"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unauthorised.stdout == "401"


def metrics(daemon) -> dict:
    out = curl(daemon, "/metrics")
    assert out.returncode == 0, out.stderr
    return {family.name: family for family in text_string_to_metric_families(out.stdout)}


def value(family, suffix: str = "", **labels) -> float:
    return sum(
        s.value
        for s in family.samples
        if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_parse_with_prometheus_client(http_daemon):
    before = metrics(http_daemon)
    client = sdk(http_daemon)
    client.completions.create(
        model="tiny-llama", prompt=[5, 6, 7], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(http_daemon)
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert after[f"kvasir:{name}"].type == "histogram"
    gained = value(after["kvasir:generation_tokens"], "_total") - value(before["kvasir:generation_tokens"], "_total")
    assert gained >= 5
    assert value(after["kvasir:request_success"], "_total", finished_reason="length") >= 1
    assert value(after["kvasir:e2e_request_latency_seconds"], "_count") >= 1
    busy = after["kvasir:worker_busy_seconds"]
    assert {s.labels["stage"] for s in busy.samples} == {"0", "1"}
    for _ in range(50):  # the stages report their busy time periodically: the first report may be due
        if value(busy, "_total") > 0:
            break
        time.sleep(0.2)
        busy = metrics(http_daemon)["kvasir:worker_busy_seconds"]
    assert value(busy, "_total") > 0
    assert after["kvasir:kv_blocks_in_use"].type == "gauge"
    assert 0 <= value(after["kvasir:kv_cache_usage_perc"], "") <= 1
    assert value(after["kvasir:request_generation_tokens"], "_count") >= 1
    assert after["kvasir:prefix_cache_queries"].type == after["kvasir:prefix_cache_hits"].type == "counter"
    assert (
        0 <= value(after["kvasir:prefix_cache_hits"], "_total") <= value(after["kvasir:prefix_cache_queries"], "_total")
    )
    for family in after.values():
        if family.name.startswith("kvasir:"):
            assert all(s.labels.get("model_name") == "tiny-llama" for s in family.samples), family.name


def test_a_client_that_goes_away_has_its_request_cancelled(http_daemon):
    before = value(metrics(http_daemon)["kvasir:request_success"], "_total", finished_reason="abort")
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True})
    with socket.create_connection(("127.0.0.1", http_daemon.port), timeout=30) as conn:
        conn.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with http_daemon.client() as client:
            if client.stats().in_flight == 0:
                break
        time.sleep(0.1)
    aborted = value(metrics(http_daemon)["kvasir:request_success"], "_total", finished_reason="abort")
    assert aborted == before + 1


def front_pids(daemon) -> list[int]:
    return [int(pid) for pid in re.findall(r"http front ready .*pid=(\d+)", daemon.log())]


def own_front(tiny_models, start_daemon, http: dict | None = None, **plan) -> tuple[Daemon, openai.OpenAI]:
    """A daemon of the test's own (the Llama with a tokenizer, one front without keys,
    ``ignore_eos`` allowed, ``http`` added to its [http]), serving once its front says so,
    and an SDK client for it."""
    port = free_port()
    front = {"listen": f"127.0.0.1:{port}", "allow_ignore_eos": True, **(http or {})}
    daemon = start_daemon(tiny_models["llama-tokenizer"], SPLITS, http=front, **plan)
    daemon.wait_ready()
    daemon.port = port
    deadline = time.monotonic() + 30
    while curl_health(port)[0] != "200" and time.monotonic() < deadline:
        time.sleep(0.1)
    return daemon, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_failed_front_is_restarted_alone_and_health_follows_the_daemon(tiny_models, start_daemon):
    daemon, client = own_front(tiny_models, start_daemon, max_seq_len=512)
    port = daemon.port
    [first] = front_pids(daemon)
    with daemon.client() as zmq_client:
        running = zmq_client.submit(token_ids=[5, 6], max_tokens=400, temperature=0, ignore_eos=True)
        subprocess.run(["kill", "-9", str(first)], check=True)
        final = list(zmq_client.events(running))[-1]  # the ZeroMQ client's request goes on
    assert isinstance(final, Finished) and len(final.token_ids) == 400
    deadline = time.monotonic() + 60
    while len(front_pids(daemon)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "http front failed; restarting it alone" in daemon.log()
    answer = None
    while answer is None and time.monotonic() < deadline:
        try:
            answer = client.completions.create(model="llama-tokenizer", prompt=[5], max_tokens=3)
        except (openai.APIConnectionError, openai.InternalServerError):
            time.sleep(0.2)
    assert answer is not None and answer.usage.completion_tokens <= 3
    with daemon.client() as zmq_client:
        assert zmq_client.stats().restarts == 0  # the ring never noticed
    stream = client.completions.create(
        model="llama-tokenizer", prompt=[5], max_tokens=500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    daemon.process.terminate()  # drains: the running stream ends, /health says so meanwhile
    health = curl_health(port)
    deadline = time.monotonic() + 10
    while health[0] == "200" and time.monotonic() < deadline:  # the front asks for the state twice a second
        health = curl_health(port)
    assert health[0] == "503" and "draining" in health[1]
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] == "length"
    assert daemon.stop() == 0


def curl_health(port: int) -> tuple[str, str]:
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}/health"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    body, _, code = out.stdout.rpartition("\n")
    return code, body


def test_logprobs_are_the_reference_models(http_daemon, tiny_models):
    import torch

    from tests.support.models import reference_model

    client = sdk(http_daemon)
    prompt = [5, 17, 42, 99, 3]
    out = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    ids = choice.token_ids  # type: ignore[attr-defined]
    model = reference_model(tiny_models["llama-tokenizer"])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    got = choice.logprobs
    assert got.token_logprobs == pytest.approx([float(expected[k, t]) for k, t in enumerate(ids)], abs=1e-3)
    for k, top in enumerate(got.top_logprobs):
        # greedy: the chosen token is the best; two tokens may share a text (bytes of one character)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(got.token_logprobs[k], abs=1e-6)
    assert "".join(got.tokens) == choice.text and got.text_offset[0] == 0
    echoed = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True
    ).choices[0]
    scored = echoed.logprobs
    assert len(scored.token_logprobs) == len(prompt) + len(ids) and scored.token_logprobs[0] is None
    assert scored.top_logprobs[0] is None and all(len(top) <= 2 for top in scored.top_logprobs[1:])
    reference = torch.log_softmax(logits[: len(prompt) - 1], dim=-1)  # token k given the tokens before it
    expected_prompt = [float(reference[k - 1, prompt[k]]) for k in range(1, len(prompt))]
    assert scored.token_logprobs[1 : len(prompt)] == pytest.approx(expected_prompt, abs=1e-3)
    # one of the two computed its prompt whole, the other may have found it in the prefix cache
    # (computed in another batch's shape): equal to float32 rounding
    assert scored.token_logprobs[len(prompt) :] == pytest.approx(got.token_logprobs, abs=1e-4)
    assert echoed.text.endswith(choice.text) and echoed.text == "".join(scored.tokens)
    long = [(7 * k + 3) % 300 + 5 for k in range(150)]  # longer than a batch (max_tokens 64): scored in chunks
    whole = client.completions.create(model="tiny-llama", prompt=long, max_tokens=1, logprobs=0, echo=True)
    with torch.no_grad():
        long_logits = torch.log_softmax(model(torch.tensor([long])).logits[0].float(), dim=-1)
    expected_long = [float(long_logits[k - 1, long[k]]) for k in range(1, len(long))]
    assert whole.choices[0].logprobs.token_logprobs[1 : len(long)] == pytest.approx(expected_long, abs=1e-3)
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(expected_prompt, abs=1e-3)
    assert first.text == "".join(first.logprobs.tokens)
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= 0 and bytes(e.bytes).decode(errors="replace") == e.token for e in entries)
    streamed = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, stream=True
    )
    scores = [lp for chunk in streamed for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    assert scores == pytest.approx(got.token_logprobs, abs=1e-4)


def test_bench_drives_both_doors_with_the_same_jobs(http_daemon):
    from tests.support.daemon import BIN

    run = subprocess.run(
        [
            str(BIN / "kvasir"), "bench", "doors", "--runtime-dir", str(http_daemon.runtime_dir),
            f"http://127.0.0.1:{http_daemon.port}", "--api-key", KEY,
            "--requests", "8", "--warmup", "2", "--concurrency", "4", "--prompt-len", "6", "--output-len", "5",
            "--ignore-eos", "--json",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)["doors"]
    assert [entry["door"] for entry in report["rounds"]] == ["zeromq", "http"]
    for entry in report["rounds"]:
        summary = entry["summary"]
        assert summary["requests"] == 8 and summary["errors"] == 0 and summary["output_tokens"] == 40
    assert report["http_over_zeromq"]["output_tokens_per_s"] > 0
    wrong = subprocess.run(
        [str(BIN / "kvasir"), "bench", "doors", "--runtime-dir", str(http_daemon.runtime_dir), "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert wrong.returncode == 2 and "give the front's URL" in wrong.stderr


def test_hostile_bodies_get_openai_errors_and_the_front_keeps_serving(http_daemon):
    url = f"http://127.0.0.1:{http_daemon.port}/v1/completions"
    auth = ["-H", f"Authorization: Bearer {KEY}"]
    cases = [
        (["-d", "{not json"], "400"),
        (["-d", '{"prompt": {"nested": [[[[1]]]]}}'], "400"),
        (["-d", '{"prompt": "x", "n": 1e400}'], "400"),
        (["-d", '{"prompt": "x", "stop": ["' + "s" * 300 + '"]}'], "400"),
        (["-d", '{"prompt": [1, -5]}'], "400"),
        (["-d", '{"prompt": "x", "max_tokens": 0}'], "400"),
        (["-d", '{"prompt": "x", "temperature": -1}'], "400"),
        (["-d", '{"prompt": "x", "logprobs": 99}'], "400"),
        (["-d", '{"messages": [{"role": "user", "content": "x"}]}'], "400"),  # chat body on completions
        (["--data-binary", "@-"], "413"),  # 40 MB of body, more than the front reads
        (["-X", "PUT", "-d", "{}"], "405"),
    ]
    for args, status in cases:
        body = b"[" + b"1," * (20 * 1024 * 1024) + b"1]" if "@-" in args else None
        run = subprocess.run(
            ["curl", "-s", "-w", "\n%{http_code}", *auth, *args, url], input=body, capture_output=True, timeout=60
        )
        text, _, code = run.stdout.decode().rpartition("\n")
        assert code == status, (args[:2], code, text[:300])
        assert json.loads(text)["error"]["message"], text[:300]
    client = sdk(http_daemon)
    assert client.completions.create(model="tiny-llama", prompt=[5], max_tokens=2).usage.completion_tokens <= 2


def test_plan_and_start_refuse_an_exposed_or_taken_address(tiny_models, tmp_path):
    from tests.support.daemon import BIN

    exposed = write_plan(tmp_path / "exposed.toml", tiny_models["llama"], SPLITS, http={"listen": "0.0.0.0:8000"})
    check = subprocess.run([str(BIN / "kvasir"), "plan", "check", str(exposed)], capture_output=True, text=True)
    assert check.returncode == 2 and "needs http.api_keys" in check.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plan = write_plan(tmp_path / "taken.toml", tiny_models["llama"], SPLITS, http={"listen": f"127.0.0.1:{port}"})
        start = subprocess.run(
            [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(tmp_path / "rt")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert start.returncode == 1 and f"cannot bind http.listen = 127.0.0.1:{port}" in start.stdout + start.stderr


def test_a_partly_refused_request_is_one_429_and_nothing_of_it_keeps_running(tiny_models, start_daemon):
    limits = {"max_choices": 4, "max_per_caller": 4}  # a request the front lets through; the bridge takes 2 of it
    daemon, client = own_front(tiny_models, start_daemon, http=limits, max_waiting=2, max_per_client=4)
    deadline = time.monotonic() + 30
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(
            model="llama-tokenizer", prompt=[5], n=4, max_tokens=200, extra_body={"ignore_eos": True}
        )
    assert refused.value.body["code"] == "overloaded"
    aborted = 0.0
    while time.monotonic() < deadline:
        aborted = value(metrics(daemon)["kvasir:request_success"], "_total", finished_reason="abort")
        with daemon.client() as zmq_client:
            if zmq_client.stats().in_flight == 0 and aborted == 2:
                break
        time.sleep(0.1)
    assert aborted == 2  # the two it accepted were cancelled, not left to run 200 tokens
    assert (
        client.completions.create(model="llama-tokenizer", prompt=[5], n=2, max_tokens=2).usage.completion_tokens <= 4
    )


def test_tls_serves_the_openai_sdk_and_nothing_in_clear_text(tiny_models, start_daemon, tmp_path):
    import shutil
    import ssl
    import urllib.request

    from tests.support.tls import self_signed

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, _ = self_signed(tmp_path)  # next to the plan: its tls_cert and tls_key are relative to it
    port = free_port()
    front = {"listen": f"127.0.0.1:{port}", "tls_cert": "cert.pem", "tls_key": "key.pem", "model_name": "tiny"}
    daemon = start_daemon(tiny_models["llama-tokenizer"], SPLITS, http=front).wait_ready()
    trusted = ssl.create_default_context(cafile=str(cert))

    def sdk_with(context: ssl.SSLContext | None, scheme: str = "https") -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=context) if context is not None else openai.DefaultHttpxClient()
        url = f"{scheme}://127.0.0.1:{port}/v1"
        return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60, http_client=http)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=trusted, timeout=5) as health:
                if health.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.2)
    prompt = [5, 17, 42, 99, 3]
    answer = sdk_with(trusted).completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    with daemon.client() as zmq_client:
        ours = zmq_client.generate(token_ids=prompt, max_tokens=6, temperature=0)
    assert answer.choices[0].token_ids == ours.token_ids  # type: ignore[attr-defined]
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
        sdk_with(None).models.list()
    with pytest.raises(openai.APIConnectionError):  # plain HTTP gets no answer from a TLS port
        sdk_with(None, "http").models.list()
    with daemon.client() as zmq_client:
        assert zmq_client.stats().restarts == 0

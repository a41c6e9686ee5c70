"""server.py's guarantees: OpenAI's completions and chat over HTTP, streaming, limits, metrics,
the API key, shutdown.
"""
import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from http.client import HTTPResponse

import pytest
import torch

import nanoserve
from conftest import (HERE, address, assert_no_leaks, connection, http, json_or_text,
                      parse_events, request, server_in_process, server_thread, start_server,
                      stop, tiny)
from nanoserve import LLM
from openai_protocol import SAMPLING_FIELDS, chat_max_tokens, render_chat, token_text
from sampling import SamplingParams
from server import MAX_BODY_BYTES


# ----------------------------------------------------------------------------- HTTP server

def wait_for_log(proc: subprocess.Popen, text: str, seconds: float = 30) -> bool:
    """Whether a line of the server's stderr holds `text` (polled for up to `seconds`)."""
    deadline = time.time() + seconds
    while not any(text in line for line in proc.log.lines) and time.time() < deadline:
        time.sleep(0.05)
    return any(text in line for line in proc.log.lines)


def sse(url: str, path: str, body: dict) -> list:
    """The events of a streamed response, [DONE] included."""
    status, text = http(url, path, body)
    assert status == 200, text
    return parse_events(text)


def streamed_text(events: list) -> str:
    """A streamed completion's text: its chunks' texts added up."""
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


def offline_text(offline: LLM, body: dict) -> str:
    """The offline API's text for a completion request's prompt and sampling fields."""
    fields = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    return offline.generate(body["prompt"], SamplingParams(**fields))[0].outputs[0].text


def next_event(response: HTTPResponse):
    """The next server-sent event of a streamed response, read off the socket as it comes:
    its JSON, or "[DONE]"."""
    line = response.readline().decode()
    assert line.startswith("data: ") and response.readline() == b"\n", line
    data = line.removeprefix("data: ").removesuffix("\n")
    if data == "[DONE]":
        return data
    return json.loads(data)


def connect(url: str, timeout: float = 10) -> socket.socket:
    """A raw socket to the server, for what http.client will not send."""
    return socket.create_connection(address(url), timeout=timeout)


def wire_post(path: str, body: str, headers: str = "") -> bytes:
    """A POST as it goes on the wire; `headers`: more header lines, each ending in \\r\\n."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body.encode())}\r\n"
            f"{headers}\r\n{body}").encode()


def read_response(sock: socket.socket):
    """(status, the response (its headers), parsed JSON or text) of the next response on a
    raw socket."""
    response = HTTPResponse(sock)
    response.begin()
    text = response.read().decode()
    return response.status, response, json_or_text(text)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (end of file, or a reset) before the socket's
    timeout; nothing more may arrive first."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_http_completion_equals_offline_generate(server, offline):
    body = dict(prompt="ROMEO:", max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                ignore_eos=True)
    want = offline.generate("ROMEO:", SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9,
                                                     seed=7, ignore_eos=True))[0].outputs[0]
    status, got = http(server, "/v1/completions", body | dict(logprobs=0))
    assert status == 200 and got["object"] == "text_completion"
    assert got["choices"][0]["text"] == want.text and got["choices"][0]["finish_reason"] == "length"
    tokenizer = offline.engine.tokenizer  # the same tokens, not only the same text
    assert got["choices"][0]["logprobs"]["tokens"] == [token_text(tokenizer, t)
                                                       for t in want.token_ids]
    assert got["usage"] == dict(prompt_tokens=6, completion_tokens=12, total_tokens=18)
    events = sse(server, "/v1/completions",
                 body | dict(stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and events[-2]["usage"] == got["usage"]
    assert "".join(c["text"] for e in events[:-2] for c in e["choices"]) == want.text
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (beside include_usage): every chunk carries
    its choice's usage so far; the last chunk, the whole request's."""
    body = dict(prompt="ROMEO:", max_tokens=5, n=2, seed=3, ignore_eos=True, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = sse(server, "/v1/completions", body)
    chunks = events[:-2]
    assert len(chunks) == 10 and events[-2]["usage"]["completion_tokens"] == 10
    for index in (0, 1):
        counts = [e["usage"]["completion_tokens"] for e in chunks
                  if e["choices"][0]["index"] == index]
        assert counts == [1, 2, 3, 4, 5]
    assert all(e["usage"]["prompt_tokens"] == 6 for e in chunks)


def test_an_openai_client_streams_with_continuous_usage_stats(server):
    """What a load tool sends (the openai package, if installed: not a dependency)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    stream = client.completions.create(
        model=http(server, "/v1/models")[1]["data"][0]["id"], prompt="ROMEO:", max_tokens=4,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    usages = [chunk.usage.completion_tokens for chunk in stream]
    assert usages == [1, 2, 3, 4, 4]


def test_http_n_streams_each_choice_under_its_index(server, offline):
    want = offline.generate("A", SamplingParams(n=3, seed=8, max_tokens=5, ignore_eos=True))
    events = sse(server, "/v1/completions", dict(prompt="A", n=3, seed=8, max_tokens=5,
                                                 ignore_eos=True, stream=True))
    texts = ["", "", ""]
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c.text for c in want[0].outputs]


def test_http_prompt_list_and_n_give_each_choice_its_offline_output(server, offline):
    """A list of prompts (text and token ids) with n = 2: a choice per prompt and sample, in
    order, each the offline output with seed, seed + 1; usage counts every prompt once."""
    params = [SamplingParams(max_tokens=5, seed=s, ignore_eos=True) for s in (3, 4)]
    want = [o.outputs[0] for p in ("A", [65, 66]) for o in offline.generate([p, p], params)]
    status, got = http(server, "/v1/completions", dict(prompt=["A", [65, 66]], n=2, seed=3,
                                                       max_tokens=5, ignore_eos=True))
    assert status == 200 and [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == [w.text for w in want]
    assert got["usage"]["prompt_tokens"] == 3 and got["usage"]["completion_tokens"] == 20


def test_http_logprobs_and_echo_equal_dense_log_softmax(server, offline):
    status, got = http(server, "/v1/completions", dict(prompt=[5, 80, 9, 200], max_tokens=4,
                                                       temperature=0, logprobs=3, echo=True))
    assert status == 200
    lp = got["choices"][0]["logprobs"]
    ids = [5, 80, 9, 200] + offline.generate([[5, 80, 9, 200]], SamplingParams(
        max_tokens=4, temperature=0))[0].outputs[0].token_ids
    dense = offline.engine.model.forward_dense(torch.tensor([ids])).log_softmax(-1)[0]
    tokenizer = offline.engine.tokenizer
    assert lp["tokens"] == [token_text(tokenizer, t) for t in ids]
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["token_logprobs"]) == 8
    for i in range(1, 8):  # the top 3, and the token itself (OpenAI's completions: k + 1)
        assert lp["token_logprobs"][i] == pytest.approx(dense[i - 1, ids[i]].item(), abs=1e-4)
        top = dense[i - 1].topk(3)
        want = dict(zip(top.indices.tolist(), top.values.tolist()))
        want[ids[i]] = dense[i - 1, ids[i]].item()
        want = {token_text(tokenizer, t): value for t, value in want.items()}
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=1e-4)
    assert any(len(top) == 4 for top in lp["top_logprobs"][1:4])  # a prompt token not in top 3
    assert lp["text_offset"][:2] == [0, len(tokenizer.decode(ids[:1]))]
    events = sse(server, "/v1/completions", dict(prompt=[5, 80, 9, 200], max_tokens=4,
                                                 temperature=0, logprobs=3, echo=True, stream=True))
    streamed = [e["choices"][0]["logprobs"] for e in events[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == got["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for chunk in streamed for x in chunk[key]] == lp[key], key


def test_http_chat_uses_the_documented_template(server, offline):
    messages = [dict(role="system", content="Be brief."), dict(role="user", content="Hi")]
    prompt = "SYSTEM:\nBe brief.\n\nUSER:\nHi\n\nASSISTANT:\n"
    want = offline.generate(prompt, SamplingParams(max_tokens=6, seed=1, stop=["\n\n"],
                                                   logprobs=2))[0].outputs[0]
    body = dict(messages=messages, max_tokens=6, seed=1, logprobs=True, top_logprobs=2)
    status, got = http(server, "/v1/chat/completions", body)
    assert status == 200 and got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == dict(role="assistant", content=want.text)
    content = got["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(
        [e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-6)
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    events = sse(server, "/v1/chat/completions", body | dict(stream=True))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    special = dict(messages=[dict(role="user", content="<|endoftext|>")], max_tokens=2)
    assert http(server, "/v1/chat/completions", special)[0] == 200  # encoded as the engine does
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == want.text


def test_chat_content_parts_and_the_developer_role_read_as_text_and_system(server):
    """OpenAI's other forms of a message: content as text parts (joined by newlines, as vLLM
    joins them) and "developer", its newer name for "system"."""
    plain = [dict(role="system", content="Be brief."), dict(role="user", content="Hi\nthere")]
    parts = [dict(role="developer", content=[dict(type="text", text="Be brief.")]),
             dict(role="user", content=[dict(type="text", text="Hi"),
                                        dict(type="text", text="there")])]
    answers = [http(server, "/v1/chat/completions",
                    dict(messages=messages, max_tokens=6, seed=1))
               for messages in (plain, parts)]
    assert answers[0][0] == answers[1][0] == 200
    assert answers[0][1]["choices"] == answers[1][1]["choices"]
    assert answers[0][1]["usage"] == answers[1][1]["usage"]


def test_http_penalties_and_vllm_sampling_fields_equal_offline(server, offline):
    fields = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                  min_p=0.05, min_tokens=2, stop_token_ids=[70], include_stop_str_in_output=True)
    want = offline.generate("ROMEO:", SamplingParams(max_tokens=12, seed=5, logit_bias={65: 2.0},
                                                     **fields))[0].outputs[0]
    body = dict(prompt="ROMEO:", max_tokens=12, seed=5, logit_bias={"65": 2.0}, **fields)
    status, got = http(server, "/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == want.text
    chat = dict(messages=[dict(role="user", content="Hi")], max_tokens=6, seed=5, **fields)
    assert http(server, "/v1/chat/completions", chat)[0] == 200


@pytest.mark.parametrize("field, value", [("logit_bias", {"300": 1}), ("stop_token_ids", [300]),
                                          ("min_p", 2), ("presence_penalty", True)])
def test_http_error_param_names_the_bad_sampling_field(server, field, value):
    status, got = http(server, "/v1/completions", {"prompt": "x", field: value})
    assert (status, got["error"]["param"]) == (400, field)


def test_32_concurrent_streams_each_get_their_own_output(server, offline):
    prompts = [f"{i} " * (1 + i % 5) for i in range(32)]
    params = [SamplingParams(max_tokens=6 + i % 4, seed=i, ignore_eos=True) for i in range(32)]
    want = [o.outputs[0].text for o in offline.generate(prompts, params)]
    got = [None] * 32

    def client(i):
        events = sse(server, "/v1/completions", dict(prompt=prompts[i], seed=i, stream=True,
                                                     max_tokens=6 + i % 4, ignore_eos=True))
        got[i] = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == want


def test_keep_alive_serves_requests_one_after_another_on_one_connection(server, offline):
    """HTTP/1.1 keeps the connection: whole answers (with a Content-Length) and streams (in
    chunked encoding, so that their end is known) follow one another on the same socket,
    each the offline API's output."""
    bodies = [dict(prompt="ROMEO:", max_tokens=5, seed=1, ignore_eos=True),
              dict(prompt="JULIET:", max_tokens=4, seed=2, ignore_eos=True, stream=True),
              dict(prompt="x" * 20, max_tokens=6, seed=4, ignore_eos=True, stream=True),
              dict(prompt="A", max_tokens=3, seed=3, ignore_eos=True)]
    conn = connection(server)
    conn.connect()
    sock = conn.sock
    try:
        for body in bodies:
            status, response, got = request(conn, "POST", "/v1/completions", body)
            assert status == 200, got
            assert conn.sock is sock  # http.client did not have to reconnect
            if body.get("stream"):
                assert response.getheader("Transfer-Encoding") == "chunked"
                assert streamed_text(parse_events(got)) == offline_text(offline, body)
            else:
                assert response.getheader("Content-Length") is not None
                assert got["choices"][0]["text"] == offline_text(offline, body)
    finally:
        conn.close()


@pytest.mark.parametrize("version, header", [("HTTP/1.1", "Connection: close\r\n"),
                                             ("HTTP/1.0", "")], ids=["close", "http-1.0"])
def test_connection_close_and_http_1_0_get_one_answer_then_the_close(server, version, header):
    with connect(server) as sock:
        sock.sendall(f"GET /health {version}\r\nHost: x\r\n{header}\r\n".encode())
        status, response, got = read_response(sock)
        assert (status, got) == (200, {"status": "ok"})
        assert response.getheader("Connection") == "close"
        assert closed_by_server(sock)


def test_two_streams_read_in_turn_token_by_token_each_get_their_own_output(server, offline):
    """Two streams on two connections, read one event from each in turn: each event comes
    as its token is made (both first ones while both still run), and each stream is its own
    offline output."""
    bodies = [dict(prompt="ROMEO:", max_tokens=60, seed=5, ignore_eos=True, stream=True),
              dict(prompt="x" * 40, max_tokens=60, seed=6, ignore_eos=True, stream=True)]
    conns = [connection(server), connection(server)]
    try:
        for conn, body in zip(conns, bodies):
            conn.request("POST", "/v1/completions", json.dumps(body))
        responses = [conn.getresponse() for conn in conns]
        events = [[next_event(response)] for response in responses]
        assert requests_in_engine(server) == 2
        for _ in range(60):  # 59 more tokens, one event each, then [DONE]
            for response, got in zip(responses, events):
                got.append(next_event(response))
    finally:
        for conn in conns:
            conn.close()
    assert [e[-1] for e in events] == ["[DONE]", "[DONE]"]
    assert [streamed_text(e) for e in events] == [offline_text(offline, b) for b in bodies]


def metric(url: str, name: str) -> float:
    text = http(url, "/metrics")[1]
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith(f"nanoserve:{name} ")))


def wait_until_idle(url: str, seconds: float = 30) -> None:
    """Poll /metrics until no block is used and nothing runs or waits (or `seconds` pass)."""
    deadline = time.time() + seconds
    while time.time() < deadline and (metric(url, "kv_blocks_used") > 0
                                      or requests_in_engine(url) > 0):
        time.sleep(0.05)


def requests_in_engine(url: str) -> float:
    """Sequences running or waiting, as the newest step left them."""
    return metric(url, "num_requests_running") + metric(url, "num_requests_waiting")


def test_disconnect_mid_stream_frees_the_blocks(server):
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps(dict(prompt="x" * 100, max_tokens=900, ignore_eos=True, stream=True))
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     f"{len(body)}\r\n\r\n{body}".encode())
        assert b"data: " in sock.recv(4096) + sock.recv(4096)  # streaming has begun
        assert metric(server, "kv_blocks_used") > 0
    deadline = time.time() + 30
    while metric(server, "kv_blocks_used") > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert metric(server, "kv_blocks_used") == 0 and metric(server, "num_requests_running") == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_stops_its_generation_within_a_few_tokens(server, stream):
    """A request for 900 tokens (about two seconds of them) whose client closes the
    connection once generation has begun: after the close, fewer than 5% of them are made.
    A server that noticed only when the request ended would make all 900."""
    max_tokens = 900
    body = json.dumps(dict(prompt="x" * 100, max_tokens=max_tokens, ignore_eos=True,
                           stream=stream))
    before = metric(server, "generation_tokens_total")
    with connect(server, timeout=60) as sock:
        sock.sendall(wire_post("/v1/completions", body))
        if stream:
            received = b""
            while received.count(b"data: ") < 2:  # two tokens have come
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
        else:
            deadline = time.time() + 30
            while metric(server, "generation_tokens_total") == before and time.time() < deadline:
                time.sleep(0.01)  # generation has begun
        at_close = metric(server, "generation_tokens_total")
    wait_until_idle(server)
    assert metric(server, "kv_blocks_used") == 0
    assert at_close > before
    assert metric(server, "generation_tokens_total") - at_close < 0.05 * max_tokens


def test_a_client_that_stops_reading_is_dropped_and_others_go_on(offline):
    """A client that never reads a long stream (a small receive buffer, and a model name of
    8000 characters in every event, so that the answer outgrows the kernel's socket buffers
    within a few hundred tokens): once 4096 bytes wait unsent the server drops it (closes
    the connection before [DONE]), aborts its request (blocks freed; far fewer tokens than
    asked) and says so on stderr. A stream beside it is its offline output."""
    proc, url = start_server("--max-write-buffer", "4096", "--served-model-name", "m" * 8000)
    slow = socket.socket()
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.settimeout(60)
        slow.connect(address(url))
        before = metric(url, "generation_tokens_total")
        body = dict(prompt="x" * 100, n=4, max_tokens=900, ignore_eos=True, logprobs=5,
                    echo=True, stream=True)
        slow.sendall(wire_post("/v1/completions", json.dumps(body)))
        other = dict(prompt="ROMEO:", max_tokens=20, seed=3, ignore_eos=True, stream=True)
        events = sse(url, "/v1/completions", other)
        wait_until_idle(url, seconds=60)
        generated = metric(url, "generation_tokens_total") - before
        assert streamed_text(events) == offline_text(offline, other)
        assert metric(url, "kv_blocks_used") == 0
        assert generated - 20 < 4 * 900
        assert wait_for_log(proc, "stopped reading")
        unread = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := slow.recv(65536):  # what was on its way, then the close
                unread += chunk
        assert b"data: [DONE]" not in unread
    finally:
        slow.close()
        stop(proc)


LATENCIES = ("time_to_first_token_seconds", "time_per_output_token_seconds",
             "e2e_request_latency_seconds")


def test_metrics_count_tokens_and_latencies(server):
    """A 3-token completion adds 3 generated tokens and one observation to each latency
    histogram (its count, and its sum); prefix-cache hits and queries count tokens."""
    before = metric(server, "generation_tokens_total")
    counts = {name: metric(server, f"{name}_count") for name in LATENCIES}
    sums = {name: metric(server, f"{name}_sum") for name in LATENCIES}
    http(server, "/v1/completions", dict(prompt="abc", max_tokens=3, ignore_eos=True))
    assert metric(server, "generation_tokens_total") == before + 3
    for name in LATENCIES:
        assert metric(server, f"{name}_count") == counts[name] + 1, name
        assert metric(server, f"{name}_sum") > sums[name], name
    hits, queries = metric(server, "prefix_cache_hits_total"), metric(
        server, "prefix_cache_queries_total")
    for _ in range(2):  # the second finds the first's 2 whole blocks of 16 in the prefix cache
        http(server, "/v1/completions", dict(prompt="metrics " * 5, max_tokens=1))
    assert (metric(server, "prefix_cache_hits_total") - hits,
            metric(server, "prefix_cache_queries_total") - queries) == (32, 80)
    # n = 3 queries once a sample, as it hits: the first computes the 40-token prompt, the
    # others find its 2 whole blocks
    hits, queries = metric(server, "prefix_cache_hits_total"), metric(
        server, "prefix_cache_queries_total")
    http(server, "/v1/completions", dict(prompt="samples " * 5, max_tokens=1, n=3))
    assert (metric(server, "prefix_cache_hits_total") - hits,
            metric(server, "prefix_cache_queries_total") - queries) == (64, 120)
    text = http(server, "/metrics")[1]
    for name in LATENCIES:
        assert f"# TYPE nanoserve:{name} histogram" in text
        assert f'nanoserve:{name}_bucket{{le="+Inf"}}' in text
    assert "nanoserve:num_preemptions_total 0" in text and "kv_blocks_free" in text
    # tiny's KV cache: 64 contexts of 1024 tokens (max-num-seqs), 8 KiB a token (4 layers x
    # 4 K/V heads x 64 dims, K and V, fp32)
    assert metric(server, "kv_cache_tokens") == 64 * 1024
    assert metric(server, "kv_cache_tokens_per_gib") == 2**30 // 8192


BAD_REQUESTS = [
    ("POST", "/v1/completions", b"{bad json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/completions", dict(prompt="x", temperature="hot"), 400, "temperature"),
    ("POST", "/v1/completions", dict(prompt="x", temperature=float("nan")), 400, "temperature"),
    ("POST", "/v1/completions", dict(prompt="x", max_tokens=True), 400, "max_tokens"),
    ("POST", "/v1/completions", dict(prompt="x", n=0), 400, "n must be"),
    ("POST", "/v1/completions", dict(prompt="x", logprobs=6), 400, "at most 5"),
    ("POST", "/v1/completions", dict(prompt="x", stream="yes"), 400, "stream must be of type bool"),
    ("POST", "/v1/completions", dict(prompt="x", model="gpt-4"), 404,
     "The model `gpt-4` does not exist."),
    ("POST", "/v1/completions", dict(prompt="x", best_of=3), 400, "best_of is not supported"),
    ("POST", "/v1/completions", dict(prompt="x", presence_penalty=3), 400, "presence_penalty"),
    ("POST", "/v1/completions", dict(prompt="x", logit_bias={"a": 1}), 400, "logit_bias"),
    ("POST", "/v1/completions", dict(prompt="x", logit_bias={"300": 1}), 400,
     "logit_bias: token id 300 is not in the vocabulary"),
    ("POST", "/v1/completions", dict(prompt="x", max_tokens=2, min_tokens=3), 400, "min_tokens"),
    ("POST", "/v1/completions", dict(prompt="x", wat=1), 400, "wat is not supported"),
    ("POST", "/v1/completions", dict(prompt=[]), 400, "prompt must be"),
    ("POST", "/v1/completions", dict(prompt=[[1], [99999]]), 400, "token ids must be"),
    ("POST", "/v1/completions", dict(prompt="x" * 1100), 400, "the model's context is 1024"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="bot", content="x")]), 400,
     "messages must be"),
    # a body of exactly MAX_BODY_BYTES is parsed (it is not JSON); one byte more is refused
    ("POST", "/v1/completions", b"x" * MAX_BODY_BYTES, 400, "not valid JSON"),
    ("POST", "/v1/completions", b"x" * (MAX_BODY_BYTES + 1), 413, "the limit is"),
    ("GET", "/v2/nothing", None, 404, "no such path"),
    ("GET", "/v1/completions", None, 405, "takes POST"),
    ("DELETE", "/v1/models", None, 405, "takes GET"),
    ("OPTIONS", "/v1/completions", None, 405, "takes POST"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("POST", "/v1/completions", b"[" * 100000, 400, "nested too deeply"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="\ud800")]), 400,
     "character 6 is a lone surrogate, U+D800"),
    ("POST", "/tokenize", dict(prompt="a\udfff"), 400,
     "character 1 is a lone surrogate, U+DFFF"),
    ("POST", "/v1/completions", dict(prompt="x", repetition_penalty=1e-308), 400,
     "repetition_penalty must be a number in [0.01, 100]"),
    ("POST", "/v1/completions", dict(prompt="x", stop=["a"] * 17), 400, "stop has 17 strings"),
    # a chat without a template stops at its turn's end too: a 17th string, within the cap
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          stop=["a"] * 16), 400, "stop has 17 strings"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          top_logprobs=-1), 400, "top_logprobs must be"),
    ("POST", "/v1/completions", dict(prompt="x", stop_token_ids=list(range(257))), 400,
     "stop_token_ids has 257 token ids"),
    ("POST", "/v1/completions", dict(prompt=[[1]] * 5, n=64), 400, "at most 256 in all"),
    ("POST", "/v1/completions", dict(prompt=["x", "x" * 1100]), 400, "(prompt[1])"),
    ("POST", "/v1/completions", dict(prompt="x", user={"id": 1}), 400, "user must be"),
    ("POST", "/v1/completions", dict(prompt="x", stream_options={"include_usage": True}), 400,
     "stream_options needs stream: true"),
    ("POST", "/v1/completions", dict(prompt="x", priority=True), 400,
     "priority must be of type int"),
    ("POST", "/v1/completions", dict(prompt="x", priority=2**40), 400,
     "priority must be an integer in [-2147483647, 2147483647], got 1099511627776"),
    ("POST", "/v1/completions", dict(prompt="x", stream=True,
                                     stream_options={"continuous_usage_stats": 1}), 400,
     "stream_options.continuous_usage_stats must be of type bool"),
    ("POST", "/v1/completions", dict(prompt="x", stream=True,
                                     stream_options={"include_usage": True, "x": True}), 400,
     "stream_options.x is not supported"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          top_logprobs=2), 400, "top_logprobs needs logprobs"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          max_completion_tokens=0), 400,
     "max_completion_tokens must be"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                          max_tokens="x", max_completion_tokens=5), 400,
     "max_tokens must be"),
    ("POST", "/v1/chat/completions", dict(messages=[dict(role="user", content=[
        dict(type="image_url", image_url=dict(url="http://x"))])]), 400, "content parts"),
]


@pytest.mark.parametrize("method, path, body, status, message", BAD_REQUESTS,
                         ids=[f"{r[3]}-{r[4][:20]}" for r in BAD_REQUESTS])
def test_http_bad_input_gets_an_openai_error_and_the_server_goes_on(
        server, method, path, body, status, message):
    raw = body if isinstance(body, bytes) else None
    got_status, got = http(server, path, None if raw else body, method, raw)
    assert got_status == status and message in got["error"]["message"]
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert http(server, "/health") == (200, {"status": "ok"})
    assert metric(server, "kv_blocks_used") == 0


@pytest.mark.allows_fallback
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_request_failing_in_the_engine_gets_a_500_and_a_concurrent_one_goes_on(offline,
                                                                                 stream):
    """The model raises whenever one request's marker token is in the batch: that request
    alone fails, a 500 of type server_error (streamed: an error event, then [DONE]); a
    stream running beside it gets its offline output; no block is left behind."""
    engine = tiny().engine
    normal = dict(prompt="ROMEO:", max_tokens=100, seed=1, ignore_eos=True, stream=True)
    want = offline.generate("ROMEO:", SamplingParams(max_tokens=100, seed=1, ignore_eos=True))
    seen = engine.tokenizer.encode("ROMEO:") + want[0].outputs[0].token_ids
    marker = min(set(range(257)) - set(seen))  # a token the normal request never holds
    real_forward = engine.model.forward

    def forward(input_ids, *args):
        if (input_ids == marker).any():
            raise ValueError("poisoned request")
        return real_forward(input_ids, *args)
    engine.model.forward = forward
    with server_in_process(engine) as url:
        conn = connection(url)
        conn.request("POST", "/v1/completions", json.dumps(normal))
        response = conn.getresponse()
        first = next_event(response)  # the normal stream is running
        failing = dict(prompt=[65, marker, 66], max_tokens=5, stream=stream)
        status, got = http(url, "/v1/completions", failing)
        rest = parse_events(response.read().decode())
        conn.close()
    assert status == (200 if stream else 500)
    if stream:
        events = parse_events(got)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error"
        assert events[-2]["error"]["code"] == 500
    else:
        assert got["error"]["type"] == "server_error" and got["error"]["code"] == 500
    assert streamed_text([first] + rest) == want[0].outputs[0].text
    assert_no_leaks(engine)


MALFORMED = [  # bytes sent, the status answered
    (b"HELLO\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n", 431),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Content-Length: 34\r\n\r\n", 400),
]


@pytest.mark.parametrize("raw, status", MALFORMED,
                         ids=["garbage", "headers-over-64k", "chunked", "length-and-chunked",
                              "two-lengths"])
def test_malformed_http_gets_an_openai_error_then_the_close_and_the_server_goes_on(
        server, raw, status):
    with connect(server) as sock:
        sock.sendall(raw)
        got_status, _, got = read_response(sock)
        assert got_status == status and got["error"]["code"] == status
        assert set(got["error"]) == {"message", "type", "param", "code"}
        assert closed_by_server(sock)
    assert http(server, "/health") == (200, {"status": "ok"})


def test_a_body_cut_short_by_the_client_gets_400(server):
    """Content-Length 10, 5 bytes, then the client's half-close: the body cannot come."""
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
                     b'{"pro')
        sock.shutdown(socket.SHUT_WR)
        status, _, got = read_response(sock)
    assert status == 400 and "ended after" in got["error"]["message"]


def test_expect_100_continue_is_answered_before_the_body_is_sent(server, offline):
    body = dict(prompt="A", max_tokens=3, seed=1, ignore_eos=True)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
            "Expect: 100-continue\r\n\r\n")
    with connect(server) as sock:
        sock.sendall(head.encode())
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):  # byte by byte: nothing past it is read
            byte = sock.recv(1)
            assert byte, interim
            interim += byte
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(data)
        status, _, got = read_response(sock)
    assert status == 200 and got["choices"][0]["text"] == offline_text(offline, body)


@pytest.fixture(scope="module")
def strict_server():
    """A server of its own whose limits are a second: a request must arrive within one of
    its first byte; a connection with no request under way is closed after one."""
    proc, url = start_server("--request-timeout", "1", "--timeout-keep-alive", "1")
    yield url
    stop(proc)


def test_headers_sent_too_slowly_get_408(strict_server):
    """A byte every 50 ms: the whole request would take 7 s; the server answers 408 (as soon
    as it does, the client stops sending)."""
    raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * 100 + b"\r\n\r\n"
    with connect(strict_server) as sock:
        for byte in raw:
            answered = select.select([sock], [], [], 0.05)[0]
            if answered:
                break
            sock.sendall(bytes([byte]))
        status, _, got = read_response(sock)
        assert status == 408 and got["error"]["code"] == 408
        assert closed_by_server(sock)


def test_a_body_that_stops_arriving_gets_408(strict_server):
    with connect(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
                     b'{"pro')
        status, _, got = read_response(sock)
        assert status == 408 and got["error"]["code"] == 408
        assert closed_by_server(sock)


@pytest.mark.parametrize("requests_before", [0, 1], ids=["fresh", "after-a-request"])
def test_an_idle_connection_is_closed_silently_after_the_keep_alive_timeout(strict_server,
                                                                            requests_before):
    with connect(strict_server) as sock:
        for _ in range(requests_before):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock)[0] == 200
        assert closed_by_server(sock)  # within the socket's 10 s


SHUTDOWNS = [  # the signal, the server's flags, each request's max_tokens, how each ends
    # SIGTERM, requests that cannot finish within the second given: 4 x 900 tokens, one at
    # a time, take seconds
    (signal.SIGTERM, ("--shutdown-timeout", "1", "--max-num-seqs", "1"), 900, "abort"),
    # SIGTERM, requests that finish well within the default 5 s: they run to their end
    (signal.SIGTERM, (), 200, "length"),
    # SIGINT (Ctrl-C): the same requests end at once
    (signal.SIGINT, (), 200, "abort"),
]


@pytest.mark.parametrize("sig, flags, max_tokens, finish_reason", SHUTDOWNS,
                         ids=["sigterm-past-the-timeout", "sigterm-within-it", "sigint"])
def test_shutdown_answers_every_request_in_flight_and_exits_0(sig, flags, max_tokens,
                                                              finish_reason):
    """Two streams (one asking for usage) and two whole requests in flight when the signal
    comes: each gets its answer, ending with `finish_reason`: a stream its final chunk (then
    its usage) and [DONE], a whole request a 200. Then the server exits 0, and stderr
    after the serving line says only that."""
    proc, url = start_server(*flags)
    try:
        bodies = [dict(prompt=f"{i} ", max_tokens=max_tokens, seed=i, ignore_eos=True,
                       stream=i < 2) for i in range(4)]
        bodies[0]["stream_options"] = {"include_usage": True}
        answers = [None] * 4

        def client(i):
            answers[i] = http(url, "/v1/completions", bodies[i])
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.time() + 30
        while requests_in_engine(url) < 4 and time.time() < deadline:
            time.sleep(0.01)
        assert requests_in_engine(url) == 4
        proc.send_signal(sig)
        for thread in threads:
            thread.join(60)
        assert proc.wait(timeout=30) == 0
        assert [status for status, _ in answers] == [200] * 4
        with_usage = parse_events(answers[0][1])
        assert with_usage[-1] == "[DONE]"
        assert with_usage[-2]["choices"] == [] and "usage" in with_usage[-2]
        assert with_usage[-3]["choices"][0]["finish_reason"] == finish_reason
        plain = parse_events(answers[1][1])
        assert plain[-1] == "[DONE]"
        assert plain[-2]["choices"][0]["finish_reason"] == finish_reason
        assert [got["choices"][0]["finish_reason"] for _, got in answers[2:]] == \
            [finish_reason] * 2
        assert proc.log.whole() == "server stopped\n"
    finally:
        stop(proc)


def refuses_connections(url: str) -> bool:
    """Whether the server's listener is closed: a connection is refused, or reset when it
    reached the kernel's backlog just as the listener closed."""
    try:
        connect(url, timeout=5).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    return False


def test_an_answer_written_before_sigterm_reaches_a_slow_reader_whole():
    """A client that reads slowly (a 4 KiB receive buffer) has 3 MB of answer waiting in the
    server's buffers when SIGTERM comes: the server sends it all before it exits."""
    proc, url = start_server("--shutdown-timeout", "30")
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(address(url))
        body = json.dumps(dict(prompt="ROMEO:", max_tokens=200, n=100, logprobs=5, seed=1,
                               ignore_eos=True)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        deadline = time.time() + 60
        while metric(url, "e2e_request_latency_seconds_count") < 1 and time.time() < deadline:
            time.sleep(0.05)  # answered: all of it written, most of it unread
        proc.send_signal(signal.SIGTERM)
        sock.settimeout(30)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
        head, _, answer = received.partition(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        assert length > 3_000_000 and len(answer) == length
        assert proc.wait(timeout=30) == 0, proc.log.whole()
    finally:
        sock.close()
        stop(proc)


def test_health_is_503_on_an_open_connection_while_the_server_drains():
    """After SIGTERM, while a request in flight may still finish, the server takes no new
    connection, and /health on one opened before says 503 (a load balancer stops sending)
    and that the connection closes (no client reuses it, to be cut off at the drain's end)."""
    proc, url = start_server()
    probe = connection(url)
    try:
        assert request(probe, "GET", "/health")[0] == 200
        body = dict(prompt="x" * 100, max_tokens=900, ignore_eos=True)
        thread = threading.Thread(target=http, args=(url, "/v1/completions", body))
        thread.start()
        deadline = time.time() + 30
        while requests_in_engine(url) < 1 and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while not refuses_connections(url) and time.time() < deadline:
            time.sleep(0.01)
        status, response, _ = request(probe, "GET", "/health")
        assert status == 503 and response.getheader("Connection") == "close"
        thread.join(60)
        assert proc.wait(timeout=30) == 0
    finally:
        probe.close()
        stop(proc)


def test_refused_requests_leave_nothing_behind_in_the_server():
    """A request the engine refuses ends with its 400, its bookkeeping too: many of them
    (one batched, its first prompt added, then taken back) leave no record to grow on."""
    with server_thread(tiny().engine) as server:
        for _ in range(5):
            assert http(server.url, "/v1/completions", dict(prompt="x" * 1100))[0] == 400
        assert http(server.url, "/v1/completions", dict(prompt=["x", "x" * 1100]))[0] == 400
        assert not server.times and not server.requests and not server.in_flight


def test_tokenize_and_detokenize_equal_the_engines_tokenizer(server, offline):
    """/tokenize encodes as the engine does (special tokens too), a chat as its template's
    text; /detokenize decodes back."""
    tokenizer = offline.engine.tokenizer
    text = "ROMEO: é <|endoftext|>\n"
    ids = tokenizer.encode(text)
    assert http(server, "/tokenize", dict(prompt=text)) == (200, dict(
        count=len(ids), max_model_len=offline.engine.max_model_len, tokens=ids))
    messages = [dict(role="system", content="Be brief."), dict(role="user", content="Hi")]
    status, got = http(server, "/tokenize", dict(messages=messages))
    assert status == 200
    assert got["tokens"] == tokenizer.encode(render_chat(messages))
    assert http(server, "/detokenize", dict(tokens=ids)) == (200, {"prompt": text})
    assert http(server, "/detokenize", dict(tokens=[200, 201])) == (
        200, {"prompt": tokenizer.decode([200, 201])})


@pytest.mark.parametrize("bad", [257, -1, 10**9])
def test_detokenize_refuses_a_token_outside_the_vocabulary(server, bad):
    status, got = http(server, "/detokenize", dict(tokens=[65, bad]))
    assert status == 400 and got["error"]["code"] == 400


def test_version_is_the_packages(server):
    assert http(server, "/version") == (200, {"version": nanoserve.__version__})


KEY_PATHS = [("/v1/models", None), ("/v1/completions", dict(prompt="A", max_tokens=1)),
             ("/v1/chat/completions", dict(messages=[dict(role="user", content="A")],
                                           max_tokens=1)),
             ("/tokenize", dict(prompt="A")), ("/detokenize", dict(tokens=[65]))]


@pytest.mark.parametrize("flags, env", [(("--api-key", "sk-test"), None),
                                        ((), os.environ | {"NANOSERVE_API_KEY": "sk-test"})],
                         ids=["flag", "environment"])
def test_api_key_guards_the_api_and_leaves_probes_open(flags, env):
    """With a key, the API needs "Authorization: Bearer KEY": without it, or with another
    key, a 401 in OpenAI's error body; /health, /metrics and /version need none."""
    proc, url = start_server(*flags, env=env)
    try:
        for path, body in KEY_PATHS:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                status, got = http(url, path, body, headers=headers)
                assert status == 401 and "API key" in got["error"]["message"], path
                assert set(got["error"]) == {"message", "type", "param", "code"}
            right = {"Authorization": "Bearer sk-test"}
            assert http(url, path, body, headers=right)[0] == 200, path
        for path in ("/health", "/metrics", "/version"):
            assert http(url, path)[0] == 200, path
    finally:
        stop(proc)


def test_served_model_name_is_listed_and_the_only_model_accepted(offline):
    proc, url = start_server("--served-model-name", "nano-1")
    try:
        status, models = http(url, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["nano-1"]
        body = dict(prompt="A", model="nano-1", max_tokens=3, seed=1, ignore_eos=True)
        status, got = http(url, "/v1/completions", body)
        assert status == 200 and got["model"] == "nano-1"
        assert got["choices"][0]["text"] == offline_text(offline, body)
        status, got = http(url, "/v1/completions", body | dict(model="tiny"))
        assert status == 404 and got["error"]["message"] == "The model `tiny` does not exist."
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def cors_server():
    """A server of its own that lets one origin call it, and needs a key."""
    proc, url = start_server("--allowed-origins", "https://ok.example", "--api-key", "sk-test")
    yield url
    stop(proc)


def test_cors_headers_go_to_an_allowed_origin_only(cors_server, server):
    key = {"Authorization": "Bearer sk-test"}
    conn = connection(cors_server)
    try:
        status, response, _ = request(conn, "GET", "/v1/models", None,
                                      key | {"Origin": "https://ok.example"})
        assert status == 200
        assert response.getheader("Access-Control-Allow-Origin") == "https://ok.example"
        status, response, _ = request(conn, "GET", "/v1/models", None,
                                      key | {"Origin": "https://other.example"})
        assert status == 200 and response.getheader("Access-Control-Allow-Origin") is None
    finally:
        conn.close()
    conn = connection(server)  # no --allowed-origins: no CORS header ever
    try:
        status, response, _ = request(conn, "GET", "/v1/models", None,
                                      {"Origin": "https://ok.example"})
        assert status == 200 and response.getheader("Access-Control-Allow-Origin") is None
    finally:
        conn.close()


def test_cors_preflight_of_an_allowed_origin_gets_204_without_the_key(cors_server):
    conn = connection(cors_server)
    try:
        status, response, _ = request(conn, "OPTIONS", "/v1/completions", None, {
            "Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
    finally:
        conn.close()
    assert status == 204
    assert response.getheader("Access-Control-Allow-Origin") == "https://ok.example"
    assert "POST" in response.getheader("Access-Control-Allow-Methods")
    assert "authorization" in response.getheader("Access-Control-Allow-Headers").lower()


def test_requests_are_logged_only_with_log_requests():
    quiet, quiet_url = start_server()
    logged, logged_url = start_server("--log-requests")
    try:
        http(quiet_url, "/health")
        http(logged_url, "/health")
        http(logged_url, "/v2/nothing")
        assert wait_for_log(logged, '"GET /health" 200')
        assert wait_for_log(logged, '"GET /v2/nothing" 404')
        assert not wait_for_log(quiet, "GET /health", seconds=0.5)
    finally:
        stop(quiet)
        stop(logged)


def test_server_warns_when_bound_beyond_loopback():
    proc = subprocess.Popen([sys.executable, "nanoserve.py", "--serve", "--port", "0", "--host",
                             "0.0.0.0", "--preset", "tiny"], cwd=HERE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert "warning: bound to 0.0.0.0" in proc.stderr.readline()
        line = proc.stderr.readline()
        assert line.startswith("serving tiny (weights ") and " on http://0.0.0.0:" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)  # never left running, whatever failed


# ----------------------------------------------------------------------------- bench.py --url

def test_api_key_must_match_whole_not_as_a_prefix():
    """Only "Authorization: Bearer KEY" exactly passes: a header that starts with the key
    and goes on, repeats it, or holds only part of it gets a 401."""
    proc, url = start_server("--api-key", "sk-test")
    try:
        for given in ("Bearer sk-test2", "Bearer sk-testsk-test", "Bearer sk-test junk",
                      "Bearer sk-test Bearer sk-test", "Bearer sk-tes", "Bearer ", "sk-test"):
            status, got = http(url, "/v1/models", headers={"Authorization": given})
            assert status == 401 and "API key" in got["error"]["message"], given
        assert http(url, "/v1/models", headers={"Authorization": "Bearer sk-test"})[0] == 200
    finally:
        stop(proc)


def test_chat_max_completion_tokens_wins_over_max_tokens():
    """OpenAI's newer name wins when a chat request gives both, in either order."""
    assert chat_max_tokens({"max_tokens": 3, "max_completion_tokens": 5}, 16) == 5
    assert chat_max_tokens({"max_completion_tokens": 5, "max_tokens": 3}, 16) == 5
    assert chat_max_tokens({"max_tokens": 3}, 16) == 3
    assert chat_max_tokens({}, 16) == 16

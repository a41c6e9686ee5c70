"""The OpenAI-compatible HTTP server: python nanoserve.py --serve.

OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events or whole,
n samples, logprobs, echo), /v1/models, vLLM's /tokenize and /detokenize, /health, /version,
/metrics (Prometheus' text format, vLLM's metric names), and the watch page at / with its
stream of step frames, /watch/events (watch.py, watch.html). One asyncio event loop serves
every connection (HTTP/1.1 keep-alive, written here on the standard library); the engine runs
on its own thread (EngineThread), which takes requests and aborts between steps and hands each
step's outputs to the loop in one call. ServerConfig holds the flags that say where and for
whom it serves and the limits that keep a slow or silent client from holding anything.
openai_protocol.py turns a request's JSON into the engine's requests and its outputs back
into OpenAI's JSON; this file is the wire and the concurrency around it.

Three kinds of request meet here, each with its own id: an HTTP request (ServedRequest) may
carry several prompts; each prompt is one engine request (a request id); each request fans
out into its n samples, the engine's sequences. The server sees requests only.
"""
import asyncio
import contextlib
import hmac
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus

import watch
from beam_search import BeamSearchParams
from lora import LoRARequest, load_lora
from nanoserve import Engine, EngineDeadError, RequestOutput, __version__, accumulate
from openai_protocol import (HTTPError, chat_prompt, check_model, choice, choice_usage,
                             encode_text, error_body, parse_request, typed, usage_of)
from options import check_fields, option
from sampling import print_sampling_defaults


@dataclass
class ServerConfig:
    """How --serve serves: where, under which model name, to whom, and the limits that keep a
    slow or silent client from holding anything (uvicorn's and vLLM's flag names)."""
    host: str = option("127.0.0.1", "the address to bind")
    port: int = option(8000, "the port (0: any free one)", low=0, high=65535)
    served_model_name: str | None = option(None, "the model's name in the API; default: the "
                                           "model's or the preset's", type=str)
    api_key: str | None = option(None, "/v1/*, /tokenize and /detokenize need 'Authorization: "
                                 "Bearer KEY'; default: $NANOSERVE_API_KEY", type=str)
    allowed_origins: tuple = option((), "origins a browser may call from (CORS); * for any")
    timeout_keep_alive: float = option(5.0, "seconds a connection may stay open with no "
                                       "request under way", low=0, open_low=True)
    request_timeout: float = option(30.0, "seconds from a request's first byte to its last "
                                    "(then 408)", low=0, open_low=True)
    max_write_buffer: int = option(1 << 20, "bytes a client may leave unread; past that it is "
                                   "dropped and its request aborted (a watching page misses "
                                   "frames instead)")
    shutdown_timeout: float = option(5.0, "on SIGTERM, seconds the requests in flight may "
                                     "still run (then they end with finish_reason abort)", low=0)
    log_requests: bool = option(False, "an access-log line per request, on stderr")
    # LoRA (lora.py; the engine's --enable-lora): vLLM's flags
    lora_modules: tuple = option((), "LoRA adapters served by name (the request's model): "
                                 "name=path, or vLLM's JSON {\"name\": ..., \"path\": ...}")
    allow_runtime_lora_updating: bool = option(False, "POST /v1/load_lora_adapter and "
                                               "/v1/unload_lora_adapter (also "
                                               "$VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")

    def __post_init__(self):
        self.allowed_origins = tuple(self.allowed_origins)
        self.lora_modules = tuple(self.lora_modules)
        if self.api_key is None:
            self.api_key = os.environ.get("NANOSERVE_API_KEY") or None
        check_fields(self)
        if not self.host:
            raise ValueError("host is empty: give an address to bind (0.0.0.0 for every one)")
        if self.api_key == "":
            raise ValueError("api_key is empty: no request could match it")
        if not all(isinstance(origin, str) and origin for origin in self.allowed_origins):
            raise ValueError(f"allowed_origins must be strings, got {self.allowed_origins!r}")
        self.lora_modules = tuple(parse_lora_module(module) for module in self.lora_modules)
        if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"):
            self.allow_runtime_lora_updating = True


def parse_lora_module(module) -> dict:
    """--lora-modules' item: "name=path" or vLLM's JSON {"name", "path", "base_model_name"}
    -> {"name": ..., "path": ...}; ValueError naming the item otherwise."""
    if isinstance(module, dict):
        return module
    if not isinstance(module, str):
        raise ValueError(f"lora_modules: {module!r} is not name=path or a JSON object")
    if module.startswith("{"):
        try:
            parsed = json.loads(module)
        except ValueError as e:
            raise ValueError(f"lora_modules: {module!r} is not JSON: {e}") from None
        if not (isinstance(parsed, dict) and isinstance(parsed.get("name"), str)
                and isinstance(parsed.get("path"), str)
                and set(parsed) <= {"name", "path", "base_model_name"}):
            raise ValueError(f"lora_modules: {module!r} must be {{\"name\": str, \"path\": "
                             "str, \"base_model_name\": str (optional)}")
        return dict(name=parsed["name"], path=parsed["path"])
    name, sep, path = module.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules: {module!r} is not name=path")
    return dict(name=name, path=path)


MAX_BODY_BYTES = 1 << 20  # a larger request body is refused (413)
MAX_HEADER_BYTES = 64 << 10  # a larger header block is refused (431)
DRAIN_ANSWER_TIMEOUT = 10.0  # seconds a shutdown waits for aborted requests' answers (a step)
CORS_PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                  "Access-Control-Allow-Headers": "Authorization, Content-Type",
                  "Access-Control-Max-Age": "600"}

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


def zero_bucket_counts() -> list[int]:
    return [0] * len(BUCKETS)


@dataclass
class Histogram:
    """Prometheus' histogram: for each bucket's bound, how many observations were <= it."""
    counts: list[int] = field(default_factory=zero_bucket_counts)
    sum: float = 0.0
    count: int = 0

    def observe(self, x: float) -> None:
        for i, upper_bound in enumerate(BUCKETS):
            if x <= upper_bound:
                self.counts[i] += 1
        self.sum += x
        self.count += 1

    def lines(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        for upper_bound, count in zip(BUCKETS, self.counts):
            lines.append(f'{name}_bucket{{le="{upper_bound}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {self.count}")
        return lines


@dataclass
class RequestTimes:
    """When a request arrived and got its first token, and how many tokens it got so far."""
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0


class EngineThread(threading.Thread):
    """The one thread that touches the engine. Between steps it runs the calls the event loop
    put in its inbox (add a request, abort, read the gauges), blocking there while the engine
    has no work; after each step it hands the step's outputs, the whole list, to the loop in
    one call: one wake-up of the loop per step, however many streams are open. While a page
    watches (`watched`), it also hands over the step's frame (watch.frame); while none does,
    no frame is built. Not a daemon: stop() and join() end it before the process exits."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, deliver, died, show):
        super().__init__(name="engine")
        self.engine = engine
        self.loop = loop
        self.deliver = deliver  # called on the loop with each step's outputs
        self.died = died        # called on the loop with the EngineDeadError, if the engine dies
        self.show = show        # called on the loop with each step's frame while `watched`
        self.watched = False    # set by the loop while a page watches the engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # calls to run between steps; None: stop

    def run(self) -> None:
        while self._run_inbox():
            try:
                outputs = self.engine.step()
            except EngineDeadError as e:
                self.loop.call_soon_threadsafe(self.died, e)
                self._answer_until_stopped()
                return
            if self.watched and self.engine.step_recorded:
                self.send_frame()  # first: a page has the step's frame when its tokens go out
            if outputs:
                self.loop.call_soon_threadsafe(self.deliver, outputs)

    def send_frame(self) -> None:
        """Hand the engine's state now, as a frame (watch.frame), to the loop's show()."""
        self.loop.call_soon_threadsafe(self.show, watch.frame(self.engine))

    def _answer_until_stopped(self) -> None:
        """The engine is dead: run what is still asked (adds now fail) until stop()."""
        while True:
            call = self.inbox.get()
            if call is None:
                return
            call()

    def _run_inbox(self) -> bool:
        """Run the calls waiting in the inbox; with no work in the engine, wait for one first.
        False once stop() was called."""
        block = not self.engine.has_unfinished()
        while True:
            try:
                call = self.inbox.get(block=block)
            except queue.Empty:
                return True
            if call is None:
                return False
            call()
            block = False

    def stop(self) -> None:
        self.inbox.put(None)

    def call(self, fn, *args) -> asyncio.Future:
        """On the loop: run fn(*args) on this thread between steps; the future gets its result
        or its exception."""
        future = self.loop.create_future()
        self.inbox.put(partial(self._run_call, future, fn, args))
        return future

    def _run_call(self, future: asyncio.Future, fn, args: tuple) -> None:
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 (the caller, on the loop, gets it)
            self.loop.call_soon_threadsafe(settle, future, None, e)
            return
        self.loop.call_soon_threadsafe(settle, future, result, None)

    def add(self, requests: list, ids: list[str], priority: int, lora_request=None) -> None:
        """All of one HTTP request's engine requests (one a prompt), or none of them, at its
        priority, with its LoRA adapter if any: ValueError names what is wrong
        (EngineDeadError: the engine is gone)."""
        if self.engine.dead is not None:
            raise EngineDeadError(self.engine.dead)
        added = []
        try:
            for (prompt, params), request_id in zip(requests, ids):
                if isinstance(params, BeamSearchParams) and lora_request is not None:
                    raise ValueError("use_beam_search does not run with a LoRA adapter")
                if isinstance(params, BeamSearchParams):  # use_beam_search (beam_search.py)
                    self.engine.add_beam_request(prompt, params, request_id, priority)
                else:
                    self.engine.add_request(prompt, params, request_id, priority=priority,
                                            lora_request=lora_request)
                added.append(request_id)
        except ValueError as e:  # another prompt of its HTTP request was refused
            self.abort(added)
            if len(requests) == 1:
                raise
            raise ValueError(f"{e} (prompt[{len(added)}])") from None

    def abort(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)

    def gauges(self) -> list[str]:
        """The engine's gauges and counters in Prometheus' text format: vLLM's metric names,
        with a nanoserve: prefix; the gauges as the newest step's record left them."""
        engine = self.engine
        step = engine.last_step
        num_running = step.num_running if step else 0
        num_waiting = step.num_waiting if step else 0
        kv_blocks_used = step.kv_blocks_used if step else 0
        values = [("num_requests_running", "gauge", num_running),
                  ("num_requests_waiting", "gauge", num_waiting),
                  ("kv_blocks_used", "gauge", kv_blocks_used),
                  ("kv_blocks_free", "gauge", engine.block_pool.num_blocks - kv_blocks_used),
                  ("kv_cache_tokens", "gauge", engine.kv_cache_tokens),
                  ("kv_cache_tokens_per_gib", "gauge", engine.kv_tokens_per_gib),
                  ("kv_cache_bytes", "gauge", engine.kv_cache_bytes),
                  ("kv_cache_clipped_total", "counter", engine.num_kv_clipped),
                  ("model_weights_bytes", "gauge", engine.model_weights_bytes),
                  ("prompt_tokens_total", "counter", engine.stats.num_prompt_tokens),
                  ("generation_tokens_total", "counter", engine.stats.num_generated_tokens),
                  ("prefix_cache_queries_total", "counter", engine.stats.num_queried_tokens),
                  ("prefix_cache_hits_total", "counter", engine.stats.num_cached_tokens),
                  ("num_preemptions_total", "counter", engine.scheduler.num_preemptions),
                  ("spec_decode_num_drafts_total", "counter", engine.stats.spec_decode_num_drafts),
                  ("spec_decode_num_draft_tokens_total", "counter",
                   engine.stats.spec_decode_num_draft_tokens),
                  ("spec_decode_num_accepted_tokens_total", "counter",
                   engine.stats.spec_decode_num_accepted_tokens),
                  ("num_swapped_out_total", "counter", engine.scheduler.num_swapped_out),
                  ("num_swapped_in_total", "counter", engine.scheduler.num_swapped_in),
                  ("num_fallbacks_total", "counter", engine.stats.num_fallbacks),
                  # disaggregated prefill (kv_connector.py)
                  ("kv_load_tokens_total", "counter", engine.stats.num_kv_loaded_tokens),
                  ("kv_load_bytes_total", "counter", engine.stats.kv_load_bytes),
                  ("kv_load_seconds_total", "counter", engine.stats.kv_load_seconds),
                  ("kv_load_failures_total", "counter", engine.stats.num_kv_load_failures),
                  ("kv_save_tokens_total", "counter", engine.stats.num_kv_saved_tokens),
                  ("swap_blocks_used", "gauge", step.swap_blocks_used if step else 0)]
        lines = []
        for name, kind, value in values:
            lines.append(f"# TYPE nanoserve:{name} {kind}")
            lines.append(f"nanoserve:{name} {value}")
        return lines


def settle(future: asyncio.Future, result, error: Exception | None) -> None:
    """Give a future its result or error, unless its waiter has gone (then it was cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
        return
    future.set_result(result)


# Headers read here that a request may send once: of two, which counts would be a guess. Two
# Content-Lengths frame the body two ways, and a proxy that reads the other one lets a
# request hide in another's body (smuggling; RFC 9112, 6.3).
SINGLE_HEADERS = ("content-length", "authorization")


@dataclass
class HTTPRequest:
    """One request as read off its connection; header names in lower case."""
    method: str
    path: str
    headers: dict[str, str]
    keep_alive: bool     # HTTP/1.1 unless "Connection: close"; HTTP/1.0 only if asked
    body: bytes = b""


def parse_head(head: bytes) -> HTTPRequest:
    """The request line and headers (up to the blank line) -> HTTPRequest; HTTPError 400 if
    they are not HTTP/1.x."""
    lines = head.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/") \
            or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise HTTPError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise HTTPError(400, f"malformed header line {line[:80]!r}")
        name = name.lower()
        if name in SINGLE_HEADERS and name in headers:  # which one counts is ambiguous
            raise HTTPError(400, f"the {name} header is sent twice")
        headers[name] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = connection == "keep-alive"
    if version == "HTTP/1.1":
        keep_alive = connection != "close"
    return HTTPRequest(method, target.split("?")[0], headers, keep_alive)


class ClientProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol for one connection, which also notices at once when the
    client goes away (closes its side, or the connection drops), so that the request it is
    waiting for is aborted within a step, streamed or not."""

    def __init__(self, server: "Server"):
        self.server = server
        self.gone = False
        self.waiting: ServedRequest | Watcher | None = None  # woken if the client goes
        super().__init__(asyncio.StreamReader(limit=MAX_HEADER_BYTES), self._connected)

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        return self.server.handle(self, reader, writer)

    def eof_received(self):
        self.went_away()
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self.went_away()
        super().connection_lost(exc)

    def went_away(self) -> None:
        self.gone = True
        if self.waiting is not None:
            self.waiting.wake.set()


@dataclass(eq=False)  # compared and hashed by identity: the loop keeps a set of them
class ServedRequest:
    """One HTTP request as the loop sees it: its engine requests (one a prompt, each with its
    n samples), the outputs the engine thread delivered that are not yet written, and the
    event that wakes the coroutine answering."""
    ids: list[str]                        # its engine requests' ids
    outputs: list[RequestOutput] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dead: EngineDeadError | None = None   # the engine died under it


@dataclass(eq=False)
class Watcher:
    """A page watching the engine (/watch/events): its stream, and the event that wakes the
    coroutine holding it when the client goes."""
    exchange: "Exchange"
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Exchange:
    """One request on its connection and its answer: a whole response, or server-sent events
    in chunked encoding (so that the connection serves another request after the stream)."""

    def __init__(self, request: HTTPRequest, writer: asyncio.StreamWriter,
                 client: ClientProtocol, headers: dict[str, str]):
        self.request = request
        self.writer = writer
        self.client = client
        self.headers = headers   # every response carries them (CORS)
        self.status = None       # the status answered, once answered

    def send(self, status: int, obj, content_type="application/json") -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        self._write_head(status, {"Content-Type": content_type, "Content-Length": len(data)})
        self.writer.write(data)

    def send_error(self, error: "HTTPError") -> None:
        self.send(error.status, error_body(error))

    def start_stream(self) -> None:
        self._write_head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                               "Transfer-Encoding": "chunked"})

    def event(self, obj) -> None:
        """One server-sent event, as one chunk: a JSON object, or "[DONE]"."""
        text = obj if isinstance(obj, str) else json.dumps(obj)
        data = b"data: %s\n\n" % text.encode()
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")

    def unsent_bytes(self) -> int:
        return self.writer.transport.get_write_buffer_size()

    def _write_head(self, status: int, headers: dict) -> None:
        self.status = status
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
        for name, value in (headers | self.headers).items():
            lines.append(f"{name}: {value}")
        if not self.request.keep_alive:
            lines.append("Connection: close")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))


class Server:
    """OpenAI's API on one asyncio event loop: every connection is a coroutine on it; the
    engine runs on its EngineThread, which hands each step's outputs to the loop in one call
    (deliver). Requests and aborts go the other way, through the thread's inbox. run() serves
    until shutdown() (SIGTERM, SIGINT) or until the engine dies."""
    ROUTES = {"/health": ("GET", "health"), "/version": ("GET", "version"),
              "/v1/models": ("GET", "models"), "/metrics": ("GET", "metrics"),
              "/tokenize": ("POST", "tokenize"), "/detokenize": ("POST", "detokenize"),
              "/v1/completions": ("POST", "completions"),
              "/v1/chat/completions": ("POST", "chat_completions"),
              "/": ("GET", "watch_page"), "/watch/events": ("GET", "watch_events"),
              "/v1/load_lora_adapter": ("POST", "load_lora_adapter"),
              "/v1/unload_lora_adapter": ("POST", "unload_lora_adapter")}
    NEEDS_KEY = ("/v1/", "/tokenize", "/detokenize")  # paths (prefixes) the API key guards

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = (config.served_model_name or engine.config.model
                           or engine.config.preset or "shakespeare")
        self.created = int(time.time())
        self.started = threading.Event()  # set once listening; self.url is then the address
        self.url = None
        self.requests: dict[str, ServedRequest] = {}  # request id -> its HTTP request
        self.in_flight: set[ServedRequest] = set()     # HTTP requests not yet answered
        self.times: dict[str, RequestTimes] = {}      # request id -> its latency so far
        self.histograms = {name: Histogram() for name in (
            "time_to_first_token_seconds", "time_per_output_token_seconds",
            "e2e_request_latency_seconds")}
        self.connections: set[asyncio.StreamWriter] = set()
        self.watchers: set[Watcher] = set()           # pages following /watch/events
        self.request_numbers = itertools.count()
        self.draining = False
        self.dead: EngineDeadError | None = None
        self.lora_requests: dict[str, LoRARequest] = {}  # adapter name -> its request
        self.lora_ids = itertools.count(1)  # never reused: a reloaded name caches apart
        self.lora_request_counts: dict[str, int] = {}  # adapter name -> requests served
        for module in config.lora_modules:
            self.add_lora(module["name"], module["path"])

    def add_lora(self, name: str, path: str) -> None:
        """Serve an adapter under `name` (checked now: ValueError if it cannot be served)."""
        if self.engine.lora_manager is None:
            raise ValueError("lora_modules need LoRA enabled (--enable-lora)")
        if name == self.model_name or name in self.lora_requests:
            raise ValueError(f"lora_name {name!r} is already served")
        request = LoRARequest(name, next(self.lora_ids), path)
        load_lora(request, self.engine.model, self.engine.config.max_lora_rank)
        self.lora_requests[name] = request

    # -- lifetime

    async def run(self) -> None:
        """Listen, serve until shutdown() or the engine's death, drain, stop the engine
        thread. Raises EngineDeadError if the engine died."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.shutdown_asked = loop.create_future()  # its result: seconds to let requests run
        self.idle = asyncio.Event()                 # set whenever nothing is in flight
        self.idle.set()
        self.engine_thread = EngineThread(self.engine, loop, self.deliver, self.engine_died,
                                          self.show)
        listener = await loop.create_server(partial(ClientProtocol, self), self.config.host,
                                            self.config.port, backlog=256)
        host, port = listener.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self.shutdown, self.config.shutdown_timeout)
            loop.add_signal_handler(signal.SIGINT, self.shutdown, 0)
        self.engine_thread.start()
        try:
            print(f"serving {self.model_name} ({self.engine.memory_summary()}) on {self.url}",
                  file=sys.stderr, flush=True)
            print_sampling_defaults(self.engine.sampling_defaults)
            self.started.set()
            timeout = await self.shutdown_asked
            listener.close()  # no new connections
            await self.drain(timeout)
        finally:
            self.engine_thread.stop()
            self.engine_thread.join()
        if self.dead is not None:
            raise self.dead

    def shutdown(self, timeout: float) -> None:
        """From any thread: stop accepting connections, let the requests in flight run for up
        to `timeout` seconds, end the rest with finish_reason "abort"; then run() returns."""
        self.loop.call_soon_threadsafe(self._ask_shutdown, timeout)

    def _ask_shutdown(self, timeout: float) -> None:
        if not self.shutdown_asked.done():
            self.shutdown_asked.set_result(timeout)

    async def drain(self, timeout: float) -> None:
        """Let what is in flight finish for `timeout` seconds (/health: 503 meanwhile), abort
        the rest (each still gets its answer), then close every connection."""
        self.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout)
        for served in self.in_flight:
            self.engine_thread.inbox.put(partial(self.engine_thread.abort, served.ids))
        with contextlib.suppress(asyncio.TimeoutError):  # the next step ends them all
            await asyncio.wait_for(self.idle.wait(), DRAIN_ANSWER_TIMEOUT)
        writers = list(self.connections)
        for writer in writers:
            writer.close()
        # An answer is whole once written; closing sends what a slow reader left in the
        # buffers first, for as long as a client that reads needs (one that does not: cut).
        closing = [asyncio.ensure_future(writer.wait_closed()) for writer in writers]
        if closing:
            await asyncio.wait(closing, timeout=DRAIN_ANSWER_TIMEOUT)
        for writer, closed in zip(writers, closing):
            if not closed.done():  # its client stopped reading: dropped
                writer.transport.abort()

    def engine_died(self, error: EngineDeadError) -> None:
        """On the loop: every open request gets the error now; then the server stops."""
        self.dead = error
        for served in self.in_flight:
            served.dead = error
            served.wake.set()
        self._ask_shutdown(0)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """On the loop, once per step: each output to the coroutine answering its request."""
        now = time.perf_counter()
        for out in outputs:
            self.observe(out, now)
            served = self.requests.get(out.request_id)
            if out.finished:
                self.requests.pop(out.request_id, None)
            if served is None:  # its client went away: aborted, nobody to tell
                continue
            served.outputs.append(out)
            served.wake.set()

    def show(self, frame: dict) -> None:
        """On the loop, after each step while a page watches: the step's frame to every
        watching page, encoded once. A page that has left more than --max-write-buffer bytes
        unread misses frames until it catches up: it never holds the engine or anyone else."""
        text = json.dumps(frame, separators=(",", ":"))
        for watcher in self.watchers:
            exchange = watcher.exchange
            if exchange.client.gone or exchange.unsent_bytes() > self.config.max_write_buffer:
                continue
            exchange.event(text)

    # -- a connection

    async def handle(self, client: ClientProtocol, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        """Serve one connection: its requests one after another (keep-alive), until the
        client closes or asks to, breaks the protocol, is too slow, or the server stops."""
        self.connections.add(writer)
        try:
            keep_alive = True
            while keep_alive and not client.gone:
                keep_alive = await self.serve_one(client, reader, writer)
        except ConnectionError:
            pass  # the client went away mid-answer
        finally:
            self.connections.discard(writer)
            writer.close()

    async def serve_one(self, client: ClientProtocol, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> bool:
        """Read one request and answer it; whether the connection may serve another."""
        try:
            first_byte = await asyncio.wait_for(reader.read(1), self.config.timeout_keep_alive)
        except asyncio.TimeoutError:
            return False  # idle for too long: closed without a word, as uvicorn does
        if not first_byte:
            return False  # the client closed the connection
        try:
            request = await self.read_request(first_byte, reader, writer)
        except HTTPError as e:  # malformed, too big or too slow: answered, then closed
            unreadable = HTTPRequest("", "", {}, keep_alive=False)
            Exchange(unreadable, writer, client, {}).send_error(e)
            return False
        if request is None:
            return False
        if self.draining:  # the answer says the connection closes, so no client reuses it
            request.keep_alive = False
        exchange = Exchange(request, writer, client, self.cors_headers(request))
        await self.answer(exchange)
        client.waiting = None  # answered, or abandoned early: nothing of it to wake any more
        if self.config.log_requests:
            print(f'"{request.method} {request.path}" {exchange.status}', file=sys.stderr)
        return request.keep_alive and not client.gone and not writer.is_closing()

    async def read_request(self, first_byte: bytes, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> HTTPRequest | None:
        """The rest of a request whose first byte came, within --request-timeout (else
        HTTPError 408): a slow client holds a coroutine, never a thread, and not for long."""
        try:
            return await asyncio.wait_for(self._read_rest(first_byte, reader, writer),
                                          self.config.request_timeout)
        except asyncio.TimeoutError:
            raise HTTPError(408, "the request did not arrive within "
                            f"{self.config.request_timeout} s") from None

    async def _read_rest(self, first_byte: bytes, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> HTTPRequest | None:
        """The rest of a request whose first byte came: headers, then a Content-Length body.
        None if the client closed mid-headers; HTTPError for what is not served."""
        try:
            head = first_byte + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise HTTPError(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes") \
                from None
        except asyncio.IncompleteReadError:
            return None
        request = parse_head(head)
        headers = request.headers
        if "transfer-encoding" in headers and "content-length" in headers:
            raise HTTPError(400, "Content-Length and Transfer-Encoding together are ambiguous")
        if "transfer-encoding" in headers:
            raise HTTPError(411, "send the body with a Content-Length (Transfer-Encoding is "
                            "not read)")
        length_text = headers.get("content-length", "0")
        if not (length_text.isascii() and length_text.isdigit()):
            raise HTTPError(400, f"Content-Length must be a number, got {length_text!r}")
        length = int(length_text)
        expects_continue = headers.get("expect", "").lower() == "100-continue"
        if length > MAX_BODY_BYTES:
            if not expects_continue:  # read (up to 16x) first: unread, closing resets the socket
                await discard(reader, min(length, 16 * MAX_BODY_BYTES))
            raise HTTPError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        if expects_continue and length:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            request.body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise HTTPError(400, f"the body ended after {len(e.partial)} of its {length} "
                            "bytes") from None
        return request

    def cors_headers(self, request: HTTPRequest) -> dict[str, str]:
        """CORS: an allowed Origin is echoed back; none is allowed by default."""
        origin = request.headers.get("origin")
        allowed = self.config.allowed_origins
        if origin is None or not (origin in allowed or "*" in allowed):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    async def answer(self, exchange: Exchange) -> None:
        """Route a request to its method and answer; an error is answered as OpenAI does (a
        500 for a bug here, logged), and the server goes on."""
        request = exchange.request
        try:
            if request.method == "OPTIONS" and exchange.headers \
                    and "access-control-request-method" in request.headers:
                exchange.headers |= CORS_PREFLIGHT  # a browser asking first: no key needed
                exchange.send(204, "", "text/plain")
                return
            self.check_api_key(request)
            if request.path not in self.ROUTES:
                raise HTTPError(404, f"no such path: {request.path}")
            method, name = self.ROUTES[request.path]
            if request.method != method:
                raise HTTPError(405, f"{request.path} takes {method}, not {request.method}")
            await getattr(self, name)(exchange)
        except HTTPError as e:
            exchange.send_error(e)
        except ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 (the request fails; the server goes on)
            error = HTTPError(500, f"{type(e).__name__}: {e}")
            print(f"error: {request.method} {request.path}: {error}", file=sys.stderr)
            if exchange.status is None:  # nothing sent yet
                exchange.send_error(error)

    def check_api_key(self, request: HTTPRequest) -> None:
        """With --api-key: HTTPError 401 unless the request carries it (only the paths in
        NEEDS_KEY; /health and /metrics stay open to probes and scrapers)."""
        key = self.config.api_key
        if key is None or not request.path.startswith(self.NEEDS_KEY):
            return
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return
        raise HTTPError(401, "invalid or missing API key: send the header 'Authorization: "
                        "Bearer <key>'")

    # -- the endpoints

    async def health(self, exchange: Exchange) -> None:
        if self.draining:
            exchange.send(503, {"status": "shutting down"})
            return
        exchange.send(200, {"status": "ok"})

    async def version(self, exchange: Exchange) -> None:
        exchange.send(200, {"version": __version__})

    async def models(self, exchange: Exchange) -> None:
        """The base model, then each adapter, its parent the base model (as vLLM lists them)."""
        data = [dict(id=self.model_name, object="model", created=self.created,
                     owned_by="nanoserve", max_model_len=self.engine.max_model_len)]
        data += [dict(id=name, object="model", created=self.created, owned_by="nanoserve",
                      root=request.lora_path, parent=self.model_name,
                      max_model_len=self.engine.max_model_len)
                 for name, request in self.lora_requests.items()]
        exchange.send(200, dict(object="list", data=data))

    async def load_lora_adapter(self, exchange: Exchange) -> None:
        """vLLM's: serve another adapter, {"lora_name", "lora_path"}, read and checked now."""
        self.check_runtime_lora_updating()
        body = json_body(exchange.request)
        name = typed(body, "lora_name", None, str)
        path = typed(body, "lora_path", None, str)
        if not name or not path:
            raise HTTPError(400, "give lora_name and lora_path", "lora_name")
        try:
            await asyncio.to_thread(self.add_lora, name, path)
        except ValueError as e:
            raise HTTPError(400, str(e), "lora_path") from None
        exchange.send(200, f"Success: LoRA adapter '{name}' added successfully.", "text/plain")

    async def unload_lora_adapter(self, exchange: Exchange) -> None:
        """vLLM's: stop serving an adapter, {"lora_name"}; its requests in flight finish."""
        self.check_runtime_lora_updating()
        name = typed(json_body(exchange.request), "lora_name", None, str)
        if name not in self.lora_requests:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.lora_requests[name]
        exchange.send(200, f"Success: LoRA adapter '{name}' removed successfully.",
                      "text/plain")

    def check_runtime_lora_updating(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise HTTPError(404, "runtime LoRA updating is off: start the server with "
                            "--allow-runtime-lora-updating or "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")

    def served_model(self, body: dict) -> tuple[str, LoRARequest | None]:
        """The request's `model`: the base model's name (or none given), or an adapter's;
        HTTPError 404 for any other."""
        name = body.get("model")
        if isinstance(name, str) and name in self.lora_requests:
            return name, self.lora_requests[name]
        check_model(body, self.model_name)
        return self.model_name, None

    async def metrics(self, exchange: Exchange) -> None:
        lines = await self.engine_thread.call(self.engine_thread.gauges)
        if self.lora_request_counts:
            lines.append("# TYPE nanoserve:lora_requests_total counter")
        for name, count in self.lora_request_counts.items():
            lines.append(f'nanoserve:lora_requests_total{{lora_name="{name}"}} {count}')
        for name, histogram in self.histograms.items():
            lines += histogram.lines("nanoserve:" + name)
        exchange.send(200, "\n".join(lines) + "\n", "text/plain; version=0.0.4")

    async def watch_page(self, exchange: Exchange) -> None:
        """The page that watches the engine (watch.html), live: it follows /watch/events."""
        exchange.send(200, watch.page(), "text/html; charset=utf-8")

    async def watch_events(self, exchange: Exchange) -> None:
        """A watching page's stream, until it goes or the server stops: the engine's state
        now, then a frame after every step (show), each a server-sent event. Only while a page
        watches does the engine thread build frames; with none, the engine pays nothing.
        Open without the API key, as /metrics: a frame holds ids and counts, no text."""
        exchange.start_stream()
        watcher = Watcher(exchange)
        exchange.client.waiting = watcher
        self.watchers.add(watcher)
        self.engine_thread.watched = True
        self.engine_thread.inbox.put(self.engine_thread.send_frame)  # the state now, for it
        try:
            while not exchange.client.gone:
                await watcher.wake.wait()
                watcher.wake.clear()
        finally:
            self.watchers.discard(watcher)
            self.engine_thread.watched = bool(self.watchers)

    async def tokenize(self, exchange: Exchange) -> None:
        """vLLM's /tokenize: a prompt's (or chat's) token ids, as the engine encodes them."""
        body = json_body(exchange.request)
        check_model(body, self.model_name)
        param = "prompt"
        if "messages" in body:
            param = "messages"
            text = chat_prompt(body, self.engine.chat_template)
        else:
            text = typed(body, "prompt", None, str)
        if text is None:
            raise HTTPError(400, "give a prompt (a string) or messages", "prompt")
        tokens = encode_text(self.engine, text, param)
        exchange.send(200, dict(count=len(tokens), max_model_len=self.engine.max_model_len,
                                tokens=tokens))

    async def detokenize(self, exchange: Exchange) -> None:
        """vLLM's /detokenize: token ids back to text."""
        body = json_body(exchange.request)
        check_model(body, self.model_name)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise HTTPError(400, "tokens must be a list of token ids", "tokens")
        try:
            self.engine.parse_prompt(tokens)  # ValueError unless ids of the vocabulary
            text = self.engine.tokenizer.decode(tokens, skip_special_tokens=False)  # as vLLM's
        except ValueError as e:
            raise HTTPError(400, f"tokens: {e}", "tokens") from None
        exchange.send(200, {"prompt": text})

    async def chat_completions(self, exchange: Exchange) -> None:
        await self.completions(exchange, chat=True)

    async def completions(self, exchange: Exchange, chat=False) -> None:
        body = json_body(exchange.request)
        model_name, lora_request = self.served_model(body)
        requests, options = parse_request(body, self.engine, model_name, chat,
                                          self.engine.chat_template, self.engine.sampling_defaults)
        if self.draining:
            raise HTTPError(503, "the server is shutting down")
        served = ServedRequest([str(next(self.request_numbers)) for _ in requests])
        arrival = time.perf_counter()
        for request_id in served.ids:
            self.requests[request_id] = served
            self.times[request_id] = RequestTimes(arrival)
        self.in_flight.add(served)
        self.idle.clear()
        try:
            await self.compile_structured_outputs(requests, options["constraint_field"])
            await self.add(served, requests, chat, options["priority"], lora_request)
            head = dict(id=f"cmpl-{served.ids[0]}", object="text_completion")
            if chat and options["stream"]:
                head = dict(id=f"chatcmpl-{served.ids[0]}", object="chat.completion.chunk")
            elif chat:
                head = dict(id=f"chatcmpl-{served.ids[0]}", object="chat.completion")
            head |= dict(created=int(time.time()), model=model_name)
            await self.respond(exchange, served, head, options)
        except Exception:  # refused (nothing to abort), or a bug here: its blocks are freed
            self.abort(served)
            raise
        finally:
            self.forget(served)

    async def compile_structured_outputs(self, requests: list, field: str | None) -> None:
        """Compile the request's structured output, if any, on a worker thread: neither the
        event loop nor the engine's thread (whose steps would wait) runs it; the engine's
        add_request then finds it in its cache. HTTPError 400 naming the field if it does not
        compile (field: the one compile errors name; None, vLLM's structured_outputs)."""
        # one for all of a request's prompts (none with use_beam_search: BeamSearchParams)
        constraint = getattr(requests[0][1], "structured_outputs", None)
        if constraint is None:
            return
        manager = self.engine.structured_output_manager
        try:
            await asyncio.to_thread(manager.compile, constraint, field)
        except ValueError as e:
            param = (field or "structured_outputs").split(".")[0]
            raise HTTPError(400, str(e), param) from None

    async def add(self, served: ServedRequest, requests: list, chat: bool, priority: int,
                  lora_request: LoRARequest | None = None) -> None:
        """Hand the request's sequences to the engine; HTTPError if it refuses them."""
        try:
            await self.engine_thread.call(self.engine_thread.add, requests, served.ids,
                                          priority, lora_request)
        except ValueError as e:  # the prompt's, unless a token id field's (checked here)
            param = "messages" if chat else "prompt"
            for name in ("stop_token_ids", "logit_bias"):
                if str(e).startswith(name):
                    param = name
            raise HTTPError(400, str(e), param) from None
        except EngineDeadError as e:
            raise HTTPError(500, str(e)) from None
        if lora_request is not None:
            name = lora_request.lora_name
            self.lora_request_counts[name] = self.lora_request_counts.get(name, 0) + 1

    def forget(self, served: ServedRequest) -> None:
        """The request is answered (or its client gone): the loop lets go of it."""
        for request_id in served.ids:
            self.requests.pop(request_id, None)
            self.times.pop(request_id, None)  # a refused one never finishes to drop its own
        self.in_flight.discard(served)
        if not self.in_flight:
            self.idle.set()

    async def respond(self, exchange: Exchange, served: ServedRequest, head: dict,
                      options: dict) -> None:
        """Whole, or streamed as server-sent events (a chunk per delta, the usage if asked,
        then [DONE]). A client that goes away, or stops reading, aborts its sequences."""
        stream = options["stream"]
        ids = served.ids
        n = options["n"]
        first_choice = {request_id: n * k for k, request_id in enumerate(ids)}  # its 1st index
        whole = {}     # request id -> its whole output so far
        num_sent = {}  # (request id, sample) -> the characters of its choice streamed so far
        tokenizer = self.engine.tokenizer
        if stream:
            exchange.start_stream()
        exchange.client.waiting = served
        while not all(i in whole and whole[i].finished for i in ids):
            await served.wake.wait()
            served.wake.clear()
            if exchange.client.gone:
                self.abort(served)
                return
            if served.dead is not None:
                self.fail(exchange, served, str(served.dead))
                return
            outputs = served.outputs
            served.outputs = []
            for out in outputs:
                failure = self.failure(out)
                if failure is not None:
                    self.fail(exchange, served, failure)
                    return
                accumulate(whole, out)
                if stream:
                    self.stream_delta(exchange, head, out, options, first_choice[out.request_id],
                                      num_sent, whole[out.request_id])
            if exchange.unsent_bytes() > self.config.max_write_buffer:
                self.drop(exchange, served)
                return
        usage = usage_of(ids, whole)
        if not stream:
            choices = [choice(tokenizer, first_choice[i] + c.index, whole[i], c, options, True)
                       for i in ids for c in whole[i].outputs]
            exchange.send(200, head | dict(choices=choices, usage=usage))
            return
        if options["include_usage"]:
            exchange.event(head | dict(choices=[], usage=usage))
        exchange.event("[DONE]")
        exchange.end_stream()

    def stream_delta(self, exchange: Exchange, head: dict, out: RequestOutput, options: dict,
                     first_choice: int, num_sent: dict, so_far: RequestOutput) -> None:
        """A chunk for each sample in a delta; num_sent[(request id, sample)]: the characters
        of that choice streamed so far (its logprobs' text offsets go on from there). With
        continuous_usage_stats each chunk carries its choice's usage so far (so_far: the
        request's whole output, this delta included), as vLLM counts it: its prompt, the
        tokens that choice has streamed."""
        for completion in out.outputs:
            key = (out.request_id, completion.index)
            offset = num_sent.get(key, 0)
            chunk = choice(self.engine.tokenizer, first_choice + completion.index, out,
                           completion, options, key not in num_sent, offset)
            num_sent[key] = offset + len(chunk.get("text", ""))
            event = head | dict(choices=[chunk])
            if options["continuous_usage"]:
                event["usage"] = choice_usage(so_far, completion.index)
            exchange.event(event)

    @staticmethod
    def failure(out: RequestOutput) -> str | None:
        """Why the engine failed one of this output's samples (its error), or None. A sample
        that a shutdown aborted is an answer (finish_reason "abort"), not a failure."""
        for completion in out.outputs:
            if completion.finish_reason == "error":
                return completion.error
        return None

    def fail(self, exchange: Exchange, served: ServedRequest, message: str) -> None:
        """The engine failed the request: a 500, or, once streaming, an error event then
        [DONE] (as vLLM does); the rest of it is aborted."""
        self.abort(served)
        error = HTTPError(500, message)
        if exchange.status is None:
            exchange.send_error(error)
            return
        exchange.event(error_body(error))
        exchange.event("[DONE]")
        exchange.end_stream()

    def drop(self, exchange: Exchange, served: ServedRequest) -> None:
        """A client that stopped reading: close its connection, abort its request."""
        print(f"dropped a client that stopped reading ({exchange.unsent_bytes()} bytes unsent "
              f"past --max-write-buffer {self.config.max_write_buffer}); its request is "
              "aborted", file=sys.stderr)
        exchange.writer.transport.abort()
        self.abort(served)

    def abort(self, served: ServedRequest) -> None:
        """Abort the HTTP request's engine requests (the engine thread takes the abort between
        two steps and frees their blocks then) and let go of it: nothing more is written."""
        self.engine_thread.inbox.put(partial(self.engine_thread.abort, served.ids))
        self.forget(served)

    def observe(self, out: RequestOutput, now: float) -> None:
        """Per request: time to first token, time per output token after it, end to end."""
        times = self.times.get(out.request_id)
        if times is None:
            return
        num_new_tokens = sum(len(completion.token_ids) for completion in out.outputs)
        if times.first_token is None and num_new_tokens:
            times.first_token = now
            self.histograms["time_to_first_token_seconds"].observe(now - times.arrival)
        times.num_tokens += num_new_tokens
        if not out.finished:
            return
        del self.times[out.request_id]
        if any(completion.finish_reason in ("abort", "error") for completion in out.outputs):
            return
        self.histograms["e2e_request_latency_seconds"].observe(now - times.arrival)
        if times.num_tokens > 1:
            time_per_token = (now - times.first_token) / (times.num_tokens - 1)
            self.histograms["time_per_output_token_seconds"].observe(time_per_token)


async def discard(reader: asyncio.StreamReader, num_bytes: int) -> None:
    """Read and drop up to num_bytes (fewer if the client stops sending)."""
    while num_bytes > 0:
        chunk = await reader.read(min(num_bytes, 65536))
        if not chunk:
            return
        num_bytes -= len(chunk)


def json_body(request: HTTPRequest) -> dict:
    """The request's body as a JSON object; HTTPError 400 if it is not one."""
    if not request.body:
        raise HTTPError(400, "the request needs a JSON body and its Content-Length")
    try:
        body = json.loads(request.body)
    except ValueError as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # json's parser recurses once a nesting level
        raise HTTPError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return body


def serve(engine: Engine, config: ServerConfig) -> None:
    """--serve: OpenAI's API until SIGTERM (requests in flight get config.shutdown_timeout
    seconds) or SIGINT (at once), or until the engine dies (EngineDeadError, raised after
    every open request got a 500)."""
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"warning: bound to {config.host}: anyone who can reach this machine can use "
              "the server (give it an --api-key)", file=sys.stderr)
    asyncio.run(Server(engine, config).run())
    print("server stopped", file=sys.stderr)

"""The disaggregated serving proxy: each OpenAI request goes to a prefill instance, then to a
decode instance, whose answer streams back (vLLM's toy proxy server, in small).

    python nanoserve.py --serve --port 8100 --kv-transfer-config \\
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    python nanoserve.py --serve --port 8200 --kv-transfer-config '{... "kv_consumer" ...}'
    python nanoserve.py --disagg-proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

One request's timeline: the proxy sends it to a prefill instance with max_tokens 1 (and n 1,
not streamed); that instance computes the prompt, saves its full blocks' K/V (kv_connector.py)
and answers one token, which the proxy drops. The proxy then sends the request as it came to
a decode instance, which finds those blocks, loads them, computes only the prompt's last
partial block and decodes every token, never stalled by another request's prefill. Several
instances of each kind are taken in turn (round-robin). A prefill instance that fails or
cannot be reached costs only time: the decode instance then computes the prompt itself.

Other paths (GET /v1/models, /health, /metrics...) go to a decode instance. Standard library
only (http.server, http.client): a thread a connection, which a proxy that only waits can
afford. Left out: routing by load or by cache contents, retries, KV-aware scheduling.
"""
import http.client
import itertools
import json
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Content-Type", "Authorization")
UPSTREAM_TIMEOUT = 600.0  # seconds an instance may take to answer (a long prompt's prefill)
CHUNK_BYTES = 1 << 16     # read from the decode instance and relayed at most this much a time
# a prefill request's fields that would make it do more than compute the prompt, or be
# refused with max_tokens 1
DROPPED_FIELDS = ("stream", "stream_options", "n", "min_tokens", "max_completion_tokens",
                  "best_of")


@dataclass
class ProxyConfig:
    """Where the instances are (base URLs, http://host:port) and where the proxy listens."""
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_addresses: list[tuple[str, int]] = field(init=False)
    decode_addresses: list[tuple[str, int]] = field(init=False)

    def __post_init__(self):
        for kind in ("prefill", "decode"):
            urls = getattr(self, kind)
            if not urls:
                raise ValueError(f"--disagg-proxy needs at least one --{kind} URL")
            setattr(self, f"{kind}_addresses", [parse_url(kind, url) for url in urls])
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")


def parse_url(kind: str, url: str) -> tuple[str, int]:
    """http://host:port (a path or a trailing slash ignored) -> (host, port)."""
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"--{kind} {url!r}: give an instance's base URL, http://host:port")
    try:
        port = parsed.port or 80
    except ValueError:
        raise ValueError(f"--{kind} {url!r}: its port is not a number in [0, 65535]") from None
    return parsed.hostname, port


def prefill_body(body: dict) -> dict:
    """The request a prefill instance gets: the same prompt and sampling, one token, one
    sample, not streamed (its answer is dropped; only its saved K/V matter)."""
    prefill = {name: value for name, value in body.items() if name not in DROPPED_FIELDS}
    prefill["max_tokens"] = 1
    return prefill


class DisaggProxy(ThreadingHTTPServer):
    """The proxy's HTTP server: its instances, taken in turn, and what it counted."""
    daemon_threads = True

    def __init__(self, config: ProxyConfig):
        super().__init__((config.host, config.port), ProxyHandler)
        self.config = config
        self._prefill = itertools.cycle(config.prefill_addresses)
        self._decode = itertools.cycle(config.decode_addresses)
        self._lock = threading.Lock()  # the cycles, from the connections' threads
        self.num_requests = 0
        self.num_prefill_failures = 0  # the prefill instance failed: the decode one computed

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def next_instances(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """The next (prefill, decode) pair, round-robin, each kind on its own."""
        with self._lock:
            self.num_requests += 1
            return next(self._prefill), next(self._decode)

    def count_prefill_failure(self) -> None:
        with self._lock:
            self.num_prefill_failures += 1


class ProxyHandler(BaseHTTPRequestHandler):
    """One client connection: HTTP/1.0, closed after each answer (a streamed one ends when
    the connection does)."""
    server: DisaggProxy

    def log_message(self, format, *args) -> None:  # quiet, as the server is by default
        return

    def do_GET(self) -> None:
        _, decode = self.server.next_instances()
        self._relay(decode, "GET", None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        prefill, decode = self.server.next_instances()
        if self.path in COMPLETION_PATHS:
            self._prefill(prefill, raw)
        self._relay(decode, "POST", raw)

    def _headers(self) -> dict:
        return {name: self.headers[name] for name in FORWARDED_HEADERS if name in self.headers}

    def _prefill(self, address: tuple[str, int], raw: bytes) -> None:
        """Have the prefill instance compute (and save) the prompt; its answer is dropped. A
        body that is not a JSON object goes to the decode instance alone, to be refused there."""
        try:
            body = json.loads(raw)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        conn = http.client.HTTPConnection(*address, timeout=UPSTREAM_TIMEOUT)
        try:
            conn.request("POST", self.path, json.dumps(prefill_body(body)), self._headers())
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                self.server.count_prefill_failure()
        except OSError:  # unreachable or gone: the decode instance computes the prompt
            self.server.count_prefill_failure()
        finally:
            conn.close()

    def _relay(self, address: tuple[str, int], method: str, raw: bytes | None) -> None:
        """Send the request as it came to the decode instance and stream its answer back as
        it arrives (server-sent events, token by token)."""
        conn = http.client.HTTPConnection(*address, timeout=UPSTREAM_TIMEOUT)
        try:
            try:
                conn.request(method, self.path, raw, self._headers())
                response = conn.getresponse()
            except OSError as e:
                self._send_error(502, f"the decode instance {address[0]}:{address[1]} failed: "
                                 f"{e}")
                return
            self.send_response(response.status)
            self.send_header("Content-Type", response.getheader("Content-Type", "text/plain"))
            self.send_header("Connection", "close")
            self.end_headers()
            while chunk := response.read1(CHUNK_BYTES):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: closing the decode connection aborts its request
        finally:
            conn.close()

    def _send_error(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "BadGateway",
                                     "code": status}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_proxy(config: ProxyConfig) -> None:
    """--disagg-proxy: serve until interrupted, saying where on stderr first."""
    proxy = DisaggProxy(config)
    print(f"serving the disaggregated proxy on {proxy.url} (prefill: "
          f"{', '.join(config.prefill)}; decode: {', '.join(config.decode)})", file=sys.stderr,
          flush=True)
    try:
        proxy.serve_forever()
    finally:
        proxy.server_close()

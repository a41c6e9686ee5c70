"""Helpers and fixtures the test files share: the tiny engine, runs to the end, leak checks,
the HTTP test server. Tests import the plain helpers from here (from conftest import ...).
"""
import asyncio
import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import threading
from http.client import HTTPConnection

import pytest

# The tests' models are tiny: a second thread a process costs more than it saves, and the
# server's and command line's subprocesses run beside the suite's (two threads a process ran
# the suite in 15 minutes on two cores). Subprocesses inherit it; a test may still ask for more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402 (after OMP_NUM_THREADS)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import cli
import cuda_runtime
from nanoserve import LLM, Engine
from paged_cache import BlockTable
from sampling import SamplingParams
from scheduler import Sequence, SequenceStatus
from server import Server, ServerConfig
from tokenizer import EOT, gpt2_byte_chars

HERE = os.path.dirname(os.path.abspath(__file__))


# Prompt lengths 1..150 bytes: single-token, shorter than a block, several blocks, longer
# than the token budgets used below (so chunked prefill really chunks).
PROMPTS = ["A", "Hello there", "The quick brown fox jumps over the lazy dog. " * 3 + "And",
           "x" * 37, "0123456789" * 6, "ROMEO: " * 5]


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def tiny(**kwargs) -> LLM:
    """The tiny preset (random weights) on CPU in fp32, with a small KV cache unless set."""
    return LLM(**{"preset": "tiny", "kv_cache_tokens": 4096, "device": "cpu",
                  "dtype": "float32"} | kwargs)


class FakeCuda:
    """conftest's stand-in for the CUDA runtime (cuda_runtime.py), on a CPU: every device is
    "CUDA" to the engine, its tensors the CPU's. The GPU has `total` bytes, `used` of them in
    use; a profiled run() runs and peaks at `peak` bytes; a graph's capture runs its function
    once (the warm-up) and its replay runs it again, eagerly: the padded path. Pinned memory
    is plain memory, torch.compile's function is the function, and `calls` records each call
    by name (its arguments), so a test sees what the CUDA path asked of the runtime."""
    NUM_SMS = 24  # not the CPU's kernels.CPU_NUM_SMS: a test sees which it was given
    CAPABILITY = (9, 0)  # a Hopper: FP8 tensor cores (a test may set an older one)

    def __init__(self, total: int, used: int, peak: int):
        self.total, self.used, self.peak = total, used, peak
        self.calls: list[tuple] = []  # (name, *args), in order

    def record(self, name: str, *args) -> None:
        self.calls.append((name, *args))

    def calls_to(self, name: str) -> list[tuple]:
        """The arguments of each call to `name`, in order."""
        return [call[1:] for call in self.calls if call[0] == name]

    def is_cuda(self, device) -> bool:
        return True

    def pinned(self, host: torch.Tensor) -> torch.Tensor:
        self.record("pinned", tuple(host.shape))
        return host

    def pinned_empty(self, shape: tuple, *, dtype: torch.dtype) -> torch.Tensor:
        self.record("pinned_empty", shape)
        return torch.empty(shape, dtype=dtype)

    def synchronize(self, device) -> None:
        self.record("synchronize", device)

    def num_sms(self, device) -> int:
        return self.NUM_SMS

    def compile_fused(self, fn):
        self.record("compile_fused", fn.__name__)
        return fn

    def profile_memory(self, device, run) -> tuple[int, int, int]:
        run()
        self.record("profile_memory", device)
        return self.total - self.used, self.total, self.peak

    def capture_graph(self, run, pool) -> tuple:
        run()
        self.record("capture_graph", pool)
        return run, pool or "the first graph's pool"

    def device_capability(self, device) -> tuple[int, int]:
        return self.CAPABILITY

    def scaled_mm(self, a, b, scale_a, scale_b, bias, out_dtype) -> torch.Tensor:
        """torch._scaled_mm's result from its definition: fp8 operands upcast (exact), scaled,
        multiplied in fp32."""
        self.record("scaled_mm", tuple(a.shape), tuple(b.shape))
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride(0) == 1, "b column-major"
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        y = (a.float() * scale_a) @ (b.float() * scale_b)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)


FAKE_GPU = dict(total=64 * 2**20, used=16 * 2**20, peak=4 * 2**20)  # a 64 MiB "GPU"


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    """Every function of cuda_runtime replaced by a FakeCuda's (FAKE_GPU) for the test: one
    added there without a stand-in here fails every test that uses this."""
    fake = FakeCuda(**FAKE_GPU)
    for name, _ in inspect.getmembers(cuda_runtime, inspect.isfunction):
        monkeypatch.setattr(cuda_runtime, name, getattr(fake, name))
    return fake


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaks(engine: Engine) -> None:
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not any(engine.block_pool.ref_counts)
    assert engine.swap_blocks_used == 0  # the swap pool's blocks too, when there is one
    assert not engine.has_unfinished() and not engine.seqs and not engine.requests
    assert not engine.model_runner.input_batch.rows  # every row back, for the next sequences
    assert len(engine.model_runner.input_batch.free_rows) == engine.config.max_num_seqs


def run_to_end(engine: Engine, deltas: dict | None = None, steps: int | None = None) -> dict:
    """Step until nothing is left (or `steps` times); every request's delta outputs, in order,
    added to `deltas`."""
    deltas = {} if deltas is None else deltas
    for _ in range(steps) if steps is not None else iter(engine.has_unfinished, False):
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "allows_fallback: the test makes a batch fail on "
                            "purpose, so the engine may run its sequences one at a time")


@pytest.fixture(autouse=True)
def no_unexpected_fallback(request, monkeypatch):
    """Fail a test whose engines re-ran a failed batch one sequence at a time, unless it is
    marked allows_fallback: the fallback keeps the outputs right, so a step that raises would
    otherwise pass unseen. (The shared server's own process is checked by its fixture.)"""
    errors = []
    run_one_at_a_time = Engine._run_one_at_a_time

    def counted(engine, *args):
        errors.append(repr(sys.exc_info()[1]))  # execute calls it while handling the error
        return run_one_at_a_time(engine, *args)
    monkeypatch.setattr(Engine, "_run_one_at_a_time", counted)
    yield errors
    if errors and request.node.get_closest_marker("allows_fallback") is None:
        pytest.fail(f"{len(errors)} batches failed and ran one sequence at a time; the first "
                    f"raised {errors[0]}", pytrace=False)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Greedy outputs of each prompt served on its own: the reference for batching tests."""
    return [token_ids(tiny().generate([p], GREEDY))[0] for p in PROMPTS]


# ----------------------------------------------------------------------------- exactness

def running_seq(scheduler, block_pool, seq_id, prompt_len, computed, max_tokens=10) -> Sequence:
    """A sequence put straight into scheduler's running list, with `computed` of its prompt's
    tokens in blocks of its own (the scheduler and swap tests' starting point)."""
    seq = Sequence(seq_id, "", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                   BlockTable(block_pool))
    assert seq.block_table.ensure(computed)
    seq.num_computed_tokens = computed
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def new_seq(engine: Engine, tokens: list[int], seq_id: str = "s") -> Sequence:
    return Sequence(seq_id, "", tokens, GREEDY, BlockTable(engine.block_pool))


def assert_paged_equals_dense_at_every_position(engine: Engine, tokens: torch.Tensor) -> None:
    """One execute_model over the prefixes of tokens (T,), one sequence each: row i of its logits
    is position i's of a dense forward over tokens."""
    dense = engine.model.forward_dense(tokens[None])[0]
    seqs = [new_seq(engine, tokens[:i + 1].tolist(), str(i)) for i in range(len(tokens))]
    for seq in seqs:
        assert seq.block_table.ensure(len(seq.token_ids))
    paged = engine.model_runner.execute_model({seq: len(seq.token_ids) for seq in seqs}).logits
    assert (paged - dense).abs().max() / dense.abs().max() < 1e-4


# ----------------------------------------------------------------------------- Triton kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter


# ----------------------------------------------------------------------------- streaming

class CountSyncs(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: reading tensor values (item, bool,
    tolist, numpy) and ops whose output size depends on values (nonzero, boolean indexing)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name.startswith("index") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []))
        reads_a_value = name in ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select")
        if reads_a_value or bool_index:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- penalties and stops

NEAR_TIE = 1e-3  # top-two logits this close: two float32 implementations may pick either


# ----------------------------------------------------------------------------- n samples

def progress_frames(err: str) -> list[str]:
    """What each redraw of the progress line wrote (each starts with "\\r")."""
    assert err.startswith("\r") and "\n" not in err, f"not one line redrawn in place: {err!r}"
    return err.split("\r")[1:]


# ----------------------------------------------------------------------------- prefix caching

def shared(seq) -> bool:
    """Whether seq holds a block that another sequence holds too."""
    return any(seq.block_table.block_pool.ref_counts[b] > 1 for b in seq.block_table.block_ids)


# ----------------------------------------------------------------------------- chat, defaults

# ChatML's shape, written with indented block tags (trim_blocks and lstrip_blocks remove them),
# {% continue %}, raise_exception, bos_token, strftime_now and a chat_template_kwargs switch
CHAT_TEMPLATE = """{{ bos_token }}{{ strftime_now("%Y") }}
{% for message in messages %}
    {% if message.role not in ["system", "user", "assistant"] %}
        {{ raise_exception("no role " ~ message.role ~ " in this template") }}
    {% endif %}
    {% if message.content == "" %}
        {% continue %}
    {% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
    {% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

    {% endif %}
{% endif %}"""


def chat_checkpoint(path, template: str | None = CHAT_TEMPLATE,
                    generation_config: dict | None = None, **tokenizer_config) -> str:
    """The shipped checkpoint copied into `path`, with a tokenizer_config.json (GPT-2's special
    tokens, `template` as its chat_template unless None, then tokenizer_config) and, if given,
    a generation_config.json: the directory."""
    shutil.copytree(os.path.join(HERE, "checkpoints", "shakespeare"), path, dirs_exist_ok=True)
    config = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>") | tokenizer_config
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


def checkpoint_llm(path: str, **kwargs) -> LLM:
    """An LLM serving the checkpoint directory path, on CPU in fp32 unless kwargs say."""
    return LLM(model=str(path), **{"device": "cpu", "dtype": "float32"} | kwargs)


# ----------------------------------------------------------------------------- architectures

# Tiny random Llama, Qwen2, Qwen3 and Mistral checkpoints in Hugging Face's layout, with
# transformers' logits for them (in fp64): .ci/fixtures/make_model_fixtures.py made them, so
# the tests need no transformers. Grouped heads in each; tied and untied heads; llama3-tied
# has Llama 3's rope_scaling, qwen2 q/k/v biases, qwen3 q/k norms and its own head_dim.
MODEL_FIXTURES = os.path.join(HERE, ".ci", "fixtures", "models")


def fixture_llm(name: str, path, **kwargs) -> LLM:
    """An LLM serving a fixture model (copied to path, with the byte-level tokenizer's files:
    the fixtures' 257 ids are its ids), on CPU in fp32."""
    shutil.copytree(os.path.join(MODEL_FIXTURES, name), path, dirs_exist_ok=True)
    write_byte_tokenizer(path)
    return checkpoint_llm(path, **{"kv_cache_tokens": 1024} | kwargs)


# ----------------------------------------------------------------------------- checkpoints as published

def write_byte_tokenizer(path) -> None:
    """The byte-level tokenizer's files in directory path (ids 0-255 the bytes, 256
    <|endoftext|>), as Hugging Face's vocab.json and merges.txt."""
    vocab = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: 256}
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")  # bytes only: no merges


# ----------------------------------------------------------------------------- command line

def nanoserve_main(capsys, *args) -> tuple[int, str, str]:
    """cli.main in this process (a subprocess costs 1.5 s of imports): exit status,
    stdout, stderr. Threads are put back: the command line sets them."""
    threads = torch.get_num_threads()
    try:
        cli.main(list(args))
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return status, out.out, out.err


# ----------------------------------------------------------------------------- HTTP server

class ServerLog(threading.Thread):
    """A server's stderr after its serving line, read line by line as it comes (so that the
    server never blocks on a full pipe)."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream = stream
        self.lines = []

    def run(self) -> None:
        for line in self.stream:
            self.lines.append(line)

    def whole(self) -> str:
        """All of it: call once the server has exited."""
        self.join(timeout=30)
        return "".join(self.lines)


def start_server(*args, env=None) -> tuple[subprocess.Popen, str]:
    """A server process and its URL; proc.log is its stderr after the serving line."""
    proc = subprocess.Popen([sys.executable, "nanoserve.py", "--serve", "--port", "0",
                             "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                             "--threads", "1", *args], cwd=HERE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # "serving tiny on http://127.0.0.1:PORT"
    assert line.startswith("serving ") and " on http://" in line, line + proc.stderr.read()
    proc.log = ServerLog(proc.stderr)
    proc.log.start()
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def server():
    """A server in a process of its own, shared by a module's tests: its batches must never
    have fallen back (no_unexpected_fallback cannot see into that process)."""
    proc, url = start_server()
    yield url
    metrics = http(url, "/metrics")[1]
    stop(proc)
    assert "nanoserve:num_fallbacks_total 0\n" in metrics


def http(url: str, path: str, body=None, method=None, raw: bytes | None = None,
         headers: dict | None = None):
    """(status, parsed JSON or text) of one request, on a connection of its own."""
    import urllib.error
    import urllib.request
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return status, json_or_text(text)


def json_or_text(text: str):
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return text


def parse_events(text: str) -> list:
    """The server-sent events of a streamed response's body, [DONE] included."""
    return [e if e == "[DONE]" else json.loads(e)
            for e in (line.removeprefix("data: ") for line in text.split("\n\n") if line)]


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def connection(url: str) -> HTTPConnection:
    """A connection that http.client keeps alive from one request to the next."""
    host, port = address(url)
    return HTTPConnection(host, port, timeout=60)


def request(conn: HTTPConnection, method: str, path: str, body=None, headers=None):
    """(status, the response (its headers), parsed JSON or text) of a request on `conn`."""
    data = None if body is None else json.dumps(body)
    conn.request(method, path, data, headers or {})
    response = conn.getresponse()
    text = response.read().decode()
    return response.status, response, json_or_text(text)


@pytest.fixture(scope="module")
def offline():
    return tiny(kv_cache_tokens=None)


@contextlib.contextmanager
def server_in_process(engine: Engine):
    """Server on a thread of this process (its loop there), serving `engine`: its
    URL; stopped at the end (shutdown without waiting, then the thread joined)."""
    with server_thread(engine) as server:
        yield server.url


@contextlib.contextmanager
def server_thread(engine: Engine, config: ServerConfig | None = None):
    """server_in_process's Server itself (config: port 0 unless given), to look inside."""
    server = Server(engine, config or ServerConfig(port=0))
    thread = threading.Thread(target=asyncio.run, args=(server.run(),), daemon=True)
    thread.start()
    try:
        assert server.started.wait(30)
        yield server
    finally:
        server.shutdown(timeout=0)
        thread.join(30)
    assert not thread.is_alive()


class OpLog(TorchDispatchMode):
    """Every op torch runs while it is on, as (name, device of its first tensor argument,
    that tensor's number of elements, its dtype)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device.type if tensors else None
        numel = tensors[0].numel() if tensors else 0
        dtype = tensors[0].dtype if tensors else None
        self.ops.append((func.__name__, device, numel, dtype))
        return func(*args, **(kwargs or {}))


def type_lines(monkeypatch, lines: list[str]) -> None:
    """input() returns each of lines in turn, then raises EOFError (Ctrl-D): a REPL session."""
    remaining = iter(lines)

    def next_line(prompt: str) -> str:
        line = next(remaining, None)
        if line is None:
            raise EOFError
        return line
    monkeypatch.setattr("builtins.input", next_line)

"""nanoserve: the engine, its offline API, the command line, the REPL and the HTTP server.

`Engine.step()` is the serving algorithm, one iteration at a time: schedule (the scheduler's
SchedulerOutput says which tokens of which sequences run now, who was admitted, who was
preempted), execute (build the flat batch, run the model once over all of it, sample a token
for each sequence with no uncomputed token left), update (advance, append, detokenize, finish
and free), record (a StepRecord of what it did). Everything else loops over step().

In this file, in order, each part under a one-line banner: configuration (the option()
fields that are also flags, SamplingParams, EngineConfig, ServerConfig, the outputs); the
engine (Batch,
ModelOutput, StepRecord, EngineStats, Engine with step() at its top); the offline API (LLM,
the trace, accumulate); the HTTP server (OpenAI's completions and chat, /tokenize, /metrics:
one asyncio event loop for every connection, the engine on its own thread); the
command line (--prompt, piped stdin and --jsonl, the REPL, main). It uses the scheduler
(scheduler.py), the block pool (paged_cache.py), the model (model.py) and the attention and
sampling ops (kernels.py). The offline API has vLLM's shape and argument names, so moving to
vLLM is an import away:

    from nanoserve import LLM, SamplingParams
    outputs = LLM().generate(["ROMEO:"], SamplingParams(max_tokens=64, temperature=0))

Left out: beam search, speculative decoding, CUDA graphs, tensor parallelism, multi-modal
inputs, LoRA.
"""
import argparse
import asyncio
import codecs
import contextlib
import dataclasses
import hmac
import itertools
import json
import math
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from http import HTTPStatus

import jinja2
import jinja2.ext
import jinja2.sandbox
import torch

from kernels import (AttentionMetadata, Penalties, SamplingTensors, keep_freed_memory, sample,
                     select_attention)
from model import PRESETS, Detokenizer, load_model, read_json
from paged_cache import BlockTable, allocate_kv_cache, cdiv, kv_bytes_per_token
from scheduler import POLICIES, Scheduler, SchedulerOutput, Sequence, SequenceStatus

__version__ = "0.1.0"     # pyproject.toml reads it from here
KV_CACHE_BYTES = 1 << 30  # the default KV cache's memory budget: 1 GiB
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20         # top log-probabilities per token at most (vLLM's max_logprobs)


# ----------------------------------------------------------------------------- configuration

MAX_UINT64 = 2**64 - 1  # the largest integer a field takes (a seed, say)


def check_int(name: str, value, low: int, high: int = MAX_UINT64) -> None:
    """ValueError naming `name` unless value is an int (a bool is not) in [low, high]."""
    if type(value) is int and low <= value <= high:
        return
    bounds = f">= {low}" if high == MAX_UINT64 else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def check_float(name: str, value, low: float, high: float, open_low: bool) -> None:
    """ValueError naming `name` unless value is a finite number (a bool is not) in [low, high],
    or in (low, high] if open_low."""
    is_number = type(value) in (int, float) and math.isfinite(value)
    above_low = is_number and (value > low if open_low else value >= low)
    if above_low and value <= high:
        return
    opening = "(" if open_low else "["
    raise ValueError(f"{name} must be a number in {opening}{low}, {high}], got {value!r}")


def option(default, help: str, low=1, high=math.inf, open_low=False, **argparse_kwargs):
    """A config field that is also a flag: default, help, type, choices and range, only here."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, open_low=open_low,
                                                **argparse_kwargs))


def check_fields(config) -> None:
    """ValueError naming the first option() field out of its choices, type or range (a bool
    is not a number; NaN and inf are never in range)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        meta = f.metadata
        kind = meta.get("type") or type(f.default)
        if value is None and f.default is None:
            continue
        if "choices" in meta:
            if value not in meta["choices"]:
                raise ValueError(f"unknown {f.name} {value!r}; choose one of "
                                 f"{', '.join(map(str, meta['choices']))}")
        elif kind is int:
            check_int(f.name, value, meta["low"], min(meta["high"], MAX_UINT64))
        elif kind is float:
            check_float(f.name, value, meta["low"], meta["high"], meta["open_low"])
        elif type(value) is not kind:
            raise ValueError(f"{f.name} must be a {kind.__name__}, got {value!r}")


def add_config_args(parser, cls, skip=()) -> None:
    """One flag per option() field of the dataclass `cls`, all of it from the field."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kwargs = {k: v for k, v in f.metadata.items() if k not in ("low", "high", "open_low")}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, tuple):  # of strings when empty
            kwargs |= dict(nargs="+", type=type(f.default[0]) if f.default else str)
        elif "type" not in kwargs and "choices" not in kwargs:
            kwargs["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM and the OpenAI API name it."""
    n: int = option(1, "samples of the prompt, one request (a seeded sample i uses seed + i)")
    max_tokens: int = option(16, "tokens to generate at most")
    temperature: float = option(1.0, "0 (or below 1e-5): greedy", low=0)
    top_k: int = option(0, "keep the k most likely tokens; 0 or -1: all", low=-1)
    top_p: float = option(1.0, "keep the fewest most likely tokens whose probability reaches "
                          "top_p", low=0, high=1, open_low=True)
    seed: int | None = option(None, "per-request RNG: the same tokens whatever the batch",
                              low=0, type=int)
    stop: list[str] | None = option(None, "stop before any of these strings", type=list)
    ignore_eos: bool = option(False, "keep going after an end-of-sequence token")
    logprobs: int | None = option(None, "each output token's log-probability and the top k",
                                  low=0, high=MAX_LOGPROBS, type=int)
    prompt_logprobs: int | None = option(None, "each prompt token's log-probability and the "
                                         "top k", low=0, high=MAX_LOGPROBS, type=int)
    presence_penalty: float = option(0.0, "minus this from the logit of every token generated "
                                     "so far (OpenAI's)", low=-2, high=2)
    frequency_penalty: float = option(0.0, "minus this times its count from the logit of every "
                                      "token generated so far (OpenAI's)", low=-2, high=2)
    repetition_penalty: float = option(1.0, "divide the positive logits (multiply the negative) "
                                       "of every token of the prompt and output by this",
                                       low=0, open_low=True)
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely",
                          low=0, high=1)
    min_tokens: int = option(0, "no end-of-text, stop token or stop string before this many "
                             "tokens", low=0)
    stop_token_ids: list[int] | None = option(None, "stop after any of these tokens (kept in "
                                              "token_ids, not in the text)", type=list)
    include_stop_str_in_output: bool = option(False, "keep the stop string (or stop token) at "
                                              "the end of the text")
    logit_bias: dict[int, float] | None = option(None, "token id -> a bias in [-100, 100] "
                                                 "added to its logit (OpenAI's)", type=dict)

    def __post_init__(self):
        try:  # a string, or any iterable of strings, read once here (a generator is used up)
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        except TypeError:
            raise ValueError(f"stop must be a string or strings, got {self.stop!r}") from None
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop_token_ids = parse_token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = parse_logit_bias(self.logit_bias)
        check_fields(self)
        self.top_k = max(self.top_k, 0)  # vLLM's -1 and 0 both mean off
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this row's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


def parse_token_ids(name: str, value) -> list[int]:
    """None or token ids -> a new list; ValueError naming `name` unless ints >= 0 (a bool is
    not; the vocabulary's bound is the engine's to check)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for token_id in value:
        check_int(name, token_id, 0)
    return list(value)


def parse_logit_bias(value) -> dict[int, float]:
    """None or {token id: bias} -> a new dict; ValueError unless ids are ints >= 0 (or their
    decimal strings, as JSON sends them) and biases numbers in [-100, 100], as OpenAI's."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {value!r}")
    bias = {}
    for key, number in value.items():
        token_id = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token_id = int(key)
        check_int("logit_bias's token id", token_id, 0)
        check_float("logit_bias's bias", number, -100, 100, open_low=False)
        bias[token_id] = float(number)
    return bias


# generation_config.json's sampling fields (vLLM's list) -> SamplingParams' names for them
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def default_sampling(engine: "Engine") -> dict:
    """The sampling fields the checkpoint's generation_config.json gives, by SamplingParams'
    names ({"temperature": 0.6, "top_p": 0.95, ...}; {} with --generation-config vllm, a preset
    or no file): the defaults of a request that leaves them unset, as vLLM takes them (do_sample
    is not read). Each front end lays them over its own defaults, and the user's values over
    them. ValueError naming the file and the field unless each is a valid request value."""
    if engine.config.generation_config == "vllm":
        return {}
    given = engine.checkpoint.generation_config
    defaults = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        if given.get(key) is None:
            continue
        try:
            SamplingParams(**{name: given[key]})
        except ValueError as e:
            path = os.path.join(engine.checkpoint.path, "generation_config.json")
            raise ValueError(f"{path}: {key} {given[key]!r} is not a valid default ({e}); "
                             "--generation-config vllm ignores the file") from None
        defaults[name] = given[key]
    return defaults


def print_sampling_defaults(defaults: dict) -> None:
    """The start-up line (stderr) that names the checkpoint's sampling defaults, if it gave any."""
    if not defaults:
        return
    taken = ", ".join(f"{name} {value}" for name, value in defaults.items())
    print(f"using the checkpoint's sampling defaults (generation_config.json): {taken}; a "
          "request's own values win (--generation-config vllm ignores the file)",
          file=sys.stderr, flush=True)


@dataclass
class EngineConfig:
    """How the engine is built, with vLLM's argument names where vLLM has one."""
    model: str | None = option(None, "a checkpoint dir, a name in the Hugging Face cache "
                               "(Qwen/Qwen3-0.6B) or gpt2[-medium|-large|-xl]; none: the "
                               "shipped Shakespeare model", type=str)
    preset: str | None = option(None, "random seeded weights of a shape", choices=list(PRESETS))
    device: str = option("cuda" if torch.cuda.is_available() else "cpu", "cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto: float32 on CPU; on CUDA the checkpoint's torch_dtype, "
                        "else bfloat16", choices=["auto", *DTYPES])
    attention: str = option("auto", "paged attention; auto: torch on CPU, Triton on CUDA",
                            choices=["auto", "torch", "triton"])
    max_model_len: int | None = option(None, "prompt + output at most; default: the context",
                                       type=int)
    block_size: int = option(16, "tokens per KV block")
    kv_cache_tokens: int | None = option(None, "KV cache capacity in tokens; default: "
                                         "max-num-seqs full contexts, within 1 GiB", type=int)
    max_num_seqs: int = option(64, "sequences in one step at most")
    max_num_batched_tokens: int = option(512, "tokens in one step at most (the token budget)")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps")
    enable_prefix_caching: bool = option(True, "reuse the cached KV blocks of earlier requests' "
                                         "prompt prefixes")
    policy: str = option("fcfs", "scheduling policy", choices=list(POLICIES))
    seed: int = option(0, "seeds random weights and requests without a seed", low=0)
    generation_config: str = option("auto", "sampling defaults of requests that leave a field "
                                    "unset; auto: the checkpoint's generation_config.json where "
                                    "it gives one; vllm: ignore the file (vLLM's flag)",
                                    choices=["auto", "vllm"])

    def __post_init__(self):
        check_fields(self)
        if self.model is not None and self.preset is not None:
            raise ValueError("give a model or a preset, not both")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}; use cpu, cuda or cuda:N")
        if device.type == "cuda" and self.attention == "torch":
            raise ValueError("attention torch is the CPU path: it reads every layer's metadata "
                             "on the host, a wait for the GPU each layer; on CUDA use triton "
                             "(the default there)")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: " + (
                f"there are {torch.cuda.device_count()} CUDA devices" if torch.cuda.is_available()
                else "CUDA is not available on this machine"))
        if self.dtype == "auto" and device.type == "cpu":  # on CUDA: Engine._dtype
            self.dtype = "float32"
        if self.attention == "triton" and device.type == "cpu" and self.dtype == "bfloat16":
            raise ValueError("Triton attention cannot run bfloat16 on a CPU (its interpreter "
                             "multiplies bf16 wrongly); use --dtype float32 or float16")


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
                                   "dropped and its request aborted")
    shutdown_timeout: float = option(5.0, "on SIGTERM, seconds the requests in flight may "
                                     "still run (then they end with finish_reason abort)", low=0)
    log_requests: bool = option(False, "an access-log line per request, on stderr")

    def __post_init__(self):
        self.allowed_origins = tuple(self.allowed_origins)
        if self.api_key is None:
            self.api_key = os.environ.get("NANOSERVE_API_KEY") or None
        check_fields(self)
        if not all(isinstance(origin, str) and origin for origin in self.allowed_origins):
            raise ValueError(f"allowed_origins must be strings, got {self.allowed_origins!r}")


@dataclass
class CompletionOutput:
    """A request's new text and tokens since its last output (vLLM's DELTA), or all of them."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop", "length", "abort" or None while running
    stop_reason: str | None = None  # the stop string that ended it, or why it was aborted
    logprobs: list[dict[int, float]] | None = None  # per token: its log-probability, the top k


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None              # None for a prompt given as token ids, as in vLLM
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in a request's first output


# ----------------------------------------------------------------------------- engine

@dataclass
class Batch:
    """One step's model inputs, flattened over the scheduled sequences (see _prepare_inputs)."""
    input_ids: torch.Tensor         # (N,) the new tokens of every scheduled sequence
    positions: torch.Tensor         # (N,) each token's position in its sequence
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor       # (n,) the last row of each sequence that samples
    sample_seqs: list[Sequence]     # (n,) the sequences with no uncomputed token left
    prompt_rows: torch.Tensor       # (m,) rows whose next token is a prompt token to score
    prompt_targets: torch.Tensor    # (m,) those next tokens
    prompt_seqs: list[Sequence]     # (m,) their sequences


@dataclass
class ModelOutput:
    """What execute() gives update(): the token sampled for each sequence with no uncomputed
    token left, the log-probabilities asked for, and the sequences that failed."""
    sampled_token_ids: dict[Sequence, int] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # (len(sampled_token_ids), vocab) fp32, in that order
    logprobs: dict[Sequence, dict[int, float]] = field(default_factory=dict)  # sampled token's
    prompt_logprobs: dict[Sequence, list[dict]] = field(default_factory=dict)  # scored this step
    failed: dict[Sequence, str] = field(default_factory=dict)  # failed alone -> the error


@dataclass
class StepRecord:
    """What one step did, by request id: the record that --trace, /metrics and bench.py read
    and EngineStats adds up."""
    scheduled: dict[str, int]       # tokens computed this step
    sampled: list[str]              # got a token
    finished: list[str]             # ended in this step, or were aborted since the last one
    preempted: list[str]            # sent back to waiting, their blocks freed
    num_cached_tokens: dict[str, int]  # first admitted, with this many prefix-cache hits (> 0)
    num_running: int
    num_waiting: int
    num_kv_tokens: int              # tokens whose K/V the running sequences hold
    kv_blocks_used: int


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens the prefix cache supplied
    num_generated_tokens: int = 0
    num_batched_seqs: int = 0       # summed over steps: divide by num_steps for the mean
    num_batched_tokens: int = 0     # tokens computed, recomputation after preemption included
    peak_batch_size: int = 0

    def record(self, step: StepRecord) -> None:
        if not step.scheduled:  # only aborts since the last step
            return
        self.num_steps += 1
        self.num_cached_tokens += sum(step.num_cached_tokens.values())
        self.num_generated_tokens += len(step.sampled)
        self.num_batched_seqs += len(step.scheduled)
        self.num_batched_tokens += sum(step.scheduled.values())
        self.peak_batch_size = max(self.peak_batch_size, len(step.scheduled))


class EngineDeadError(RuntimeError):
    """The device failed (a CUDA error): the engine cannot run another step; restart it."""


def is_device_error(error: Exception) -> bool:
    """Whether an error is the device's (a device-side assert, an illegal address): CUDA
    reports it at the next wait for the GPU, whichever request caused it, and the CUDA context
    stays unusable, so running the requests again one at a time would only fail them all."""
    return isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error)


def sample_id(request_id: str, index: int) -> str:
    """The sequence id of a request's sample `index`: the request's own id for sample 0 (so a
    request of one sample is one id, and the trace's row for a request is its first sample),
    "{index}_{request_id}" for the others (vLLM's form)."""
    if index == 0:
        return request_id
    return f"{index}_{request_id}"


def to_host(tensor: torch.Tensor) -> list:
    """A device tensor's values as (nested) Python lists. The only place a step waits for the
    device: a CUDA test runs whole steps with every other wait made an error."""
    return tensor.tolist()


BLOCK_TABLE_COLUMNS = 16  # block tables are padded to a multiple of this many columns


def padded_block_tables(block_ids: torch.Tensor, num_blocks: torch.Tensor,
                        max_num_blocks: int) -> torch.Tensor:
    """The step's block tables end to end, block_ids (total,), with each sequence's count
    num_blocks (S,) -> (S, width) int32, padded with block 0 (never read: attention stops at
    each sequence's context_len), built on block_ids' device without waiting for it.

    width is max_num_blocks rounded up to a multiple of 16: Triton specialises the kernel on
    whether the row stride divides by 16, so every batch launches one compiled kernel."""
    width = cdiv(max_num_blocks, BLOCK_TABLE_COLUMNS) * BLOCK_TABLE_COLUMNS
    device = block_ids.device
    rows = torch.repeat_interleave(torch.arange(len(num_blocks), device=device), num_blocks,
                                   output_size=len(block_ids))   # each id's sequence
    first = torch.cumsum(num_blocks, 0) - num_blocks                 # each table's first id
    columns = torch.arange(len(block_ids), device=device) - first[rows]
    tables = torch.zeros(len(num_blocks), width, dtype=torch.int32, device=device)
    tables[rows, columns] = block_ids.to(torch.int32)
    return tables


class Engine:
    """Continuous batching over a paged KV cache: add requests any time, call step().
    abort() may be called from any thread; everything else from the thread that steps."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device.startswith("cpu"):
            keep_freed_memory()
        checkpoint = load_model(config.model, config.preset, config.seed)
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids  # each ends a request unless ignore_eos
        dtype = self._dtype(checkpoint.dtype)
        self.model = checkpoint.model.to(config.device, dtype).eval()
        c = self.model.config
        self.vocab_size = self._vocab_size(c.vocab_size)
        # what the checkpoint says of requests: read here, so a bad one stops the engine's start
        self.sampling_defaults = default_sampling(self)  # generation_config.json's
        self.chat_template = load_chat_template(checkpoint.path)  # None: render_chat's
        if config.max_model_len is not None and config.max_model_len > c.n_positions:
            raise ValueError(f"max_model_len {config.max_model_len} > the context {c.n_positions}")
        self.attention = select_attention(config.attention, config.device)
        # K and V for every layer and K/V head: grouped-query attention's saving is here
        self.kv_bytes_per_token = kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim, dtype)
        self.k_cache, self.v_cache, self.block_pool = allocate_kv_cache(
            c.n_layer, c.n_kv_head, c.head_dim, self._kv_cache_tokens(c.n_positions),
            config.block_size, config.device, dtype, config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(config.max_model_len, c.n_positions)
        self.scheduler = Scheduler(self.block_pool, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.policy, self.eos_token_ids)
        self.generator = torch.Generator(config.device).manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}            # sequence id -> its sequence
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n samples
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None           # the newest step's record
        self.step_records: list[StepRecord] | None = None  # every record, once made a list
        self._ids = itertools.count()
        self._lock = threading.Lock()  # abort() from other threads against step()
        self._aborted_outputs: list[RequestOutput] = []  # for the next step() to return
        self.dead: str | None = None  # why the engine cannot step any more (a device error)

    def _kv_cache_tokens(self, context: int) -> int:
        """kv_cache_tokens if given, else a full context (max_model_len's, or the model's) for
        every one of max_num_seqs sequences, within KV_CACHE_BYTES."""
        config = self.config
        if config.kv_cache_tokens is not None:
            return config.kv_cache_tokens
        if config.max_model_len is not None:
            context = config.max_model_len
        return min(config.max_num_seqs * context, KV_CACHE_BYTES // self.kv_bytes_per_token)

    def _dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """--dtype, or for auto on CUDA the checkpoint's torch_dtype (bfloat16 if it gives
        none; EngineConfig made auto float32 on a CPU)."""
        if self.config.dtype != "auto":
            return DTYPES[self.config.dtype]
        return checkpoint_dtype or torch.bfloat16

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, C) -> fp32 logits (n, vocab_size): the tokenizer's ids only, so
        an embedding row past them is never sampled."""
        return self.model.compute_logits(hidden)[:, :self.vocab_size]

    def _vocab_size(self, num_embeddings: int) -> int:
        """The token ids a prompt may hold and a step may sample: the tokenizer's. Qwen's
        embedding has rows past it (151,936 for 151,665 ids), padding that is never text."""
        num_token_ids = self.tokenizer.n_vocab
        if num_token_ids > num_embeddings:
            raise ValueError(f"the tokenizer has {num_token_ids} token ids; the model embeds "
                             f"{num_embeddings}")
        return num_token_ids

    @property
    def kv_cache_tokens(self) -> int:
        """The KV cache's capacity: whole blocks of block_size tokens."""
        return self.block_pool.num_blocks * self.block_pool.block_size

    @property
    def kv_tokens_per_gib(self) -> int:
        """How many tokens' K/V a GiB holds: what grouped-query attention multiplies."""
        return 2**30 // self.kv_bytes_per_token

    def _max_model_len(self, asked: int | None, context: int) -> int:
        """The longest sequence served: asked for, else the model's context, but never more
        than the KV cache holds (as vLLM refuses such a max_model_len: a sequence that cannot
        fit alone could never finish). Today's configs declare 32k-128k-token contexts."""
        if asked is None:
            return min(context, self.kv_cache_tokens)
        if asked > self.kv_cache_tokens:
            raise ValueError(f"max_model_len {asked} does not fit in the KV cache "
                             f"({self.kv_cache_tokens} tokens): lower max_model_len or raise "
                             "kv_cache_tokens")
        return asked

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching: schedule, execute, update, record. Returns a
        delta output for every request that got a token, and the last output of each one
        aborted or failed since the last step."""
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            outputs = self._aborted_outputs
            self._aborted_outputs = []
            scheduler_output = self.scheduler.schedule()
            model_output = self.execute(scheduler_output)
            outputs += self.update(scheduler_output, model_output)
            self.record(scheduler_output, model_output, outputs)
            return outputs

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run the model once over every scheduled token and sample. If the batch fails, run
        each sequence alone: the ones that fail alone are the ones that fail."""
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        if not num_scheduled_tokens:
            return ModelOutput()
        try:
            return self.run_batch(num_scheduled_tokens)
        except Exception as e:  # noqa: BLE001 (find the request that fails; it alone fails)
            self._fail_fast_on_device_error(e)
            return self._run_one_at_a_time(num_scheduled_tokens)

    def _fail_fast_on_device_error(self, error: Exception) -> None:
        """A device error ends the engine: EngineDeadError now, and at every later step()."""
        if not is_device_error(error):
            return
        first_line = str(error).strip().splitlines()[0]
        self.dead = f"the device failed ({first_line}); the engine must be restarted"
        raise EngineDeadError(self.dead) from error

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput
               ) -> list[RequestOutput]:
        """Apply a step's results: failed sequences abort; the scheduler advances the others
        and appends their tokens; each sampled sequence detokenizes and makes its output."""
        outputs = []
        for seq, error in model_output.failed.items():
            outputs.append(self._abort(seq, error))
        ran = dict(scheduler_output.num_scheduled_tokens)
        for seq in model_output.failed:
            del ran[seq]
        self.scheduler.update(ran, model_output.sampled_token_ids)
        for seq, entries in model_output.prompt_logprobs.items():
            seq.prompt_logprobs += entries
        for seq, entry in model_output.logprobs.items():
            seq.logprobs.append(entry)
        for seq in model_output.sampled_token_ids:
            outputs.append(self._detokenize(seq))
        return outputs

    def record(self, scheduler_output: SchedulerOutput, model_output: ModelOutput,
               outputs: list[RequestOutput]) -> None:
        """Make the step's StepRecord (an idle step without outputs makes none) and count it."""
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled and not outputs:
            return
        self.last_step = StepRecord(
            scheduled={seq.seq_id: num_new for seq, num_new in scheduled.items()},
            sampled=[seq.seq_id for seq in model_output.sampled_token_ids],
            finished=[sample_id(output.request_id, completion.index) for output in outputs
                      for completion in output.outputs if completion.finish_reason is not None],
            preempted=[seq.seq_id for seq in scheduler_output.preempted],
            num_cached_tokens={seq.seq_id: num_cached for seq, num_cached
                               in scheduler_output.newly_admitted.items() if num_cached > 0},
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            kv_blocks_used=self.block_pool.num_blocks - self.block_pool.num_free_blocks)
        self.stats.record(self.last_step)
        if self.step_records is not None:
            self.step_records.append(self.last_step)

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (a string, a list of token ids, {"prompt": str} or
        {"prompt_token_ids": [...]}) with a copy of params (none: the checkpoint's sampling
        defaults over SamplingParams' own, its max_tokens at most what the context leaves);
        ValueError if it can never run."""
        text, token_ids = self.parse_prompt(prompt)
        if params is None:
            params = self.default_params(len(token_ids))
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, validated again
        if request_id is None:  # the next free number: never a caller's id
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        self._validate(token_ids, params, request_id)
        seqs = [self._sample_sequence(request_id, index, text, token_ids, params)
                for index in range(params.n)]
        with self._lock:  # abort() may run on another thread
            self.requests[request_id] = seqs
            for seq in seqs:
                self.seqs[seq.seq_id] = seq
                self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def default_params(self, num_prompt_tokens: int) -> SamplingParams:
        """A request's sampling when it gives none: the checkpoint's defaults over
        SamplingParams' own, a default max_tokens cut to what the context leaves (at least
        1), as vLLM cuts it: a max_new_tokens past max_model_len would refuse every prompt."""
        params = SamplingParams(**self.sampling_defaults)
        if "max_tokens" not in self.sampling_defaults:
            return params
        max_tokens = self.max_tokens_within_context(params.max_tokens, num_prompt_tokens)
        return dataclasses.replace(params, max_tokens=max_tokens)

    def max_tokens_within_context(self, max_tokens: int | None, num_prompt_tokens: int) -> int:
        """A default max_tokens (None: no limit but the context) cut to what max_model_len
        leaves after a prompt, at least 1 (a prompt too long is then refused, saying why). Only
        defaults are cut: a request's own max_tokens past the context is refused."""
        room_left = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = room_left
        return max(1, min(max_tokens, room_left))

    def _sample_sequence(self, request_id: str, index: int, text: str | None,
                         token_ids: list[int], params: SamplingParams) -> Sequence:
        """Sample `index` of a request: each of its n samples is a sequence of its own (vLLM's
        fan-out, ids from sample_id); a seeded one's seed is seed + index."""
        seq_id = sample_id(request_id, index)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.config.device).manual_seed(params.seed)
        seq = Sequence(seq_id, text, token_ids, params, BlockTable(self.block_pool), generator,
                       Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output),
                       request_id=request_id, index=index)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has no log-probability
        return seq

    def parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt in any form add_request takes -> (its text, its token ids); the text is
        None for a prompt given as token ids, as in vLLM."""
        if isinstance(prompt, dict) and set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise ValueError("a prompt is a string, a list of token ids, {'prompt': str} or "
                             f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}")
        vocab_size = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        return None, list(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        num_tokens = len(token_ids) + params.max_tokens
        num_kv_tokens = num_tokens - 1  # the last sampled token's K/V are never computed
        budget = self.config.max_num_batched_tokens
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not token_ids:
            raise ValueError("prompt is empty: it needs at least one token")
        sample_ids = [sample_id(request_id, index) for index in range(params.n)]
        if request_id in self.requests or any(i in self.seqs for i in sample_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias))):
            unknown = [token_id for token_id in ids if token_id >= vocab_size]
            if unknown:
                raise ValueError(f"{name}: token id {unknown[0]} is not in the vocabulary "
                                 f"(0 to {vocab_size - 1})")
        if num_tokens > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens and max_tokens is "
                             f"{params.max_tokens}: {num_tokens} tokens; the model's context "
                             f"is {self.max_model_len}")
        if not self.config.enable_chunked_prefill and num_kv_tokens > budget:
            raise ValueError(f"request may need to prefill {num_kv_tokens} tokens in one step, "
                             f"but max_num_batched_tokens is {budget} and chunked prefill is off")

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request and free its blocks now (after any step in flight); its last output
        (finish_reason "abort", stop_reason `reason`) comes from the next step()."""
        with self._lock:
            for seq in self.requests.get(request_id, []):
                if not seq.is_finished:
                    self._aborted_outputs.append(self._abort(seq, reason))

    def _abort(self, seq: Sequence, reason: str) -> RequestOutput:
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        seq.stop_reason = reason
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted_outputs)

    def run_batch(self, num_scheduled_tokens: dict[Sequence, int]) -> ModelOutput:
        """Build the inputs, run the model over every scheduled token, sample a token for each
        sequence with no uncomputed token left, gather the log-probabilities asked for."""
        batch = self._prepare_inputs(num_scheduled_tokens)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata,
                            self.k_cache, self.v_cache, self.attention)    # (N, C)
        logits = self.compute_logits(hidden[batch.sample_rows])            # (n, vocab) fp32
        output = ModelOutput(logits=logits)
        if not batch.sample_seqs and not batch.prompt_seqs:
            return output
        token_ids = batch.prompt_targets[:0]  # none sampled: an empty id tensor, on the device
        if batch.sample_seqs:
            token_ids = sample(logits, self.sampling_tensors(batch.sample_seqs), self.generator)
        if any(seq.params.logprobs is not None for seq in batch.sample_seqs) or batch.prompt_seqs:
            self._gather_logprobs(batch, hidden, logits, token_ids, output)
        # The step's one wait for the device (log-probabilities, if asked for, were read above).
        output.sampled_token_ids = dict(zip(batch.sample_seqs, to_host(token_ids)))
        return output

    def _run_one_at_a_time(self, num_scheduled_tokens: dict[Sequence, int]) -> ModelOutput:
        """The batch failed: run each sequence alone; those that fail alone fail."""
        merged = ModelOutput()
        logits = []
        for seq, num_new in num_scheduled_tokens.items():
            try:
                alone = self.run_batch({seq: num_new})
            except Exception as e:  # noqa: BLE001
                self._fail_fast_on_device_error(e)
                merged.failed[seq] = f"error: {type(e).__name__}: {e}"
                continue
            merged.sampled_token_ids |= alone.sampled_token_ids
            merged.logprobs |= alone.logprobs
            merged.prompt_logprobs |= alone.prompt_logprobs
            logits.append(alone.logits)
        if logits:
            merged.logits = torch.cat(logits)
        return merged

    def _gather_logprobs(self, batch: Batch, hidden: torch.Tensor, logits: torch.Tensor,
                         token_ids: torch.Tensor, output: ModelOutput) -> None:
        """Fill output.logprobs (each sampled token's) and output.prompt_logprobs (each prompt
        token scored this step): the token's own log-probability and the top k of its row,
        from the model's log-softmax (before temperature, top-k and top-p, as vLLM returns
        them). One topk over all rows; token ids and values are read in one copy each."""
        seqs = batch.sample_seqs + batch.prompt_seqs  # a row each
        num_sampled = len(batch.sample_seqs)
        # per row: how many top log-probabilities it asked for (None: none at all)
        wants = [sampled.params.logprobs for sampled in batch.sample_seqs]
        wants += [scored.params.prompt_logprobs for scored in batch.prompt_seqs]
        prompt_logits = self.compute_logits(hidden[batch.prompt_rows])  # (m, vocab)
        logprobs = torch.cat([logits, prompt_logits]).log_softmax(dim=-1)    # (n + m, vocab)
        targets = torch.cat([token_ids, batch.prompt_targets])[:, None]      # (n + m, 1)
        top_k = max([want for want in wants if want is not None], default=0)
        top = logprobs.topk(top_k, dim=-1)
        ids = to_host(torch.cat([targets, top.indices], dim=1))                # (n + m, 1 + k)
        values = to_host(torch.cat([logprobs.gather(1, targets), top.values], dim=1))
        for row, seq in enumerate(seqs):
            row_top_k = wants[row]
            if row_top_k is None:
                continue
            entry = {ids[row][0]: values[row][0]}  # the token itself, then its row's top
            entry |= dict(zip(ids[row][1:1 + row_top_k], values[row][1:1 + row_top_k]))
            if row < num_sampled:
                output.logprobs[seq] = entry
            else:
                output.prompt_logprobs.setdefault(seq, []).append(entry)

    def _detokenize(self, seq: Sequence) -> RequestOutput:
        """Add seq's new token to its text, finish it at a stop string, make its output; an
        error here fails this request alone."""
        try:
            token = seq.token_ids[-1]
            params = seq.params
            ended_by_stop_token = seq.is_finished and seq.stop_reason == token
            if ended_by_stop_token and not params.include_stop_str_in_output:
                seq.detokenizer.flush()  # the stop token stays in token_ids, not in the text
                return self._output(seq)
            # As vLLM: stop strings count only once the output is longer than min_tokens.
            check_stop = seq.num_output_tokens > params.min_tokens
            stop = seq.detokenizer.append(token, check_stop)
            if stop is not None:
                seq.stop_reason = stop
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.is_finished:
                seq.detokenizer.flush()
            return self._output(seq)
        except Exception as e:  # noqa: BLE001 (this request alone fails)
            seq.detokenizer = Detokenizer(self.tokenizer, [])  # not the one that failed
            return self._abort(seq, f"error: {type(e).__name__}: {e}")

    def _output(self, seq: Sequence) -> RequestOutput:
        """The request's delta since its last output; a finished request leaves the engine."""
        finished = seq.is_finished
        num_sent = seq.num_sent_tokens
        is_first_output = num_sent == 0
        new_token_ids = seq.token_ids[len(seq.prompt_token_ids) + num_sent:]
        seq.num_sent_tokens = seq.num_output_tokens
        new_logprobs = None
        if seq.params.logprobs is not None:
            new_logprobs = seq.logprobs[num_sent:]
        completion = CompletionOutput(
            index=seq.index, text=seq.detokenizer.new_text(finished), token_ids=new_token_ids,
            finish_reason=seq.status.value if finished else None, stop_reason=seq.stop_reason,
            logprobs=new_logprobs)
        prompt_logprobs = None
        if is_first_output and seq.prompt_logprobs:
            prompt_logprobs = list(seq.prompt_logprobs)
        request_finished = False
        if finished:
            request_finished = self._release(seq)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids),
                             [completion], request_finished, prompt_logprobs)

    def _release(self, seq: Sequence) -> bool:
        """A finished sequence leaves the engine. Whether it was the last of its request: only
        the output that ends a request's last sample says the request is finished."""
        self.seqs.pop(seq.seq_id, None)
        samples = self.requests.get(seq.request_id, [])
        if any(sample.seq_id in self.seqs for sample in samples):
            return False
        self.requests.pop(seq.request_id, None)
        return True

    def _prepare_inputs(self, num_scheduled_tokens: dict[Sequence, int]) -> Batch:
        """The step's inputs, flattened over the scheduled sequences and sent to the device in
        one pinned, non-blocking copy. Example, block_size 4, three sequences:

            A  decode: 6 tokens computed, 1 new     block table [3, 7]
            B  prompt chunk: 10-token prompt, 4 computed, 3 new     block table [5, 2]
            C  decode: 2 tokens computed, 1 new     block table [1]

            input_ids        [a6, b4, b5, b6, c2]     (token t of A written a6)
            positions        [ 6,  4,  5,  6,  2]
            slot_mapping     [30,  8,  9, 10,  6]     (A's 6: block 7 * 4 + 2 = 30)
            query_start_loc  [0, 1, 4, 5]             (B owns rows 1..3)
            context_lens     [7, 7, 3]
            block_ids        [3, 7, 5, 2, 1]          (the tables end to end, as they are)
            num_blocks       [2, 2, 1]
            block_tables     [[3, 7, 0 ...], [5, 2, 0 ...], [1, 0, 0 ...]]   (on the device)
            sample_rows      [0, 4]                   (B has tokens left to compute: no sample)

        The tables go up unpadded and are padded on the device (padded_block_tables): a step
        costs what its sequences' blocks are, not max_model_len / block_size entries for each
        sequence (8,192 at a 128k context)."""
        ints = dict(input_ids=[], positions=[], slot_mapping=[], block_ids=[], num_blocks=[],
                    context_lens=[], query_start_loc=[0], sample_rows=[], prompt_rows=[],
                    prompt_targets=[])
        sample_seqs = []  # the sequences that sample, in the order of ints["sample_rows"]
        prompt_seqs = []  # the sequence of each of ints["prompt_rows"]
        for seq, num_new in num_scheduled_tokens.items():
            start = seq.num_computed_tokens
            end = start + num_new
            first_row = ints["query_start_loc"][-1]
            block_ids = seq.block_table.block_ids
            ints["input_ids"] += seq.token_ids[start:end]
            ints["positions"] += range(start, end)
            ints["slot_mapping"] += seq.block_table.slot_mapping(start, end)
            ints["block_ids"] += block_ids
            ints["num_blocks"].append(len(block_ids))
            ints["context_lens"].append(end)
            ints["query_start_loc"].append(first_row + num_new)
            if end == len(seq.token_ids):  # no uncomputed token left: sample the next one
                ints["sample_rows"].append(first_row + num_new - 1)
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None:
                for position in self._prompt_positions_to_score(seq, start, end):
                    ints["prompt_rows"].append(first_row + position - start)
                    ints["prompt_targets"].append(seq.token_ids[position + 1])
                    prompt_seqs.append(seq)
        tensors = self._upload(ints, torch.int64)
        attn_metadata = AttentionMetadata(
            slot_mapping=tensors["slot_mapping"],
            block_tables=padded_block_tables(tensors["block_ids"], tensors["num_blocks"],
                                             max(ints["num_blocks"])),
            context_lens=tensors["context_lens"].to(torch.int32),
            query_start_loc=tensors["query_start_loc"].to(torch.int32),
            max_query_len=max(num_scheduled_tokens.values()))
        return Batch(input_ids=tensors["input_ids"], positions=tensors["positions"],
                     attn_metadata=attn_metadata, sample_rows=tensors["sample_rows"],
                     sample_seqs=sample_seqs, prompt_rows=tensors["prompt_rows"],
                     prompt_targets=tensors["prompt_targets"], prompt_seqs=prompt_seqs)

    @staticmethod
    def _prompt_positions_to_score(seq: Sequence, start: int, end: int) -> range:
        """The positions among start..end-1 whose next token is a prompt token not scored yet
        (a recomputation after preemption scores nothing twice)."""
        first_unscored = len(seq.prompt_logprobs) - 1
        last_prompt_position = len(seq.prompt_token_ids) - 1
        return range(max(start, first_unscored), min(end, last_prompt_position))

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The sampling parameters of the rows that sample, as device tensors."""
        vocab_size = self.vocab_size
        greedy = [seq.params.temperature < GREEDY_BELOW for seq in seqs]
        temperature = [1.0 if g else seq.params.temperature for g, seq in zip(greedy, seqs)]
        top_k = [seq.params.top_k or vocab_size for seq in seqs]
        top_p = [seq.params.top_p for seq in seqs]
        floats = self._upload(dict(temperature=temperature, top_p=top_p), torch.float32)
        ints = self._upload(dict(top_k=top_k, greedy=greedy), torch.int64)
        any_top_k_top_p = any(k < vocab_size or p < 1 for k, p in zip(top_k, top_p))
        tensors = SamplingTensors(
            temperature=floats["temperature"], top_p=floats["top_p"],
            greedy=ints["greedy"].bool(), top_k=ints["top_k"],
            generators=[seq.generator for seq in seqs], all_greedy=all(greedy),
            any_top_k_top_p=any_top_k_top_p)
        if any(seq.params.min_p > 0 for seq in seqs):
            min_p = [seq.params.min_p for seq in seqs]
            tensors.min_p = self._upload(dict(min_p=min_p), torch.float32)["min_p"]
        tensors.logit_bias = self._logit_bias(seqs)
        if any(seq.params.has_penalties for seq in seqs):
            tensors.penalties = self._penalties(seqs)
        return tensors

    def _logit_bias(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """(n, vocab): each row's logit_bias, and -inf on the tokens that would end it while
        it has fewer than min_tokens (end-of-text unless ignored, its stop_token_ids); None if
        no row has either. One scatter from one upload."""
        rows = []
        token_ids = []
        biases = []
        for row, seq in enumerate(seqs):
            params = seq.params
            banned = []
            if seq.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if not params.ignore_eos:
                    banned += self.eos_token_ids
            entries = list(params.logit_bias.items()) + [(i, -math.inf) for i in banned]
            for token_id, bias in entries:
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        if not rows:
            return None
        index = self._upload(dict(rows=rows, token_ids=token_ids), torch.int64)
        values = self._upload(dict(biases=biases), torch.float32)["biases"]
        logit_bias = torch.zeros(len(seqs), self.vocab_size,
                                 device=self.config.device)
        return logit_bias.index_put_((index["rows"], index["token_ids"]), values,
                                     accumulate=True)

    def _penalties(self, seqs: list[Sequence]) -> Penalties:
        """The penalized rows' token counts, built on the device from this step's tokens: one
        upload and one scatter-add for the output counts, one scatter for the tokens seen
        (prompt and output). Rebuilt each step rather than kept: a row's tokens change by one
        a step, but its place in the batch changes whenever the batch does."""
        vocab_size = self.vocab_size
        ints = dict(output_rows=[], output_ids=[], seen_rows=[], seen_ids=[])
        for row, seq in enumerate(seqs):
            if not seq.params.has_penalties:
                continue
            output = seq.token_ids[len(seq.prompt_token_ids):]
            ints["output_rows"] += [row] * len(output)
            ints["output_ids"] += output
            ints["seen_rows"] += [row] * len(seq.token_ids)
            ints["seen_ids"] += seq.token_ids
        index = self._upload(ints, torch.int64)
        values = self._upload(dict(
            presence=[seq.params.presence_penalty for seq in seqs],
            frequency=[seq.params.frequency_penalty for seq in seqs],
            repetition=[seq.params.repetition_penalty for seq in seqs]), torch.float32)
        device = self.config.device
        counts = torch.zeros(len(seqs), vocab_size, device=device)
        ones = torch.ones(len(ints["output_ids"]), device=device)  # made there, not uploaded
        counts.index_put_((index["output_rows"], index["output_ids"]), ones, accumulate=True)
        seen = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
        seen[index["seen_rows"], index["seen_ids"]] = True
        return Penalties(output_counts=counts, seen=seen, presence=values["presence"],
                         frequency=values["frequency"], repetition=values["repetition"])

    def _upload(self, host_lists: dict[str, list], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Named host lists -> device tensors of one dtype, by the same names: one pinned
        buffer, one non-blocking copy (on CUDA)."""
        flat = list(itertools.chain.from_iterable(host_lists.values()))
        pin = self.config.device.startswith("cuda")
        host = torch.tensor(flat, dtype=dtype, pin_memory=pin)
        device = host.to(self.config.device, non_blocking=True)
        sizes = [len(values) for values in host_lists.values()]
        return dict(zip(host_lists, device.split(sizes)))


# ----------------------------------------------------------------------------- offline API

def as_prompt_list(prompts) -> list:
    """One prompt (a string, a list of token ids, or a dict add_request takes) or a list of
    them -> a list of prompts; ValueError for anything else."""
    is_token_ids = isinstance(prompts, list) and bool(prompts) and type(prompts[0]) is int
    if isinstance(prompts, (str, dict)) or is_token_ids:
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those; "
                         f"got {prompts!r}")
    return list(prompts)


def progress_wanted(use_tqdm) -> bool:
    """Whether to draw the progress line: use_tqdm True or False says so; None (the default)
    only when stderr is a terminal, never into a pipe or a log."""
    if use_tqdm is None:
        return sys.stderr.isatty()
    if not isinstance(use_tqdm, bool):
        raise ValueError(f"use_tqdm must be None, True or False, got {use_tqdm!r}")
    return use_tqdm


class Progress:
    """A long job's progress: one line on stderr, redrawn in place ("\\r") at most 10 times a
    second (and whenever every prompt is done): prompts done of total, elapsed time, input
    tokens/s (a prompt counts once its first token is out) and output tokens/s. clear() blanks
    it, the cursor back at column 0: called before anything goes to stdout and at the end, so
    the line and the results never garble each other. Disabled, it draws nothing."""

    def __init__(self, total: int, enabled: bool):
        self.total = total      # prompts to serve (piped stdin adds each line it submits)
        self.enabled = enabled
        self.done = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.started = set()    # ids of the requests with output so far, not finished yet
        self.start = time.perf_counter()
        self.drawn_at = -math.inf
        self.width = 0          # characters on the line now: what clear() blanks

    def count(self, delta: RequestOutput) -> None:
        """Add a delta output's tokens: its prompt's with its request's first output."""
        if delta.request_id not in self.started:
            self.started.add(delta.request_id)
            self.input_tokens += len(delta.prompt_token_ids)
        for completion in delta.outputs:  # one sample's new tokens (a request may have n)
            self.output_tokens += len(completion.token_ids)
        if delta.finished:
            self.started.discard(delta.request_id)
            self.done += 1

    def draw(self) -> None:
        """Redraw the line, unless it was drawn under 0.1 s ago and prompts are left to do."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.drawn_at < 0.1 and self.done < self.total:
            return
        self.drawn_at = now
        elapsed = now - self.start
        line = (f"{self.done}/{self.total} prompts, {elapsed:.1f} s, input "
                f"{self.input_tokens / elapsed:.0f} tok/s, output "
                f"{self.output_tokens / elapsed:.0f} tok/s").ljust(self.width)
        print("\r" + line, end="", file=sys.stderr, flush=True)
        self.width = len(line)

    def clear(self) -> None:
        """Blank the line, the cursor back at column 0."""
        if not self.width:  # nothing drawn since the last clear
            return
        print("\r" + " " * self.width + "\r", end="", file=sys.stderr, flush=True)
        self.width = 0


class LLM:
    """vLLM's offline API: LLM(model=..., **EngineConfig fields).generate(prompts, params)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's sampling defaults (generation_config.json, unless
        --generation-config vllm) over SamplingParams' own, what generate() uses when given no
        params (there with max_tokens cut to each prompt's context: Engine.default_params)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 trace: bool = False, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Serve all prompts (any form add_request takes) as one batch; whole outputs, in order.
        params None: Engine.default_params for each prompt (the checkpoint's defaults). trace:
        print the step-by-step timeline to stderr at the end. use_tqdm (vLLM's name): the
        progress line on stderr (Progress); None: only when stderr is a terminal."""
        show_progress = progress_wanted(use_tqdm)
        prompts = as_prompt_list(prompts)
        if not isinstance(params, (list, tuple)):  # None: each prompt's default_params
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        whole = {}
        self.engine.step_records = [] if trace else None
        progress = Progress(len(prompts), show_progress)
        try:
            for prompt, prompt_params in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, prompt_params))
            while any(i not in whole or not whole[i].finished for i in ids):
                for delta in self.engine.step():
                    accumulate(whole, delta)
                    progress.count(delta)
                progress.draw()
        except BaseException:  # all or nothing: a failed or interrupted batch leaves nothing
            for request_id in ids:
                self.engine.abort(request_id, "withdrawn: generate() did not finish")
            if self.engine.dead is None:
                self.engine.step()
            raise
        finally:
            progress.clear()
        if trace:
            print(render_trace(self.engine.step_records, ids), file=sys.stderr)
        return [whole[i] for i in ids]


TRACE_LEGEND = "= prompt chunk  o generated token  * end  x preempted  . waiting  c cache hit"


def trace_mark(request_id: str, record: StepRecord) -> str:
    """What one step did for one request, as the trace draws it (TRACE_LEGEND)."""
    if request_id in record.preempted:
        return "x"
    if request_id in record.finished:
        return "*"
    if request_id in record.num_cached_tokens:
        return "c"
    if request_id in record.sampled:
        return "o"
    if request_id in record.scheduled:
        return "="
    return "."


def render_trace(records: list[StepRecord], request_ids: list[str]) -> str:
    """The timeline that continuous-batching diagrams draw: a row per request, a column per
    step (the requests are taken to have arrived before the first step), a step number
    every ten columns."""
    width = max(len(i) for i in [*request_ids, "request"])
    ruler = ""
    for n in range(len(records)):
        if n % 10 == 0:
            ruler += str(n // 10 % 10)
        else:
            ruler += " "
    rows = [f"{'request':>{width}} | {ruler.rstrip()}"]
    for request_id in request_ids:
        marks = ""
        for record in records:
            marks += trace_mark(request_id, record)
            if request_id in record.finished:
                break
        rows.append(f"{request_id:>{width}} | {marks}")
    return "\n".join(rows + ["", TRACE_LEGEND])


def accumulate(whole: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Add a delta output to its request's whole output so far, kept in `whole` by request id,
    each completion under its index (a request's n samples arrive interleaved, in any order).
    The deltas are left as they were (a whole completion starts as a copy of its first)."""
    request = whole.get(delta.request_id)
    if request is None:
        request = dataclasses.replace(delta, outputs=[])
        whole[delta.request_id] = request
    for new in delta.outputs:
        so_far = completion_at(request, new.index)
        if so_far is None:
            request.outputs.append(dataclasses.replace(new))
            request.outputs.sort(key=completion_index)
            continue
        so_far.text += new.text
        so_far.token_ids = so_far.token_ids + new.token_ids  # a new list: the first delta's stays
        if so_far.logprobs is not None:
            so_far.logprobs = so_far.logprobs + new.logprobs
        so_far.finish_reason = new.finish_reason
        so_far.stop_reason = new.stop_reason
    if delta.prompt_logprobs is not None:
        request.prompt_logprobs = delta.prompt_logprobs
    request.finished = delta.finished


def completion_at(request: RequestOutput, index: int) -> CompletionOutput | None:
    for completion in request.outputs:
        if completion.index == index:
            return completion
    return None


def completion_index(completion: CompletionOutput) -> int:
    return completion.index


# ----------------------------------------------------------------------------- HTTP server

MAX_BODY_BYTES = 1 << 20  # a larger request body is refused (413)
MAX_HEADER_BYTES = 64 << 10  # a larger header block is refused (431)
DRAIN_ANSWER_TIMEOUT = 10.0  # seconds a shutdown waits for aborted requests' answers (a step)
CORS_PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                  "Access-Control-Allow-Headers": "Authorization, Content-Type",
                  "Access-Control-Max-Age": "600"}
MAX_N = 64                # samples of one prompt in one request at most
CHAT_TURN_END = "\n\n"    # the chat template ends every turn with a blank line
TRANSCRIPT_ROLES = ("system", "user", "assistant")  # the roles of render_chat's transcript
TEMPLATE_ROLES = (*TRANSCRIPT_ROLES, "tool")        # a checkpoint's template may take tool results
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # transformers' special_tokens_map's names
# SamplingParams' fields a request may set, OpenAI's and vLLM's extra ones (top_k, min_p, ...)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                   "stop_token_ids", "include_stop_str_in_output", "logit_bias")
FIELDS = {"model", "n", "stream", "stream_options", "user", "stop", "logprobs",
          *SAMPLING_FIELDS}  # both endpoints serve these
CHAT_FIELDS = {"messages", "top_logprobs", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = {"prompt", "echo"}
NEUTRAL = dict(best_of=1, suffix="")  # accepted at these values only
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


class HTTPError(Exception):
    """Answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


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
    one call: one wake-up of the loop per step, however many streams are open. Not a daemon:
    stop() and join() end it before the process exits."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, deliver, died):
        super().__init__(name="engine")
        self.engine = engine
        self.loop = loop
        self.deliver = deliver  # called on the loop with each step's outputs
        self.died = died        # called on the loop with the EngineDeadError, if the engine dies
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # calls to run between steps; None: stop

    def run(self) -> None:
        while self._run_inbox():
            try:
                outputs = self.engine.step()
            except EngineDeadError as e:
                self.loop.call_soon_threadsafe(self.died, e)
                self._answer_until_stopped()
                return
            if outputs:
                self.loop.call_soon_threadsafe(self.deliver, outputs)

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

    def add(self, requests: list, ids: list[str]) -> None:
        """All of one HTTP request's sequences, or none of them: ValueError names what is wrong
        (EngineDeadError: the engine is gone)."""
        if self.engine.dead is not None:
            raise EngineDeadError(self.engine.dead)
        added = []
        try:
            for (prompt, params), request_id in zip(requests, ids):
                self.engine.add_request(prompt, params, request_id)
                added.append(request_id)
        except ValueError:
            self.abort(added, "another prompt of its request was refused")
            raise

    def abort(self, ids: list[str], reason: str) -> None:
        for request_id in ids:
            self.engine.abort(request_id, reason)

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
                  ("prompt_tokens_total", "counter", engine.stats.num_prompt_tokens),
                  ("generation_tokens_total", "counter", engine.stats.num_generated_tokens),
                  ("prefix_cache_queries_total", "counter", engine.stats.num_prompt_tokens),
                  ("prefix_cache_hits_total", "counter", engine.stats.num_cached_tokens),
                  ("num_preemptions_total", "counter", engine.scheduler.num_preemptions)]
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


def typed(body: dict, name: str, default, *kinds):
    """body[name] (absent or null: default); HTTPError 400 unless of one of the JSON kinds."""
    if (value := body.get(name)) is None:
        return default
    if type(value) not in kinds:
        raise HTTPError(400, f"{name} must be of type {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {value!r}", name)
    return value


def check_messages(messages, roles: tuple[str, ...]) -> None:
    """HTTPError 400 unless messages is a non-empty list of {"role": one of roles, "content":
    a string} (other keys are the template's to read)."""
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str)
            for m in messages):
        return
    names = ", ".join(f'"{role}"' for role in roles[:-1]) + f' or "{roles[-1]}"'
    raise HTTPError(400, f'messages must be a non-empty list of {{"role": {names}, "content": '
                    'a string}', "messages")


def render_chat(messages) -> str:
    """The chat template for a base model: every turn is "ROLE:\\n" + content + a blank line,
    then "ASSISTANT:\\n" for the model to go on; its reply ends at its own blank line."""
    check_messages(messages, TRANSCRIPT_ROLES)
    return "".join(f"{m['role'].upper()}:\n{m['content']}{CHAT_TURN_END}" for m in messages) \
        + "ASSISTANT:\n"


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers' mark of the assistant's text (for
    training masks), which some templates hold; rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def template_tojson(value, ensure_ascii=False, indent=None, separators=None,
                    sort_keys=False) -> str:
    """transformers' tojson filter: json.dumps' text, its arguments too (Jinja2's own filter
    escapes HTML characters, which a prompt must keep as they are)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message: str):
    """A template's refusal of a conversation (transformers' global): the request's error."""
    raise jinja2.TemplateError(message)


def strftime_now(fmt: str) -> str:
    """The local date and time as fmt writes it (transformers' global; Llama 3.x's templates
    put today's date in the system turn)."""
    return datetime.now().strftime(fmt)


def chat_template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Jinja2 set up as transformers' apply_chat_template sets it up: sandboxed (a template is
    a program that came with the checkpoint), trim_blocks and lstrip_blocks, {% break %} and
    {% continue %}, its tojson filter and its raise_exception and strftime_now globals."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationTag])
    env.filters["tojson"] = template_tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass
class ChatTemplate:
    """A checkpoint's chat template, compiled, and the special tokens' text it renders with."""
    template: jinja2.Template
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: tokenizer_config.json's
    source: str                     # the file it came from

    def render(self, messages: list[dict], kwargs: dict) -> str:
        """The prompt's text as transformers' apply_chat_template(messages,
        add_generation_prompt=True, **kwargs) renders it: the special tokens, tools and
        documents None, then kwargs (a request's chat_template_kwargs, which may set any of
        those: Qwen3's enable_thinking, say). ValueError with the template's message if it
        refuses the conversation."""
        context = self.special_tokens | dict(tools=None, documents=None,
                                             add_generation_prompt=True) | kwargs
        try:
            return self.template.render(context | dict(messages=messages))
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def load_chat_template(path: str | None) -> ChatTemplate | None:
    """The chat template of the checkpoint directory `path`, where transformers looks for it:
    chat_template.jinja, else tokenizer_config.json's chat_template. Compiled here, so a broken
    one is an error at start-up. None for a preset (path None) or a checkpoint with neither:
    chat is then render_chat's transcript."""
    if path is None:
        return None
    config_file = os.path.join(path, "tokenizer_config.json")
    config = read_json(config_file)
    source = os.path.join(path, "chat_template.jinja")
    if os.path.exists(source):
        with open(source, encoding="utf-8") as f:
            text = f.read()
    else:
        source = config_file
        text = default_chat_template(config.get("chat_template"), source)
    if text is None:
        return None
    try:
        template = chat_template_environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: the chat template does not compile: {e}") from None
    return ChatTemplate(template, special_tokens(config), source)


def default_chat_template(value, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates [{"name",
    "template"}, ...] of which chat uses the one named "default", as transformers does;
    ValueError naming the file for anything else."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        raise ValueError(f"{source}: chat_template must be a string or a list of "
                         f'{{"name": ..., "template": ...}}, got {value!r:.80}')
    named = {t["name"]: t["template"] for t in value}
    if "default" not in named:
        raise ValueError(f"{source}: no chat template is named default (the names: "
                         f"{', '.join(named)})")
    return named["default"]


def special_tokens(config: dict) -> dict[str, str]:
    """tokenizer_config.json's special tokens as a template sees them, by name (bos_token:
    "<s>", ...); a token written as an object ({"content": "<s>", ...}, older files) is its
    content. A template that reads one the file lacks gets Jinja2's empty undefined."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def chat_prompt(body: dict, template: ChatTemplate | None) -> str:
    """A chat request's prompt text: its messages through the checkpoint's template with its
    chat_template_kwargs, else render_chat's transcript (which takes no kwargs); HTTPError
    400 naming the field at fault."""
    kwargs = typed(body, "chat_template_kwargs", {}, dict)
    messages = body.get("messages")
    if template is None:
        return render_chat(messages)
    check_messages(messages, TEMPLATE_ROLES)
    try:
        return template.render(messages, kwargs)
    except ValueError as e:
        raise HTTPError(400, str(e), "messages") from None


def parse_request(body: dict, engine: Engine, model_name: str, chat: bool,
                  template: ChatTemplate | None, defaults: dict) -> tuple[list, dict]:
    """An OpenAI request -> its sequences [(prompt, SamplingParams)], n for each prompt, and
    how to answer (stream, include_usage, echo, logprobs k); HTTPError 400 if anything is off.
    A chat's prompt is the checkpoint's template, if any (template); a sampling field absent
    or null is the checkpoint's default, if any (defaults: default_sampling's)."""
    check_known_fields(body, chat)
    check_model(body, model_name)
    fields = defaults | {name: body[name] for name in SAMPLING_FIELDS
                         if body.get(name) is not None}
    fields["stop"] = typed(body, "stop", [], str, list)
    n = typed(body, "n", 1, int)
    echo = typed(body, "echo", False, bool)
    if chat:  # as token ids, encoded once and as the engine encodes text (special tokens too)
        prompts = [engine.tokenizer.encode(chat_prompt(body, template))]
        default_max_tokens = engine.max_tokens_within_context(defaults.get("max_tokens"),
                                                              len(prompts[0]))
        fields["max_tokens"] = chat_max_tokens(body, default_max_tokens)
        fields["logprobs"] = None
        if typed(body, "logprobs", False, bool):
            fields["logprobs"] = typed(body, "top_logprobs", 0, int)
    else:
        prompts = completion_prompts(body)
        fields["logprobs"] = typed(body, "logprobs", None, int)
        if (fields["logprobs"] or 0) > 5:  # OpenAI's limit for completions
            raise HTTPError(400, f"logprobs must be at most 5, got {fields['logprobs']}",
                            "logprobs")
        fields["prompt_logprobs"] = fields["logprobs"] if echo else None
    stream_options = typed(body, "stream_options", {}, dict)
    options = dict(stream=typed(body, "stream", False, bool), chat=chat, n=n,
                   k=fields["logprobs"] or 0, echo=echo,
                   include_usage=typed(stream_options, "include_usage", False, bool))
    transcript = chat and template is None  # a reply there ends at its turn's blank line
    params = sample_params(fields, n, transcript, typed(body, "top_logprobs", 0, int))
    if chat or body.get("max_tokens") is not None or "max_tokens" not in defaults:
        return [(prompt, params) for prompt in prompts], options
    return [(prompt, within_context(engine, prompt, params)) for prompt in prompts], options


def within_context(engine: Engine, prompt, params: SamplingParams) -> SamplingParams:
    """params with the checkpoint's default max_tokens (the request gave none) cut to what
    the prompt's context leaves (Engine.max_tokens_within_context)."""
    try:
        _, token_ids = engine.parse_prompt(prompt)
    except ValueError as e:
        raise HTTPError(400, str(e), "prompt") from None
    max_tokens = engine.max_tokens_within_context(params.max_tokens, len(token_ids))
    return dataclasses.replace(params, max_tokens=max_tokens)


def check_known_fields(body: dict, chat: bool) -> None:
    """HTTPError 400 naming the first field this endpoint does not serve (a NEUTRAL one is
    accepted at its neutral value)."""
    known = FIELDS | (CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for name, value in body.items():
        if name in known:
            continue
        if name not in NEUTRAL:
            raise HTTPError(400, f"{name} is not supported", name)
        if value not in (None, NEUTRAL[name]):
            raise HTTPError(400, f"{name} is not supported (only {NEUTRAL[name]!r})", name)


def chat_max_tokens(body: dict, default: int) -> int:
    """max_completion_tokens, else max_tokens, else `default` (the checkpoint's, or what the
    context has left, whichever is less: Engine.max_tokens_within_context)."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return body[name]
    return default


def completion_prompts(body: dict) -> list:
    """The completions endpoint's prompt field as a non-empty list of prompts."""
    prompt = body.get("prompt")
    if isinstance(prompt, (str, list)):
        prompts = as_prompt_list(prompt)
        if prompts:
            return prompts
    raise HTTPError(400, "prompt must be a string, a list of token ids, or a non-empty list of "
                    "those", "prompt")


def sample_params(fields: dict, n: int, transcript: bool, top_logprobs: int) -> SamplingParams:
    """The request's SamplingParams (its n samples are the engine's fan-out: sample i of a
    seeded request uses seed + i); a reply in render_chat's transcript also stops at the end
    of its turn. HTTPError 400 naming a bad field."""
    try:
        check_int("n", n, 1, MAX_N)
        check_int("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
        params = SamplingParams(n=n, **fields)
    except ValueError as e:
        bad_field = next((f for f in [*fields, "n", "top_logprobs"] if str(e).startswith(f)), None)
        raise HTTPError(400, str(e), bad_field) from None
    if transcript:
        params = dataclasses.replace(params, stop=params.stop + [CHAT_TURN_END])
    return params


def token_text(tokenizer, token_id: int) -> str:
    """A token as text (a special token's too, as vLLM's logprobs write <|endoftext|>); as
    OpenAI writes it, "bytes:\\xe2\\x80" if it is not UTF-8 alone."""
    data = tokenizer.token_bytes(token_id, skip_special_tokens=False)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def logprob_value(item: tuple[int, float]) -> float:
    return item[1]


def logprobs_json(tokenizer, token_ids: list[int], entries: list, k: int, chat: bool,
                  offset: int = 0) -> dict:
    """Each token's log-probability and the top k, in OpenAI's completions or chat shape (text
    offsets start at `offset`: the characters that earlier chunks of the choice held). An
    entry is {token id: log-probability}; the first prompt token's is None."""
    tops = []
    for entry in entries:
        if entry is None:
            tops.append(None)
        else:
            tops.append(sorted(entry.items(), key=logprob_value, reverse=True)[:k])
    if chat:
        content = []
        for token_id, entry, top in zip(token_ids, entries, tops):
            item = chat_logprob_item(tokenizer, token_id, entry[token_id])
            item["top_logprobs"] = [chat_logprob_item(tokenizer, t, lp) for t, lp in top]
            content.append(item)
        return dict(content=content)
    token_logprobs = []
    top_logprobs = []
    for token_id, entry, top in zip(token_ids, entries, tops):
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(entry[token_id])
            top_logprobs.append({token_text(tokenizer, t): lp for t, lp in top})
    text_offset = [offset + len(tokenizer.decode(token_ids[:i], skip_special_tokens=False))
                   for i in range(len(entries))]  # as vLLM's: the lengths of the tokens' texts
    return dict(tokens=[token_text(tokenizer, t) for t in token_ids],
                token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                text_offset=text_offset)


def chat_logprob_item(tokenizer, token_id: int, logprob: float) -> dict:
    return dict(token=token_text(tokenizer, token_id), logprob=logprob,
                bytes=list(tokenizer.token_bytes(token_id, skip_special_tokens=False)))


def choice(tokenizer, index: int, out: RequestOutput, completion: CompletionOutput,
           options: dict, first: bool, offset=0) -> dict:
    """One choice (`completion`, one of out's samples) of a response, or of a stream's chunk
    (then from a delta, `offset` characters into the choice's text)."""
    token_ids = completion.token_ids
    entries = completion.logprobs
    text = completion.text
    if first and options["echo"]:  # the prompt (and its log-probabilities) first
        token_ids = out.prompt_token_ids + token_ids
        # the prompt as written, or its ids' text with the special tokens (as /detokenize's)
        prompt = out.prompt or tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        text = prompt + text
        if entries is not None:
            entries = out.prompt_logprobs + entries
    logprobs = None
    if entries is not None:
        logprobs = logprobs_json(tokenizer, token_ids, entries, options["k"],
                                 options["chat"], offset)
    if not options["chat"]:
        return dict(index=index, text=text, logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason)
    message = dict(content=text)
    if first:
        message = dict(role="assistant", content=text)
    message_key = "delta" if options["stream"] else "message"
    return {"index": index, message_key: message, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def usage_of(ids: list[str], whole: dict[str, RequestOutput]) -> dict:
    """OpenAI's usage of one HTTP request: each prompt once, every sample's tokens."""
    prompt_tokens = sum(len(whole[i].prompt_token_ids) for i in ids)
    completion_tokens = sum(len(c.token_ids) for i in ids for c in whole[i].outputs)
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


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
        headers[name.lower()] = value.strip()
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
        self.waiting: ServedRequest | None = None  # woken if the client goes
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
    """One HTTP request's sequences as the loop sees them: the outputs the engine thread
    delivered that are not yet written, and the event that wakes the coroutine answering."""
    ids: list[str]
    outputs: list[RequestOutput] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended_by_server: bool = False         # a shutdown aborted it: not a failure
    dead: EngineDeadError | None = None   # the engine died under it


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


def error_body(error: "HTTPError") -> dict:
    """OpenAI's error body."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": dict(message=str(error), type=kind, param=error.param, code=error.status)}


class Server:
    """OpenAI's API on one asyncio event loop: every connection is a coroutine on it; the
    engine runs on its EngineThread, which hands each step's outputs to the loop in one call
    (deliver). Requests and aborts go the other way, through the thread's inbox. run() serves
    until shutdown() (SIGTERM, SIGINT) or until the engine dies."""
    ROUTES = {"/health": ("GET", "health"), "/version": ("GET", "version"),
              "/v1/models": ("GET", "models"), "/metrics": ("GET", "metrics"),
              "/tokenize": ("POST", "tokenize"), "/detokenize": ("POST", "detokenize"),
              "/v1/completions": ("POST", "completions"),
              "/v1/chat/completions": ("POST", "chat_completions")}
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
        self.request_numbers = itertools.count()
        self.draining = False
        self.dead: EngineDeadError | None = None

    # -- lifetime

    async def run(self) -> None:
        """Listen, serve until shutdown() or the engine's death, drain, stop the engine
        thread. Raises EngineDeadError if the engine died."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.shutdown_asked = loop.create_future()  # its result: seconds to let requests run
        self.idle = asyncio.Event()                 # set whenever nothing is in flight
        self.idle.set()
        self.engine_thread = EngineThread(self.engine, loop, self.deliver, self.engine_died)
        listener = await loop.create_server(partial(ClientProtocol, self), self.config.host,
                                            self.config.port, backlog=256)
        host, port = listener.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self.shutdown, self.config.shutdown_timeout)
            loop.add_signal_handler(signal.SIGINT, self.shutdown, 0)
        self.engine_thread.start()
        try:
            print(f"serving {self.model_name} on {self.url}", file=sys.stderr, flush=True)
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
            served.ended_by_server = True
            self.engine_thread.inbox.put(partial(self.engine_thread.abort, served.ids,
                                                 "the server is shutting down"))
        with contextlib.suppress(asyncio.TimeoutError):  # the next step ends them all
            await asyncio.wait_for(self.idle.wait(), DRAIN_ANSWER_TIMEOUT)
        for writer in list(self.connections):
            writer.close()
        await asyncio.sleep(0)  # the connections' coroutines see the close and end

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
        exchange.send(200, dict(object="list", data=[dict(
            id=self.model_name, object="model", created=self.created, owned_by="nanoserve",
            max_model_len=self.engine.max_model_len)]))

    async def metrics(self, exchange: Exchange) -> None:
        lines = await self.engine_thread.call(self.engine_thread.gauges)
        for name, histogram in self.histograms.items():
            lines += histogram.lines("nanoserve:" + name)
        exchange.send(200, "\n".join(lines) + "\n", "text/plain; version=0.0.4")

    async def tokenize(self, exchange: Exchange) -> None:
        """vLLM's /tokenize: a prompt's (or chat's) token ids, as the engine encodes them."""
        body = json_body(exchange.request)
        check_model(body, self.model_name)
        if "messages" in body:
            text = chat_prompt(body, self.engine.chat_template)
        else:
            text = typed(body, "prompt", None, str)
        if text is None:
            raise HTTPError(400, "give a prompt (a string) or messages", "prompt")
        tokens = self.engine.tokenizer.encode(text)
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
        requests, options = parse_request(body, self.engine, self.model_name, chat,
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
            await self.add(served, requests, chat)
            head = dict(id=f"cmpl-{served.ids[0]}", object="text_completion")
            if chat and options["stream"]:
                head = dict(id=f"chatcmpl-{served.ids[0]}", object="chat.completion.chunk")
            elif chat:
                head = dict(id=f"chatcmpl-{served.ids[0]}", object="chat.completion")
            head |= dict(created=int(time.time()), model=self.model_name)
            await self.respond(exchange, served, head, options)
        except Exception:  # refused (nothing to abort), or a bug here: its blocks are freed
            self.abort(served, "the server could not answer")
            raise
        finally:
            self.forget(served)

    async def add(self, served: ServedRequest, requests: list, chat: bool) -> None:
        """Hand the request's sequences to the engine; HTTPError if it refuses them."""
        try:
            await self.engine_thread.call(self.engine_thread.add, requests, served.ids)
        except ValueError as e:  # the prompt's, unless a token id field's (checked here)
            param = "messages" if chat else "prompt"
            for name in ("stop_token_ids", "logit_bias"):
                if str(e).startswith(name):
                    param = name
            raise HTTPError(400, str(e), param) from None
        except EngineDeadError as e:
            raise HTTPError(500, str(e)) from None

    def forget(self, served: ServedRequest) -> None:
        """The request is answered (or its client gone): the loop lets go of it."""
        for request_id in served.ids:
            self.requests.pop(request_id, None)
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
                self.abort(served, "the client disconnected")
                return
            if served.dead is not None:
                self.fail(exchange, served, str(served.dead))
                return
            outputs = served.outputs
            served.outputs = []
            for out in outputs:
                failure = self.failure(served, out)
                if failure is not None:
                    self.fail(exchange, served, failure)
                    return
                if stream:
                    self.stream_delta(exchange, head, out, options, first_choice[out.request_id],
                                      num_sent)
                accumulate(whole, out)
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
                     first_choice: int, num_sent: dict) -> None:
        """A chunk for each sample in a delta; num_sent[(request id, sample)]: the characters
        of that choice streamed so far (its logprobs' text offsets go on from there)."""
        for completion in out.outputs:
            key = (out.request_id, completion.index)
            offset = num_sent.get(key, 0)
            chunk = choice(self.engine.tokenizer, first_choice + completion.index, out,
                           completion, options, key not in num_sent, offset)
            num_sent[key] = offset + len(chunk.get("text", ""))
            exchange.event(head | dict(choices=[chunk]))

    @staticmethod
    def failure(served: ServedRequest, out: RequestOutput) -> str | None:
        """Why the engine failed this sequence (its error), or None: it did not, or was ended
        by a shutdown (then its "abort" is an answer, not a failure)."""
        if served.ended_by_server:
            return None
        for completion in out.outputs:
            if completion.finish_reason == "abort":
                return completion.stop_reason
        return None

    def fail(self, exchange: Exchange, served: ServedRequest, message: str) -> None:
        """The engine failed the request: a 500, or, once streaming, an error event then
        [DONE] (as vLLM does); its other sequences are aborted."""
        self.abort(served, "another sequence of its request failed")
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
        self.abort(served, "the client stopped reading")

    def abort(self, served: ServedRequest, reason: str) -> None:
        """Abort the request's sequences (their blocks are free after the next step) and let
        go of it: nothing more is written."""
        self.engine_thread.inbox.put(partial(self.engine_thread.abort, served.ids, reason))
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
        if any(completion.finish_reason == "abort" for completion in out.outputs):
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
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return body


def check_model(body: dict, model_name: str) -> None:
    """vLLM's 404 for a request naming a model this server does not serve."""
    name = typed(body, "model", model_name, str)
    if name != model_name:
        raise HTTPError(404, f"The model `{name}` does not exist.", "model")


def serve(engine: Engine, config: ServerConfig) -> None:
    """--serve: OpenAI's API until SIGTERM (requests in flight get config.shutdown_timeout
    seconds) or SIGINT (at once), or until the engine dies (EngineDeadError, raised after
    every open request got a 500)."""
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"warning: bound to {config.host}: anyone who can reach this machine can use "
              "the server (give it an --api-key)", file=sys.stderr)
    asyncio.run(Server(engine, config).run())
    print("server stopped", file=sys.stderr)


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="nanoserve: continuous batching over a paged KV "
                                "cache", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = partial(argparse_error, p)  # one line, no usage dump
    p.add_argument("--prompt", action="append", help="a prompt; repeat it to serve several "
                   "together as one batch; none: prompts from stdin (at a terminal, a REPL)")
    p.add_argument("--jsonl", action="store_true", help="stdin and stdout: a JSON object a "
                   "line; prompt and SamplingParams fields in; text, token ids, finish out")
    p.add_argument("--trace", action="store_true", help="with --prompt: the step-by-step "
                   "timeline at the end (to stderr)")
    p.add_argument("--serve", action="store_true", help="serve OpenAI's API over HTTP")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch CPU threads: half the cores, so a busy core does not stall steps")
    sampling = p.add_argument_group("sampling (SamplingParams; a flag not given: the "
                                    "checkpoint's generation_config.json value, else the "
                                    "command line's own default, shown)")
    sampling.add_argument("--max-tokens", type=int, default=argparse.SUPPRESS,
                          help="default: the checkpoint's max_new_tokens, else 200; at most "
                          "what the context has left")
    sampling.add_argument("--stop", action="append", help="stop before this string (repeatable)")
    sampling.add_argument("--stop-token-ids", type=int, nargs="+", metavar="ID",
                          help="stop after any of these tokens")
    # logit_bias is a map: --jsonl lines, the REPL's /set and the HTTP API take it
    add_config_args(sampling, SamplingParams, skip=(
        "max_tokens", "stop", "seed", "logprobs", "prompt_logprobs", "stop_token_ids",
        "logit_bias"))
    p.set_defaults(temperature=0.8, top_p=0.95)
    engine = p.add_argument_group("engine (EngineConfig)")
    add_config_args(engine, EngineConfig)
    # vLLM's spelling of --no-enable-prefix-caching, accepted but not listed twice in --help
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    server = p.add_argument_group("server, with --serve (ServerConfig)")
    add_config_args(server, ServerConfig)
    return with_sampling_given(p, argv)


def with_sampling_given(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parsed flags, and as args.sampling_given the sampling flags the command line gave
    ({name: value}): the checkpoint's defaults go under those and over the rest. argparse sets a
    flag's default only where the namespace lacks its name, and a flag given is never None, so
    a name left None was not given: then it gets its default here."""
    names = (*CLI_SAMPLING, "max_tokens")
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(names, None)))
    args.sampling_given = {name: getattr(args, name) for name in names
                           if getattr(args, name) is not None}
    for name in CLI_SAMPLING:
        if getattr(args, name) is None:
            setattr(args, name, parser.get_default(name))
    return args


def argparse_error(parser: argparse.ArgumentParser, message: str) -> None:
    parser.exit(2, f"error: {message}\n")


# Control characters (random weights emit any byte) print as visible escapes, not raw.
VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}
CLI_MAX_TOKENS = 200  # the command line's max_tokens, unless a flag, the checkpoint or the
                      # context says otherwise
CLI_SAMPLING = ("n", "temperature", "top_k", "top_p", "stop", "ignore_eos", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                "stop_token_ids", "include_stop_str_in_output")  # the flags cli_params reads


def cli_params(engine: Engine, args: argparse.Namespace, prompt, **fields) -> SamplingParams:
    """The command line's sampling for a prompt: each field from `fields` (a --jsonl line's,
    the REPL's /set), else the flag if given, else the checkpoint's default (default_sampling),
    else the command line's own (the flags' defaults; max_tokens 200). A default max_tokens is
    at most what the context leaves (at least 1: a prompt too long then says why)."""
    _, token_ids = engine.parse_prompt(prompt)
    defaults = {name: getattr(args, name) for name in CLI_SAMPLING}
    defaults |= dict(max_tokens=CLI_MAX_TOKENS) | engine.sampling_defaults
    defaults["max_tokens"] = engine.max_tokens_within_context(defaults["max_tokens"],
                                                              len(token_ids))
    return SamplingParams(**defaults | args.sampling_given | fields)


def line_params(engine: Engine, args: argparse.Namespace, prompt, **fields) -> SamplingParams:
    """cli_params for a piped line or a REPL prompt, which print one completion each."""
    params = cli_params(engine, args, prompt, **fields)
    if params.n > 1:
        raise ValueError(f"n is {params.n}, but piped lines and the REPL print one completion "
                         "each; n above 1 is for --prompt, the Python API and the server")
    return params


def run_prompts(engine: Engine, args: argparse.Namespace) -> None:
    """Serve every --prompt as one batch; stream each one's samples in turn (--n: each under
    its index); a summary, Ctrl-C or not."""
    ids = [engine.add_request(prompt, cli_params(engine, args, prompt)) for prompt in args.prompt]
    samples = [(k, request_id, index) for k, request_id in enumerate(ids)
               for index in range(args.n)]  # in the order they print
    later = {(request_id, index): [] for _, request_id, index in samples}  # deltas not printed
    current = 0  # the sample being printed
    start = time.perf_counter()
    if args.trace:
        engine.step_records = []
    print(sample_heading(args, 0, 0), end="", flush=True)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                for completion in out.outputs:
                    later[(out.request_id, completion.index)].append(completion)
            while current < len(samples) and later[samples[current][1:]]:
                completion = later[samples[current][1:]].pop(0)
                print_delta(completion)
                if completion.finish_reason is None:
                    continue
                current += 1
                if current < len(samples):  # the next sample, which prints next
                    prompt_number, _, index = samples[current]
                    print(sample_heading(args, prompt_number, index), end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", end="", file=sys.stderr)
        print_summary(engine, time.perf_counter() - start, ids if args.trace else None)
        raise
    print_summary(engine, time.perf_counter() - start, ids if args.trace else None)


def sample_heading(args: argparse.Namespace, prompt_number: int, index: int) -> str:
    """What prints before a sample's text: its prompt, before the prompt's first sample (after
    a blank line, but for the very first); with --n above 1, the sample's index too."""
    heading = ""
    if index == 0:
        heading = args.prompt[prompt_number].translate(VISIBLE)
    if index == 0 and prompt_number > 0:
        heading = "\n\n" + heading
    if args.n > 1:
        heading += f"\n[{index}] "
    return heading


def print_delta(completion: CompletionOutput) -> None:
    """A delta's new text, as it comes; why a request aborted, on stderr."""
    print(completion.text.translate(VISIBLE), end="", flush=True)
    if completion.finish_reason == "abort":
        print(f"\n[{completion.stop_reason}]", file=sys.stderr)


def print_summary(engine: Engine, elapsed: float, trace_ids: list[str] | None) -> None:
    """The run's figures on stderr, then the trace of trace_ids if given."""
    stats = engine.stats
    hit_rate = stats.num_cached_tokens / stats.num_prompt_tokens
    print(f"\n\n[{stats.num_prompt_tokens} prompt + {stats.num_generated_tokens} generated "
          f"tokens in {elapsed:.2f} s, {stats.num_generated_tokens / elapsed:.1f} tok/s, "
          f"{stats.num_steps} steps, peak batch {stats.peak_batch_size}, "
          f"{engine.scheduler.num_preemptions} preemptions, prefix cache hits {hit_rate:.0%}; "
          f"KV cache {engine.kv_cache_tokens} tokens, {kv_cache_description(engine)}]",
          file=sys.stderr)
    if trace_ids is not None:
        print(render_trace(engine.step_records, trace_ids), file=sys.stderr)


def kv_cache_description(engine: Engine) -> str:
    """How many tokens a GiB of KV cache holds, and why: "16384 a GiB (2 K/V heads for 8)"."""
    c = engine.model.config
    return f"{engine.kv_tokens_per_gib} a GiB ({c.n_kv_head} K/V heads for {c.n_head})"


def read_lines(stream, lines: queue.Queue) -> None:
    """Put each line of stream into `lines`, then None for the end (a thread's target)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def arrived_lines(lines: queue.Queue, wait: bool) -> list[str | None]:
    """The lines read so far (None: the end of input); with `wait`, at least one."""
    arrived = []
    try:
        arrived.append(lines.get(block=wait))
        while True:
            arrived.append(lines.get_nowait())
    except queue.Empty:
        pass
    return arrived


def run_stdin(engine: Engine, args: argparse.Namespace) -> tuple[int, int]:
    """Piped stdin: each line is submitted as it is read, all served as one continuous batch;
    each completion is printed whole, in input order, an error in its place (--jsonl: a JSON
    object a line in and out, an error as {"error": ...}, blank lines skipped; else errors go
    to stderr). When stderr is a terminal, it shows the progress line (Progress), blanked
    before each result is printed and at the end. Returns (lines that failed, lines submitted)."""
    progress = Progress(0, sys.stderr.isatty())
    try:
        return serve_stdin(engine, args, progress)
    finally:
        progress.clear()


def serve_stdin(engine: Engine, args: argparse.Namespace, progress: Progress) -> tuple[int, int]:
    """run_stdin's loop: read, submit, step, print in order; `progress` counts and draws."""
    lines = queue.Queue()
    threading.Thread(target=read_lines, args=(sys.stdin, lines), daemon=True).start()
    whole = {}          # request id -> its whole output so far
    result_index = {}   # request id -> its place in results
    results = []        # per submitted line: None while it runs, then its output or error
    line_number = 0
    num_printed = 0
    num_failed = 0
    eof = False
    while not eof or engine.has_unfinished():
        if not eof:  # take the lines that have arrived; wait for one only when idle
            for line in arrived_lines(lines, wait=not engine.has_unfinished()):
                line_number += 1
                if line is None:
                    eof = True
                elif line.strip() or not args.jsonl:  # --jsonl skips blank lines
                    submitted = submit_line(engine, args, line, line_number)
                    if isinstance(submitted, ValueError):
                        results.append(submitted)
                    else:  # a request id
                        result_index[submitted] = len(results)
                        results.append(None)
                        progress.total += 1
        for delta in engine.step():
            accumulate(whole, delta)
            progress.count(delta)
            if delta.finished:
                results[result_index.pop(delta.request_id)] = whole.pop(delta.request_id)
        while num_printed < len(results) and results[num_printed] is not None:
            result = results[num_printed]
            progress.clear()
            print_result(result, args.jsonl)
            num_printed += 1
            if isinstance(result, ValueError) or result.outputs[0].finish_reason == "abort":
                num_failed += 1
        progress.draw()
    return num_failed, len(results)


def submit_line(engine: Engine, args: argparse.Namespace, line: str, line_number: int
                ) -> str | ValueError:
    """Queue one line's request: its request id, or the error (naming the line)."""
    try:
        fields = {"prompt": line.rstrip("\r\n")}
        if args.jsonl:
            fields = parse_jsonl_line(line)
        prompt = fields.pop("prompt")
        return engine.add_request(prompt, line_params(engine, args, prompt, **fields))
    except ValueError as e:
        return ValueError(f"line {line_number}: {e}")


def parse_jsonl_line(line: str) -> dict:
    """A --jsonl line: a JSON object of "prompt" and SamplingParams fields; ValueError naming
    what is wrong."""
    try:
        fields = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(fields, dict) or "prompt" not in fields:
        raise ValueError('a line must be a JSON object with a "prompt"')
    allowed = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = [name for name in fields if name != "prompt" and name not in allowed]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; a line holds \"prompt\" and any of "
                         f"{', '.join(allowed)}")
    return fields


def print_result(result: RequestOutput | ValueError, jsonl: bool) -> None:
    """A finished line: its whole completion, or its error."""
    if isinstance(result, ValueError):
        if jsonl:
            print(json.dumps({"error": str(result)}), flush=True)
        else:
            print(f"error: {result}", file=sys.stderr)
        return
    completion = result.outputs[0]
    if jsonl:
        print(json.dumps(dict(
            prompt=result.prompt, text=completion.text, token_ids=completion.token_ids,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            logprobs=completion.logprobs, prompt_logprobs=result.prompt_logprobs)), flush=True)
    else:
        text = (result.prompt or "") + completion.text
        print(text.translate(VISIBLE), end="\n\n", flush=True)


REPL_HELP = ("/set NAME VALUE sets a sampling field (max_tokens, temperature, top_k, top_p, "
             "min_p, seed, stop, ignore_eos, presence_penalty, frequency_penalty, "
             "repetition_penalty, min_tokens, stop_token_ids, logit_bias, ...; /set NAME alone "
             "resets it), /help, /quit.\nCtrl-C stops a completion; at the prompt, Ctrl-C or "
             "Ctrl-D ends.")
REPL_CHAT_HELP = ("A chat, through the checkpoint's chat template: each line is your turn in "
                  "one conversation; /clear starts a new one.")


def run_terminal(engine: Engine, args: argparse.Namespace) -> None:
    """At a terminal: each line is a prompt whose completion streams as it is generated. With
    the checkpoint's chat template, a chat: each line is the user's turn in one conversation,
    which the template renders whole; the reply streams, then joins the conversation (one that
    Ctrl-C stopped is dropped, with its turn)."""
    settings = {}
    template = engine.chat_template
    conversation = []  # with a template: the user's turns and the replies so far
    print(REPL_HELP if template is None else f"{REPL_HELP}\n{REPL_CHAT_HELP}")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() == "/clear" and template is not None:
            conversation.clear()
            print("a new conversation")
            continue
        if line.startswith("/"):
            if line.strip() == "/quit":
                return
            print(repl_command(line, settings, engine, args))
            continue
        turn = [dict(role="user", content=line)]
        try:
            prompt = line if template is None else template.render(conversation + turn, {})
            request_id = engine.add_request(prompt, line_params(engine, args, prompt, **settings))
        except ValueError as e:
            print(f"error: {e}")
            continue
        reply = stream_completion(engine, request_id)
        if template is not None and reply is not None:
            conversation += turn + [dict(role="assistant", content=reply)]


def stream_completion(engine: Engine, request_id: str) -> str | None:
    """Step until the request ends, printing its text as it comes: the whole text, or None if
    Ctrl-C stopped it (its blocks freed; back to the prompt)."""
    text = ""
    try:
        while engine.has_unfinished():
            for out in engine.step():
                text += out.outputs[0].text
                print(out.outputs[0].text.translate(VISIBLE), end="", flush=True)
    except KeyboardInterrupt:
        engine.abort(request_id, "interrupted")
        engine.step()
        print("\n[interrupted]")
        return None
    print()
    return text


def repl_command(line: str, settings: dict, engine: Engine, args: argparse.Namespace) -> str:
    """/set NAME [VALUE] or /help: the reply. A value is JSON (0.7, 5, true, null); stop's is
    a string with escapes (/set stop \\n\\n)."""
    words = line.split(maxsplit=2)
    command = words[0]
    name = words[1] if len(words) > 1 else ""
    value = words[2] if len(words) > 2 else ""
    if command == "/help":
        return REPL_HELP + "\nnow: " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
    if command != "/set" or name not in {f.name for f in dataclasses.fields(SamplingParams)}:
        return f"error: unknown command {line!r}; /help lists them"
    if not value:
        settings.pop(name, None)
        return f"{name} reset"
    try:
        parsed = [codecs.decode(value, "unicode_escape")] if name == "stop" else json.loads(value)
        line_params(engine, args, "", **settings | {name: parsed})  # validates
    except ValueError as e:
        return f"error: {e}"
    settings[name] = parsed
    return f"{name} = {parsed!r}"


def main(argv=None) -> None:
    """Errors: one "error: ..." line, status 2; piped lines that failed: status 1. Ctrl-C:
    status 130. A closed stdout: quiet."""
    args = parse_args(argv)
    try:
        check_int("--threads", args.threads, 1)
        if args.trace and not args.prompt:
            raise ValueError("--trace needs --prompt")
        if args.serve and args.prompt:
            raise ValueError("--serve takes no --prompt")
        torch.set_num_threads(args.threads)
        config = EngineConfig(**{f.name: getattr(args, f.name)
                                 for f in dataclasses.fields(EngineConfig)})
        server_config = ServerConfig(**{f.name: getattr(args, f.name)
                                        for f in dataclasses.fields(ServerConfig)})
        engine = Engine(config)
        if args.serve:  # the server says which defaults it took as it starts
            serve(engine, server_config)
            return
        print_sampling_defaults(engine.sampling_defaults)
        if args.prompt:
            run_prompts(engine, args)
        elif sys.stdin.isatty() and not args.jsonl:
            run_terminal(engine, args)
        else:
            num_failed, num_lines = run_stdin(engine, args)
            if num_failed:
                print(f"error: {num_failed} of {num_lines} lines failed", file=sys.stderr)
                sys.exit(1)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no 2nd error at exit
        sys.exit(1)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except EngineDeadError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

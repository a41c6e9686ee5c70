"""nanoserve: the engine, its offline API and its command line.

`Engine.step()` is the whole serving algorithm, one iteration at a time: schedule (which
tokens of which sequences run now), execute (build the inputs, run the model once over every
scheduled token, sample one token for each sequence whose prompt is fully computed), update
(advance, append, detokenize, finish and free). Everything else (LLM.generate, the command
line) is a `while engine.has_unfinished(): engine.step()`.

    python nanoserve.py --prompt "ROMEO:" --prompt "JULIET:" --max-tokens 200

The offline API has vLLM's shape and argument names, so moving to vLLM is an import away:

    from nanoserve import LLM, SamplingParams
    outputs = LLM().generate(["ROMEO:"], SamplingParams(max_tokens=64, temperature=0))
    print(outputs[0].outputs[0].text)
"""
import argparse
import codecs
import ctypes
import dataclasses
import itertools
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from kernels import AttentionMetadata, select_attention
from model import PRESETS, load_model
from paged_cache import BlockAllocator, BlockTable, allocate_kv_cache, cdiv
from scheduler import POLICIES, Scheduler, Sequence, SequenceStatus

KV_CACHE_BYTES = 1 << 30  # the default KV cache's memory budget: 1 GiB
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


# ----------------------------------------------------------------------------- validation

def check_int(name: str, value, low: int, high: float = math.inf) -> None:
    """ValueError naming `name` unless value is an int (bools are not) in [low, high]."""
    if type(value) is not int or not low <= value <= high:
        bound = f"in [{low}, {high}]" if high < math.inf else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """ValueError naming `name` unless value is a finite real number in its range."""
    ok = type(value) in (int, float) and math.isfinite(value) and value <= high \
        and (value > low if low_open else value >= low)
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if low_open else '['}{low}, {high}], "
                         f"got {value!r}")


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM and the OpenAI API name it. temperature 0 is greedy."""
    max_tokens: int = 16                  # tokens to generate at most
    temperature: float = 1.0              # 0 (or below 1e-5): greedy (argmax)
    top_k: int = 0                        # keep the k most likely tokens; 0 or -1: all
    top_p: float = 1.0                    # keep the smallest set with probability >= top_p
    seed: int | None = None               # per-request RNG: same tokens whatever the batch
    stop: list[str] = field(default_factory=list)  # stop before any of these strings
    ignore_eos: bool = False              # keep going after <|endoftext|>

    def __post_init__(self):
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0, math.inf)
        check_float("top_p", self.top_p, 0, 1, low_open=True)
        check_int("top_k", self.top_k, -1)
        self.top_k = max(self.top_k, 0)   # vLLM's -1 and 0 both mean off
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**64 - 1)
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        try:
            self.stop = list(stop)  # any iterable, read once (a generator is used up here)
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}") from None
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


def option(default, help: str, **argparse_kwargs):
    """A config field that is also a command-line flag: its default and help live here only."""
    return field(default=default, metadata=dict(help=help, **argparse_kwargs))


@dataclass
class EngineConfig:
    """How the engine is built, with vLLM's argument names where vLLM has one."""
    model: str | None = option(None, "checkpoint directory or gpt2[-medium|-large|-xl]; "
                               "default: the shipped Shakespeare model", type=str)
    preset: str | None = option(None, "random seeded weights of this shape instead",
                                choices=list(PRESETS))
    device: str = option("cuda" if torch.cuda.is_available() else "cpu", "cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto: float32 on CPU, bfloat16 on CUDA",
                        choices=["auto", *DTYPES])
    attention: str = option("auto", "paged attention backend; auto: torch on CPU, Triton on "
                            "CUDA (on a CPU, Triton runs in its slow interpreter)",
                            choices=["auto", "torch", "triton"])
    max_model_len: int | None = option(None, "longest prompt + output in tokens; default: "
                                       "the model's context", type=int)
    block_size: int = option(16, "tokens per KV block")
    kv_cache_tokens: int | None = option(None, "KV cache capacity in tokens; default: "
                                         "max-num-seqs full contexts, within 1 GiB", type=int)
    max_num_seqs: int = option(64, "sequences in one step at most")
    max_num_batched_tokens: int = option(512, "tokens in one step at most (the token budget)")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps")
    policy: str = option("fcfs", "scheduling policy", choices=list(POLICIES))
    seed: int = option(0, "seeds random weights and every request without a seed of its own")

    def __post_init__(self):
        if self.model is not None and self.preset is not None:
            raise ValueError("give a model or a preset, not both")
        for name in ("model", "preset", "device", "dtype", "attention", "policy"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_cache_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0, 2**64 - 1)
        if type(self.enable_chunked_prefill) is not bool:
            raise ValueError(f"enable_chunked_prefill must be True or False, "
                             f"got {self.enable_chunked_prefill!r}")
        choices = {"preset": PRESETS, "policy": POLICIES, "dtype": ["auto", *DTYPES],
                   "attention": ["auto", "torch", "triton"]}
        for name, allowed in choices.items():
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; "
                                 f"choose one of {', '.join(allowed)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"block_size ({self.block_size} tokens) is larger than the KV "
                             f"cache (kv_cache_tokens={self.kv_cache_tokens})")
        self._check_device()
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.attention == "triton" and self.device == "cpu" and self.dtype == "bfloat16":
            raise ValueError("Triton attention cannot run bfloat16 on a CPU (its interpreter "
                             "multiplies bf16 wrongly); use --dtype float32 or float16")

    def _check_device(self) -> None:
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"unknown device {self.device!r}; use cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not supported; use cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available on this machine")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")


@dataclass
class CompletionOutput:
    """What a request produced since its previous output (a delta, as vLLM's
    RequestOutputKind.DELTA), or in all (what LLM.generate returns)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None     # "stop", "length", "abort" or None while running
    stop_reason: str | None = None  # the stop string that ended it, or why it was aborted


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


# ----------------------------------------------------------------------------- text

class Detokenizer:
    """A request's output text, decoded a token at a time: each step costs what its new tokens
    cost, not what the whole output does. An unfinished UTF-8 character waits in the decoder;
    a stop string is looked for only where a new one can be (the new text and the longest
    stop string's overlap with the text before it), and text that could be the start of a
    stop string is held back from outputs until it cannot be, so that everything ever
    streamed is a prefix of the final text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.max_stop_len = max(map(len, stop), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.num_sent_chars = 0

    def append(self, token: int) -> str | None:
        """Add one token's text; return the stop string it completed (the text is cut before
        it), if any. End-of-text, and ids past the tokenizer (random weights), add nothing."""
        tok = self.tokenizer
        data = tok.decode_single_token_bytes(token) if token < tok.eot_token else b""
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += self.decoder.decode(data)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not found:
            return None
        i, stop = min(found)
        self.text = self.text[:i]
        return stop

    def flush(self) -> None:
        """The request ended: bytes of an unfinished character become U+FFFD."""
        self.text += self.decoder.decode(b"", final=True)

    def new_text(self, finished: bool) -> str:
        """Text not yet returned, less what could still grow into a stop string."""
        end = len(self.text)
        if not finished:
            end -= self._held_back()
        new = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return new

    def _held_back(self) -> int:
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                return n
        return 0


# ----------------------------------------------------------------------------- sampling

@dataclass
class SamplingTensors:
    """The sampling parameters of a step's sampling rows, one entry per row, on the device."""
    temperature: torch.Tensor       # (n,) fp32; 1 on greedy rows
    top_k: torch.Tensor             # (n,) int64; vocab size where off
    top_p: torch.Tensor             # (n,) fp32; 1 where off
    greedy: torch.Tensor            # (n,) bool
    generators: list                # per row: its own torch.Generator, or None (the engine's)
    all_greedy: bool
    any_top_k_top_p: bool


def sample(logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """One token per row of logits (n, vocab) -> (n,), the whole batch at once.

    Greedy rows take the argmax. The others: temperature, then top-k and top-p, then the
    Gumbel-max trick, argmax(probs / E) with E ~ Exponential(1), which draws from probs; a
    seeded row's E comes from its own generator, so it samples the same tokens whatever
    shares its batch, and no row's draw depends on another's parameters.
    """
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    logits = logits / t.temperature[:, None]
    if t.any_top_k_top_p:
        logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, gen in enumerate(t.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    # E can be exactly 0: clamp, or 0 / 0 would be NaN and argmax would pick it
    drawn = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return torch.where(t.greedy, greedy, drawn)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                      ) -> torch.Tensor:
    """Mask logits (n, vocab) outside each row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p; the token that
    crosses top_p stays). top_k = vocab and top_p = 1 leave a row exactly as it was."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    kth = ascending.gather(1, (vocab - top_k).clamp(min=0)[:, None])  # the k-th largest
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and all less
    ascending = ascending.masked_fill(below <= 1 - top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


# ----------------------------------------------------------------------------- engine

@dataclass
class Batch:
    """One step's model inputs, flattened over the scheduled sequences."""
    input_ids: torch.Tensor         # (N,)
    positions: torch.Tensor         # (N,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor       # (n,): rows of the last token of each sequence that samples
    sample_seqs: list[Sequence]     # the sequences whose prompt is now fully computed
    sampling: SamplingTensors | None


@dataclass
class ModelOutput:
    """What execute() returns: one sampled token per sequence whose prompt is fully computed."""
    seqs: list[Sequence]
    logits: torch.Tensor            # (len(seqs), vocab) fp32
    token_ids: list[int]


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_batched_seqs: int = 0       # summed over steps: divide by num_steps for the mean
    num_batched_tokens: int = 0     # tokens computed, recomputation after preemption included
    peak_batch_size: int = 0


def keep_freed_memory() -> None:
    """Let glibc reuse freed memory instead of handing large blocks back to the OS.

    PyTorch's CPU tensors come from malloc, and glibc serves blocks above its mmap threshold
    (128 KiB, rising with use) as fresh pages, so every large temporary (the reference
    path's K/V gathers above all) pays a page fault per 4 KiB: measured here, a batch-32
    decode step with one long context went from 34 ms to 11 ms. vLLM's CPU backend asks for
    tcmalloc for the same reason. Not glibc (macOS, musl): nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the heap
    libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MiB of freed heap


class Engine:
    """Continuous batching over a paged KV cache: add requests any time, call step().

    abort() may be called from any thread; everything else from the thread that steps."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device == "cpu":
            keep_freed_memory()
        model, self.tokenizer = load_model(config.model, config.preset, config.seed)
        self.model = model.to(config.device, DTYPES[config.dtype]).eval()
        c = self.model.config
        self.max_model_len = config.max_model_len or c.n_positions
        if self.max_model_len > c.n_positions:
            raise ValueError(f"max_model_len is {self.max_model_len}; the model's context is "
                             f"{c.n_positions}")
        self.attention = select_attention(config.attention, config.device)
        kv_cache_tokens = config.kv_cache_tokens or self._default_kv_cache_tokens()
        num_blocks = kv_cache_tokens // config.block_size
        self.k_cache, self.v_cache = allocate_kv_cache(
            c.n_layer, num_blocks, config.block_size, c.n_head, c.head_dim, config.device,
            DTYPES[config.dtype])
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.policy, self.tokenizer.eot_token)
        self.generator = torch.Generator(config.device).manual_seed(config.seed)
        self.pin_memory = config.device.startswith("cuda")
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._lock = threading.Lock()       # abort() from other threads vs step()
        self._final_outputs: list[RequestOutput] = []  # aborted or failed, for the next step()

    def _default_kv_cache_tokens(self) -> int:
        c = self.model.config
        bytes_per_token = 2 * c.n_layer * c.n_embd * DTYPES[self.config.dtype].itemsize  # K and V
        return min(self.config.max_num_seqs * self.max_model_len, KV_CACHE_BYTES // bytes_per_token)

    # ------------------------------------------------------------------------- requests

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request: a prompt string, a list of token ids, or vLLM's
        {"prompt": str} / {"prompt_token_ids": [...]}. Raises ValueError, with nothing
        queued, if it can never be served. The params are copied: changing them later
        changes nothing here."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, validated again
        text, token_ids = self._parse_prompt(prompt)
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.seqs)
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        self._validate(token_ids, params, request_id)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.config.device).manual_seed(params.seed)
        seq = Sequence(request_id, text, token_ids, params, BlockTable(self.allocator),
                       generator, Detokenizer(self.tokenizer, params.stop))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _parse_prompt(self, prompt) -> tuple[str, list[int]]:
        """(text, token ids) of a prompt in any accepted form."""
        if isinstance(prompt, dict) and set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, allowed_special="all")
        if isinstance(prompt, list):
            vocab = self.model.config.vocab_size
            if not all(type(t) is int and 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            return self.detokenize(prompt), list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids, {'prompt': str} or "
                         f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}")

    def _validate(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise ValueError("prompt is empty: it needs at least one token")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if n + params.max_tokens > limit:
            raise ValueError(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                             f"{n + params.max_tokens} tokens; the model's context is {limit}")
        cached = n + params.max_tokens - 1  # the last sampled token is never written
        blocks = cdiv(cached, self.config.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks ({cached} tokens) but the cache "
                             f"has {self.allocator.num_blocks}; raise kv_cache_tokens")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and cached > budget:
            raise ValueError(f"request may need to prefill {cached} tokens in one step, but "
                             f"max_num_batched_tokens is {budget} and chunked prefill is off")

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a waiting or running request and free its blocks at once (after the step in
        flight, if another thread is stepping); its last output, finish_reason "abort" and
        `reason`, comes from the next step(). Unknown or finished ids are ignored."""
        with self._lock:
            seq = self.seqs.get(request_id)
            if seq is not None:
                self._abort(seq, reason)

    def _abort(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        seq.stop_reason = reason
        self._final_outputs.append(self._output(seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._final_outputs)

    # ------------------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update. Returns a delta output for every request
        that got a token, and the last output of every request aborted or failed since."""
        with self._lock:
            outputs, self._final_outputs = self._final_outputs, []
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return outputs
            try:
                model_output = self.execute(scheduled)
            except Exception:  # noqa: BLE001 (find the request that fails, fail it alone)
                model_output = self._execute_one_at_a_time(scheduled)
            return outputs + self._update(scheduled, model_output)

    def execute(self, scheduled: dict[Sequence, int]) -> ModelOutput:
        """Build the inputs, run the model over every scheduled token, sample."""
        batch = self._prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.k_cache,
                            self.v_cache, self.attention)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        if not batch.sample_seqs:
            return ModelOutput([], logits, [])
        token_ids = sample(logits, batch.sampling, self.generator)
        return ModelOutput(batch.sample_seqs, logits, token_ids.tolist())  # the step's one sync

    def _execute_one_at_a_time(self, scheduled: dict[Sequence, int]) -> ModelOutput:
        """The batch failed: run each sequence alone, and fail (abort, blocks freed) those
        that fail alone; the others get exactly the tokens they would have got."""
        seqs, logits, token_ids = [], [], []
        for seq, num_new in list(scheduled.items()):
            try:
                out = self.execute({seq: num_new})
            except Exception as e:  # noqa: BLE001
                del scheduled[seq]
                self._abort(seq, f"error: {type(e).__name__}: {e}")
                continue
            seqs, logits, token_ids = seqs + out.seqs, logits + [out.logits], token_ids + out.token_ids
        return ModelOutput(seqs, torch.cat(logits) if logits else None, token_ids)

    def _update(self, scheduled: dict[Sequence, int], out: ModelOutput) -> list[RequestOutput]:
        """Advance and append (the scheduler), then detokenize, apply stop strings, output."""
        self.scheduler.update(scheduled, dict(zip(out.seqs, out.token_ids)))
        outputs = []
        for seq in out.seqs:
            try:
                stop = seq.detokenizer.append(seq.token_ids[-1])
                if stop is not None:
                    seq.stop_reason = stop
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                elif seq.is_finished:
                    seq.detokenizer.flush()
                outputs.append(self._output(seq))
            except Exception as e:  # noqa: BLE001 (this request alone fails)
                self._abort(seq, f"error: {type(e).__name__}: {e}")
                outputs.append(self._final_outputs.pop())
        self._count(scheduled, len(out.seqs))
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        """The request's delta since its last output; a finished request leaves the engine."""
        finished = seq.is_finished
        new_token_ids = seq.token_ids[len(seq.prompt_token_ids) + seq.num_sent_tokens:]
        seq.num_sent_tokens = seq.num_output_tokens
        completion = CompletionOutput(0, seq.detokenizer.new_text(finished), new_token_ids,
                                      seq.status.value if finished else None, seq.stop_reason)
        if finished:
            self.seqs.pop(seq.seq_id, None)
        return RequestOutput(seq.seq_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             finished)

    def _count(self, scheduled: dict[Sequence, int], num_sampled: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_batched_seqs += len(scheduled)
        s.num_batched_tokens += sum(scheduled.values())
        s.peak_batch_size = max(s.peak_batch_size, len(scheduled))

    def _prepare(self, scheduled: dict[Sequence, int]) -> Batch:
        """The step's inputs: built on the host as lists, then sent to the device in one
        pinned, non-blocking copy per dtype. Block tables have a fixed width,
        cdiv(max_model_len, block_size), so the Triton kernel is specialised only once."""
        input_ids, positions, slots, starts, sample_rows, sample_seqs = [], [], [], [0], [], []
        tables, context_lens = [], []
        width = cdiv(self.max_model_len, self.config.block_size)
        for seq, num_new in scheduled.items():
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += seq.block_table.slots(start, end)
            starts.append(starts[-1] + num_new)
            tables += seq.block_table.block_ids + [0] * (width - len(seq.block_table.block_ids))
            context_lens.append(end)
            if end == len(seq.token_ids):  # the whole prompt is in: sample the next token
                sample_rows.append(starts[-1] - 1)
                sample_seqs.append(seq)
        params = [seq.params for seq in sample_seqs]
        vocab = self.model.config.vocab_size
        top_ks = [p.top_k or vocab for p in params]
        ints = self._upload([input_ids, positions, slots, tables, context_lens, starts,
                             sample_rows, top_ks], torch.int64)
        floats = self._upload([[max(p.temperature, GREEDY_BELOW) for p in params],
                               [p.top_p for p in params]], torch.float32)
        int32 = lambda t: t.to(torch.int32)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=ints[2], block_tables=int32(ints[3]).view(len(scheduled), width),
            context_lens=int32(ints[4]), query_start_loc=int32(ints[5]),
            max_query_len=max(scheduled.values()))
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        sampling = SamplingTensors(
            temperature=torch.where(self._upload([greedy], torch.bool)[0], 1.0, floats[0]),
            top_k=ints[7], top_p=floats[1], greedy=self._upload([greedy], torch.bool)[0],
            generators=[seq.generator for seq in sample_seqs], all_greedy=all(greedy),
            any_top_k_top_p=any(k < vocab or p.top_p < 1 for k, p in zip(top_ks, params)))
        return Batch(ints[0], ints[1], meta, ints[6], sample_seqs, sampling)

    def _upload(self, lists: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host lists -> device tensors, through one pinned buffer and one non-blocking copy."""
        host = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=dtype,
                            pin_memory=self.pin_memory)
        device = host.to(self.config.device, non_blocking=True)
        return list(device.split([len(x) for x in lists]))

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids -> text. End-of-text, and ids past the tokenizer (random gpt2-shaped
        weights over the byte tokenizer), print nothing."""
        ids = [t for t in token_ids if t < self.tokenizer.eot_token]
        return self.tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")


class LLM:
    """vLLM's offline API: LLM(model=..., **EngineConfig fields).generate(prompts, params)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Serve all prompts as one continuous batch; whole outputs, in prompt order. A prompt
        is a string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompts, (str, dict)) or (prompts and type(prompts[0]) is int):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids, whole = [], {}
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
            while len(whole) < len(ids) or any(not whole[i].finished for i in ids):
                for delta in self.engine.step():
                    if delta.request_id in ids:
                        _accumulate(whole, delta)
        except BaseException:  # all or nothing: a failed or interrupted batch leaves no request
            for request_id in ids:
                self.engine.abort(request_id, "withdrawn: generate() did not finish")
            self.engine.step()
            raise
        return [whole[i] for i in ids]


def _accumulate(whole: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Add a delta output to the request's whole output so far."""
    if delta.request_id not in whole:
        whole[delta.request_id] = delta
        return
    kept, new = whole[delta.request_id], delta.outputs[0]
    out = kept.outputs[0]
    out.text += new.text
    out.token_ids += new.token_ids
    out.finish_reason, out.stop_reason, kept.finished = new.finish_reason, new.stop_reason, delta.finished


# ----------------------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: "error: ...", exit status 2
        self.exit(2, f"error: {message}\n")


def add_config_args(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    """One flag per field of the dataclass `cls` (EngineConfig, bench's BenchConfig): the
    name, default, type, choices and help all come from the field."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kwargs = dict(f.metadata)
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, tuple):
            kwargs |= dict(nargs="+", type=type(f.default[0]))
        elif "type" not in kwargs and "choices" not in kwargs:
            kwargs["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description="nanoserve: continuous batching over a paged KV cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt; repeat it to serve several together as one batch")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch CPU threads: half the cores, so that a busy core does not stall "
                   "every step")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, help="default: 200, or what the context has left")
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=0.95, help="1: off")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after end-of-text")
    add_config_args(p.add_argument_group("engine (EngineConfig)"), EngineConfig)
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


# Control characters (random weights emit any byte) print as visible escapes, not raw.
VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}


def run_prompts(engine: Engine, args: argparse.Namespace) -> None:
    """Serve every --prompt as one batch; stream each one's text in turn, then a summary.
    Ctrl-C stops generating and still prints the summary."""
    ids = []
    for prompt in args.prompt:
        max_tokens = args.max_tokens
        if max_tokens is None:  # 200, or what the context leaves (at least 1: then it says why)
            num_prompt = len(engine.tokenizer.encode(prompt, allowed_special="all"))
            max_tokens = max(1, min(200, engine.max_model_len - num_prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        ids.append(engine.add_request(prompt, params))
    waiting = {i: [] for i in ids}  # deltas of the requests after the one being printed
    current, start = 0, time.perf_counter()
    print(args.prompt[0].translate(VISIBLE), end="", flush=True)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                waiting[out.request_id].append(out)
            while current < len(ids) and waiting[ids[current]]:
                out = waiting[ids[current]].pop(0)
                print(out.outputs[0].text.translate(VISIBLE), end="", flush=True)
                if out.outputs[0].finish_reason == "abort":
                    print(f"\n[{out.outputs[0].stop_reason}]", file=sys.stderr)
                if out.finished and (current := current + 1) < len(ids):
                    print("\n\n" + args.prompt[current].translate(VISIBLE), end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", end="", file=sys.stderr)
        print_summary(engine, time.perf_counter() - start)
        raise
    print_summary(engine, time.perf_counter() - start)


def print_summary(engine: Engine, elapsed: float) -> None:
    s = engine.stats
    print(f"\n\n[{s.num_prompt_tokens} prompt + {s.num_generated_tokens} generated tokens in "
          f"{elapsed:.2f} s, {s.num_generated_tokens / elapsed:.1f} tok/s, {s.num_steps} steps, "
          f"peak batch {s.peak_batch_size}, {engine.scheduler.num_preemptions} preemptions]",
          file=sys.stderr)


def main(argv=None) -> None:
    """The command line: every error is one "error: ..." line and exit status 2; Ctrl-C
    while loading exits quietly; a closed stdout (| head) ends the run quietly."""
    args = parse_args(argv)
    try:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
        run_prompts(Engine(engine_config(args)), args)
    except (ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
            sys.exit(1)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

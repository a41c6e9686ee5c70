"""nanoserve: the engine, its offline API, the command line, the REPL and the HTTP server.

`Engine.step()` is the serving algorithm, one iteration at a time: schedule (which tokens of
which sequences run now), execute (build the inputs, run the model once over all of them,
sample a token for each sequence whose prompt is fully computed), update (advance, append,
detokenize, finish and free), and a StepRecord of what it did. The rest loops over step():
`LLM.generate`, `--prompt`, the REPL, and the OpenAI-compatible server's EngineThread. The
offline API has vLLM's shape and argument names, so moving to vLLM is an import away:

    from nanoserve import LLM, SamplingParams
    outputs = LLM().generate(["ROMEO:"], SamplingParams(max_tokens=64, temperature=0))
"""
import argparse
import codecs
import dataclasses
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from kernels import (AttentionMetadata, SamplingTensors, keep_freed_memory, sample,
                     select_attention)
from model import PRESETS, Detokenizer, load_model
from paged_cache import BlockTable, allocate_kv_cache, cdiv
from scheduler import POLICIES, Scheduler, Sequence, SequenceStatus

KV_CACHE_BYTES = 1 << 30  # the default KV cache's memory budget: 1 GiB
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20         # top log-probabilities per token at most (vLLM's max_logprobs)


# ----------------------------------------------------------------------------- configuration

def check_int(name: str, value, low: int, high=2**64 - 1) -> None:
    """ValueError naming `name` unless value is an int (a bool is not) in [low, high]."""
    if type(value) is not int or not low <= value <= high:
        bounds = f">= {low}" if high == 2**64 - 1 else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def option(default, help: str, low=1, high=math.inf, open_low=False, **argparse_kwargs):
    """A config field that is also a flag: default, help, type, choices and range, only here."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, open_low=open_low,
                                                **argparse_kwargs))


def check_fields(config) -> None:
    """ValueError naming the first option() field out of its choices, type or range (a bool
    is not a number; NaN and inf are never in range)."""
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        kind = meta.get("type") or type(f.default)
        if value is None and f.default is None:
            continue
        if "choices" in meta:
            if value not in meta["choices"]:
                raise ValueError(f"unknown {f.name} {value!r}; choose one of "
                                 f"{', '.join(map(str, meta['choices']))}")
        elif kind is int:
            check_int(f.name, value, meta["low"], min(meta["high"], 2**64 - 1))
        elif kind is float:
            low, high, open_low = meta["low"], meta["high"], meta["open_low"]
            number = type(value) in (int, float) and math.isfinite(value)
            if not (number and (value > low if open_low else value >= low) and value <= high):
                raise ValueError(f"{f.name} must be a number in {'(' if open_low else '['}{low}, "
                                 f"{high}], got {value!r}")
        elif type(value) is not kind:
            raise ValueError(f"{f.name} must be a {kind.__name__}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM and the OpenAI API name it."""
    max_tokens: int = option(16, "tokens to generate at most")
    temperature: float = option(1.0, "0 (or below 1e-5): greedy", low=0)
    top_k: int = option(0, "keep the k most likely tokens; 0 or -1: all", low=-1)
    top_p: float = option(1.0, "keep the fewest most likely tokens whose probability reaches "
                          "top_p", low=0, high=1, open_low=True)
    seed: int | None = option(None, "per-request RNG: the same tokens whatever the batch",
                              low=0, type=int)
    stop: list[str] | None = option(None, "stop before any of these strings", type=list)
    ignore_eos: bool = option(False, "keep going after <|endoftext|>")
    logprobs: int | None = option(None, "each output token's log-probability and the top k",
                                  low=0, high=MAX_LOGPROBS, type=int)
    prompt_logprobs: int | None = option(None, "each prompt token's log-probability and the "
                                         "top k", low=0, high=MAX_LOGPROBS, type=int)

    def __post_init__(self):
        try:  # a string, or any iterable of strings, read once here (a generator is used up)
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        except TypeError:
            raise ValueError(f"stop must be a string or strings, got {self.stop!r}") from None
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        check_fields(self)
        self.top_k = max(self.top_k, 0)  # vLLM's -1 and 0 both mean off


@dataclass
class EngineConfig:
    """How the engine is built, with vLLM's argument names where vLLM has one."""
    model: str | None = option(None, "checkpoint dir or gpt2[-medium|-large|-xl]; none: the "
                               "shipped Shakespeare model", type=str)
    preset: str | None = option(None, "random seeded weights of a shape", choices=list(PRESETS))
    device: str = option("cuda" if torch.cuda.is_available() else "cpu", "cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto: float32 on CPU, bfloat16 on CUDA", choices=["auto", *DTYPES])
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

    def __post_init__(self):
        check_fields(self)
        if self.model is not None and self.preset is not None:
            raise ValueError("give a model or a preset, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"block_size ({self.block_size} tokens) is larger than the KV "
                             f"cache (kv_cache_tokens={self.kv_cache_tokens})")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}; use cpu, cuda or cuda:N")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: " + (
                f"there are {torch.cuda.device_count()} CUDA devices" if torch.cuda.is_available()
                else "CUDA is not available on this machine"))
        if self.dtype == "auto":
            self.dtype = "bfloat16" if device.type == "cuda" else "float32"
        if self.attention == "triton" and device.type == "cpu" and self.dtype == "bfloat16":
            raise ValueError("Triton attention cannot run bfloat16 on a CPU (its interpreter "
                             "multiplies bf16 wrongly); use --dtype float32 or float16")


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
    """One step's model inputs, flattened over the scheduled sequences."""
    input_ids: torch.Tensor         # (N,)
    positions: torch.Tensor         # (N,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor       # (n,): the last row of each sequence that samples
    sample_seqs: list[Sequence]     # the sequences whose prompt is now fully computed
    prompt_rows: torch.Tensor       # (m,): rows whose next token is a prompt token to score
    prompt_targets: torch.Tensor    # (m,): those next tokens
    prompt_seqs: list[Sequence]     # (m,): their sequences


@dataclass
class ModelOutput:  # execute(): one sampled token per sequence whose prompt is fully computed
    seqs: list[Sequence]
    logits: torch.Tensor            # (len(seqs), vocab) fp32
    token_ids: list[int]
    logprobs: list[dict | None] = field(default_factory=list)        # per seq, if it asked
    prompt_logprobs: list[tuple[Sequence, dict]] = field(default_factory=list)


@dataclass
class StepRecord:
    """What one step did, by request id: the record that --trace, /metrics and bench.py read
    and EngineStats adds up."""
    scheduled: dict[str, int]       # tokens computed this step
    sampled: list[str]              # got a token
    finished: list[str]             # ended in this step, or were aborted since the last one
    preempted: list[str]            # sent back to waiting, their blocks freed
    cached: dict[str, int]          # first admitted, with this many prompt tokens cached
    num_running: int
    num_waiting: int
    num_kv_tokens: int              # tokens whose K/V the running sequences hold
    kv_blocks_used: int


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens found in the prefix cache
    num_generated_tokens: int = 0
    num_batched_seqs: int = 0       # summed over steps: divide by num_steps for the mean
    num_batched_tokens: int = 0     # tokens computed, recomputation after preemption included
    peak_batch_size: int = 0

    def record(self, step: StepRecord) -> None:
        if not step.scheduled:  # only aborts since the last step
            return
        self.num_steps += 1
        self.num_cached_tokens += sum(step.cached.values())
        self.num_generated_tokens += len(step.sampled)
        self.num_batched_seqs += len(step.scheduled)
        self.num_batched_tokens += sum(step.scheduled.values())
        self.peak_batch_size = max(self.peak_batch_size, len(step.scheduled))


class Engine:
    """Continuous batching over a paged KV cache: add requests any time, call step().
    abort() may be called from any thread; everything else from the thread that steps."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device.startswith("cpu"):
            keep_freed_memory()
        model, self.tokenizer = load_model(config.model, config.preset, config.seed)
        self.model = model.to(config.device, DTYPES[config.dtype]).eval()
        c = self.model.config
        self.max_model_len = config.max_model_len or c.n_positions
        if self.max_model_len > c.n_positions:
            raise ValueError(f"max_model_len {self.max_model_len} > the context {c.n_positions}")
        self.attention = select_attention(config.attention, config.device)
        bytes_per_token = 2 * c.n_layer * c.n_embd * DTYPES[config.dtype].itemsize  # K and V
        kv_cache_tokens = config.kv_cache_tokens or min(
            config.max_num_seqs * self.max_model_len, KV_CACHE_BYTES // bytes_per_token)
        self.k_cache, self.v_cache, self.block_pool = allocate_kv_cache(
            c.n_layer, c.n_head, c.head_dim, kv_cache_tokens, config.block_size, config.device,
            DTYPES[config.dtype], config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_pool, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.policy, self.tokenizer.eot_token)
        self.generator = torch.Generator(config.device).manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None         # the newest step's record
        self.step_records: list[StepRecord] | None = None  # every record, once made a list
        self._ids = itertools.count()
        self._lock = threading.Lock()  # abort() from other threads against step()
        self._admitted: set[str] = set()  # the unfinished requests admitted once
        self._final_outputs: list[RequestOutput] = []  # aborted or failed, for the next step()

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (a string, a list of token ids, {"prompt": str} or
        {"prompt_token_ids": [...]}) with a copy of params; ValueError if it can never run."""
        if not isinstance(params := params or SamplingParams(), SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, validated again
        text, token_ids = self._parse_prompt(prompt)
        if request_id is None:  # the next free number: never a caller's id
            request_id = next(i for i in map(str, self._ids) if i not in self.seqs)
        self._validate(token_ids, params, request_id)
        generator = None if params.seed is None else \
            torch.Generator(self.config.device).manual_seed(params.seed)
        seq = Sequence(request_id, text, token_ids, params, BlockTable(self.block_pool),
                       generator, Detokenizer(self.tokenizer, params.stop))
        seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else []
        with self._lock:  # abort() may run on another thread
            self.seqs[request_id] = seq
            self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _parse_prompt(self, prompt) -> tuple[str | None, list[int]]:  # (text, token ids)
        if isinstance(prompt, dict) and set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, allowed_special="all")
        if not isinstance(prompt, list):
            raise ValueError("a prompt is a string, a list of token ids, {'prompt': str} or "
                             f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}")
        vocab = self.model.config.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, list(prompt)  # as vLLM: no prompt text for a prompt given as token ids

    def _validate(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        n, limit, budget = len(token_ids), self.max_model_len, self.config.max_num_batched_tokens
        cached = n + params.max_tokens - 1  # the last sampled token is never written
        blocks = cdiv(cached, self.config.block_size)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if n == 0:
            raise ValueError("prompt is empty: it needs at least one token")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if n + params.max_tokens > limit:
            raise ValueError(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                             f"{n + params.max_tokens} tokens; the model's context is {limit}")
        if blocks > self.block_pool.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks ({cached} tokens) but the cache "
                             f"has {self.block_pool.num_blocks}; raise kv_cache_tokens")
        if not self.config.enable_chunked_prefill and cached > budget:
            raise ValueError(f"request may need to prefill {cached} tokens in one step, but "
                             f"max_num_batched_tokens is {budget} and chunked prefill is off")

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Stop a request and free its blocks now (after any step in flight); its last output
        (finish_reason "abort", stop_reason `reason`) comes from the next step()."""
        with self._lock:
            if request_id in self.seqs:
                self._abort(self.seqs[request_id], reason)

    def _abort(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        seq.stop_reason = reason
        self._final_outputs.append(self._output(seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._final_outputs)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update. Returns a delta output for every request
        that got a token, and the last output of each one aborted or failed since."""
        with self._lock:
            outputs, self._final_outputs = self._final_outputs, []
            running = list(self.scheduler.running)  # to see which are preempted
            scheduled, sampled = self.scheduler.schedule(), []
            if scheduled:
                try:
                    model_output = self.execute(scheduled)
                except Exception:  # noqa: BLE001 (find the request that fails; it alone fails)
                    model_output = self._execute_one_at_a_time(scheduled)
                outputs += self._update(scheduled, model_output)
                sampled = model_output.seqs
            if scheduled or outputs:
                self._record(scheduled, sampled, running, outputs)
            return outputs

    def execute(self, scheduled: dict[Sequence, int]) -> ModelOutput:
        """Build the inputs, run the model over every scheduled token, sample."""
        batch = self._prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.k_cache,
                            self.v_cache, self.attention)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        token_ids = sample(logits, self.sampling_tensors(batch.sample_seqs), self.generator) \
            if batch.sample_seqs else batch.prompt_targets[:0]
        seqs = batch.sample_seqs + batch.prompt_seqs
        wants = [(s.params.logprobs if i < len(logits) else s.params.prompt_logprobs)
                 for i, s in enumerate(seqs)]
        if all(k is None for k in wants):
            return ModelOutput(seqs, logits, token_ids.tolist(), [None] * len(seqs))  # the sync
        # the model's own log-softmax (before temperature, top-k, top-p), as vLLM returns it
        logprobs = torch.cat([logits, self.model.compute_logits(hidden[batch.prompt_rows])]
                             ).log_softmax(dim=-1)
        targets = torch.cat([token_ids, batch.prompt_targets])[:, None]
        top = logprobs.topk(k := max(k or 0 for k in wants), dim=-1)
        rows = torch.cat([targets.float(), logprobs.gather(1, targets), top.values,
                          top.indices.float()], dim=1).tolist()  # the step's one sync
        entries = [None if want is None else {int(r[0]): r[1]} | dict(
                   zip(map(int, r[2 + k:2 + k + want]), r[2:2 + want]))
                   for r, want in zip(rows, wants)]
        n = len(batch.sample_seqs)
        return ModelOutput(batch.sample_seqs, logits, [int(r[0]) for r in rows[:n]],
                           entries[:n], list(zip(batch.prompt_seqs, entries[n:])))

    def _execute_one_at_a_time(self, scheduled: dict[Sequence, int]) -> ModelOutput:
        """The batch failed: run each sequence alone; abort those that fail alone."""
        outs = []
        for seq, num_new in list(scheduled.items()):
            try:
                outs.append(self.execute({seq: num_new}))
            except Exception as e:  # noqa: BLE001
                del scheduled[seq]
                self._abort(seq, f"error: {type(e).__name__}: {e}")
        cat = lambda name: [x for o in outs for x in getattr(o, name)]  # noqa: E731
        return ModelOutput(cat("seqs"), torch.cat([o.logits for o in outs]) if outs else None,
                           cat("token_ids"), cat("logprobs"), cat("prompt_logprobs"))

    def _update(self, scheduled: dict[Sequence, int], out: ModelOutput) -> list[RequestOutput]:
        """The scheduler advances and appends; then detokenize, stop strings, outputs."""
        self.scheduler.update(scheduled, dict(zip(out.seqs, out.token_ids)))
        for seq, entry in out.prompt_logprobs:
            seq.prompt_logprobs.append(entry)
        for seq, entry in zip(out.seqs, out.logprobs):
            seq.logprobs += [entry] if entry is not None else []
        outputs = []
        for seq in out.seqs:
            try:
                if (stop := seq.detokenizer.append(seq.token_ids[-1])) is not None:
                    seq.stop_reason = stop
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                elif seq.is_finished:
                    seq.detokenizer.flush()
                outputs.append(self._output(seq))
            except Exception as e:  # noqa: BLE001 (this request alone fails)
                seq.detokenizer = Detokenizer(self.tokenizer, [])  # not the one that failed
                self._abort(seq, f"error: {type(e).__name__}: {e}")
                outputs.append(self._final_outputs.pop())
        return outputs

    def _record(self, scheduled: dict[Sequence, int], sampled: list[Sequence],
                running: list[Sequence], outputs: list[RequestOutput]) -> None:
        s, pool = self.scheduler, self.block_pool
        self.last_step = StepRecord(
            scheduled={seq.seq_id: n for seq, n in scheduled.items()},
            sampled=[seq.seq_id for seq in sampled],
            finished=[o.request_id for o in outputs if o.finished],
            preempted=[seq.seq_id for seq in running if seq.status == SequenceStatus.WAITING],
            cached={seq.seq_id: seq.num_cached_tokens for seq in scheduled
                    if seq.seq_id not in self._admitted and seq.num_cached_tokens},
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_kv_tokens=sum(seq.num_computed_tokens for seq in s.running),
            kv_blocks_used=pool.num_blocks - pool.num_free_blocks)
        self._admitted |= {seq.seq_id for seq in scheduled}
        self._admitted -= set(self.last_step.finished)
        self.stats.record(self.last_step)
        if self.step_records is not None:
            self.step_records.append(self.last_step)

    def _output(self, seq: Sequence) -> RequestOutput:
        """The request's delta since its last output; a finished request leaves the engine."""
        finished = seq.is_finished
        first, sent = seq.num_sent_tokens == 0, seq.num_sent_tokens
        new_token_ids = seq.token_ids[len(seq.prompt_token_ids) + sent:]
        seq.num_sent_tokens = seq.num_output_tokens
        completion = CompletionOutput(0, seq.detokenizer.new_text(finished), new_token_ids,
                                      seq.status.value if finished else None, seq.stop_reason,
                                      None if seq.params.logprobs is None else seq.logprobs[sent:])
        if finished:
            self.seqs.pop(seq.seq_id, None)
        return RequestOutput(seq.seq_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             finished, list(seq.prompt_logprobs) if first and seq.prompt_logprobs
                             else None)

    def _prepare(self, scheduled: dict[Sequence, int]) -> Batch:
        """The step's inputs, sent to the device in one pinned, non-blocking copy; block tables
        are cdiv(max_model_len, block_size) wide, so the kernel is specialised only once."""
        input_ids, positions, slots, starts, tables, context_lens = [], [], [], [0], [], []
        sample_rows, sample_seqs, prompt_rows, prompt_targets, prompt_seqs = [], [], [], [], []
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
            if seq.params.prompt_logprobs is not None:  # the prompt tokens not yet scored
                scored = range(max(start, len(seq.prompt_logprobs) - 1),
                               min(end, len(seq.prompt_token_ids) - 1))
                prompt_rows += [starts[-2] + p - start for p in scored]
                prompt_targets += [seq.token_ids[p + 1] for p in scored]
                prompt_seqs += [seq] * len(scored)
        ints = self._upload([input_ids, positions, slots, tables, context_lens, starts,
                             sample_rows, prompt_rows, prompt_targets], torch.int64)
        int32 = lambda t: t.to(torch.int32)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=ints[2], block_tables=int32(ints[3]).view(len(scheduled), width),
            context_lens=int32(ints[4]), query_start_loc=int32(ints[5]),
            max_query_len=max(scheduled.values()))
        return Batch(ints[0], ints[1], meta, ints[6], sample_seqs, ints[7], ints[8], prompt_seqs)

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The sampling parameters of the rows that sample, as device tensors (one copy)."""
        params, vocab = [seq.params for seq in seqs], self.model.config.vocab_size
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        top_k = [p.top_k or vocab for p in params]
        temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        floats = self._upload([temperature, [p.top_p for p in params], greedy, top_k],
                              torch.float32)  # exact: top_k <= vocab < 2**24
        return SamplingTensors(
            temperature=floats[0], top_p=floats[1], greedy=floats[2].bool(),
            top_k=floats[3].long(), generators=[seq.generator for seq in seqs],
            all_greedy=all(greedy),
            any_top_k_top_p=any(k < vocab or p.top_p < 1 for k, p in zip(top_k, params)))

    def _upload(self, lists: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host lists -> device tensors: one pinned buffer, one non-blocking copy (on CUDA)."""
        host = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=dtype,
                            pin_memory=self.config.device.startswith("cuda"))
        device = host.to(self.config.device, non_blocking=True)
        return list(device.split([len(x) for x in lists]))


class LLM:
    """vLLM's offline API: LLM(model=..., **EngineConfig fields).generate(prompts, params)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 trace: bool = False) -> list[RequestOutput]:
        """Serve all prompts (any form add_request takes) as one batch; whole outputs, in order.
        trace: print the step-by-step timeline to stderr at the end."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and type(prompts[0]) is int):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of them, got {prompts!r}")
        if not isinstance(params, (list, tuple)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids, whole = [], {}
        self.engine.step_records = [] if trace else None
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
            while any(i not in whole or not whole[i].finished for i in ids):
                for delta in self.engine.step():
                    accumulate(whole, delta)
        except BaseException:  # all or nothing: a failed or interrupted batch leaves nothing
            for request_id in ids:
                self.engine.abort(request_id, "withdrawn: generate() did not finish")
            self.engine.step()
            raise
        if trace:
            print(render_trace(self.engine.step_records, ids), file=sys.stderr)
        return [whole[i] for i in ids]


TRACE_LEGEND = "= prompt chunk  o generated token  * end  x preempted  . waiting  c cache hit"


def render_trace(records: list[StepRecord], request_ids: list[str]) -> str:
    """The timeline that continuous-batching diagrams draw: a row per request, a column per
    step (the requests are taken to have arrived before the first step)."""
    width = max(len(i) for i in [*request_ids, "request"])
    rows = [f"{'request':>{width}} | " + "".join(f"{n // 10 % 10}" if n % 10 == 0 else " "
                                                 for n in range(len(records))).rstrip()]
    for i in request_ids:
        marks, ended = "", False
        for r in records:
            marks += " " if ended else "x" if i in r.preempted else "*" if i in r.finished \
                else "c" if i in r.cached else "o" if i in r.sampled else "=" if i in r.scheduled \
                else "."
            ended = ended or i in r.finished
        rows.append(f"{i:>{width}} | {marks.rstrip()}")
    return "\n".join(rows + ["", TRACE_LEGEND])


def accumulate(whole: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Add a delta output to its request's whole output so far, kept in `whole` by request id."""
    if delta.request_id not in whole:
        whole[delta.request_id] = delta
        return
    out, new = whole[delta.request_id].outputs[0], delta.outputs[0]
    out.text, out.token_ids = out.text + new.text, out.token_ids + new.token_ids
    if out.logprobs is not None:
        out.logprobs = out.logprobs + new.logprobs
    out.finish_reason, out.stop_reason = new.finish_reason, new.stop_reason
    whole[delta.request_id].finished = delta.finished


# ----------------------------------------------------------------------------- HTTP server

MAX_BODY_BYTES = 1 << 20  # a larger request body is refused (413)
MAX_N = 64                # samples of one prompt in one request at most
CHAT_TURN_END = "\n\n"    # the chat template ends every turn with a blank line
FIELDS = {"model", "n", "stream", "stream_options", "user", "max_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "ignore_eos", "logprobs"}
NEUTRAL = dict(frequency_penalty=0, presence_penalty=0, repetition_penalty=1, min_tokens=0,
               best_of=1, logit_bias={}, suffix="")  # accepted at these values only
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


class HTTPError(Exception):
    """Answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Histogram:  # Prometheus': cumulative counts of the observations <= each bucket's bound
    counts: list = field(default_factory=lambda: [0] * len(BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, x: float) -> None:
        self.counts = [c + (x <= le) for c, le in zip(self.counts, BUCKETS)]
        self.sum, self.count = self.sum + x, self.count + 1

    def lines(self, name: str) -> list[str]:
        return [f"# TYPE {name} histogram"] + [f'{name}_bucket{{le="{le}"}} {c}' for le, c in zip(
            [*BUCKETS, "+Inf"], [*self.counts, self.count])] + [f"{name}_sum {self.sum}",
                                                                f"{name}_count {self.count}"]


class EngineThread(threading.Thread):
    """The one thread that touches the engine. Between steps it runs the calls that handlers
    put in its inbox (add a request, abort, read the metrics); with no work, it blocks there.
    Each request's deltas go to the reply queue of the handler that added it."""

    def __init__(self, engine: Engine):
        super().__init__(daemon=True)
        self.engine, self.inbox, self.replies, self.times = engine, queue.Queue(), {}, {}
        self.histograms = {name: Histogram() for name in ("time_to_first_token_seconds",
                           "time_per_output_token_seconds", "e2e_request_latency_seconds")}

    def run(self) -> None:
        while True:
            try:
                self.inbox.get(block=not self.engine.has_unfinished())()
                while True:
                    self.inbox.get_nowait()()
            except queue.Empty:
                pass
            for out in self.engine.step():
                self._observe(out)
                (self.replies.pop if out.finished else self.replies.get)(out.request_id).put(out)

    def add(self, requests: list, arrival: float, reply: queue.Queue) -> None:
        """All of one HTTP request's sequences, or none of them; reply gets the ids or the error."""
        ids = []
        try:
            for prompt, params in requests:
                ids.append(self.engine.add_request(prompt, params))
                self.replies[ids[-1]], self.times[ids[-1]] = reply, [arrival, None, 0]
        except ValueError as e:
            for request_id in ids:
                self.engine.abort(request_id)
            return reply.put(e)
        reply.put(ids)

    def abort(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id, "the client disconnected")

    def _observe(self, out: RequestOutput) -> None:
        """Per request: time to first token, time per output token after it, end to end."""
        times, now, c = self.times[out.request_id], time.perf_counter(), out.outputs[0]
        if times[1] is None and c.token_ids:
            times[1] = now
            self.histograms["time_to_first_token_seconds"].observe(now - times[0])
        times[2] += len(c.token_ids)
        if out.finished and self.times.pop(out.request_id) and c.finish_reason != "abort":
            self.histograms["e2e_request_latency_seconds"].observe(now - times[0])
            if times[2] > 1:
                self.histograms["time_per_output_token_seconds"].observe(
                    (now - times[1]) / (times[2] - 1))

    def metrics(self) -> str:
        """Prometheus' text format: vLLM's metric names, with a nanoserve: prefix; the gauges
        as the newest step's record left them."""
        e, step = self.engine, self.engine.last_step or StepRecord({}, [], [], [], {}, 0, 0, 0, 0)
        values = [("num_requests_running", "gauge", step.num_running),
                  ("num_requests_waiting", "gauge", step.num_waiting),
                  ("kv_blocks_used", "gauge", step.kv_blocks_used),
                  ("kv_blocks_free", "gauge", e.block_pool.num_blocks - step.kv_blocks_used),
                  ("prompt_tokens_total", "counter", e.stats.num_prompt_tokens),
                  ("generation_tokens_total", "counter", e.stats.num_generated_tokens),
                  ("prefix_cache_queries_total", "counter", e.stats.num_prompt_tokens),
                  ("prefix_cache_hits_total", "counter", e.stats.num_cached_tokens),
                  ("num_preemptions_total", "counter", e.scheduler.num_preemptions)]
        lines = [f"# TYPE nanoserve:{name} {kind}\nnanoserve:{name} {v}"
                 for name, kind, v in values]
        for name, histogram in self.histograms.items():
            lines += histogram.lines("nanoserve:" + name)
        return "\n".join(lines) + "\n"


def typed(body: dict, name: str, default, *kinds):
    """body[name] (absent or null: default); HTTPError 400 unless of one of the JSON kinds."""
    if (value := body.get(name)) is None:
        return default
    if type(value) not in kinds:
        raise HTTPError(400, f"{name} must be of type {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {value!r}", name)
    return value


def render_chat(messages) -> str:
    """The chat template for a base model: every turn is "ROLE:\\n" + content + a blank line,
    then "ASSISTANT:\\n" for the model to go on; its reply ends at its own blank line."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in messages):
        raise HTTPError(400, 'messages must be a non-empty list of {"role": "system", "user" or '
                        '"assistant", "content": a string}', "messages")
    return "".join(f"{m['role'].upper()}:\n{m['content']}{CHAT_TURN_END}" for m in messages) \
        + "ASSISTANT:\n"


def parse_request(body: dict, engine: Engine, model_name: str, chat: bool) -> tuple[list, dict]:
    """An OpenAI request -> its sequences [(prompt, SamplingParams)], n for each prompt, and
    how to answer (stream, include_usage, echo, logprobs k); HTTPError 400 if anything is off."""
    known = FIELDS | ({"messages", "top_logprobs", "max_completion_tokens"} if chat else
                      {"prompt", "echo"})
    for name, value in body.items():
        if name not in known and (name not in NEUTRAL or value not in (None, NEUTRAL[name])):
            raise HTTPError(400, f"{name} is not supported" + (
                f" (only {NEUTRAL[name]!r})" if name in NEUTRAL else ""), name)
    if typed(body, "model", model_name, str) != model_name:
        raise HTTPError(400, f"model {body['model']!r} is not served here; /v1/models lists "
                        f"{model_name!r}", "model")
    fields = {name: body[name] for name in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                            "ignore_eos") if body.get(name) is not None}
    fields["stop"], n = typed(body, "stop", [], str, list), typed(body, "n", 1, int)
    echo = typed(body, "echo", False, bool)
    if chat:  # as token ids, encoded once and as the engine encodes text (special tokens too)
        prompts = [engine.tokenizer.encode(render_chat(body.get("messages")),
                                           allowed_special="all")]
        fields["max_tokens"] = next((body[k] for k in ("max_completion_tokens", "max_tokens")
                                     if body.get(k) is not None),
                                    max(1, engine.max_model_len - len(prompts[0])))
        fields["logprobs"] = typed(body, "top_logprobs", 0, int) \
            if typed(body, "logprobs", False, bool) else None
    else:
        prompts = body.get("prompt")
        if isinstance(prompts, str) or isinstance(prompts, list) and prompts \
                and type(prompts[0]) is int:
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise HTTPError(400, "prompt must be a string, a list of token ids, or a non-empty "
                            "list of those", "prompt")
        fields["logprobs"] = typed(body, "logprobs", None, int)
        if (fields["logprobs"] or 0) > 5:  # OpenAI's limit for completions
            raise HTTPError(400, f"logprobs must be at most 5, got {fields['logprobs']}",
                            "logprobs")
        fields["prompt_logprobs"] = fields["logprobs"] if echo else None
    options = dict(stream=typed(body, "stream", False, bool), chat=chat, n=n,
                   k=fields["logprobs"] or 0, echo=echo, include_usage=typed(
                       typed(body, "stream_options", {}, dict), "include_usage", False, bool))
    try:
        check_int("n", n, 1, MAX_N)
        check_int("top_logprobs", typed(body, "top_logprobs", 0, int), 0, MAX_LOGPROBS)
        params = SamplingParams(**fields)  # each sample of a seeded request: the next seed
        if chat:  # the reply ends with its turn
            params = dataclasses.replace(params, stop=params.stop + [CHAT_TURN_END])
        samples = [params if params.seed is None else dataclasses.replace(
            params, seed=(params.seed + i) % 2**64) for i in range(n)]
    except ValueError as e:
        raise HTTPError(400, str(e), next((f for f in [*fields, "n", "top_logprobs"]
                                           if str(e).startswith(f)), None)) from None
    return [(prompt, p) for prompt in prompts for p in samples], options


def token_text(tokenizer, token_id: int) -> str:
    """A token as text; as OpenAI writes it, "bytes:\\xe2\\x80" if it is not UTF-8 alone."""
    data = tokenizer.decode_single_token_bytes(token_id)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def logprobs_json(tokenizer, token_ids: list[int], entries: list, k: int, chat: bool,
                  offset: int = 0) -> dict:
    """Each token's log-probability and the top k, in OpenAI's completions or chat shape (text
    offsets start at `offset`: the characters that earlier chunks of the choice held)."""
    text = lambda t: token_text(tokenizer, t)  # noqa: E731
    top = [None if e is None else sorted(e.items(), key=lambda x: -x[1])[:k] for e in entries]
    if chat:
        item = lambda t, lp: dict(token=text(t), logprob=lp,  # noqa: E731
                                  bytes=list(tokenizer.decode_single_token_bytes(t)))
        return dict(content=[item(t, e[t]) | dict(top_logprobs=[item(*x) for x in best])
                             for t, e, best in zip(token_ids, entries, top)])
    return dict(tokens=[text(t) for t in token_ids],
                token_logprobs=[e and e[t] for t, e in zip(token_ids, entries)],
                top_logprobs=[best and {text(t): lp for t, lp in best} for best in top],
                text_offset=[offset + len(tokenizer.decode(token_ids[:i]))
                             for i in range(len(entries))])


class Handler(BaseHTTPRequestHandler):
    """OpenAI's API, a thread per connection; engine calls go through the EngineThread."""
    ROUTES = {"/health": ("GET", "health"), "/v1/models": ("GET", "models"),
              "/metrics": ("GET", "metrics"), "/v1/completions": ("POST", "completions"),
              "/v1/chat/completions": ("POST", "chat_completions")}

    def route(self) -> None:
        path = self.path.split("?")[0]
        try:
            if path not in self.ROUTES:
                raise HTTPError(404, f"no such path: {path}")
            if self.command != self.ROUTES[path][0]:
                raise HTTPError(405, f"{path} takes {self.ROUTES[path][0]}, not {self.command}")
            getattr(self, self.ROUTES[path][1])()
        except ConnectionError:
            return  # the client went away
        except Exception as e:  # noqa: BLE001 (the request fails; the server goes on)
            if not isinstance(e, HTTPError):
                self.log_error("%s", e := HTTPError(500, f"{type(e).__name__}: {e}"))
            self.send(e.status, {"error": dict(
                message=str(e), type="invalid_request_error" if e.status < 500 else "server_error",
                param=e.param, code=e.status)})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = route
    disable_nagle_algorithm = True  # a streamed chunk goes out at once, not after the last ACK

    def send(self, status: int, obj, content_type="application/json") -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def health(self) -> None:
        self.send(200, {"status": "ok"})

    def models(self) -> None:
        self.send(200, dict(object="list", data=[dict(
            id=self.server.model_name, object="model", created=int(self.server.started),
            owned_by="nanoserve", max_model_len=self.server.engine_thread.engine.max_model_len)]))

    def metrics(self) -> None:
        reply, engine_thread = queue.Queue(), self.server.engine_thread
        engine_thread.inbox.put(lambda: reply.put(engine_thread.metrics()))
        self.send(200, reply.get(), "text/plain; version=0.0.4")

    def chat_completions(self) -> None:
        self.completions(chat=True)

    def completions(self, chat=False) -> None:
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise HTTPError(400, "the request needs a JSON body and its Content-Length")
        if int(length) > MAX_BODY_BYTES:  # read (up to 16x) first: unread, it resets the socket
            remaining = min(int(length), 16 * MAX_BODY_BYTES)
            while remaining > 0 and (chunk := self.rfile.read(min(remaining, 65536))):
                remaining -= len(chunk)
            raise HTTPError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except ValueError as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        engine_thread, reply, arrival = self.server.engine_thread, queue.Queue(), \
            time.perf_counter()
        requests, options = parse_request(body, engine_thread.engine, self.server.model_name, chat)
        engine_thread.inbox.put(lambda: engine_thread.add(requests, arrival, reply))
        if isinstance(ids := reply.get(), ValueError):
            raise HTTPError(400, str(ids), "messages" if chat else "prompt")
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{ids[0]}", created=int(time.time()),
                    model=self.server.model_name, object="text_completion" if not chat else
                    "chat.completion.chunk" if options["stream"] else "chat.completion")
        self.respond(ids, reply, head, options)

    def respond(self, ids: list[str], reply: queue.Queue, head: dict, options: dict) -> None:
        """Whole, or streamed as server-sent events (a chunk per delta, the usage if asked,
        then [DONE]). A client that goes away mid-stream aborts its sequences: blocks freed."""
        stream, index, whole, sent = options["stream"], {i: n for n, i in enumerate(ids)}, {}, {}
        event = lambda obj: self.wfile.write(b"data: %s\n\n" % json.dumps(obj).encode())  # noqa
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
        try:
            while not all(i in whole and whole[i].finished for i in ids):
                out = reply.get()
                if stream:  # sent: the characters of each choice streamed so far
                    chunk = self.choice(index[out.request_id], out, options, out.request_id
                                        not in whole, sent.get(out.request_id, 0))
                    sent[out.request_id] = sent.get(out.request_id, 0) + len(chunk.get("text", ""))
                    event(head | dict(choices=[chunk]))
                accumulate(whole, out)
            prompt_tokens = sum(len(whole[i].prompt_token_ids) for i in ids[::options["n"]])
            completion_tokens = sum(len(whole[i].outputs[0].token_ids) for i in ids)
            usage = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)
            if stream and options["include_usage"]:
                event(head | dict(choices=[], usage=usage))
            if stream:
                return self.wfile.write(b"data: [DONE]\n\n")
        except ConnectionError:
            engine_thread = self.server.engine_thread
            return engine_thread.inbox.put(lambda: engine_thread.abort(ids))
        if failed := [o.outputs[0].stop_reason for o in whole.values()
                      if o.outputs[0].finish_reason == "abort"]:
            raise HTTPError(500, failed[0])
        self.send(200, head | dict(choices=[self.choice(index[i], whole[i], options, True)
                                            for i in ids], usage=usage))

    def choice(self, index: int, out: RequestOutput, options: dict, first: bool, offset=0
               ) -> dict:
        """One choice of a response, or of a stream's chunk (then from a delta, `offset`
        characters into the choice's text)."""
        c, tokenizer = out.outputs[0], self.server.engine_thread.engine.tokenizer
        token_ids, entries, text = c.token_ids, c.logprobs, c.text
        if first and options["echo"]:  # the prompt (and its log-probabilities) first
            token_ids = out.prompt_token_ids + token_ids
            text = (out.prompt or tokenizer.decode(out.prompt_token_ids)) + text
            entries = None if entries is None else out.prompt_logprobs + entries
        logprobs = None if entries is None else logprobs_json(
            tokenizer, token_ids, entries, options["k"], options["chat"], offset)
        if not options["chat"]:
            return dict(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason)
        message = dict(role="assistant", content=text) if first else dict(content=text)
        return {"index": index, "delta" if options["stream"] else "message": message,
                "logprobs": logprobs, "finish_reason": c.finish_reason}


def serve(engine: Engine, args: argparse.Namespace) -> None:
    """--serve: OpenAI's API on host:port, until SIGINT or SIGTERM."""
    server = ThreadingHTTPServer((args.host, args.port), Handler, bind_and_activate=False)
    server.request_queue_size = 256  # connections waiting to be accepted (socketserver's: 5)
    server.server_bind()
    server.server_activate()
    server.engine_thread, server.started = EngineThread(engine), time.time()
    server.model_name = engine.config.model or engine.config.preset or "shakespeare"
    server.engine_thread.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        if args.host not in ("127.0.0.1", "localhost"):
            print(f"warning: bound to {args.host}: anyone who can reach this machine can use "
                  "the server (there is no authentication)", file=sys.stderr)
        host, port = server.server_address[:2]
        print(f"serving {server.model_name} on http://{host}:{port}", file=sys.stderr, flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    print("server stopped", file=sys.stderr)


# ----------------------------------------------------------------------------- command line

def add_config_args(parser, cls, skip=()) -> None:
    """One flag per option() field of the dataclass `cls`, all of it from the field."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kwargs = {k: v for k, v in f.metadata.items() if k not in ("low", "high", "open_low")}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, tuple):
            kwargs |= dict(nargs="+", type=type(f.default[0]))
        elif "type" not in kwargs and "choices" not in kwargs:
            kwargs["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="nanoserve: continuous batching over a paged KV "
                                "cache", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line, no usage dump
    p.add_argument("--prompt", action="append", help="a prompt; repeat it to serve several "
                   "together as one batch; none: prompts from stdin (at a terminal, a REPL)")
    p.add_argument("--jsonl", action="store_true", help="stdin and stdout: a JSON object a "
                   "line; prompt and SamplingParams fields in; text, token ids, finish out")
    p.add_argument("--trace", action="store_true", help="with --prompt: the step-by-step "
                   "timeline at the end (to stderr)")
    p.add_argument("--serve", action="store_true", help="serve OpenAI's API over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="--serve: the address to bind")
    p.add_argument("--port", type=int, default=8000, help="--serve: the port (0: any free one)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch CPU threads: half the cores, so a busy core does not stall steps")
    g = p.add_argument_group("sampling (SamplingParams, with the command line's own defaults)")
    g.add_argument("--max-tokens", type=int, default=argparse.SUPPRESS,
                   help="default: 200, or what the context has left")
    g.add_argument("--stop", action="append", help="stop before this string (repeatable)")
    add_config_args(g, SamplingParams,
                    skip=("max_tokens", "stop", "seed", "logprobs", "prompt_logprobs"))
    p.set_defaults(temperature=0.8, top_p=0.95)
    add_config_args(engine := p.add_argument_group("engine (EngineConfig)"), EngineConfig)
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=argparse.SUPPRESS, help="the same as --no-enable-prefix-caching")
    return p.parse_args(argv)


# Control characters (random weights emit any byte) print as visible escapes, not raw.
VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}


def cli_params(engine: Engine, args: argparse.Namespace, prompt, **fields) -> SamplingParams:
    """The command line's sampling for a prompt, `fields` first; max_tokens: --max-tokens, or
    200, or what the context leaves (at least 1: a prompt too long then says why)."""
    ids = engine.tokenizer.encode(prompt, allowed_special="all") if isinstance(prompt, str) \
        else prompt
    left = engine.max_model_len - len(ids)
    params = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "stop",
                                                     "ignore_eos")}
    return SamplingParams(**params | dict(max_tokens=getattr(
        args, "max_tokens", max(1, min(200, left)))) | fields)


def run_prompts(engine: Engine, args: argparse.Namespace) -> None:
    """Serve every --prompt as one batch; stream each one in turn; a summary, Ctrl-C or not."""
    ids = [engine.add_request(prompt, cli_params(engine, args, prompt)) for prompt in args.prompt]
    later = {i: [] for i in ids}  # deltas of the requests after the one being printed
    current, start, engine.step_records = 0, time.perf_counter(), [] if args.trace else None

    def summary(s=engine.stats):
        elapsed = time.perf_counter() - start
        print(f"\n\n[{s.num_prompt_tokens} prompt + {s.num_generated_tokens} generated tokens in "
              f"{elapsed:.2f} s, {s.num_generated_tokens / elapsed:.1f} tok/s, {s.num_steps} "
              f"steps, peak batch {s.peak_batch_size}, {engine.scheduler.num_preemptions} "
              f"preemptions, prefix cache hits {s.num_cached_tokens / s.num_prompt_tokens:.0%}]",
              file=sys.stderr)
        if args.trace:
            print(render_trace(engine.step_records, ids), file=sys.stderr)

    print(args.prompt[0].translate(VISIBLE), end="", flush=True)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                later[out.request_id].append(out)
            while current < len(ids) and later[ids[current]]:
                out = later[ids[current]].pop(0)
                print(out.outputs[0].text.translate(VISIBLE), end="", flush=True)
                if out.outputs[0].finish_reason == "abort":
                    print(f"\n[{out.outputs[0].stop_reason}]", file=sys.stderr)
                if out.finished and (current := current + 1) < len(ids):
                    print("\n\n" + args.prompt[current].translate(VISIBLE), end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", end="", file=sys.stderr)
        summary()
        raise
    summary()


def run_stdin(engine: Engine, args: argparse.Namespace) -> None:
    """Piped stdin: each line is submitted as it is read, all served as one continuous batch;
    each completion is printed whole, in input order, an error in its place (--jsonl: a JSON
    object a line in and out, an error as {"error": ...}; else errors go to stderr)."""
    lines, whole, where, results, printed, eof = queue.Queue(), {}, {}, [], 0, False
    threading.Thread(target=lambda: [*map(lines.put, sys.stdin), lines.put(None)],
                     daemon=True).start()
    while not eof or engine.has_unfinished():
        while not eof:  # take the lines that have arrived; wait for one only when idle
            try:
                line = lines.get(block=not engine.has_unfinished())
            except queue.Empty:
                break
            if not (eof := line is None):
                results.append(submit_line(engine, args, line, where, len(results)))
        for delta in engine.step():
            accumulate(whole, delta)
            if delta.finished:
                results[where.pop(delta.request_id)] = whole.pop(delta.request_id)
        for result in results[printed:]:
            if result is None:
                break
            printed += 1
            print_result(result, args.jsonl)


def submit_line(engine: Engine, args: argparse.Namespace, line: str, where: dict, i: int):
    """Queue line i's request (where[request_id] = i): None, or the error, as a string."""
    try:
        fields = json.loads(line) if args.jsonl else {"prompt": line.rstrip("\r\n")}
        if not isinstance(fields, dict) or "prompt" not in fields:
            raise ValueError('a line must be a JSON object with a "prompt"')
        prompt = fields.pop("prompt")
        where[engine.add_request(prompt, cli_params(engine, args, prompt, **fields))] = i
    except (ValueError, TypeError) as e:  # TypeError: a field SamplingParams does not have
        return f"line {i + 1}: {e}"


def print_result(result: RequestOutput | str, jsonl: bool) -> None:
    out = None if isinstance(result, str) else result.outputs[0]
    if jsonl:
        print(json.dumps({"error": result} if out is None else dict(
            prompt=result.prompt, text=out.text, token_ids=out.token_ids,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason, logprobs=out.logprobs,
            prompt_logprobs=result.prompt_logprobs)), flush=True)
    elif out is None:
        print(f"error: {result}", file=sys.stderr)
    else:
        print(((result.prompt or "") + out.text).translate(VISIBLE), end="\n\n", flush=True)


REPL_HELP = ("/set NAME VALUE sets a sampling field (max_tokens, temperature, top_k, top_p, "
             "seed, stop, ignore_eos; /set NAME alone resets it), /help, /quit.\nCtrl-C stops "
             "a completion; at the prompt, Ctrl-C or Ctrl-D ends.")


def run_terminal(engine: Engine, args: argparse.Namespace) -> None:
    """At a terminal: each line is a prompt whose completion streams as it is generated."""
    settings = {}
    print(REPL_HELP)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            return print()
        if line.startswith("/"):
            if line.strip() == "/quit":
                return
            print(repl_command(line, settings, engine, args))
            continue
        try:
            request_id = engine.add_request(line, cli_params(engine, args, line, **settings))
        except ValueError as e:
            print(f"error: {e}")
            continue
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    print(out.outputs[0].text.translate(VISIBLE), end="", flush=True)
        except KeyboardInterrupt:  # stop this completion, free its blocks, back to the prompt
            engine.abort(request_id, "interrupted")
            engine.step()
            print("\n[interrupted]", end="")
        print()


def repl_command(line: str, settings: dict, engine: Engine, args: argparse.Namespace) -> str:
    """/set NAME [VALUE] or /help: the reply. A value is JSON (0.7, 5, true, null); stop's is
    a string with escapes (/set stop \\n\\n)."""
    command, name, value = (line.split(maxsplit=2) + ["", ""])[:3]
    if command == "/help":
        return REPL_HELP + "\nnow: " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
    if command != "/set" or name not in {f.name for f in dataclasses.fields(SamplingParams)}:
        return f"error: unknown command {line!r}; /help lists them"
    if not value:
        settings.pop(name, None)
        return f"{name} reset"
    try:
        parsed = [codecs.decode(value, "unicode_escape")] if name == "stop" else json.loads(value)
        cli_params(engine, args, "", **settings | {name: parsed})  # validates
    except (ValueError, TypeError) as e:
        return f"error: {e}"
    settings[name] = parsed
    return f"{name} = {parsed!r}"


def main(argv=None) -> None:
    """Errors: one "error: ..." line, status 2. Ctrl-C: status 130. A closed stdout: quiet."""
    args = parse_args(argv)
    try:
        check_int("--threads", args.threads, 1)
        if args.trace and not args.prompt or args.serve and args.prompt:
            raise ValueError("--trace needs --prompt" if args.trace else
                             "--serve takes no --prompt")
        torch.set_num_threads(args.threads)
        config = EngineConfig(**{f.name: getattr(args, f.name)
                                 for f in dataclasses.fields(EngineConfig)})
        engine = Engine(config)
        if args.serve:
            serve(engine, args)
        elif args.prompt:
            run_prompts(engine, args)
        elif sys.stdin.isatty() and not args.jsonl:
            run_terminal(engine, args)
        else:
            run_stdin(engine, args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no 2nd error at exit
        sys.exit(1)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

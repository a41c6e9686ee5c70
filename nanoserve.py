"""nanoserve: the engine, its offline API and its command line.

`Engine.step()` is the whole serving algorithm, one iteration at a time: ask the scheduler
for this step's batch, run the model once over every scheduled token, sample one token for
each sequence whose prompt is fully computed, append it, and free the finished. Everything
else (LLM.generate, the command line) is a `while engine.has_unfinished(): engine.step()`.

    python nanoserve.py --prompt "ROMEO:" --prompt "JULIET:" --max-tokens 200

The offline API has vLLM's shape, so moving to vLLM is an import away:

    from nanoserve import LLM, SamplingParams
    outputs = LLM().generate(["ROMEO:"], SamplingParams(max_tokens=64, temperature=0))
    print(outputs[0].outputs[0].text)
"""
import argparse
import ctypes
import itertools
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import torch

from model import PRESETS, GPT, byte_tokenizer, load_checkpoint, load_tokenizer
from kernels import AttentionMetadata
from paged_cache import BlockAllocator, BlockTable, KVCache, cdiv
from scheduler import POLICIES, Scheduler, Sequence, SequenceStatus

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "checkpoints", "shakespeare")  # trained by model.py, shipped
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
KV_CACHE_BYTES = 1 << 30  # the default KV cache's memory budget: 1 GiB
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM and the OpenAI API name it. temperature 0 is greedy."""
    max_tokens: int = 16                  # tokens to generate at most
    temperature: float = 1.0              # 0: greedy (argmax)
    top_k: int = 0                        # keep the k most likely tokens; 0: all
    top_p: float = 1.0                    # keep the smallest set with probability >= top_p
    seed: int | None = None               # per-request RNG: same tokens whatever the batch
    stop: list[str] = field(default_factory=list)  # stop before any of these strings
    ignore_eos: bool = False              # keep going after <|endoftext|>

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class EngineConfig:
    """How the engine is built. `model`: a checkpoint directory or a GPT-2 name; `preset`:
    random (seeded) weights of that shape instead; neither: the shipped Shakespeare model."""
    model: str | None = None
    preset: str | None = None             # "tiny" or "gpt2"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "auto"                   # auto: float32 on CPU, bfloat16 on CUDA
    attention: str = "auto"               # torch | triton; auto: torch on CPU, triton on CUDA
    block_size: int = 16                  # tokens per KV block
    kv_cache_tokens: int | None = None    # KV capacity in tokens; None: max_num_seqs full
                                          # contexts, at most KV_CACHE_BYTES of memory
    max_num_seqs: int = 64                # sequences in one step at most
    token_budget: int = 512               # tokens in one step at most (max batched tokens)
    chunked_prefill: bool = True          # split long prompts across steps
    policy: str = "fcfs"                  # fcfs | sjf | static
    seed: int = 0                         # random weights, and requests without a seed

    def __post_init__(self):
        if self.model is not None and self.preset is not None:
            raise ValueError("give a model or a preset, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {list(PRESETS)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {POLICIES}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention {self.attention!r}; choose torch or triton")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto or one of {list(DTYPES)}")
        for name in ("block_size", "max_num_seqs", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) is less than one block "
                             f"({self.block_size} tokens)")
        if self.attention == "auto":
            self.attention = "triton" if self.device.startswith("cuda") else "torch"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None     # "stop", "length", "abort" or None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


# ----------------------------------------------------------------------------- models

def load_model(config: EngineConfig):
    """(model, tokenizer) for an EngineConfig: a preset, a directory, a GPT-2 name, the default."""
    if config.preset is not None:
        torch.manual_seed(config.seed)
        model, tokenizer = GPT(PRESETS[config.preset], config.attention), byte_tokenizer()
    else:
        path = config.model or DEFAULT_MODEL
        if path in HUB_MODELS and not os.path.isdir(path):
            path = hub_checkpoint(path)
        if not os.path.isdir(path):
            raise ValueError(f"model {path!r} is neither a checkpoint directory nor one of "
                             f"{', '.join(HUB_MODELS)}")
        model, tokenizer = load_checkpoint(path, config.attention), load_tokenizer(path)
    return model.to(config.device, DTYPES[config.dtype]).eval(), tokenizer


def hub_checkpoint(name: str) -> str:
    """A GPT-2 checkpoint from the local Hugging Face cache, else downloaded into it."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    files = ("config.json", "vocab.json", "merges.txt", "model.safetensors")
    for repo in (name, f"openai-community/{name}"):
        snapshots = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots")
        for snap in sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []:
            if all(os.path.exists(os.path.join(snapshots, snap, f)) for f in files):
                return os.path.join(snapshots, snap)
    advice = (f"{name} is not in the Hugging Face cache ({hub}) and cannot be downloaded"
              f" ({{}}); pass --model DIR with a GPT-2 checkpoint directory, or no --model"
              f" for the built-in Shakespeare model")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise ValueError(advice.format("HF_HUB_OFFLINE is set"))
    target = os.path.join(hub, f"models--openai-community--{name}", "snapshots", "main")
    for f in files:
        url = f"https://huggingface.co/openai-community/{name}/resolve/main/{f}"
        try:
            _download(url, os.path.join(target, f))
        except OSError as e:
            raise ValueError(advice.format(e)) from None
    return target


def _download(url: str, path: str) -> None:
    with urllib.request.urlopen(url, timeout=10) as r:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # only once the hub has answered
        with open(path + ".part", "wb") as f:
            _copy_with_progress(r, f, os.path.basename(path))
    os.replace(path + ".part", path)


def _copy_with_progress(r, f, name: str) -> None:
    total, done = int(r.headers.get("Content-Length") or 0), 0
    while chunk := r.read(1 << 20):
        done += f.write(chunk)
        print(f"\rdownloading {name}: {done / 1e6:.0f}/{total / 1e6:.0f} MB", end="",
              file=sys.stderr)
    print(file=sys.stderr)


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


# ----------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits (n, vocab), each with its own sequence's params and RNG."""
    greedy = logits.argmax(dim=-1).tolist()
    return [greedy[i] if seq.params.temperature == 0 else
            sample_one(logits[i], seq.params, seq.generator) for i, seq in enumerate(seqs)]


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p (nucleus), then a draw from what is left."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token only if the ones before it already reach top_p: the crossing one stays
        drop = cumulative - sorted_logits.softmax(dim=-1) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).item()


# ----------------------------------------------------------------------------- engine

@dataclass
class Batch:
    """One step's model inputs, flattened over the scheduled sequences."""
    input_ids: torch.Tensor         # (N,)
    positions: torch.Tensor         # (N,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor       # rows of the last token of each sequence that samples
    sample_seqs: list[Sequence]     # the sequences whose prompt is now fully computed


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_batched_seqs: int = 0       # summed over steps: divide by num_steps for the mean
    num_batched_tokens: int = 0
    peak_batch_size: int = 0


class Engine:
    """Continuous batching over a paged KV cache: add requests any time, call step()."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device == "cpu":
            keep_freed_memory()
        self.model, self.tokenizer = load_model(config)
        c = self.model.config
        kv_cache_tokens = config.kv_cache_tokens or self._default_kv_cache_tokens()
        num_blocks = kv_cache_tokens // config.block_size
        self.kv_cache = KVCache(c.n_layer, num_blocks, config.block_size, c.n_head, c.head_dim,
                                config.device, DTYPES[config.dtype])
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.token_budget,
                                   config.chunked_prefill, config.policy)
        self.generator = torch.Generator(config.device).manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    def _default_kv_cache_tokens(self) -> int:
        c = self.model.config
        bytes_per_token = 2 * c.n_layer * c.n_embd * DTYPES[self.config.dtype].itemsize  # K and V
        return min(self.config.max_num_seqs * c.n_positions, KV_CACHE_BYTES // bytes_per_token)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError, with nothing queued, if it can never be served."""
        params = params or SamplingParams()
        is_text = isinstance(prompt, str)  # else token ids
        token_ids = self.tokenizer.encode(prompt, allowed_special="all") if is_text else prompt
        request_id = str(next(self._ids)) if request_id is None else request_id
        self._validate(token_ids, params, request_id)
        if not is_text:
            prompt = self.detokenize(token_ids)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(self.config.device).manual_seed(params.seed)
        seq = Sequence(request_id, prompt, list(token_ids), params,
                       BlockTable(self.config.block_size), generator)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        n, c = len(token_ids), self.model.config
        context, vocab = c.n_positions, c.vocab_size
        if n == 0:
            raise ValueError("prompt is empty: it needs at least one token")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if n + params.max_tokens > context:
            raise ValueError(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                             f"{n + params.max_tokens} tokens; the model's context is {context}")
        cached = n + params.max_tokens - 1  # the last sampled token is never written
        blocks = cdiv(cached, self.config.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks ({cached} tokens) but the cache "
                             f"has {self.allocator.num_blocks}; raise kv_cache_tokens")
        if not self.config.chunked_prefill and cached > self.config.token_budget:
            raise ValueError(f"request may need to prefill {cached} tokens in one step, but "
                             f"token_budget is {self.config.token_budget} and chunked prefill "
                             "is off")

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, append, free the finished."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        batch = self._prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta,
                            self.kv_cache.k, self.kv_cache.v)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        next_tokens = sample(logits, batch.sample_seqs)
        for seq, num_new in scheduled.items():
            seq.num_computed_tokens += num_new
        for seq, token in zip(batch.sample_seqs, next_tokens):
            seq.token_ids.append(token)
            self._check_stop(seq)
        self._count(scheduled, len(next_tokens))
        return [self._output(seq) for seq in batch.sample_seqs]

    def _count(self, scheduled: dict[Sequence, int], num_sampled: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_batched_seqs += len(scheduled)
        s.num_batched_tokens += sum(scheduled.values())
        s.peak_batch_size = max(s.peak_batch_size, len(scheduled))

    def _prepare(self, scheduled: dict[Sequence, int]) -> Batch:
        input_ids, positions, slots, starts, sample_rows, sample_seqs = [], [], [], [0], [], []
        for seq, num_new in scheduled.items():
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += seq.block_table.slots(start, end)
            starts.append(starts[-1] + num_new)
            if end == len(seq.token_ids):  # the whole prompt is in: sample the next token
                sample_rows.append(starts[-1] - 1)
                sample_seqs.append(seq)
        seqs = list(scheduled)
        width = max(len(seq.block_table.block_ids) for seq in seqs)
        tables = [seq.block_table.block_ids + [0] * (width - len(seq.block_table.block_ids))
                  for seq in seqs]
        context_lens = [seq.num_computed_tokens + n for seq, n in scheduled.items()]
        device = self.config.device
        tensor = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=tensor(slots), block_tables=tensor(tables, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            max_query_len=max(scheduled.values()))
        return Batch(tensor(input_ids), tensor(positions), meta, tensor(sample_rows), sample_seqs)

    def _check_stop(self, seq: Sequence) -> None:
        """Update seq.text; finish the sequence on end-of-text, a stop string or max_tokens."""
        params, output_ids = seq.params, seq.output_token_ids
        eos = output_ids[-1] == self.tokenizer.eot_token and not params.ignore_eos
        seq.text = self.detokenize(output_ids)  # <|endoftext|> never appears in text
        stops = [i for i in (seq.text.find(s) for s in params.stop) if i >= 0]
        if stops:
            seq.text = seq.text[:min(stops)]
        if eos or stops:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif len(output_ids) == params.max_tokens:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        if seq.is_finished:
            del self.seqs[seq.seq_id]

    def detokenize(self, token_ids: list[int]) -> str:
        # ids past the tokenizer (random gpt2-shaped weights with the byte tokenizer) print nothing
        ids = [t for t in token_ids if t < self.tokenizer.n_vocab and t != self.tokenizer.eot_token]
        return self.tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")

    def _output(self, seq: Sequence) -> RequestOutput:
        reason = seq.status.value if seq.is_finished else None
        text = seq.text if seq.is_finished else seq.text.rstrip("\ufffd")  # hold back split UTF-8
        return RequestOutput(seq.seq_id, seq.prompt, seq.prompt_token_ids,
                             [CompletionOutput(0, text, seq.output_token_ids, reason)],
                             seq.is_finished)

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request and free its blocks; unknown ids are ignored."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()


class LLM:
    """vLLM's offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def generate(self, prompts: str | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Serve all prompts as one continuous batch; outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for request_id in ids:  # all or nothing: no half-submitted batch stays queued
                self.engine.abort(request_id)
            raise
        finished = {}
        while self.engine.has_unfinished():
            finished.update((o.request_id, o) for o in self.engine.step() if o.finished)
        return [finished[i] for i in ids]


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    defaults = EngineConfig.__dataclass_fields__
    p = argparse.ArgumentParser(description="nanoserve: continuous batching over a paged KV cache")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt; repeat it to serve several together as one batch")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="checkpoint directory or gpt2[-medium|-large|-xl]; "
                   "default: the shipped Shakespeare model")
    g.add_argument("--preset", choices=list(PRESETS), help="random weights of this shape instead")
    g.add_argument("--device", default=defaults["device"].default)
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    g.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, help="default: 200, or what the context has left")
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g = p.add_argument_group("scheduling and cache")
    g.add_argument("--policy", default="fcfs", choices=POLICIES)
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"].default)
    g.add_argument("--token-budget", type=int, default=defaults["token_budget"].default,
                   help="tokens per step (max batched tokens)")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--block-size", type=int, default=defaults["block_size"].default)
    g.add_argument("--kv-cache-tokens", type=int, help="KV cache capacity in tokens; default: "
                   "max-num-seqs full contexts, within 1 GiB")
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, preset=args.preset, device=args.device,
                        dtype=args.dtype, attention=args.attention, block_size=args.block_size,
                        kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
                        token_budget=args.token_budget, chunked_prefill=not args.no_chunked_prefill,
                        policy=args.policy)


def run_prompts(engine: Engine, args: argparse.Namespace) -> None:
    """Serve every --prompt as one batch; stream each one's text in turn, then a summary."""
    context = engine.model.config.n_positions
    ids = []
    for prompt in args.prompt:
        max_tokens = args.max_tokens
        if max_tokens is None:  # 200, or what the context leaves (at least 1: then it says why)
            max_tokens = max(1, min(200, context - len(engine.tokenizer.encode(prompt))))
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        ids.append(engine.add_request(prompt, params))
    # Request `current` streams; later ones wait their turn. shown: its characters printed.
    latest, shown, current = {}, None, 0
    start = time.perf_counter()
    while engine.has_unfinished() or current < len(ids):
        latest.update((o.request_id, o) for o in engine.step())
        while current < len(ids) and ids[current] in latest:
            out = latest[ids[current]]
            if shown is None:
                print(("\n\n" if current else "") + out.prompt, end="")
                shown = 0
            print(out.outputs[0].text[shown:], end="", flush=True)
            shown = len(out.outputs[0].text)
            if not out.finished:
                break
            current, shown = current + 1, None
    elapsed, s = time.perf_counter() - start, engine.stats
    print(f"\n\n[{s.num_prompt_tokens} prompt + {s.num_generated_tokens} generated tokens in "
          f"{elapsed:.2f} s, {s.num_generated_tokens / elapsed:.1f} tok/s, {s.num_steps} steps, "
          f"peak batch {s.peak_batch_size}, {engine.scheduler.num_preemptions} preemptions]",
          file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        engine = Engine(engine_config(args))
        run_prompts(engine, args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

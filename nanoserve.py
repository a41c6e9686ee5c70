"""nanoserve: the engine. Continuous batching over a paged KV cache, one step() at a time.

`Engine.step()` is the serving algorithm, one iteration at a time: schedule (the scheduler's
SchedulerOutput says which tokens of which sequences run now, who was admitted, who was
preempted), execute (build the flat batch, run the model once over all of it, sample a token
for each sequence with no uncomputed token left), update (advance, append, detokenize, finish
and free), record (a StepRecord of what it did). Everything else loops over step().

In this file, in order: EngineConfig, the outputs (CompletionOutput, RequestOutput), what a
step records (StepRecord, EngineStats), Engine with step() at its top, then the offline API
(LLM, accumulate). The engine uses the scheduler (scheduler.py) and the KV cache's blocks
(paged_cache.py); the device side of a step (the KV cache's tensors, the inputs, the model,
attention, sampling, CUDA graphs) is the model runner's (model_runner.py); load_model
(checkpoint.py) gives it the model and its tokenizer. The
front ends use the engine and nothing here uses them: the command line and the REPL (cli.py,
which `python nanoserve.py` runs) and the HTTP server (server.py). The offline API has
vLLM's shape and argument names, so moving to vLLM is an import away:

    from nanoserve import LLM, SamplingParams
    outputs = LLM().generate(["ROMEO:"], SamplingParams(max_tokens=64, temperature=0))

Speculative decoding (spec_decode.py) is two hooks here: propose() at the end of a step sets
the next step's drafts, and update() appends a verified run of tokens one at a time.

LoRA adapters (lora.py) are a few hooks here: add_request acquires a request's adapter, a
finished sequence releases it, and execute() puts the running ones in device slots.

Beam search (beam_search.py) is three hooks here: add_beam_request queues a request's prompt
as its first beam, update() hands the beams' logits to BeamSearch.update, which forks and
drops beams on shared blocks, and abort() cancels one; execute() makes the step's
copy-on-write block copies with its swaps. LLM.beam_search is vLLM's offline call.

Tensor parallelism (tensor_parallel.py) is a few hooks here: with tensor_parallel_size > 1
the workers start before the model loads, rank 0 loads its shard, and close() stops them.

Disaggregated prefill and decode (kv_connector.py) is a hook here and three in the scheduler:
execute() has the KV connector copy the K/V of the loads that finished into their blocks
first thing (start_load_kv), and update() has a producer save each prompt computed
(save_kv); the scheduler asks it at admission how many prompt tokens it holds, parks the
request while a background thread reads them, and at each step's start which loads finished.

Left out: multi-modal inputs.
"""
import dataclasses
import itertools
import os
import sys
import threading
from dataclasses import dataclass, field

import torch

from beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchRequest,
                         BeamSearchSequence)
from checkpoint import DTYPES, load_model
from linear import QUANTIZATION_METHODS
from display import Progress, progress_wanted, render_trace
from draft_proposer import DraftModelProposer, draft_kv_bytes_per_token, load_draft
from kernels import keep_freed_memory
from kv_connector import KVTransferConfig, make_kv_connector, parse_kv_transfer_config
from lora import LoRARequest
from model import PRESETS
from model_runner import ModelOutput, ModelRunner
from ngram_proposer import NgramProposer
from options import check_fields, check_int, option
from paged_cache import KV_CACHE_DTYPES, BlockTable, cdiv
from sampling import SamplingParams, generation_config_defaults
from scheduler import (MAX_PRIORITY, POLICIES, PREEMPTION_MODES, BeamGroup, Scheduler,
                       SchedulerOutput, Sequence, SequenceStatus, check_stop)
from spec_decode import SpeculativeConfig, Speculator, parse_speculative_config
from structured_output import StructuredOutputManager, accept_token, new_grammar
from tensor_parallel import TensorParallel, TensorParallelError
from tokenizer import Detokenizer

__version__ = "0.1.0"     # pyproject.toml reads it from here
# the defaults of max_num_seqs and max_num_batched_tokens, by device (EngineConfig)
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 512
CUDA_MAX_NUM_SEQS = 256             # of vLLM's order (its server: 256 to 1,024 by GPU)
CUDA_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's server's on an 80 GB GPU


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
    quantization: str | None = option(None, "weights in 8 bits, quantized as they load (a "
                                      "compressed-tensors FP8 checkpoint: as stored); the "
                                      "embedding and LM head stay in dtype",
                                      choices=list(QUANTIZATION_METHODS))
    kv_cache_dtype: str = option("auto", "the KV cache's dtype; auto: the model's; fp8 "
                                 "(= fp8_e4m3): float8_e4m3fn, a scale a layer, twice the "
                                 "tokens of a 16-bit cache", choices=list(KV_CACHE_DTYPES))
    attention: str = option("auto", "paged attention; auto: torch on CPU, Triton on CUDA",
                            choices=["auto", "torch", "triton"])
    max_model_len: int | None = option(None, "prompt + output at most; default: the context",
                                       type=int)
    block_size: int = option(16, "tokens per KV block")
    kv_cache_tokens: int | None = option(None, "KV cache capacity in tokens; default: "
                                         "max-num-seqs full contexts, within 1 GiB", type=int)
    # bounded: the input batch holds a row for each, made up front (input_batch.py)
    max_num_seqs: int | None = option(None, "sequences in one step at most; default: 64 on a "
                                      "CPU, 256 on CUDA", high=65536, type=int)
    max_num_batched_tokens: int | None = option(None, "tokens in one step at most (the token "
                                                "budget); default: 512 on a CPU, 8192 on CUDA",
                                                type=int)
    gpu_memory_utilization: float = option(0.9, "CUDA: the share of the GPU's memory the engine "
                                           "takes (weights, activations, KV cache: the cache "
                                           "gets the rest)", low=0, high=1, open_low=True)
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly, not in CUDA graphs")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps")
    enable_prefix_caching: bool = option(True, "reuse the cached KV blocks of earlier requests' "
                                         "prompt prefixes")
    policy: str = option("fcfs", "scheduling policy", choices=list(POLICIES))
    # vLLM V1 recomputes only; V0 could swap. recompute is the default: unchanged behaviour,
    # and with prefix caching a readmitted sequence often finds its blocks still cached.
    preemption_mode: str = option("recompute", "how a preempted sequence gives its KV blocks "
                                  "back: recompute them when readmitted, swap them to host "
                                  "memory and back, or auto: swap when copying costs less",
                                  choices=list(PREEMPTION_MODES))
    # vLLM V0's default, 4 GiB; allocated only when preemption_mode may swap (pinned on CUDA;
    # on a CPU its pages are touched only as blocks are swapped out)
    swap_space: float = option(4.0, "GiB of host memory for swapped-out KV blocks "
                               "(preemption_mode swap or auto); 0: none, always recompute",
                               low=0)
    seed: int = option(0, "seeds random weights and requests without a seed", low=0)
    generation_config: str = option("auto", "sampling defaults of requests that leave a field "
                                    "unset; auto: the checkpoint's generation_config.json where "
                                    "it gives one; vllm: ignore the file (vLLM's flag)",
                                    choices=["auto", "vllm"])
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\""
        ": 4} or {\"model\": PATH, \"num_speculative_tokens\": 4} (spec_decode.py)",
        type=parse_speculative_config)

    kv_transfer_config: KVTransferConfig | None = option(
        None, "disaggregated prefill and decode, as JSON: {\"kv_connector\": "
        "\"ExampleConnector\", \"kv_role\": \"kv_producer\" | \"kv_consumer\" | "
        "\"kv_both\", \"kv_connector_extra_config\": {\"shared_storage_path\": DIR}} "
        "(kv_connector.py)", type=parse_kv_transfer_config)

    # LoRA (lora.py): vLLM's flags
    enable_lora: bool = option(False, "serve LoRA adapters (requests name one: lora_request)")
    max_loras: int = option(4, "LoRA adapters resident on the device at once (a step's most)",
                            high=1024)
    max_lora_rank: int = option(16, "the largest LoRA rank served (slots are padded to it)",
                                high=512)
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory; default: "
                                       "max_loras", type=int)

    # tensor parallelism (tensor_parallel.py): vLLM's flag
    tensor_parallel_size: int = option(1, "processes the model is cut across (Megatron's cut: "
                                       "each holds 1/N of the heads, MLP and KV cache); gloo "
                                       "on a CPU, NCCL on CUDA (a GPU each)")

    def __post_init__(self):
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        check_fields(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} is below max_loras "
                             f"{self.max_loras}: the host keeps every resident adapter")
        if self.model == "":
            raise ValueError("model is empty: give a checkpoint or leave it out (the shipped "
                             "model)")
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
        self._default_limits(device.type)
        if self.attention == "triton" and device.type == "cpu" and self.dtype == "bfloat16":
            raise ValueError("Triton attention cannot run bfloat16 on a CPU (its interpreter "
                             "multiplies bf16 wrongly); use --dtype float32 or float16")
        self._check_tensor_parallel(device.type)

    def _check_tensor_parallel(self, device_type: str) -> None:
        """What tensor_parallel_size > 1 does not run with (yet), refused by name; whether
        the model's heads divide by it is checked as it loads (tensor_parallel.py)."""
        size = self.tensor_parallel_size
        if size == 1:
            return
        if device_type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs (one a rank); "
                             f"this machine has {torch.cuda.device_count()}")
        if self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config with tensor_parallel_size > 1: the connector "
                             "saves and loads rank 0's K/V heads only")

    def _default_limits(self, device_type: str) -> None:
        """max_num_seqs and max_num_batched_tokens left unset take the device's defaults: a
        CPU's 2 cores are busy with 64 sequences and 512 tokens a step; a GPU needs batches of
        vLLM's size (256 and 8,192) to be busy."""
        max_num_seqs, max_num_batched_tokens = CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS
        if device_type == "cuda":
            max_num_seqs, max_num_batched_tokens = CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS
        if self.max_num_seqs is None:
            self.max_num_seqs = max_num_seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max_num_batched_tokens


@dataclass
class CompletionOutput:
    """A request's new text and tokens since its last output (vLLM's DELTA), or all of them."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop", "length", "abort" (cancelled), "error" (failed),
                                    # or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: its log-probability, the top k
    error: str | None = None        # why it failed (finish_reason "error")
    cumulative_logprob: float | None = None  # beam search: the hypothesis's log-probability


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None              # None for a prompt given as token ids, as in vLLM
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in a request's first output


@dataclass
class StepRecord:
    """What one step did, by sequence id (a request's first sample has the request's own id):
    the record that --trace, /metrics, bench.py and the watch page read and EngineStats adds
    up."""
    scheduled: dict[str, int]       # tokens computed this step
    sampled: list[str]              # got a token
    finished: list[str]             # ended in this step, or were aborted since the last one
    preempted: list[str]            # sent back to waiting, their blocks freed
    num_cached_tokens: dict[str, int]  # first admitted, with this many prefix-cache hits (> 0)
    num_queried_tokens: int         # the prompt tokens of the sequences first admitted: each
                                    # sample looks its prompt up in the prefix cache once
    num_running: int
    num_waiting: int
    num_kv_tokens: int              # tokens whose K/V the running sequences hold
    kv_blocks_used: int
    # each scheduled sequence's phase this step (scheduled_phase): "prefill", "decode",
    # "verify", "recompute"
    phases: dict[str, str] = field(default_factory=dict)
    # speculative decoding: the draft tokens each sequence verified, and how many it accepted
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    swapped_out: list[str] = field(default_factory=list)  # of the preempted: to host memory
    swapped_in: list[str] = field(default_factory=list)   # readmitted from host memory
    lora_names: dict[str, str] = field(default_factory=dict)  # scheduled with a LoRA adapter
    swap_blocks_used: int = 0       # host blocks holding swapped-out K/V (swap.py)
    num_block_copies: int = 0       # copy-on-write: blocks copied before the step (beams)
    # disaggregated prefill (kv_connector.py): admitted with K/V loaded from another instance
    # -> how many tokens; and what the connector read (checked), spent, failed and wrote
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    num_kv_load_failures: int = 0   # entries there but bad: their tokens computed instead
    num_kv_saved_tokens: int = 0
    fell_back: bool = False         # the batch failed and each sequence ran alone


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_queried_tokens: int = 0     # prompt tokens looked up in the prefix cache, a sample's
                                    # once (n = 3: three times the prompt)
    num_cached_tokens: int = 0      # of those, the tokens the prefix cache supplied
    num_generated_tokens: int = 0
    num_batched_seqs: int = 0       # summed over steps: divide by num_steps for the mean
    num_batched_tokens: int = 0     # tokens computed, recomputation after preemption included
    peak_batch_size: int = 0
    # speculative decoding, vLLM's counters: sequences that verified drafts (summed over
    # steps), their draft tokens, and of those the accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # steps whose batch failed and ran again one sequence at a time: a step that raises is
    # seen here (and in /metrics), not only in the requests that fail alone
    num_fallbacks: int = 0
    # disaggregated prefill (kv_connector.py): prompt tokens loaded rather than computed, the
    # bytes read for them, the seconds it took, bad entries recomputed, tokens saved
    num_kv_loaded_tokens: int = 0
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    num_kv_load_failures: int = 0
    num_kv_saved_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """The share of the prompt tokens looked up that the prefix cache supplied."""
        if self.num_queried_tokens == 0:
            return 0.0
        return self.num_cached_tokens / self.num_queried_tokens

    def record(self, step: StepRecord) -> None:
        self.num_kv_loaded_tokens += sum(step.num_loaded_tokens.values())
        self.kv_load_bytes += step.kv_load_bytes
        self.kv_load_seconds += step.kv_load_seconds
        self.num_kv_load_failures += step.num_kv_load_failures
        self.num_kv_saved_tokens += step.num_kv_saved_tokens
        self.num_queried_tokens += step.num_queried_tokens  # admitted to load (kv_connector.py)
        self.num_cached_tokens += sum(step.num_cached_tokens.values())  # or to run
        if not step.scheduled:  # only aborts since the last step, or admissions to load
            return
        self.num_steps += 1
        self.num_generated_tokens += len(step.sampled) + sum(step.num_accepted_tokens.values())
        self.spec_decode_num_drafts += len(step.num_draft_tokens)
        self.spec_decode_num_draft_tokens += sum(step.num_draft_tokens.values())
        self.spec_decode_num_accepted_tokens += sum(step.num_accepted_tokens.values())
        self.num_batched_seqs += len(step.scheduled)
        self.num_batched_tokens += sum(step.scheduled.values())
        self.peak_batch_size = max(self.peak_batch_size, len(step.scheduled))
        if step.fell_back:
            self.num_fallbacks += 1


class EngineDeadError(RuntimeError):
    """The device failed (a CUDA error): the engine cannot run another step; restart it."""


def is_device_error(error: Exception) -> bool:
    """Whether an error is the device's (a device-side assert, an illegal address): CUDA
    reports it at the next wait for the GPU, whichever request caused it, and the CUDA context
    stays unusable, so running the requests again one at a time would only fail them all."""
    if isinstance(error, TensorParallelError):  # the ranks cannot step together: as fatal
        return True
    return isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error)


def sample_id(request_id: str, index: int) -> str:
    """The sequence id of a request's sample `index`: the request's own id for sample 0 (so a
    request of one sample is one id, and the trace's row for a request is its first sample),
    "{index}_{request_id}" for the others (vLLM's form)."""
    if index == 0:
        return request_id
    return f"{index}_{request_id}"


class Engine:
    """Continuous batching over a paged KV cache: add requests any time, call step().
    add_request(), abort() and has_unfinished() may be called from any thread (each waits for
    the step in flight, under the engine's lock); everything else from the thread that steps."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device.startswith("cpu"):
            keep_freed_memory()
        self.tensor_parallel: TensorParallel | None = None  # ranks 1..N-1, if N > 1
        shard = None
        if config.tensor_parallel_size > 1:  # the workers load their shards as we load ours
            self.tensor_parallel = TensorParallel(config)
            shard = self.tensor_parallel.shard
        # built on its device in its dtype (auto on CUDA: the checkpoint's, run_dtype)
        checkpoint = load_model(config.model, config.preset, config.seed, config.device,
                                DTYPES.get(config.dtype), config.quantization, shard=shard)
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids  # each ends a request unless ignore_eos
        self.model = checkpoint.model.eval()
        if self.tensor_parallel is not None:  # every forward of ours runs on the workers too
            self.tensor_parallel.attach(self.model)
        c = self.model.config
        self.vocab_size = self._vocab_size(c.vocab_size)
        # what the checkpoint says of requests: read here, so a bad one stops the engine's start
        self.sampling_defaults = generation_config_defaults(  # generation_config.json's
            checkpoint.generation_config, checkpoint.path, config.generation_config)
        self.chat_template = checkpoint.chat_template  # None: the server's transcript
        # compiles requests' structured outputs (JSON schemas, regexes...), cached by text
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.eos_token_ids, self.vocab_size)
        if config.max_model_len is not None and config.max_model_len > c.n_positions:
            raise ValueError(f"max_model_len {config.max_model_len} > the context {c.n_positions}")
        spec_config = config.speculative_config
        draft = None  # a draft model: loaded first, its weights and its cache sized with ours
        if spec_config is not None and spec_config.method == "draft_model":
            draft = load_draft(spec_config.model, config, checkpoint.dtype, self.tokenizer)
        # the device side: the KV cache (sized here), the persistent batch, the graphs
        self.model_runner = ModelRunner(config, self.model, checkpoint.dtype, self.vocab_size,
                                        self.eos_token_ids,
                                        draft_kv_bytes_per_token(draft, config.kv_cache_dtype))
        self.block_pool = self.model_runner.block_pool
        # disaggregated prefill: K/V to and from other instances (kv_connector.py), or None
        self.kv_connector = make_kv_connector(
            config.kv_transfer_config, model_id(checkpoint, config), config.block_size,
            self.model_runner.k_caches, self.model_runner.v_caches)
        if self.tensor_parallel is not None:  # the workers' caches and adapter slots
            self.tensor_parallel.prepare(self.model_runner)
        self.max_model_len = self._max_model_len(config.max_model_len, c.n_positions)
        self.model_runner.prepare(self.max_model_len)
        self.scheduler = Scheduler(self.block_pool, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.policy, preemption_mode=config.preemption_mode,
                                   swap_space=self.model_runner.swap_space,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   kv_connector=self.kv_connector,
                                   speculative=spec_config is not None)
        self.lora_manager = self.model_runner.lora_manager  # None unless enable_lora
        self.seqs: dict[str, Sequence] = {}            # sequence id -> its sequence
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n samples
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None           # the newest step's record
        self.step_recorded = False  # whether the last step() made one (an idle step makes none)
        self.step_records: list[StepRecord] | None = None  # every record, once made a list
        self._ids = itertools.count()
        self._lock = threading.Lock()  # abort() from other threads against step()
        self._aborted_outputs: list[RequestOutput] = []  # for the next step() to return
        self.dead: str | None = None  # why the engine cannot step any more (a device error)
        self.beam_search = BeamSearch(self.scheduler, self.model_runner, self.eos_token_ids)
        self.speculator: Speculator | None = None  # speculative decoding, if configured
        if spec_config is not None:
            self.speculator = Speculator(spec_config, self._proposer(spec_config, draft),
                                         config.device)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (done too when the engine is collected,
        and at exit), and the KV connector's loading thread, after which the engine cannot
        step; without either, nothing."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def _proposer(self, spec_config: SpeculativeConfig, draft):
        """The proposer speculative_config names: n-gram lookup, or a draft model (draft,
        loaded)."""
        if spec_config.method == "ngram":
            return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)
        return DraftModelProposer(spec_config.model, draft, self)

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
    def swap_blocks_used(self) -> int:
        """Host blocks holding swapped-out sequences' K/V (0 without a swap space)."""
        swap_space = self.model_runner.swap_space
        if swap_space is None:
            return 0
        return swap_space.num_blocks - swap_space.num_free_blocks

    @property
    def kv_tokens_per_gib(self) -> int:
        """How many tokens' K/V a GiB holds: what grouped-query attention multiplies."""
        return 2**30 // self.model_runner.kv_bytes_per_token

    @property
    def model_weights_bytes(self) -> int:
        """The model's parameters' bytes (a tied LM head counted once): 8-bit projections and
        their fp32 scales, with quantization, beside the embedding and norms in dtype."""
        return sum(p.nbytes for p in self.model.parameters())

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's bytes: K and V of every layer and block, the null block included."""
        return self.model_runner.k_caches.nbytes + self.model_runner.v_caches.nbytes

    @property
    def num_kv_clipped(self) -> int:
        """K/V values an FP8 cache clipped to +-448 so far, over every layer (a wait for the
        device: read by /metrics, never by a step)."""
        return int(sum(layer.self_attn.num_kv_clipped for layer in self.model.model.layers))

    def memory_summary(self) -> str:
        """What the start-up line says of memory: "weights 13.7 MiB (int8), KV cache 64.0 MiB
        (float8_e4m3fn, 65536 tokens)"."""
        scheme = f" ({self.config.quantization})" if self.config.quantization else ""
        kv_dtype = str(self.model_runner.kv_cache_dtype).removeprefix("torch.")
        return (f"weights {self.model_weights_bytes / 2**20:.1f} MiB{scheme}, KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB ({kv_dtype}, {self.kv_cache_tokens} "
                "tokens)")

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
        delta output for every streamed request that got a token, the whole output of each
        sample that finished without streaming, and the last output of each request aborted
        or failed since the last step."""
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            outputs = self._aborted_outputs
            self._aborted_outputs = []
            scheduler_output = self.scheduler.schedule()
            model_output = self.execute(scheduler_output)
            outputs += self.update(scheduler_output, model_output)
            self.propose()
            self.record(scheduler_output, model_output, outputs)
            return outputs

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run the model once over every scheduled token and sample. If the batch fails, run
        each sequence alone: the ones that fail alone are the ones that fail."""
        for seq in scheduler_output.preempted:  # readmitted, it will start from a new row
            self._remove(seq)
        if self.kv_connector is not None:  # loaded K/V into their blocks, before a swap out
            self.kv_connector.start_load_kv()  # reads them or anything else writes the blocks
        self.model_runner.swap(scheduler_output.swapped_out, scheduler_output.swapped_in,
                               scheduler_output.block_copies)
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not num_scheduled_tokens:
            return ModelOutput()
        if self.lora_manager is not None:  # the running sequences' adapters into device slots
            self.lora_manager.activate(self.scheduler.running)
        # A batch may fail after sampling; alone, its seeded sequences draw the same again:
        # their noise is a function of seed and output position (sampling.noise_seed).
        try:
            return self.model_runner.execute_timed(num_scheduled_tokens, spec_decode_tokens)
        except Exception as e:  # noqa: BLE001 (find the request that fails; it alone fails)
            self._fail_fast_on_device_error(e)
            for seq in num_scheduled_tokens:  # whatever the failed batch wrote of their rows
                self.model_runner.remove(seq)
            return self._run_one_at_a_time(num_scheduled_tokens, spec_decode_tokens)

    def _fail_fast_on_device_error(self, error: Exception) -> None:
        """A device error ends the engine: EngineDeadError now, and at every later step()."""
        if not is_device_error(error):
            return
        first_line = str(error).strip().splitlines()[0]
        self.dead = f"the device failed ({first_line}); the engine must be restarted"
        raise EngineDeadError(self.dead) from error

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput
               ) -> list[RequestOutput]:
        """Apply a step's results: failed sequences fail; the scheduler advances the others
        (past their accepted drafts only); each sampled sequence takes its tokens one at a
        time, detokenizing and checking each (check_stop), and makes its output if it
        streams or finished."""
        outputs = []
        ran = dict(scheduler_output.num_scheduled_tokens)
        for seq, error in model_output.failed.items():
            ran.pop(seq, None)  # a sibling beam's failure may have taken it out
            if seq.beams is not None:
                outputs += self._fail_beams(seq, error, ran, model_output.sampled_token_ids)
            else:
                outputs.append(self._fail(seq, error))
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        self.scheduler.update(ran, model_output.sampled_token_ids, spec_decode_tokens)
        self.save_kv(ran)
        any_beams = bool(self.beam_search.requests)  # before update() ends any of them
        for request in self.beam_search.update(model_output):  # the beams' next tokens
            outputs.append(self._beam_output(request))
        for seq, drafts in spec_decode_tokens.items():
            if seq in model_output.sampled_token_ids:
                self._verified(seq, drafts, model_output.sampled_token_ids[seq])
        for seq, entries in model_output.prompt_logprobs.items():
            seq.prompt_logprobs += entries
        logprobs = model_output.logprobs
        sampled = model_output.sampled_token_ids
        if any_beams:  # a beam's sample is unused: BeamSearch.update chose for it
            sampled = {seq: tokens for seq, tokens in sampled.items() if seq.beams is None}
        for seq, tokens in sampled.items():
            output = self._append_tokens(seq, tokens, logprobs)
            if output is not None:
                outputs.append(output)
        return outputs

    def save_kv(self, ran: dict[Sequence, int]) -> None:
        """A KV producer (kv_connector.py) saves the full blocks of each prompt whose last
        token this step computed (num_new of them ran), for a decode instance to load."""
        if self.kv_connector is None:
            return
        for seq, num_new in ran.items():
            computed = seq.num_computed_tokens
            if computed - num_new < seq.num_prompt_tokens <= computed:
                self.kv_connector.save_kv(seq)

    def _verified(self, seq: Sequence, drafts: list[int], emitted: list[int]) -> None:
        """seq verified its drafts: its input-batch row forgets the blocks the scheduler freed
        past the accepted ones, and the speculator learns how many were accepted."""
        self.model_runner.truncate(seq)
        self.speculator.verified(seq, len(drafts), len(emitted) - 1)

    def propose(self) -> None:
        """Speculative decoding: the drafts of each running sequence's next step."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)

    def record(self, scheduler_output: SchedulerOutput, model_output: ModelOutput,
               outputs: list[RequestOutput]) -> None:
        """Make the step's StepRecord (an idle step without outputs makes none, and says so in
        step_recorded; one that only admitted sequences to load their K/V is not idle) and
        count it."""
        scheduled = scheduler_output.num_scheduled_tokens
        self.step_recorded = bool(scheduled or outputs or scheduler_output.newly_admitted)
        if not self.step_recorded:
            return
        self.last_step = StepRecord(
            scheduled={seq.seq_id: num_new for seq, num_new in scheduled.items()},
            sampled=[seq.seq_id for seq in model_output.sampled_token_ids],
            finished=[sample_id(output.request_id, completion.index) for output in outputs
                      for completion in output.outputs if completion.finish_reason is not None],
            preempted=[seq.seq_id for seq in scheduler_output.preempted],
            num_cached_tokens={seq.seq_id: num_cached for seq, num_cached
                               in scheduler_output.newly_admitted.items() if num_cached > 0},
            num_queried_tokens=sum(seq.num_prompt_tokens
                                   for seq in scheduler_output.newly_admitted),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            kv_blocks_used=self.block_pool.num_blocks - self.block_pool.num_free_blocks,
            phases={seq.seq_id: phase for seq, phase in scheduler_output.phases.items()},
            num_draft_tokens={seq.seq_id: len(drafts) for seq, drafts
                              in scheduler_output.scheduled_spec_decode_tokens.items()},
            num_accepted_tokens={seq.seq_id: len(model_output.sampled_token_ids[seq]) - 1
                                 for seq in scheduler_output.scheduled_spec_decode_tokens
                                 if seq in model_output.sampled_token_ids},
            swapped_out=[seq.seq_id for seq in scheduler_output.swapped_out],
            swapped_in=[seq.seq_id for seq in scheduler_output.swapped_in],
            lora_names=self._lora_names(scheduled),
            swap_blocks_used=self.swap_blocks_used,
            num_block_copies=sum(map(len, scheduler_output.block_copies.values())),
            fell_back=model_output.fell_back)
        self._record_kv_transfer(self.last_step, scheduler_output)
        self.stats.record(self.last_step)
        if self.step_records is not None:
            self.step_records.append(self.last_step)

    def _lora_names(self, scheduled: dict[Sequence, int]) -> dict[str, str]:
        """Each scheduled sequence's adapter name, by sequence id, if it has one (an engine
        without LoRA makes no pass over the step for it)."""
        if self.lora_manager is None:
            return {}
        return {seq.seq_id: seq.lora_request.lora_name for seq in scheduled
                if seq.lora_request is not None}

    def _record_kv_transfer(self, step: StepRecord, scheduler_output: SchedulerOutput) -> None:
        """What the KV connector loaded, read, spent and saved in the step (kv_connector.py)."""
        if self.kv_connector is None:
            return
        step.num_loaded_tokens = {seq.seq_id: num for seq, num
                                  in scheduler_output.num_external_tokens.items()}
        stats = self.kv_connector.take_stats()
        step.kv_load_bytes = stats.num_load_bytes
        step.kv_load_seconds = stats.load_seconds
        step.num_kv_load_failures = stats.num_load_failures
        step.num_kv_saved_tokens = stats.num_saved_tokens

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a prompt (a string, a list of token ids, {"prompt": str} or
        {"prompt_token_ids": [...]}) with a copy of params (none: the checkpoint's sampling
        defaults over SamplingParams' own, its max_tokens at most what the context leaves);
        ValueError if it can never run. stream: step() returns an output for each sample
        every step it makes a token (a delta); False: only the one that finishes it, whole,
        which saves a caller that wants only the end (LLM.generate) making and dropping an
        output per token. priority (vLLM's): lower is served first under --policy priority,
        which may preempt a running request of a higher number for it; the other policies
        ignore it. lora_request (vLLM's): the LoRA adapter it runs with (lora.py; None: the
        base model), read from disk here if the host does not hold it."""
        if type(stream) is not bool:
            raise ValueError(f"stream must be True or False, got {stream!r}")
        check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
        text, token_ids = self.parse_prompt(prompt)
        if params is None:
            params = self.default_params(len(token_ids))
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, validated again
        # before the lock, so a step never waits for it; a repeated constraint is cached
        compiled = self.structured_output_manager.compile(params.structured_outputs)
        # Under the lock from the id's check to its request's insertion: two threads adding
        # one id would both pass the check, and the second would hide the first from abort().
        with self._lock:
            if request_id is None:  # the next free number: never a caller's id, nor a sample's
                request_id = next(i for i in map(str, self._ids) if not self._in_use(i, params.n))
            self._validate(token_ids, params, request_id)
            self._check_lora(lora_request)
            seqs = [self._sample_sequence(request_id, index, text, token_ids, params, stream)
                    for index in range(params.n)]
            for seq in seqs:
                seq.priority = priority
                seq.lora_request = lora_request
                seq.block_table.cache_salt = lora_cache_salt(lora_request)
            if lora_request is not None:  # last: nothing after it may fail and leave it held
                self.lora_manager.acquire(lora_request, params.n)
            self.requests[request_id] = seqs
            for seq in seqs:
                seq.grammar = new_grammar(compiled)  # each sample matches on its own
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
                         token_ids: list[int], params: SamplingParams, stream: bool) -> Sequence:
        """Sample `index` of a request: each of its n samples is a sequence of its own (vLLM's
        fan-out, ids from sample_id); a seeded one's seed is seed + index."""
        seq_id = sample_id(request_id, index)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
        detokenizer = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        seq = Sequence(seq_id, text, token_ids, params, BlockTable(self.block_pool),
                       detokenizer=detokenizer, request_id=request_id, index=index, stream=stream)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has no log-probability
        return seq

    def add_beam_request(self, prompt, params: BeamSearchParams, request_id: str | None = None,
                         priority: int = 0) -> str:
        """Queue a beam-search request (beam_search.py): a prompt in any form add_request takes,
        searched with params; one output, when it finishes, its beam_width sequences best
        first. ValueError if it can never run."""
        check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.tensor_parallel is not None:
            raise ValueError("beam search with tensor_parallel_size > 1: the workers' caches "
                             "do not take the beams' copy-on-write block copies")
        params = dataclasses.replace(params)  # a copy, validated again
        text, token_ids = self.parse_prompt(prompt)
        # what the scheduler reads of a beam: a length, greedy (the sampled token is unused)
        sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                  ignore_eos=True)
        with self._lock:
            if request_id is None:
                request_id = next(i for i in map(str, self._ids) if not self._in_use(i, 1))
            self._validate(token_ids, sampling, request_id)
            self._validate_beams(token_ids, params)
            group = BeamGroup(params.beam_width)
            seq = Sequence(request_id, text, token_ids, sampling, BlockTable(self.block_pool),
                           request_id=request_id, stream=False, priority=priority, beams=group)
            if params.stop:  # its text, for the stop strings: each candidate forks it
                seq.detokenizer = Detokenizer(self.tokenizer, params.stop,
                                              params.include_stop_str_in_output)
            group.seqs.append(seq)
            self.requests[request_id] = group.seqs
            self.beam_search.add(BeamSearchRequest(request_id, text, token_ids, params, group))
            self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _validate_beams(self, token_ids: list[int], params: BeamSearchParams) -> None:
        """What a beam-search request needs beyond a request's: a sequence slot for each beam,
        and room for all of them unshared (so its beams can always be readmitted together)."""
        if self.speculator is not None:
            raise ValueError("beam search does not run with speculative decoding")
        if self.config.policy == "static":  # its batches admit no beams forked later
            raise ValueError("beam search does not run under policy static")
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(f"beam_width {params.beam_width} is more than max_num_seqs "
                             f"({self.config.max_num_seqs}): each beam is a sequence")
        num_blocks = params.beam_width * cdiv(len(token_ids) + params.max_tokens,
                                              self.block_pool.block_size)
        if num_blocks > self.block_pool.num_blocks:
            raise ValueError(f"beam_width {params.beam_width} beams of {len(token_ids)} + "
                             f"{params.max_tokens} tokens may need {num_blocks} KV blocks; the "
                             f"cache has {self.block_pool.num_blocks}")

    def _beam_output(self, request: BeamSearchRequest) -> RequestOutput:
        """A finished, aborted or failed beam-search request's output: its beam_width best
        hypotheses, best first, each a completion (index its rank, cumulative_logprob set)."""
        self.requests.pop(request.request_id, None)
        completions = []
        if request.error is not None or request.aborted:
            reason = "abort" if request.aborted else "error"
            completions.append(CompletionOutput(0, "", [], reason, error=request.error))
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                 completions, finished=True)
        for rank, hypothesis in enumerate(request.best(self.beam_search.eos_token_id)):
            token_ids = hypothesis.tokens[len(request.prompt_token_ids):]
            text = hypothesis.text  # a stop string's cut
            if text is None:
                text = self._beam_text(token_ids, request.params)
            completions.append(CompletionOutput(
                rank, text, token_ids, hypothesis.finish_reason, hypothesis.stop_reason,
                logprobs=hypothesis.logprobs, cumulative_logprob=hypothesis.cum_logprob))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, finished=True)

    def _beam_text(self, token_ids: list[int], params: BeamSearchParams) -> str:
        """A hypothesis's text: a final end-of-text's only if include_stop_str_in_output."""
        ends_in_eos = bool(token_ids) and token_ids[-1] in self.eos_token_ids
        if ends_in_eos and params.include_stop_str_in_output:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)
        if ends_in_eos:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids)

    def parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt in any form add_request takes -> (its text, its token ids); the text is
        None for a prompt given as token ids, as in vLLM."""
        if isinstance(prompt, dict):
            prompt = unwrap_prompt(prompt)
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
        if self._in_use(request_id, params.n):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias))):
            unknown = [token_id for token_id in ids if token_id >= vocab_size]
            if unknown:
                raise ValueError(f"{name}: token id {unknown[0]} is not in the vocabulary "
                                 f"(0 to {vocab_size - 1})")
        if num_tokens > self.max_model_len:
            limit = f"the model's context is {self.max_model_len}"
            if self.max_model_len < self.model.config.n_positions:  # the cache's or the user's
                limit = f"max_model_len is {self.max_model_len}"
            raise ValueError(f"prompt has {len(token_ids)} tokens and max_tokens is "
                             f"{params.max_tokens}: {num_tokens} tokens; {limit}")
        if not self.config.enable_chunked_prefill and num_kv_tokens > budget:
            raise ValueError(f"request may need to prefill {num_kv_tokens} tokens in one step, "
                             f"but max_num_batched_tokens is {budget} and chunked prefill is off")

    def _check_lora(self, lora_request) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.lora_manager is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled "
                             "(enable_lora)")

    def _in_use(self, request_id: str, n: int) -> bool:
        """Whether request_id names a live request, or the id of one of its n samples a live
        sequence (sample 1 of request "X" is "1_X", which a caller may also choose)."""
        if request_id in self.requests:
            return True
        return any(sample_id(request_id, index) in self.seqs for index in range(n))

    @torch.inference_mode()  # it writes the input batch's rows, made inside step()'s mode
    def abort(self, request_id: str) -> None:
        """Cancel a request and free its blocks now (after any step in flight); its last output
        (finish_reason "abort") comes from the next step()."""
        with self._lock:
            request = self.beam_search.abort(request_id)
            if request is not None:
                self._aborted_outputs.append(self._beam_output(request))
                return
            for seq in self.requests.get(request_id, []):
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                    self._aborted_outputs.append(self._output(seq))

    def _fail_beams(self, seq: Sequence, error: str, ran: dict[Sequence, int],
                    sampled: dict[Sequence, list[int]]) -> list[RequestOutput]:
        """A beam failed: its request fails whole (once, whichever of its beams failed), and
        its other beams neither advance nor sample in this step."""
        for beam in seq.beams.seqs:
            ran.pop(beam, None)
            sampled.pop(beam, None)
        request = self.beam_search.fail(seq, error)
        if request is None:
            return []
        return [self._beam_output(request)]

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """End a sequence that an error failed (finish_reason "error"; the error in its output)."""
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        seq.error = error
        return self._output(seq)

    def has_unfinished(self) -> bool:
        with self._lock:  # not between an abort's finish and its output's queueing
            return self.scheduler.has_unfinished() or bool(self._aborted_outputs)

    def _run_one_at_a_time(self, num_scheduled_tokens: dict[Sequence, int],
                           spec_decode_tokens: dict[Sequence, list[int]]) -> ModelOutput:
        """The batch failed: run each sequence alone; those that fail alone fail."""
        merged = ModelOutput(fell_back=True)
        logits = []
        for seq, num_new in num_scheduled_tokens.items():
            drafts = {seq: spec_decode_tokens[seq]} if seq in spec_decode_tokens else {}
            try:
                alone = self.model_runner.execute_model({seq: num_new}, drafts)
            except Exception as e:  # noqa: BLE001
                self._fail_fast_on_device_error(e)
                merged.failed[seq] = f"{type(e).__name__}: {e}"
                continue
            merged.failed |= alone.failed
            merged.sampled_token_ids |= alone.sampled_token_ids
            merged.logprobs |= alone.logprobs
            merged.prompt_logprobs |= alone.prompt_logprobs
            merged.sample_seqs += alone.sample_seqs
            logits.append(alone.logits)
        if logits:
            merged.logits = torch.cat(logits)
        return merged

    def _append_tokens(self, seq: Sequence, tokens: list[int],
                       logprobs: dict[Sequence, list[dict]]) -> RequestOutput | None:
        """Append seq's new tokens (one, or a verified run) one at a time, each with its text
        and log-probabilities (`logprobs`: the step's, by sequence; most steps have none),
        finishing it at the first that check_stop ends it with (the rest are dropped, from
        `tokens` too: the output ends where it would have without speculation), each checked
        against its structured output if it has one; its output, if it streams or finished.
        An error here fails this request alone."""
        try:
            for i, token in enumerate(tokens):
                seq.token_ids.append(token)
                if seq.grammar is not None:  # structured output: a token outside it fails seq
                    accept_token(seq, token)
                if logprobs and seq in logprobs:  # most steps ask for none
                    seq.logprobs.append(logprobs[seq][i])
                stop_string = self._append_text(seq, token)
                finish = check_stop(seq, token, stop_string, self.eos_token_ids)
                if finish is not None:
                    del tokens[i + 1:]  # never output: the step's record counts what was
                    return self._finish(seq, finish, stop_string)
            if not seq.stream:
                return None
            return self._output(seq)
        except Exception as e:  # noqa: BLE001 (this request alone fails)
            seq.detokenizer = Detokenizer(self.tokenizer, [])  # not the one that failed
            return self._fail(seq, f"{type(e).__name__}: {e}")

    def _finish(self, seq: Sequence, finish: tuple, stop_string: str | None) -> RequestOutput:
        """End seq as check_stop said (status, stop_reason); its last output."""
        status, seq.stop_reason = finish
        self.scheduler.finish(seq, status)
        if stop_string is None:  # a stop string cut the text; else it ends here, whole
            seq.detokenizer.flush()
        return self._output(seq)

    @staticmethod
    def _append_text(seq: Sequence, token: int) -> str | None:
        """Add the token's text to seq's, unless it is a stop token kept out of the text
        (in token_ids only); the stop string the text now holds, if any."""
        params = seq.params
        if token in params.stop_token_ids and not params.include_stop_str_in_output:
            return None
        # As vLLM: stop strings count only once the output is longer than min_tokens.
        look_for_stop_strings = seq.num_output_tokens > params.min_tokens
        return seq.detokenizer.append(token, look_for_stop_strings)

    def _output(self, seq: Sequence) -> RequestOutput:
        """The request's delta since its last output; a finished request leaves the engine."""
        finished = seq.is_finished
        num_sent = seq.num_sent_tokens
        is_first_output = num_sent == 0
        new_token_ids = seq.token_ids[seq.num_prompt_tokens + num_sent:]
        seq.num_sent_tokens = seq.num_output_tokens
        new_logprobs = None
        if seq.params.logprobs is not None:
            new_logprobs = seq.logprobs[num_sent:]
        completion = CompletionOutput(
            index=seq.index, text=seq.detokenizer.new_text(finished), token_ids=new_token_ids,
            finish_reason=seq.status.value if finished else None, stop_reason=seq.stop_reason,
            logprobs=new_logprobs, error=seq.error)
        prompt_logprobs = None
        if is_first_output and seq.prompt_logprobs:
            prompt_logprobs = list(seq.prompt_logprobs)
        request_finished = False
        if finished:
            request_finished = self._release(seq)
        # Outputs are the caller's to change, so they carry a copy of the prompt's ids: made
        # once and shared by the sequence's outputs, as vLLM shares one list (a copy in each
        # output cost a step 1 ms at batch 256 and 4,096-token prompts).
        if seq.returned_prompt_token_ids is None:
            seq.returned_prompt_token_ids = list(seq.prompt_token_ids)
        return RequestOutput(seq.request_id, seq.prompt, seq.returned_prompt_token_ids,
                             [completion], request_finished, prompt_logprobs)

    def _remove(self, seq: Sequence) -> None:
        """seq left the running batch (finished, preempted or failed): its input-batch row, its
        drafts and its proposer state go."""
        self.model_runner.remove(seq)
        if self.speculator is not None:
            self.speculator.remove(seq)

    def _release(self, seq: Sequence) -> bool:
        """A finished sequence leaves the engine. Whether it was the last of its request: only
        the output that ends a request's last sample says the request is finished."""
        if seq.lora_request is not None and self.seqs.get(seq.seq_id) is seq:  # once
            self.lora_manager.release(seq.lora_request)
        self.seqs.pop(seq.seq_id, None)
        self._remove(seq)
        samples = self.requests.get(seq.request_id, [])
        # by identity: a finished sample's id may name another request's sequence by now
        if any(self.seqs.get(sample.seq_id) is sample for sample in samples):
            return False
        self.requests.pop(seq.request_id, None)
        return True


def model_id(checkpoint, config: EngineConfig) -> str:
    """What a KV connector's entries name as their model, so another model's K/V of the same
    shape are never loaded: the checkpoint's real path, or a preset and its seed, and the
    weights' quantization (int8 weights compute other K/V in the same dtype)."""
    name = f"preset {config.preset} seed {config.seed}"
    if checkpoint.path is not None:
        name = os.path.realpath(checkpoint.path)
    if config.quantization is None:
        return name
    return f"{name} quantization {config.quantization}"


def lora_cache_salt(lora_request: LoRARequest | None) -> bytes:
    """The root of a sequence's block-hash chain: the adapter's (none for the base model)."""
    if lora_request is None:
        return b""
    return lora_request.cache_salt


def unwrap_prompt(prompt: dict):
    """{"prompt": a string} -> the string, {"prompt_token_ids": a list} -> the list (vLLM's
    TextPrompt and TokensPrompt: each key takes its own kind); any other dict as it is, for
    parse_prompt to refuse."""
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    return prompt


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


class LLM:
    """vLLM's offline API: LLM(model=..., **EngineConfig fields).generate(prompts, params)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (Engine.close)."""
        self.engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's sampling defaults (generation_config.json, unless
        --generation-config vllm) over SamplingParams' own, what generate() uses when given no
        params (there with max_tokens cut to each prompt's context: Engine.default_params)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 trace: bool = False, use_tqdm: bool | None = None,
                 priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Serve all prompts (any form add_request takes) as one batch; whole outputs, in order.
        params None: Engine.default_params for each prompt (the checkpoint's defaults). trace:
        print the step-by-step timeline to stderr at the end. use_tqdm (vLLM's name): the
        progress line on stderr (Progress); None: only when stderr is a terminal. priority
        (vLLM's): one per prompt (Engine.add_request); None: all 0. lora_request (vLLM's): the
        LoRA adapter of every prompt, or a list of one per prompt (None: the base model)."""
        show_progress = progress_wanted(use_tqdm)
        prompts = as_prompt_list(prompts)
        if not isinstance(params, (list, tuple)):  # None: each prompt's default_params
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if priority is None:
            priority = [0] * len(prompts)
        if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority must be a list of one integer a prompt ({len(prompts)}), "
                             f"got {priority!r}")
        if not isinstance(lora_request, (list, tuple)):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_request)} lora requests")
        ids = []
        whole = {}
        self.engine.step_records = [] if trace else None
        progress = Progress(len(prompts), show_progress)
        try:
            for prompt, prompt_params, prompt_priority, prompt_lora in zip(
                    prompts, params, priority, lora_request):
                # whole outputs only: an output per token would be made to be merged here
                ids.append(self.engine.add_request(prompt, prompt_params, stream=False,
                                                   priority=prompt_priority,
                                                   lora_request=prompt_lora))
            while any(i not in whole or not whole[i].finished for i in ids):
                for delta in self.engine.step():
                    accumulate(whole, delta)
                    progress.count(delta)
                progress.draw()
        except BaseException:  # all or nothing: a failed or interrupted batch leaves nothing
            for request_id in ids:
                self.engine.abort(request_id)
            if self.engine.dead is None:
                self.engine.step()
            raise
        finally:
            progress.clear()
        if trace:
            print(render_trace(self.engine.step_records, ids), file=sys.stderr)
        return [whole[i] for i in ids]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's: beam search over every prompt, as one batch (beam_search.py); one output a
        prompt, in order, its beam_width sequences best first."""
        prompts = as_prompt_list(prompts)
        ids = []
        finished = {}
        try:
            for prompt in prompts:
                ids.append(self.engine.add_beam_request(prompt, params))
            while len(finished) < len(ids):
                for output in self.engine.step():
                    finished[output.request_id] = output
        except BaseException:  # all or nothing, as generate()
            for request_id in ids:
                self.engine.abort(request_id)
            if self.engine.dead is None:
                self.engine.step()
            raise
        for request_id in ids:
            output = finished[request_id]
            if output.outputs and output.outputs[0].finish_reason == "error":
                raise RuntimeError(f"beam search of request {request_id} failed: "
                                   f"{output.outputs[0].error}")
        return [as_beam_search_output(finished[i], self.engine.tokenizer) for i in ids]


def as_beam_search_output(output: RequestOutput, tokenizer) -> BeamSearchOutput:
    """A beam-search request's output as vLLM's LLM.beam_search returns it: each sequence's
    tokens and text with the prompt's in front."""
    prompt_text = output.prompt
    if prompt_text is None:
        prompt_text = tokenizer.decode(output.prompt_token_ids)
    return BeamSearchOutput([BeamSearchSequence(
        output.prompt_token_ids + c.token_ids, c.logprobs, c.cumulative_logprob,
        prompt_text + c.text, c.finish_reason, c.stop_reason) for c in output.outputs])


def accumulate(whole: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Add a delta output to its request's whole output so far, kept in `whole` by request id,
    each completion under its index (a request's n samples arrive interleaved, in any order).
    The deltas are left as they were: a whole completion starts as a copy of its first, with
    lists of its own, which later deltas extend in place: a delta costs its own tokens, not
    the whole output's (4,096 one-token deltas: 5.6 ms in all, 15.4 when each copied the
    list so far)."""
    request = whole.get(delta.request_id)
    if request is None:
        request = dataclasses.replace(delta, outputs=[])
        whole[delta.request_id] = request
    for new in delta.outputs:
        so_far = completion_at(request, new.index)
        if so_far is None:
            request.outputs.append(copy_completion(new))
            request.outputs.sort(key=completion_index)
            continue
        so_far.text += new.text
        so_far.token_ids += new.token_ids
        if so_far.logprobs is not None:
            so_far.logprobs += new.logprobs
        so_far.finish_reason = new.finish_reason
        so_far.stop_reason = new.stop_reason
        so_far.error = new.error
    if delta.prompt_logprobs is not None:
        request.prompt_logprobs = delta.prompt_logprobs
    request.finished = delta.finished


def copy_completion(completion: CompletionOutput) -> CompletionOutput:
    """A copy of a completion with lists of its own (its token ids, its log-probabilities)."""
    logprobs = None
    if completion.logprobs is not None:
        logprobs = list(completion.logprobs)
    return dataclasses.replace(completion, token_ids=list(completion.token_ids),
                               logprobs=logprobs)


def completion_at(request: RequestOutput, index: int) -> CompletionOutput | None:
    for completion in request.outputs:
        if completion.index == index:
            return completion
    return None


def completion_index(completion: CompletionOutput) -> int:
    return completion.index


# `python nanoserve.py ...` runs the command line. Only as a script: the engine, imported as
# a module, never imports a front end.
if __name__ == "__main__":
    import cli
    cli.main()

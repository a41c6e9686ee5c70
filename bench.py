"""bench.py: what continuous batching buys, measured. The Anyscale/Orca experiment at this scale.

The same requests (random prompts, exponential output lengths capped at a limit, EOS ignored) on
the same weights through each of the MODES; greedy, so every mode must produce the same tokens.
What it measures, in the order it runs:
- offline: all requests queued at once, every mode at equal batch size and at equal KV memory:
  useful output tokens/s, the steps, what each step held (sequences, tokens, KV slots);
- the hardware view: the paged engine's decode step (its model forward, its host part) beside a
  dense-cache step and a roofline measured in the same run; the host cost by output length; the
  cost of sampling;
- grouped-query attention: llama-tiny against the same model with a K/V head per query head,
  at equal KV memory: sequences a step and tokens/s;
- online: Poisson arrivals, vLLM's latency metrics (TTFT, TPOT, ITL, E2E), in process or against
  an OpenAI-compatible server (--url URL; README: Over HTTP).
Flags for one measurement alone (--lm-head, --host-overhead, --detokenizer, --kernel,
--step-gemms, --count-ops, --sampling) run only that; --jsonl FILE appends each of their rows
as it is measured (.ci/gpu's results, kept when a time limit cuts a run short).
Tables go to stdout, every figure to JSON (--out).

The file, top-down: the modes and the flags (BenchConfig); the workload; the naive baseline
(Hugging Face's static batching, on model.py's dense path and its DenseKVCache); the offline runs;
the online runs; the hardware view; the report; main.

Left out: real text (random ids, EOS ignored: every mode computes the same tokens), sampling in
the experiments (greedy only), and pass/fail goals for the figures (those are prose, in the README).

    python bench.py --out bench.json         # about 5.5 minutes on 2 CPU cores; .ci/gpu: on a GPU
"""
import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode

import lora
import model_runner
from beam_search import BeamSearchParams
from checkpoint import Checkpoint, load_model
from cli import add_config_args
from kernels import (AttentionMetadata, device_num_sms, launch_grids, paged_attention,
                     select_attention)
from linear import projections
from model import GPT, LLAMA_LAYOUT, PRESETS, DenseKVCache, GPTConfig, LMHead
from nanoserve import Engine, EngineConfig, EngineStats, accumulate
from options import check_fields, option
from paged_cache import cdiv, kv_bytes_per_token
from sampling import SamplingParams, sample, sampling_tensors
from scheduler import SchedulerOutput, Sequence
from tensor_parallel import CommStats
from structured_output import StructuredOutputsParams
from tokenizer import EOT, GPT2_PATTERN, Detokenizer, Tokenizer, byte_ranks, byte_tokenizer

MODES = {  # mode -> (what it is, EngineConfig overrides); naive does not use the engine
    "naive": ("naive: padded static batches, dense KV cache", None),
    "static": ("static: request-level batching, paged", dict(policy="static")),
    "fcfs": ("continuous, fcfs", dict(policy="fcfs")),
    "sjf": ("continuous, sjf", dict(policy="sjf")),
    "no-chunk": ("continuous, no chunked prefill", dict(enable_chunked_prefill=False)),
    "no-cache": ("continuous, fcfs, no prefix caching", dict(enable_prefix_caching=False))}
CONTIGUOUS_MODES = ("naive", "static")  # they reserve prompt + limit KV slots a sequence up front

# --kernel's head shapes, (query heads, K/V heads, head dim): GPT-2's (a K/V head a query head),
# Qwen2.5-0.5B's (7 query heads a K/V head), Llama 3.2 1B's and Llama 3 8B's (4 a K/V head)
KERNEL_SHAPES = {"gpt2": (12, 12, 64), "qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64),
                 "llama-8b": (32, 8, 128)}
KERNEL_PATHS = ("unsplit", "split", "sdpa")  # what --kernel times (BenchConfig.kernel_paths)

# --step-shapes: real models' shapes, for random weights of their size, so that a decode step
# reads the bytes and runs the GEMMs theirs would: their vocabularies (embedding rows) and tied
# embeddings as shipped, Qwen2's q/k/v biases, Llama 3's RoPE scaling. model.PRESETS holds
# small shapes only (and serves them with a 257-id byte tokenizer).
SHAPES = {
    "qwen2.5-0.5b": GPTConfig(vocab_size=151936, n_positions=32768, n_embd=896, n_layer=24,
                              n_head=14, n_kv_head=2, head_dim=64, intermediate_size=4864,
                              rope_theta=1000000.0, **LLAMA_LAYOUT | dict(qkv_bias=True)),
    "llama-3.2-1b": GPTConfig(vocab_size=128256, n_positions=131072, n_embd=2048, n_layer=16,
                              n_head=32, n_kv_head=8, head_dim=64, intermediate_size=8192,
                              rope_theta=500000.0, rope_scaling=dict(
                                  rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                              **LLAMA_LAYOUT | dict(norm_eps=1e-5))}
STEP_MAX_MODEL_LEN = 32768  # --step-shapes: the longest sequence served (block tables that wide)
STEP_MODES = ("eager", "graphed")  # decode steps run eagerly, or replayed from CUDA graphs
SPEC_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
SPEC_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data",
                         "tinyshakespeare.txt")
SPEC_WORKLOADS = ("copy", "free")  # what the speculative experiment's prompts ask for
SPEC_TOPICS = ("a lighthouse keeper", "a lost letter", "the first day of spring", "a chess game",
               "a city at night", "an old clock", "a storm at sea", "a village baker")

# HBM bandwidth, GB/s, as NVIDIA's datasheets give it, by a piece of torch's device name (the
# first that matches): what a memory-bound kernel is measured against. A GPU not listed gets
# GB/s alone.
HBM_PEAK_GB_S = (("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350), ("H200", 4800),
                 ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
                 ("L40", 864), ("L4", 300), ("A10", 600), ("T4", 320))


@dataclass
class BenchConfig:
    num_requests: int = option(160, "requests in each offline run")
    prompt_len: int = option(128, "tokens in every prompt (random ids)")
    mean_output_len: float = option(128.0, "mean of the exponential output lengths, uncapped")
    limits: tuple = option((32, 128, 512), "generation limits: output lengths are capped at each")
    online_requests: int = option(100, "requests in each online run")
    online_limit: int = option(128, "generation limit of the online runs")
    rates: tuple = option((8.0, 16.0, 32.0), "Poisson arrival rates (requests/s), online sweep")
    modes: tuple = option(tuple(MODES)[:-1], "modes to run", choices=list(MODES))
    shared_prefix_len: int = option(0, "tokens of one prefix before every prompt", low=0)
    turns: int = option(1, "offline: turns a conversation (its last turn, answer, own tokens)")
    max_num_seqs: int = option(32, "equal batch: the batch size of every mode, naive included")
    kv_budget: int = option(0, "equal memory: each mode's KV tokens; 0: 32 x (prompt + 128)", low=0)
    memory_max_num_seqs: int = option(256, "equal memory: the paged modes' batch size limit")
    max_num_batched_tokens: int = option(512, "tokens per step (no-chunk: >= prompt + limit)")
    kv_cache_tokens: int = option(0, "paged KV cache capacity in tokens; 0: the engine's default",
                                  low=0)
    block_size: int = option(16, "tokens per KV block")
    host_output_lens: tuple = option((10, 900), "host cost: output lengths, timed at one context")
    preset: str = option("tiny", "random weights of a shape: tiny 3.5M, gpt2 124M", choices=PRESETS)
    device: str = option("cpu", "cpu or cuda")
    threads: int = option(1, "torch CPU threads (0: torch's default); 1: steadier on shared cores",
                          low=0)
    grouped_query: bool = option(True, "the grouped-query experiment: llama-tiny (2 K/V heads "
                                 "for 8) against llama-tiny-mha (8 for 8) at equal KV memory")
    hardware_preset: str = option("", "also the hardware view of this shape, batch 1/8/32/64, "
                                  "torch's default threads (gpt2: ~1 min)", choices=["", *PRESETS])
    seed: int = option(0, "seeds the weights, prompts, lengths and arrivals", low=0)
    out: str = option("bench.json", "where to write every figure as JSON")
    url: str = option("", "an OpenAI-compatible server (http://host:port): the online sweep on it")
    compare: bool = option(False, "with --url: the online sweep in process too (fcfs)")
    lm_head: bool = option(False, "only the LM head's cost in bf16 on the CPU, its weight "
                           "converted each step (as before) against once (now): gpt2's decode "
                           "step, and the head alone at a 152k vocabulary")
    host_overhead: bool = option(False, "only the host's work per decode step, by phase: the "
                                 "real engine with the model's forward stubbed out")
    detokenizer: bool = option(False, "only Detokenizer.append's cost a token, with 1k, 16k "
                               "and 64k characters of a request's text not yet returned")
    host_batches: tuple = option((16, 64, 256), "host overhead: batch sizes")
    host_contexts: tuple = option((256, 4096), "host overhead: tokens of context a sequence")
    kernel: bool = option(False, "only decode attention over the paged cache, by each of "
                          "--kernel-paths: microseconds, GB/s of K/V read and its share of the "
                          "GPU's HBM peak (on CUDA: do_bench's median, L2 flushed each call)")
    kernel_batches: tuple = option((1, 16, 64, 256), "kernel: batch sizes")
    kernel_contexts: tuple = option((512, 2048, 8192), "kernel: tokens of context a sequence")
    kernel_shapes: tuple = option(("gpt2", "llama-8b"), "kernel: head shapes (query heads, "
                                  "K/V heads, head dim) of these models",
                                  choices=list(KERNEL_SHAPES))
    kernel_paths: tuple = option(KERNEL_PATHS, "kernel: split (the Triton decode kernel, "
                                 "num_decodes = batch: each context split over programs), "
                                 "unsplit (num_decodes = 0: a program a sequence and K/V head, "
                                 "the kernel before the split), sdpa (torch's SDPA on the same "
                                 "K/V made contiguous)", choices=list(KERNEL_PATHS))
    step_gemms: bool = option(False, "only decode steps of --step-batches sequences of "
                              "--prompt-len tokens, eager and in CUDA graphs (--step-modes), "
                              "against their matrix multiplies alone at the same shapes and "
                              "the floor (bytes read / HBM peak); attention's share; then "
                              "each step's kernels (torch.profiler), after every timing")
    step_shapes: tuple = option((), "--step-gemms: random weights of these models' shapes "
                                "(bf16 on CUDA), each with its whole vocabulary, instead of "
                                "--preset or --model", choices=[*SHAPES, *PRESETS])
    step_batches: tuple = option((32,), "--step-gemms: sequences decoding together")
    step_modes: tuple = option(STEP_MODES, "--step-gemms: eager (enforce_eager) and graphed "
                               "(decode in CUDA graphs: CUDA only, skipped elsewhere)",
                               choices=list(STEP_MODES))
    model: str = option("", "--step-gemms, --count-ops: a checkpoint directory instead of "
                        "--preset's weights")
    count_ops: bool = option(False, "only what each layer of --preset (a Llama-family one: "
                             "llama-tiny) runs in one decode step of --max-num-seqs sequences "
                             "of --prompt-len tokens: ATen calls on a CPU, kernels on CUDA")
    sampling: bool = option(False, "only the LM head (bf16 in, fp32 logits on CUDA) and "
                            "sample() at a --sampling-vocab vocabulary, by batch: greedy, "
                            "temperature 0.7 with top-k 20 and top-p 0.9, top-p 0.9 alone")
    sampling_batches: tuple = option((64, 256), "sampling: rows (sequences sampling together)")
    sampling_vocab: int = option(151936, "sampling: the vocabulary (Qwen2.5's embedding rows)")
    sampling_hidden: int = option(896, "sampling: the LM head's input width (Qwen2.5-0.5B's)")
    reps: int = option(20, "--kernel, --step-gemms, --sampling: calls a figure times (--kernel "
                       "on CUDA: do_bench's, for 100 ms)")
    structured_output: bool = option(False, "only structured output's cost on --model (or "
                                     "--preset): a schema's first-use compile time, and decode "
                                     "steps of --structured-batches sequences under it against "
                                     "the same unconstrained: the masks' ms a step and share")
    structured_batches: tuple = option((1, 8, 32), "structured output: batch sizes")
    structured_steps: int = option(16, "structured output: decode steps timed at each batch")
    jsonl: str = option("", "--kernel, --step-gemms, --sampling: append each row to this file "
                        "as one JSON line as soon as it is measured, so a run cut short keeps "
                        "what it measured")
    speculative: bool = option(False, "only speculative decoding: copy-heavy and free-writing "
                               "prompts of real text (--spec-text) on --model (else --preset), "
                               "greedy, at --spec-batches: tokens/s without and with each of "
                               "--spec-configs, acceptance, accepted length, drafts wasted")
    spec_batches: tuple = option((1, 8, 32), "speculative: requests served together")
    spec_configs: tuple = option((SPEC_NGRAM,), "speculative: speculative_config JSON objects "
                                 "to compare with none")
    spec_max_tokens: int = option(128, "speculative: tokens each request generates at most")
    spec_text: str = option(SPEC_TEXT, "speculative: the text passages come from (absent: a "
                            "passage of this file's docstring)")
    goodput: tuple = option((), "only the service-level experiment, with these targets "
                            "(vLLM's benchmark spelling: ttft:MS tpot:MS): interactive and "
                            "batch traffic (SLO_CLASSES) through fcfs, sjf and priority at "
                            "each --slo-rates: the share meeting the targets, goodput")
    slo_requests: int = option(120, "--goodput: requests in each run")
    slo_rates: tuple = option((20.0, 40.0), "--goodput: Poisson arrival rates (requests/s)")
    swap: bool = option(False, "only swapping against recomputing: the time to resume a "
                        "preempted sequence by context (--swap-contexts), and throughput "
                        "under a cache that preempts often, by --preemption-mode")
    swap_contexts: tuple = option((250, 500, 1000), "--swap: context lengths (tokens)")
    lora: bool = option(False, "only multi-LoRA serving: --num-requests requests spread over K "
                        "adapters (--lora-adapters), through the base model alone, multi-adapter "
                        "batching (max_loras K, and K/2 where K > 1) and one adapter at a time: "
                        "tokens/s and latency; an adapter's load time")
    lora_adapters: tuple = option((1, 4, 16), "--lora: the numbers of adapters K")
    lora_rank: int = option(16, "--lora: the adapters' rank")
    lora_max_tokens: int = option(64, "--lora: tokens each request generates")
    quantization: bool = option(False, "only quantization on --model (default: the shipped "
                                "model) in --quant-dtype: each of QUANT_SCHEMES' weight and "
                                "K/V bytes, KV tokens a GiB, decode tokens/s at "
                                "--quant-batches, greedy agreement with the unquantized model "
                                "over --quant-tokens tokens of --quant-prompts prompts, "
                                "|delta log-probability| of their tokens, held-out perplexity")
    quant_dtype: str = option("auto", "--quantization: the model's dtype (auto: float32 on a "
                              "CPU)", choices=["auto", "float32", "bfloat16", "float16"])
    quant_batches: tuple = option((1, 32), "--quantization: decode batch sizes timed")
    quant_prompts: int = option(32, "--quantization: prompts (text passages) compared")
    quant_tokens: int = option(64, "--quantization: greedy tokens compared a prompt, and "
                               "decoded a sequence when timed")
    quant_eval_bytes: int = option(16384, "--quantization: bytes of the held-out text (the "
                                   "last 10%, as train.py splits it) perplexity is taken on")
    beam_search: bool = option(False, "only beam search on shared blocks: the KV blocks one "
                               "request of --prompt-len tokens holds at its peak, at each of "
                               "--beam-widths W, against W independent greedy sequences of the "
                               "same lengths (prefix caching off), and beam-search tokens/s of "
                               "--beam-requests requests at each W")
    beam_widths: tuple = option((4, 8), "--beam-search: beam widths W")
    beam_max_tokens: int = option(128, "--beam-search: tokens each beam generates")
    beam_requests: int = option(16, "--beam-search: requests searched together, for tokens/s")
    disagg: bool = option(False, "only disaggregated prefill and decode, the interference "
                          "experiment: a steady stream of short requests (--prompt-len tokens, "
                          "--disagg-short-output out) at --disagg-rate, long prompts "
                          "(--disagg-long-len) every --disagg-long-every seconds, through one "
                          "instance of two threads (chunked prefill) and through a prefill and "
                          "a decode instance of one thread each (kv_connector.py): ITL, TPOT, "
                          "TTFT, throughput, the transfer's cost a token")
    disagg_rate: float = option(8.0, "--disagg: short requests a second", low=0, open_low=True)
    disagg_short_output: int = option(64, "--disagg: tokens each short request generates")
    disagg_long_len: int = option(896, "--disagg: tokens of each long prompt (it generates 8)")
    disagg_long_every: float = option(2.0, "--disagg: seconds between long prompts", low=0,
                                      open_low=True)
    disagg_duration: float = option(16.0, "--disagg: seconds of arrivals", low=0, open_low=True)
    tensor_parallel: bool = option(False, "only tensor parallelism: decode steps of --preset "
                                   "(or --model) at each of --tp-sizes ranks (each rank one "
                                   "thread) and --tp-batches: the step's time, its all-reduces "
                                   "(count, bytes, time) and the step channel's cost")
    tp_sizes: tuple = option((1, 2), "--tensor-parallel: tensor_parallel_size values")
    tp_batches: tuple = option((1, 16), "--tensor-parallel: sequences decoding together")
    tp_steps: int = option(32, "--tensor-parallel: decode steps timed")


def parse_args(argv=None) -> BenchConfig:
    """The flags are BenchConfig's fields; defaults and help live only there."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, BenchConfig)
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in vars(p.parse_args(argv)).items()})
    prompt = cfg.prompt_len + cfg.shared_prefix_len
    cfg = replace(cfg, kv_budget=cfg.kv_budget or 32 * (prompt + 128))
    try:  # ranges, as the engine checks its own (argparse checked each choice of a list)
        check_fields(one_of_each(cfg))
    except ValueError as e:
        p.error(str(e))
    try:
        parse_goodput(cfg.goodput)
    except ValueError as e:
        p.error(str(e))
    if min(cfg.limits + cfg.host_output_lens) < 1 or not all(r > 0 for r in cfg.rates):
        p.error("--limits and --host-output-lens must be >= 1, --rates > 0")
    sizes = cfg.kernel_batches + cfg.kernel_contexts + cfg.step_batches + cfg.sampling_batches \
        + cfg.structured_batches
    if min(sizes) < 1:
        p.error("--kernel-batches, --kernel-contexts, --step-batches, --sampling-batches and "
                "--structured-batches must be >= 1")
    if cfg.kv_budget < prompt + max(cfg.limits):
        p.error(f"--kv-budget {cfg.kv_budget} holds no sequence of prompt + largest limit tokens")
    context = PRESETS[cfg.preset].n_positions  # (with --url, the server checks its own)
    largest_limit = max(*cfg.limits, cfg.online_limit)
    alone = any(getattr(cfg, name) for name in SINGLE_MEASUREMENTS)  # they use no limit
    if not cfg.url and not alone and prompt + largest_limit > context:  # past the position table
        p.error(f"a prompt of {prompt} tokens and a limit of {largest_limit} make "
                f"{prompt + largest_limit} tokens; the {cfg.preset} preset's context is {context}")
    return cfg


def one_of_each(cfg: BenchConfig) -> BenchConfig:
    """cfg with each list of choices (--modes, --kernel-shapes, ...) cut to one choice, for
    check_fields, which checks a value against a field's choices: argparse checked each."""
    firsts = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if "choices" in f.metadata and isinstance(value, tuple):
            firsts[f.name] = value[0] if value else f.metadata["choices"][0]
    return replace(cfg, **firsts)


# ----------------------------------------------------------------------------- the workload

def make_workload(cfg: BenchConfig, n: int, limit: int, shared=False) -> tuple[list, list[int]]:
    """n prompts: [the shared prefix +] prompt_len random ids; lengths capped at `limit`."""
    prefix_len = cfg.shared_prefix_len if shared else 0
    prefix = np.random.default_rng(cfg.seed + 2).integers(0, 256, prefix_len).tolist()
    rng = np.random.default_rng(cfg.seed)
    prompts = [prefix + p for p in rng.integers(0, 256, (n, cfg.prompt_len)).tolist()]
    lengths = np.ceil(rng.exponential(cfg.mean_output_len, n)).clip(1, limit)
    return prompts, [int(length) for length in lengths]


def greedy(length: int) -> SamplingParams:
    """Exactly `length` greedy tokens: the same in every mode."""
    return SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)


@dataclass
class StepLog:
    """What one step held, in every mode alike (naive's from its own arithmetic)."""
    seqs: int       # sequences in the step
    tokens: int     # tokens computed: prompt tokens and decodes
    kv_real: int    # KV slots holding a real token after the step: prompts, outputs fed back
    kv_slots: int   # KV slots taken: naive, its dense cache; paged, the blocks in use


# ----------------------------------------------------------------------------- naive baseline

def last_logits(model, idx, positions, cache: DenseKVCache, mask=None) -> torch.Tensor:
    """Logits (B, vocab) at the last of new tokens idx (B, T), their K/V appended to `cache`;
    model.py's dense path (GPT.dense_hidden_states) says what positions and mask are."""
    hidden = model.dense_hidden_states(idx, positions, cache, mask)  # (B, T, C)
    return model.compute_logits(hidden[:, -1])


@torch.inference_mode()
def naive_batch(model, prompts: list[list[int]], lengths: list[int],
                log: list[StepLog]) -> list[list[int]]:
    """A static batch the Hugging Face way: prompts left-padded to the longest (P), a dense
    cache of P + the longest output (L) slots a row, every row stepped until the longest is
    done. Appends what each step held to `log`; returns each row's tokens."""
    dev = model.lm_head.weight.device
    B = len(prompts)
    P = max(map(len, prompts))
    L = max(lengths)
    pads = torch.tensor([P - len(p) for p in prompts], device=dev)              # (B,)
    idx = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=dev)  # (B, P)
    valid = torch.arange(P + L, device=dev)[None] >= pads[:, None]              # (B, P+L) keys
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    itself = torch.eye(P, dtype=torch.bool, device=dev)  # a pad sees itself (no key: NaN)
    prompt_mask = (causal & valid[:, None, :P]) | itself                         # (B, P, P)
    positions = (torch.arange(P, device=dev)[None] - pads[:, None]).clamp(min=0)  # (B, P)
    cache = DenseKVCache.zeros(model.config, B, P + L, model.lm_head.weight)
    tokens = [last_logits(model, idx, positions, cache, prompt_mask[:, None]).argmax(-1)]  # (B,)
    padded = bool(pads.any())  # read once: a read per step would be a wait for the GPU each
    for t in range(1, L):
        mask = valid[:, None, None, :P + t] if padded else None  # (B, 1, 1, P + t)
        logits = last_logits(model, tokens[-1][:, None], positions[:, -1:] + t, cache, mask)
        tokens.append(logits.argmax(-1))
    log += naive_steps(prompts, lengths)
    rows = torch.stack(tokens, 1).tolist()  # (B, L)
    return [row[:n] for row, n in zip(rows, lengths)]


def naive_steps(prompts: list[list[int]], lengths: list[int]) -> list[StepLog]:
    """What each step of naive_batch held: every row, at every step, in a cache of the
    padded prompt + the longest output; the padded prompts first, then a token a row."""
    B = len(prompts)
    P = max(map(len, prompts))
    L = max(lengths)
    steps = []
    for t in range(L):  # after step t: every prompt, and the outputs fed back so far
        kv_real = sum(len(p) + min(t, n - 1) for p, n in zip(prompts, lengths))
        tokens = B * P if t == 0 else B
        steps.append(StepLog(seqs=B, tokens=tokens, kv_real=kv_real, kv_slots=B * (P + L)))
    return steps


# ----------------------------------------------------------------------------- offline runs

def make_engine(cfg: BenchConfig, mode: str = "fcfs", limit: int = 0,
                checkpoint: Checkpoint | None = None, **overrides) -> Engine:
    """A fresh engine for `mode`, on the same seeded weights as every other; given a
    checkpoint (shape_checkpoint's), on its model rather than --preset's or --model's."""
    args = dict(preset=None if cfg.model else cfg.preset, model=cfg.model or None,
                device=cfg.device, seed=cfg.seed, block_size=cfg.block_size,
                kv_cache_tokens=cfg.kv_cache_tokens or None, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens) | MODES[mode][1] | overrides
    if not args.get("enable_chunked_prefill", True):  # as in vLLM: a whole recompute fits a step
        args["max_num_batched_tokens"] = max(args["max_num_batched_tokens"],
                                             cfg.prompt_len + cfg.shared_prefix_len + limit)
    if checkpoint is None:
        return Engine(EngineConfig(**args))
    with mock.patch("nanoserve.load_model", return_value=checkpoint):  # the preset is unused
        return Engine(EngineConfig(**args))


def run_offline(cfg: BenchConfig, mode: str, prompts, lengths, limit: int, model=None):
    """All requests queued at once, run to the end: (useful tokens/s, what steps held; outputs)."""
    if mode == "naive":
        return run_offline_naive(cfg, model, prompts, lengths)
    return run_offline_engine(cfg, mode, prompts, lengths, limit)


def run_offline_naive(cfg: BenchConfig, model, prompts, lengths):
    """The requests in static batches of max_num_seqs, in order: (figures, outputs)."""
    B = cfg.max_num_seqs
    log = []
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), B):
        outputs += naive_batch(model, prompts[i:i + B], lengths[i:i + B], log)
    wall = time.perf_counter() - start
    return offline_figures(outputs, log, wall, preemptions=0, hit_rate=0.0), outputs


def run_offline_engine(cfg: BenchConfig, mode: str, prompts, lengths, limit: int):
    """Every conversation's first turn queued at once, the engine stepped to the end; a finished
    turn queues its conversation's next. (figures, outputs: turn by turn)."""
    engine = make_engine(cfg, mode, limit)
    engine.step_records = []
    whole = {}  # request id -> its output so far
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(prompt, greedy(n), str(i))
    while engine.has_unfinished():
        for delta in engine.step():  # the tokens new since the request's last output
            accumulate(whole, delta)
            if delta.finished:
                add_next_turn(cfg, engine, whole[delta.request_id], prompts, lengths)
    wall = time.perf_counter() - start
    block_size = engine.block_pool.block_size
    log = [StepLog(seqs=len(r.scheduled), tokens=sum(r.scheduled.values()),
                   kv_real=r.num_kv_tokens, kv_slots=r.kv_blocks_used * block_size)
           for r in engine.step_records]
    outputs = [whole[str(k)].outputs[0].token_ids for k in range(len(prompts) * cfg.turns)]
    preemptions = sum(len(r.preempted) for r in engine.step_records)
    hit_rate = engine.stats.prefix_cache_hit_rate
    return offline_figures(outputs, log, wall, preemptions, hit_rate), outputs


def add_next_turn(cfg: BenchConfig, engine: Engine, finished, prompts, lengths) -> None:
    """The next turn of a finished request's conversation, if it has one: request k + N after
    k (N conversations), its prompt the finished turn's prompt and answer, then the
    conversation's own prompt tokens again (not the shared prefix)."""
    N = len(prompts)
    k = int(finished.request_id)
    if k + N >= N * cfg.turns:  # its last turn
        return
    history = finished.prompt_token_ids + finished.outputs[0].token_ids
    conversation = k % N
    prompt = history + prompts[conversation][-cfg.prompt_len:]
    engine.add_request(prompt, greedy(lengths[conversation]), str(k + N))


def offline_figures(outputs, log: list[StepLog], wall: float, preemptions: int,
                    hit_rate: float) -> dict:
    """An offline run's figures, from its outputs, its steps and its wall time."""
    num_tokens = sum(map(len, outputs))
    seqs = np.array([s.seqs for s in log], dtype=np.float64)
    tokens = np.array([s.tokens for s in log], dtype=np.float64)
    kv_real = np.array([s.kv_real for s in log], dtype=np.float64)
    kv_slots = np.array([s.kv_slots for s in log], dtype=np.float64)
    return dict(output_tokens=num_tokens, wall_s=wall, tok_s=num_tokens / wall, steps=len(log),
                ms_per_step=wall / len(log) * 1e3, tokens_computed=int(tokens.sum()),
                seqs_per_step=seqs.mean(), seqs_peak=int(seqs.max()), tokens_per_step=tokens.mean(),
                kv_slots_mean=kv_slots.mean(), kv_slots_peak=int(kv_slots.max()),
                kv_real_share=kv_real.sum() / kv_slots.sum(), preemptions=preemptions,
                prefix_hit_rate=hit_rate)


def mode_config(cfg: BenchConfig, mode: str, equal_memory: bool, sequence_len: int) -> BenchConfig:
    """At equal batch size: cfg. At equal KV memory, kv_budget tokens of KV each: naive and
    static reserve a whole sequence (prompt + limit) up front, as Hugging Face and
    FasterTransformer did, so run as many as fit; the paged modes take slots as they go."""
    if not equal_memory:
        return cfg
    if mode in CONTIGUOUS_MODES:
        batch = min(cfg.num_requests, cfg.kv_budget // sequence_len)
    else:
        batch = cfg.memory_max_num_seqs
    return replace(cfg, kv_cache_tokens=cfg.kv_budget, max_num_seqs=batch)


def offline(cfg: BenchConfig, model, equal_memory: bool, progress) -> dict:
    """Every mode on the same requests at each limit, at equal batch size or equal memory."""
    found = {}
    experiment = "memory" if equal_memory else "batch"
    for limit in cfg.limits:
        prompts, lengths = make_workload(cfg, cfg.num_requests, limit, shared=True)
        runs = {}
        first = None  # the first mode's outputs
        for mode in cfg.modes:
            mode_cfg = mode_config(cfg, mode, equal_memory, len(prompts[0]) + limit)
            run, outputs = run_offline(mode_cfg, mode, prompts, lengths, limit, model)
            if first is None:
                first = outputs
            same = [a == b for a, b in zip(outputs, first)]  # greedy: no mode changes a token
            run["max_num_seqs"] = mode_cfg.max_num_seqs
            run["same_tokens"] = float(np.mean(same))
            runs[mode] = run
            progress(f"offline, equal {experiment}, limit {limit}, {mode}: "
                     f"{run['tok_s']:.0f} tok/s")
        add_ratios(runs)
        found[str(limit)] = dict(lengths=lengths, modes=runs)
    return found


def add_ratios(runs: dict) -> None:
    """Each mode's throughput over naive's, static's and no-cache's (None: not run), and
    static's steps over its own: its gain if every step cost the same."""
    for run in runs.values():
        for base in ("naive", "static", "no-cache"):
            run[f"vs_{base}"] = run["tok_s"] / runs[base]["tok_s"] if base in runs else None
        run["steps_vs_static"] = None
        if "static" in runs:
            run["steps_vs_static"] = runs["static"]["steps"] / run["steps"]


def preset_kv_bytes(preset: str) -> int:
    """A preset's KV cache bytes a token, counted in fp32: the grouped-query experiment uses
    only their ratio, the same in any one dtype."""
    c = PRESETS[preset]
    return kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim, torch.float32)


def grouped_query(cfg: BenchConfig, progress) -> dict:
    """At equal KV memory, how much grouped-query attention buys: llama-tiny (8 query heads
    sharing 2 K/V heads) against llama-tiny-mha (a K/V head per query head), fcfs, the same
    requests, each given the bytes that kv_budget tokens of llama-tiny-mha take. The grouped
    model's cache holds 4x the tokens, so more sequences run a step (up to
    memory_max_num_seqs); tokens/s says what that is worth on this device."""
    found = {}
    budget_bytes = cfg.kv_budget * preset_kv_bytes("llama-tiny-mha")
    for limit in cfg.limits:
        prompts, lengths = make_workload(cfg, cfg.num_requests, limit, shared=True)
        runs = {}
        for preset in ("llama-tiny-mha", "llama-tiny"):
            c = PRESETS[preset]
            kv_tokens = budget_bytes // preset_kv_bytes(preset)
            run_cfg = replace(cfg, preset=preset, kv_cache_tokens=kv_tokens,
                              max_num_seqs=cfg.memory_max_num_seqs)
            run, _ = run_offline_engine(run_cfg, "fcfs", prompts, lengths, limit)
            runs[preset] = run | dict(kv_heads=c.n_kv_head, kv_tokens=run_cfg.kv_cache_tokens)
            progress(f"grouped query, limit {limit}, {preset}: {run['tok_s']:.0f} tok/s, "
                     f"{run['seqs_per_step']:.1f} sequences a step")
        for run in runs.values():
            run["vs_mha"] = run["tok_s"] / runs["llama-tiny-mha"]["tok_s"]
        found[str(limit)] = runs
    return found


# ----------------------------------------------------------------------------- online runs

def run_online(cfg: BenchConfig, mode: str, prompts, lengths, rate: float) -> dict:
    """Poisson arrivals at `rate`/s, through the server at cfg.url ("http") or in process."""
    gaps = np.random.default_rng(cfg.seed + 1).exponential(1 / rate, len(prompts))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])  # s after the first
    if mode != "http":
        times = run_online_engine(cfg, mode, arrivals, prompts, lengths)
        return latency_figures(arrivals, times, [len(t) for t in times])  # a token a step
    times, tokens, client_cpu = run_online_http(cfg, arrivals, prompts, lengths)
    return latency_figures(arrivals, times, tokens) | dict(client_cpu_fraction=client_cpu)


def run_online_http(cfg: BenchConfig, arrivals, prompts, lengths) -> tuple[list, list, float]:
    """Each request sent at its arrival, streamed, on a connection of its own, all from one
    asyncio event loop in this process (not a thread a request: on a few cores the client
    competes with the server). (Each one's chunk times, s after the start; each one's tokens;
    the client's cost: this process's CPU time over the run's wall time, a share of one core.)"""
    model = json.load(http_open(cfg.url, "/v1/models"))["data"][0]["id"]  # the first listed
    bodies = [dict(model=model, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                   stream=True, stream_options=dict(include_usage=True))
              for prompt, n in zip(prompts, lengths)]
    cpu = time.process_time()
    start = time.perf_counter()
    results = asyncio.run(send_all(cfg.url, arrivals, bodies, start))
    client_cpu = (time.process_time() - cpu) / (time.perf_counter() - start)
    times = [chunk_times for chunk_times, _ in results]
    tokens = [num_tokens for _, num_tokens in results]
    return times, tokens, client_cpu


async def send_all(url: str, arrivals, bodies: list[dict], start: float) -> list[tuple]:
    """Every body POSTed at its arrival (s after start, perf_counter's clock), all at once:
    each one's stream_times, in order. After an error no request is sent, those in flight are
    read to their end (the server sees no answer cut off), then the first error is raised."""
    errors = []
    sends = [send_at(url, arrival, body, start, errors)
             for arrival, body in zip(arrivals, bodies)]
    results = await asyncio.gather(*sends)
    if errors:
        raise errors[0]
    return results


async def send_at(url: str, arrival: float, body: dict, start: float,
                  errors: list) -> tuple[list[float], int] | None:
    """stream_times at the arrival; None if a request failed before (its error in errors) or
    this one fails (its error appended)."""
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    if errors:  # an earlier request failed: send no more
        return None
    try:
        return await stream_times(url, body, start)
    except ConnectionError as e:
        errors.append(e)
        return None


async def stream_times(url: str, body: dict, start: float) -> tuple[list[float], int]:
    """POST a streamed completion: the times (s after start) of its chunks, and its tokens (the
    usage chunk's count; without one, a token a chunk)."""
    times = []
    tokens = None
    async for chunk in completion_chunks(url, body):
        if chunk.get("choices"):  # a chunk of text (or held back), as vLLM times them
            times.append(time.perf_counter() - start)
        usage = chunk.get("usage") or {}
        tokens = usage.get("completion_tokens", tokens)
    if not times:  # not a stream of OpenAI's chunks
        raise ConnectionError(f"{url}/v1/completions streamed no choices")
    if not tokens:  # no usage chunk
        return times, len(times)
    return times, tokens


async def completion_chunks(url: str, body: dict):
    """POST body to url's /v1/completions on a connection of its own and yield OpenAI's chunks
    (dicts) as they arrive. Errors, one line as http_open's: a status other than 200
    (ConnectionError with the server's answer), an answer that breaks off."""
    reader, writer = await post(url, "/v1/completions", body)
    try:
        status, headers = await response_head(reader)
        pieces = response_body(reader, headers)
        if status == 200:
            async for chunk in stream_chunks(pieces):
                yield chunk
            return
        answer = b"".join([piece async for piece in pieces])
    except (OSError, EOFError, ValueError) as e:  # cut off, reset, or not HTTP, chunks, JSON
        raise ConnectionError(f"{url}/v1/completions: a broken answer: {e}") from None
    finally:
        writer.close()
    error = answer.decode(errors="replace")  # the server's: OpenAI's error, as JSON
    raise ConnectionError(f"{url}/v1/completions answered {status}: {error}")


async def stream_chunks(pieces):
    """Yield OpenAI's chunks from a body's pieces as its server-sent events complete (each ends
    in a blank line)."""
    events = b""  # what came of the events not yet complete
    async for piece in pieces:
        complete = (events + piece).split(b"\n\n")
        events = complete.pop()
        for chunk in sse_chunks(complete):
            yield chunk
    for chunk in sse_chunks([events]):  # a last event with no blank line after it
        yield chunk


async def post(url: str, path: str,
               body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to url's host and send POST url + path, body as JSON, in raw HTTP/1.1 with
    "Connection: close" (the server closes the connection after its answer)."""
    try:
        parts = urllib.parse.urlsplit(url.rstrip("/").removesuffix("/v1"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http:// URL")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=https)
    except (OSError, ValueError) as e:  # a malformed URL, no server
        raise ConnectionError(f"cannot reach {url}: {e}") from None
    data = json.dumps(body).encode()
    head = (f"POST {parts.path}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n")
    writer.write(head.encode("latin-1") + data)
    await writer.drain()
    return reader, writer


async def response_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status line's code and the headers up to the blank line (names in lower case)."""
    line = await reader.readline()
    words = line.split()  # b"HTTP/1.1 200 OK"
    if len(words) < 2 or not words[0].startswith(b"HTTP/") or not words[1].isdigit():
        raise ValueError(f"not an HTTP answer: {line[:80]!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line.strip() == b"":  # the blank line (or the end of the connection)
            return int(words[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def response_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the body in pieces as they arrive: de-chunked if "Transfer-Encoding: chunked",
    else Content-Length bytes, else up to the end of the connection (HTTP/1.0's way)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await reader.readline()  # the chunk's size in hex [; extensions]
            if not line:
                raise EOFError("the connection closed before the last chunk")
            size = int(line.split(b";")[0], 16)
            if size == 0:  # the last chunk (trailers unread: the connection closes)
                return
            chunk = await reader.readexactly(size + 2)  # the data and its CRLF
            yield chunk[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while True:
            piece = await reader.read(65536)
            if not piece:
                return
            yield piece


def sse_chunks(events: list[bytes]) -> list[dict]:
    """OpenAI's chunks in complete server-sent events: each "data: {json}" line's object (the
    closing "data: [DONE]", comments and other fields skipped)."""
    chunks = []
    for event in events:
        for line in event.splitlines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def run_online_engine(cfg: BenchConfig, mode: str, arrivals, prompts, lengths,
                      priorities: list[int] | None = None, engine: Engine | None = None,
                      timer=time.perf_counter) -> list[list]:
    """The engine in process on a clock that counts its steps' wall time (timer's) and skips
    idle time (an idle engine jumps to the next arrival): each request's token times on that
    clock. priorities: each request's (default 0); engine: one made for the run (default:
    mode's)."""
    if engine is None:
        engine = make_engine(cfg, mode, cfg.online_limit)
    if priorities is None:
        priorities = [0] * len(prompts)
    times = [[] for _ in prompts]
    clock = 0.0
    i = 0  # the next request to arrive
    while i < len(prompts) or engine.has_unfinished():
        if not engine.has_unfinished():  # idle: jump to the next arrival
            clock = max(clock, arrivals[i])
        start = timer()
        while i < len(prompts) and arrivals[i] <= clock:
            engine.add_request(prompts[i], greedy(lengths[i]), str(i), priority=priorities[i])
            i += 1
        outputs = engine.step()
        clock += timer() - start
        for o in outputs:
            times[int(o.request_id)].append(clock)
    return times


def summary(xs) -> dict:
    """Mean, median and 99th percentile of xs; None each when there are none."""
    if len(xs) == 0:
        return dict(mean=None, p50=None, p99=None)
    return dict(mean=np.mean(xs), p50=np.percentile(xs, 50), p99=np.percentile(xs, 99))


def latency_figures(arrivals, times: list[list[float]], tokens: list[int]) -> dict:
    """vLLM's metrics: TTFT, TPOT (e2e - ttft) / (n - 1), ITL (the gaps between tokens; over
    HTTP, between chunks), E2E; and the throughputs over the whole run."""
    ttft = [t[0] - a for a, t in zip(arrivals, times)]
    tpot = [(t[-1] - t[0]) / (n - 1) for t, n in zip(times, tokens) if n > 1]
    itl = np.concatenate([np.diff(t) for t in times])
    e2e = [t[-1] - a for a, t in zip(arrivals, times)]
    duration = max(t[-1] for t in times) - arrivals[0]
    num_tokens = sum(tokens)
    return dict(ttft=summary(ttft), tpot=summary(tpot), itl=summary(itl), e2e=summary(e2e),
                requests=len(times), output_tokens=num_tokens, duration_s=duration,
                request_throughput=len(times) / duration, output_throughput=num_tokens / duration)


def http_open(url: str, path: str, body: dict | None = None):
    """GET url + path, or POST body as JSON (no proxy); errors: a one-line ConnectionError."""
    try:
        address = url.rstrip("/").removesuffix("/v1") + path
        data = json.dumps(body).encode() if body else None
        request = urllib.request.Request(address, data, {"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        return opener.open(request, timeout=600)
    except urllib.error.HTTPError as e:  # it holds the server's answer: OpenAI's error, as JSON
        raise ConnectionError(f"{url}{path} answered {e.code}: {e.read().decode()}") from None
    except Exception as e:  # a malformed URL, no server, a broken connection
        raise ConnectionError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


# ----------------------------------------------------------------------------- hardware view

def synced_clock(device: str) -> float:
    """time.perf_counter() once the device has done all it was given."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def per_call(fn, reps: int, device: str) -> float:
    """Seconds per call of fn over reps calls."""
    start = synced_clock(device)
    for _ in range(reps):
        fn()
    return (synced_clock(device) - start) / reps


def median_ms(fn, device: str, reps: int, warmup: int = 3) -> float:
    """Milliseconds a call of fn takes, the median of reps calls after `warmup` untimed ones:
    on CUDA between two CUDA events around each call (the device's time: the host's
    launches overlap the device's work, as in a step), elsewhere by perf_counter."""
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * float(np.median(times))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in events]))


def cold_l2_ms(fn, device: str, reps: int) -> float:
    """Milliseconds a call of fn takes with nothing of its inputs in the GPU's L2 cache, as a
    step's attention finds its layer's K/V (the other layers' passed through it since): on
    CUDA triton.testing.do_bench's median, which writes a 256 MB buffer before each call and
    times the call alone with CUDA events. Elsewhere the best of 3 rounds of reps calls."""
    if not device.startswith("cuda"):
        return 1e3 * min(per_call(fn, reps, device) for _ in range(3))
    import triton.testing  # here, not at the top: kernels.py sets up Triton (its interpreter
    return triton.testing.do_bench(fn, return_mode="median")  # on a CPU) before any import


def hbm_peak_gb_s(device: str) -> float | None:
    """The GPU's HBM bandwidth (GB/s) from HBM_PEAK_GB_S by its name; None on a CPU or a GPU
    not listed."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((float(peak) for part, peak in HBM_PEAK_GB_S if part in name), None)


def share_of(gb_s: float, peak: float | None) -> float | None:
    """gb_s as a share of the peak bandwidth, None without one."""
    return None if peak is None else gb_s / peak


def emit(cfg: BenchConfig, measurement: str, row: dict) -> dict:
    """Append row, as one JSON line named by its measurement, to --jsonl (if given) the moment
    it is measured, so a run cut short (a time limit on a lent GPU) keeps every row it
    finished; return it."""
    if cfg.jsonl:
        with open(cfg.jsonl, "a") as f:
            f.write(json.dumps(dict(measurement=measurement) | row, default=json_value) + "\n")
    return row


def json_value(value):
    """What json.dumps cannot write itself: a NumPy or torch scalar's value, else its text."""
    return value.item() if hasattr(value, "item") else str(value)


PREFILL_TOKENS = 16384  # engine_in_decode's token budget on CUDA: its prompts in a few steps


def prefill_steps(batch: int, prompt_len: int) -> int:
    """engine_in_decode's prompts take this many steps at most (chunked to PREFILL_TOKENS, the
    decodes of those done before taking their share), twice over: the tokens those done first
    decode meanwhile, room kept for them."""
    return 2 * cdiv(batch * prompt_len, min(batch * prompt_len, PREFILL_TOKENS))


def decode_kv_tokens(cfg: BenchConfig, batch: int, prompt_len: int, first: int, more: int) -> int:
    """The KV cache engine_in_decode gives its sequences: each one's prompt, its first output
    tokens, `more`, those decoded while other prompts were prefilled, and a block's slack."""
    tokens = prompt_len + first + more + prefill_steps(batch, prompt_len) + cfg.block_size
    return batch * tokens


def engine_in_decode(cfg: BenchConfig, batch: int, prompt_len: int, first: int, more: int,
                     checkpoint: Checkpoint | None = None, **overrides) -> Engine:
    """An engine holding `batch` sequences of prompt_len random tokens, stepped until every one
    is admitted and has `first` output tokens (the prompts in as few steps as PREFILL_TOKENS
    allows, then decodes), with room for `more` (none ends sooner); overrides: EngineConfig's
    fields (make_engine's)."""
    # On a CPU every prompt in one step, so every sequence decodes at one length (the dense
    # comparison of decode_step needs it); on CUDA (256 x 1k tokens) in chunks of PREFILL_TOKENS
    budget = batch * prompt_len
    if cfg.device.startswith("cuda"):
        budget = min(budget, PREFILL_TOKENS)
    args = dict(max_num_seqs=batch, max_num_batched_tokens=budget,
                kv_cache_tokens=decode_kv_tokens(cfg, batch, prompt_len, first, more))
    engine = make_engine(cfg, checkpoint=checkpoint, **args | overrides)
    prompts, _ = make_workload(replace(cfg, prompt_len=prompt_len), batch, 1)
    for prompt in prompts:
        engine.add_request(prompt, greedy(first + more + prefill_steps(batch, prompt_len) + 1))
    while len(engine.scheduler.waiting) or min(
            (s.num_output_tokens for s in engine.scheduler.running), default=0) < first:
        engine.step()  # none running: the prompts still wait
    return engine


@contextlib.contextmanager
def forward_timer(engine: Engine, device: str):
    """While open, hooks on the engine's model forward and its lm_head (the logits, computed
    apart) add -start and +end of each call to the list it yields, whose sum is the time in
    both. Each hook waits for the device, so a step timed with them on is not a step's time:
    time steps with them off, the forward with them on."""
    spent = []

    def started(*_) -> None:  # a forward pre-hook: (module, args)
        spent.append(-synced_clock(device))

    def ended(*_) -> None:  # a forward hook: (module, args, output); None keeps the output
        spent.append(synced_clock(device))

    handles = []
    for module in (engine.model, engine.model.lm_head):
        handles.append(module.register_forward_pre_hook(started))
        handles.append(module.register_forward_hook(ended))
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


class DenseDecoder:
    """The engine's sequences copied into a DenseKVCache (each one's tokens but its last), with
    room for `room` more tokens; `step` runs one decode step of every row on it: the newest
    token of each row in, the next greedy one out. What the paged step is compared with."""

    def __init__(self, model, seqs: list, room: int, device: str):
        self.model = model
        self.device = device
        context = len(seqs[0].token_ids) - 1  # the tokens cached: every sequence has as many
        self.cache = DenseKVCache.zeros(model.config, len(seqs), context + room,
                                        model.lm_head.weight)
        cached = torch.tensor([s.token_ids[:-1] for s in seqs], device=device)  # (B, context)
        causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
        model.dense_hidden_states(cached, None, self.cache, causal)
        self.newest = torch.tensor([[s.token_ids[-1]] for s in seqs], device=device)  # (B, 1)

    def step(self) -> None:
        positions = torch.full(self.newest.shape, self.cache.length, device=self.device)
        logits = last_logits(self.model, self.newest, positions, self.cache)
        self.newest = logits.argmax(-1, keepdim=True)


@torch.inference_mode()
def decode_step(cfg, model, batch: int, prompt_len=0, first=1, steps=16, rounds=3) -> dict:
    """Decode steps of `batch` sequences of prompt_len tokens from output `first` on: the paged
    step, its forward and logits (the rest: host part), a dense-cache forward with its logits;
    median of alternate rounds."""
    P = prompt_len or cfg.prompt_len
    n = 2 * rounds * steps  # paged steps timed: half whole, half for their forward
    engine = engine_in_decode(cfg, batch, P, first, n)
    seqs = list(engine.scheduler.running)
    first_output_len = np.mean([s.num_output_tokens for s in seqs])
    dense = DenseDecoder(model, seqs, n // 2 + 1, cfg.device)
    paged_s = []    # a paged step, s, by round
    forward_s = []  # a paged step's model forward and logits, in the round's second half
    dense_s = []    # a dense step
    for _ in range(rounds):
        paged_s.append(per_call(engine.step, steps, cfg.device))
        with forward_timer(engine, cfg.device) as spent:
            per_call(engine.step, steps, cfg.device)
        forward_s.append(sum(spent) / steps)
        dense_s.append(per_call(dense.step, steps, cfg.device))
    output_len = first_output_len + (n - 1) / 2  # the mean over the timed steps
    return decode_figures(model, len(seqs), P, output_len, paged_s, forward_s, dense_s)


def decode_figures(model, batch: int, prompt_len: int, output_len: float, paged_s, forward_s,
                   dense_s) -> dict:
    """A decode step's times (the medians of the rounds' seconds, in ms; host: the median of
    each round's step less its forward) and what it computes and reads."""
    c = model.config
    context = prompt_len + output_len  # the mean over the timed steps
    weights = sum(p.numel() for p in model.parameters()) - c.n_positions * c.n_embd
    # forward FLOPs: 2 per matmul weight (tied lm_head counted, wpe not), attention's QK^T, AV
    flops = batch * (2 * weights + 4 * c.n_layer * context * c.n_embd)
    paged = np.median(paged_s)
    dense = np.median(dense_s)
    # every sequence's K/V, read once by attention in each layer
    kv_read_bytes = batch * context * kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim,
                                                         model.lm_head.weight.dtype)
    return dict(batch=batch, prompt_len=prompt_len, output_len=output_len, context=context,
                flops=flops, weight_bytes=weights * model.lm_head.weight.element_size(),
                kv_read_bytes=kv_read_bytes,
                paged_step_ms=paged * 1e3, forward_ms=np.median(forward_s) * 1e3,
                host_ms=np.median(np.subtract(paged_s, forward_s)) * 1e3,
                dense_step_ms=dense * 1e3, paging_overhead=paged / dense - 1)


def machine_rates(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a 1024^2 matmul, bytes/s of a 128 MiB copy), each the best of three."""
    w = torch.randn(1024, 1024, dtype=dtype, device=device)
    x = torch.randn(2 ** 25, dtype=dtype, device=device)  # 128 MiB in fp32
    y = torch.randn(2 ** 25, dtype=dtype, device=device)

    def square() -> None:  # the product is thrown away: only its time counts
        w @ w

    def copy() -> None:
        y.copy_(x)

    matmul_rate = 2 * 1024 ** 3 / min(per_call(square, 10, device) for _ in range(3))
    # a copy's bytes: read and written, as STREAM counts them
    copy_rate = 2 * x.nbytes / min(per_call(copy, 3, device) for _ in range(3))
    return matmul_rate, copy_rate


def hardware_view(cfg: BenchConfig, model, batches, steps=16, host_output_lens=()) -> dict:
    """Decode steps at each batch size against a roofline measured in the same run: max((weight
    + K/V bytes) / copy bandwidth, FLOPs / matmul rate), what the step would cost if it only
    streamed the weights and the K/V it reads, or only multiplied at a big square matmul's
    rate. Host cost: at the largest batch and one context (top + 16), a step at each output
    length n (centred on n)."""
    matmul_rate, copy_rate = machine_rates(cfg.device, model.lm_head.weight.dtype)
    decode = [decode_step(cfg, model, b, steps=steps) for b in batches]
    top = max(host_output_lens, default=0)
    # 5 rounds of 2 x 4 steps: 40 steps from output n - 20, so centred on n
    host_cost = [decode_step(cfg, model, batches[-1], top + 16 - n, max(1, n - 20), steps=4,
                             rounds=5) for n in host_output_lens]
    for d in decode + host_cost:
        bytes_read = d["weight_bytes"] + d["kv_read_bytes"]
        d["roofline_ms"] = max(bytes_read / copy_rate, d["flops"] / matmul_rate) * 1e3
    return dict(decode=decode, host_cost=host_cost, preset=cfg.preset,
                threads=torch.get_num_threads(), matmul_n=1024, matmul_gflops=matmul_rate / 1e9,
                copy_gb_s=copy_rate / 1e9)


def decode_batches(largest: int) -> list[int]:
    """The decode sweep's batch sizes: the powers of two below `largest`, then `largest`."""
    batches = []
    size = 1
    while size < largest:
        batches.append(size)
        size *= 2
    return batches + [largest]


@torch.inference_mode()
def sampling_time(cfg: BenchConfig, rows: int = 64, reps: int = 50, rounds: int = 5) -> dict:
    """Sampling `rows` seeded requests (T 0.8, top-p 0.95) of cfg.prompt_len tokens as the
    engine does, in ms: as they are, then with presence, frequency and repetition penalties
    (whose per-row token counts each call builds, as each step does)."""
    engine = make_engine(cfg, max_num_seqs=rows, max_num_batched_tokens=rows * cfg.prompt_len,
                         kv_cache_tokens=rows * (cfg.prompt_len + cfg.block_size))
    plain = SamplingParams(temperature=0.8, top_p=0.95)
    for i, prompt in enumerate(make_workload(cfg, rows, 1)[0]):
        engine.add_request(prompt, replace(plain, seed=i))
    out = engine.execute(engine.scheduler.schedule())  # one step's logits, not applied
    seqs = list(out.sampled_token_ids)

    def step():
        tensors = sampling_tensors(seqs, engine.vocab_size, engine.eos_token_ids, cfg.device)
        return sample(out.logits, tensors, engine.model_runner.generator)

    plain_times = [per_call(step, reps, cfg.device) for _ in range(rounds)]
    for seq in seqs:
        seq.params = replace(seq.params, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.2)
    penalty_times = [per_call(step, reps, cfg.device) for _ in range(rounds)]
    return dict(rows=len(seqs), vocab=out.logits.shape[1], tokens_per_row=cfg.prompt_len,
                sample_ms=1e3 * np.median(plain_times),
                sample_with_penalties_ms=1e3 * np.median(penalty_times))


# ----------------------------------------------------------------------------- report

def table(title: str, rows: list[dict], keys: str) -> str:
    """A markdown table of rows' values at keys (also the JSON's keys), floats to 2 decimals."""
    keys = keys.split()
    lines = [title, table_line(keys), table_line(["---"] * len(keys))]
    for row in rows:
        lines.append(table_line([table_cell(row[k]) for k in keys]))
    return "\n".join(lines)


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_cell(value) -> str:
    if value is None:  # not measured in this row
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def offline_table(result: dict) -> str:
    cfg = result["config"]
    experiments = {"equal_batch": result["offline"], "equal_memory": result.get("equal_memory", {})}
    rows = []
    for experiment, runs in experiments.items():
        for limit, run in runs.items():
            for mode, figures in run["modes"].items():
                rows.append(dict(experiment=experiment, limit=limit, mode=mode) | figures)
    title = (f"Offline, at equal batch size ({cfg['max_num_seqs']}) and at equal KV memory ("
             f"{cfg['kv_budget']} tokens): useful output tokens/s, ratios of throughput and of "
             "steps, sequences a step, KV slots (mean, peak, share holding real tokens), "
             "preemptions")
    return table(title, rows, "experiment limit mode tok_s vs_naive vs_static max_num_seqs steps "
                 "steps_vs_static ms_per_step seqs_per_step seqs_peak tokens_per_step "
                 "kv_slots_mean kv_slots_peak kv_real_share preemptions")


def grouped_query_table(result: dict) -> str:
    cfg = result["config"]
    rows = []
    for limit, runs in result["grouped_query"].items():
        for preset, figures in runs.items():
            rows.append(dict(limit=limit, model=preset) | figures)
    title = (f"Grouped-query attention at equal KV memory (what {cfg['kv_budget']} tokens of "
             "llama-tiny-mha take), fcfs: the KV tokens that memory holds, sequences a "
             "step, useful output tokens/s")
    return table(title, rows, "limit model kv_heads kv_tokens seqs_per_step seqs_peak "
                 "tokens_per_step tok_s vs_mha steps preemptions")


def decode_table(hw: dict) -> str:
    rows = []
    for d in hw["decode"] + hw["host_cost"]:
        rows.append(d | dict(of_roofline=d["roofline_ms"] / d["paged_step_ms"]))
    title = (f"Decode step, {hw['preset']}, {hw['threads']} threads (ms): the paged engine's "
             "(forward: its model forward, host: the rest), a dense contiguous cache's, and the "
             f"roofline: max(weight bytes / {hw['copy_gb_s']:.1f} GB/s copied, FLOPs / "
             f"{hw['matmul_gflops']:.0f} GFLOP/s of a {hw['matmul_n']}^2 matmul)")
    if hw["host_cost"]:
        title += (f"; last {len(hw['host_cost'])} rows: the host cost by output length, at one "
                  "context")
    return table(title, rows, "batch prompt_len output_len paged_step_ms forward_ms host_ms "
                 "dense_step_ms paging_overhead roofline_ms of_roofline")


def online_table(result: dict) -> str:
    rows = []
    for rate, runs in result["online"].items():
        for mode, figures in runs.items():
            row = dict(rate=rate, mode=mode) | figures
            for metric in ("ttft", "tpot", "itl", "e2e"):
                for stat in ("mean", "p50", "p99"):
                    row[f"{metric}_{stat}_ms"] = figures[metric][stat] * 1e3
            row["client_cpu"] = figures.get("client_cpu_fraction", "")  # over HTTP only
            rows.append(row)
    title = f"Online, limit {result['config']['online_limit']}, Poisson arrivals"
    if any("http" in runs for runs in result["online"].values()):
        title += ("; client_cpu: the share of one core that bench's HTTP client used (its CPU "
                  "time over the run's wall time)")
    return table(title, rows, "rate mode ttft_mean_ms ttft_p50_ms ttft_p99_ms tpot_mean_ms "
                 "itl_p50_ms itl_p99_ms e2e_mean_ms e2e_p50_ms request_throughput "
                 "output_throughput client_cpu")


def report(result: dict) -> str:
    """Every table there are figures for (with --url: online only), in markdown."""
    tables = []
    if "hardware" in result:  # the in-process experiments ran
        tables.append(offline_table(result))
        tables.append(decode_table(result["hardware"]))
    if "grouped_query" in result:
        tables.append(grouped_query_table(result))
    if "hardware_big" in result:
        tables.append(decode_table(result["hardware_big"]))
    tables.append(online_table(result))
    return "\n\n".join(tables)


# ----------------------------------------------------------------------------- service levels

# The two classes of traffic: class -> (prompt tokens, output tokens, priority). Interactive
# requests are short and want their tokens soon (the --goodput targets); batch jobs are long
# and want throughput. Half the requests are of each class, in random order.
SLO_CLASSES = {"interactive": (16, 16, 0), "batch": (256, 128, 1)}
SLO_CONTEXTS = 8  # --goodput: the KV cache holds this many batch jobs' whole contexts
SLO_MODES = {"fcfs": dict(policy="fcfs"), "sjf": dict(policy="sjf"),
             "priority": dict(policy="priority"),
             "priority-swap": dict(policy="priority", preemption_mode="swap")}


def parse_goodput(specs: tuple) -> dict[str, float]:
    """vLLM's --goodput "ttft:MS tpot:MS" -> {"ttft": seconds, "tpot": seconds}; ValueError
    naming a target that is not one of these or not a positive number of milliseconds."""
    targets = {}
    for spec in specs:
        name, _, ms = spec.partition(":")
        if name not in ("ttft", "tpot"):
            raise ValueError(f"--goodput {spec!r}: a target is ttft:MS or tpot:MS")
        try:
            seconds = float(ms) / 1e3
        except ValueError:
            seconds = math.nan
        if not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"--goodput {spec!r}: MS must be a positive number")
        targets[name] = seconds
    return targets


def slo_workload(cfg: BenchConfig) -> tuple[list, list[int], list[int], list[str]]:
    """--slo-requests requests, each of a class drawn at random (half each): (prompts of the
    class's length, random ids; output lengths; priorities; classes)."""
    rng = np.random.default_rng(cfg.seed + 3)
    classes = [list(SLO_CLASSES)[k] for k in rng.integers(0, 2, cfg.slo_requests)]
    prompts = [rng.integers(0, 256, SLO_CLASSES[c][0]).tolist() for c in classes]
    lengths = [SLO_CLASSES[c][1] for c in classes]
    priorities = [SLO_CLASSES[c][2] for c in classes]
    return prompts, lengths, priorities, classes


def meets_targets(targets: dict[str, float], ttft: float, tpot: float | None) -> bool:
    """Whether one request met every target (a request of one token has no TPOT to miss)."""
    if ttft > targets.get("ttft", math.inf):
        return False
    return tpot is None or tpot <= targets.get("tpot", math.inf)


def slo_figures(targets: dict, arrivals, times: list[list[float]], classes: list[str]
                ) -> list[dict]:
    """Per class: the share of its requests that met the targets, its goodput (those
    requests a second of the run: vLLM's), its TTFT and TPOT, its output tokens a second."""
    duration = max(t[-1] for t in times) - arrivals[0]
    rows = []
    for name in SLO_CLASSES:
        ttfts, tpots, met, num_tokens = [], [], 0, 0
        for arrival, token_times, c in zip(arrivals, times, classes):
            if c != name:
                continue
            ttft = token_times[0] - arrival
            tpot = None
            if len(token_times) > 1:
                tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
                tpots.append(tpot)
            ttfts.append(ttft)
            met += meets_targets(targets, ttft, tpot)
            num_tokens += len(token_times)
        rows.append(dict(traffic=name, requests=len(ttfts), met=met / len(ttfts),
                         goodput=met / duration, ttft_p50_ms=np.percentile(ttfts, 50) * 1e3,
                         ttft_p99_ms=np.percentile(ttfts, 99) * 1e3,
                         tpot_p50_ms=np.percentile(tpots, 50) * 1e3,
                         output_throughput=num_tokens / duration))
    return rows


def service_levels(cfg: BenchConfig) -> list[dict]:
    """--goodput: the two classes of traffic through each of SLO_MODES at each arrival rate:
    a row per class and run. Under overload fcfs serves arrivals in order, and an interactive
    request waits behind the batch jobs before it; priority lets it pass them, and preempts
    one (recomputed, or swapped: priority-swap) when it cannot otherwise start."""
    targets = parse_goodput(cfg.goodput)
    prompts, lengths, priorities, classes = slo_workload(cfg)
    # a cache for SLO_CONTEXTS batch jobs (unless --kv-cache-tokens): overload fills it, and
    # what arrives then waits (fcfs) or preempts (priority)
    batch_context = SLO_CLASSES["batch"][0] + SLO_CLASSES["batch"][1]
    kv_cache_tokens = cfg.kv_cache_tokens or SLO_CONTEXTS * batch_context
    warm = make_engine(cfg)
    run_online_engine(cfg, "fcfs", [0.0] * 4, prompts[:4], [4] * 4, engine=warm)  # not timed
    rows = []
    for rate in cfg.slo_rates:
        gaps = np.random.default_rng(cfg.seed + 1).exponential(1 / rate, len(prompts))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        for mode, overrides in SLO_MODES.items():
            engine = make_engine(cfg, "fcfs", max(lengths), kv_cache_tokens=kv_cache_tokens,
                                 **overrides)
            times = run_online_engine(cfg, mode, arrivals, prompts, lengths, priorities, engine,
                                      step_timer(cfg))
            for row in slo_figures(targets, arrivals, times, classes):
                rows.append(emit(cfg, "goodput", dict(rate=rate, mode=mode) | row | dict(
                    preemptions=engine.scheduler.num_preemptions)))
    return rows


def step_timer(cfg: BenchConfig):
    """The clock of the service-level runs: on a CPU with one thread, this process's CPU time,
    which a shared machine's other processes do not inflate (a CPU step runs synchronously on
    this thread, so its CPU time is its time); else wall time."""
    if cfg.device == "cpu" and cfg.threads == 1:
        return time.process_time
    return time.perf_counter


def service_levels_table(rows: list[dict]) -> str:
    return table("Service levels: interactive (priority 0) and batch (priority 1) traffic; met: "
                 "the share meeting the --goodput targets, goodput: those requests/s", rows,
                 "rate mode traffic requests met goodput ttft_p50_ms ttft_p99_ms tpot_p50_ms "
                 "output_throughput preemptions")


# ----------------------------------------------------------------------------- swap or recompute

PREEMPTION_MODES = ("recompute", "swap", "auto")


def resume_seconds(cfg: BenchConfig, mode: str, context: int, reps: int = 3) -> dict:
    """The time to resume a sequence of `context` tokens preempted after its first output
    token: from its readmission to its second token (swapped in and one decode, or its
    context recomputed in one prefill step: the budget holds it), and the time its preemption
    took (the copy out, if swapped); medians of reps, after one not timed. The prefix cache is
    off: with it a recompute could find its blocks still cached (never, under the memory
    pressure that preempts)."""
    engine = make_engine(cfg, "fcfs", 0, preemption_mode=mode, enable_prefix_caching=False,
                         max_num_batched_tokens=max(cfg.max_num_batched_tokens, context + 1),
                         kv_cache_tokens=2 * (context + 16), max_num_seqs=2)
    prompt = np.random.default_rng(cfg.seed).integers(0, 256, context).tolist()
    resumes, preemptions = [], []
    for rep in range(reps + 1):
        request_id = engine.add_request(prompt, greedy(2))
        seq = engine.seqs[request_id]
        while seq.num_output_tokens < 1:
            engine.step()
        start = time.perf_counter()
        output = SchedulerOutput()
        engine.scheduler._preempt_in_step(seq, output)
        engine.execute(output)  # the copy out (swap)
        preempted = time.perf_counter()
        while seq.num_output_tokens < 2:
            engine.step()
        if rep > 0:
            resumes.append(time.perf_counter() - preempted)
            preemptions.append(preempted - start)
    return dict(mode=mode, context=context, resume_ms=np.median(resumes) * 1e3,
                preempt_ms=np.median(preemptions) * 1e3,
                swapped=engine.scheduler.num_swapped_out > 0)


def preempting_throughput(cfg: BenchConfig, mode: str) -> dict:
    """Output tokens/s of --num-requests requests (--prompt-len tokens, 128 out each) queued at
    once into a cache of 8 contexts for 32 sequences: most steps preempt."""
    prompts, _ = make_workload(cfg, cfg.num_requests, 1)
    context = cfg.prompt_len + 128
    engine = make_engine(cfg, "fcfs", 0, preemption_mode=mode, max_num_seqs=32,
                         kv_cache_tokens=8 * context)
    start = time.perf_counter()
    outputs = [engine.add_request(p, greedy(128)) for p in prompts]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            accumulate(finished, out)
    wall = time.perf_counter() - start
    scheduler = engine.scheduler
    return dict(mode=mode, output_throughput=128 * len(prompts) / wall,
                preemptions=scheduler.num_preemptions, swapped_out=scheduler.num_swapped_out,
                tokens=[finished[i].outputs[0].token_ids for i in outputs])


def swap_against_recompute(cfg: BenchConfig) -> dict:
    """--swap: resume times by context, then throughput under preemption, by mode."""
    resume = [emit(cfg, "resume", resume_seconds(cfg, mode, context))
              for context in cfg.swap_contexts for mode in ("recompute", "swap")]
    throughput = []
    recomputed_tokens = None
    for mode in PREEMPTION_MODES:  # recompute first: the tokens the others must equal
        row = preempting_throughput(cfg, mode)
        tokens = row.pop("tokens")
        if recomputed_tokens is None:
            recomputed_tokens = tokens
        row["same_tokens"] = tokens == recomputed_tokens  # greedy: in every mode alike
        throughput.append(emit(cfg, "preempting_throughput", row))
    return dict(resume=resume, throughput=throughput)


def swap_table(found: dict) -> str:
    resume = table("Resuming a preempted sequence: readmission to its next token (swap: copied "
                   "back in; recompute: its context prefilled again), and the preemption itself",
                   found["resume"], "context mode resume_ms preempt_ms swapped")
    throughput = table("Throughput under a cache that preempts often", found["throughput"],
                       "mode output_throughput preemptions swapped_out same_tokens")
    return resume + "\n\n" + throughput


# ----------------------------------------------------------------------------- beam search

def peak_blocks(engine: Engine) -> int:
    """Step the engine to the end: the most KV blocks held after any step."""
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.last_step.kv_blocks_used)
    return peak


def beam_blocks(cfg: BenchConfig, beam_width: int) -> dict:
    """The peak KV blocks of one beam-search request of beam_width beams, and of beam_width
    independent greedy requests of the same prompt and length with the prefix cache off (no
    block shared: the paper's baseline), each alone in an engine; the block copies made."""
    prompt = make_workload(cfg, 1, 1)[0][0]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=cfg.beam_max_tokens,
                              ignore_eos=True)
    engine = make_engine(cfg, "fcfs", 0, max_num_seqs=max(cfg.max_num_seqs, beam_width))
    engine.step_records = []
    engine.add_beam_request(prompt, params)
    beam = peak_blocks(engine)
    copies = sum(record.num_block_copies for record in engine.step_records)
    engine = make_engine(cfg, "no-cache", 0, max_num_seqs=max(cfg.max_num_seqs, beam_width))
    for _ in range(beam_width):
        engine.add_request(prompt, greedy(cfg.beam_max_tokens))
    independent = peak_blocks(engine)
    return dict(beam_width=beam_width, beam_blocks=beam, independent_blocks=independent,
                ratio=beam / independent, block_copies=copies)


def beam_throughput(cfg: BenchConfig, beam_width: int) -> dict:
    """--beam-requests beam searches of beam_width beams at once (LLM.beam_search's way):
    tokens/s of the beams (beam_width x max_tokens a request) and of the sequences returned
    best."""
    prompts, _ = make_workload(cfg, cfg.beam_requests, 1)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=cfg.beam_max_tokens,
                              ignore_eos=True)
    engine = make_engine(cfg, "fcfs", 0,
                         max_num_seqs=max(cfg.max_num_seqs, beam_width * cfg.beam_requests))
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_beam_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    num_tokens = cfg.beam_requests * cfg.beam_max_tokens
    return dict(beam_width=beam_width, requests=cfg.beam_requests, wall_s=wall,
                beam_tokens_per_s=beam_width * num_tokens / wall,
                best_tokens_per_s=num_tokens / wall)


def beam_search_figures(cfg: BenchConfig) -> dict:
    """--beam-search: blocks held, then tokens/s, at each beam width."""
    blocks = [emit(cfg, "beam_blocks", beam_blocks(cfg, w)) for w in cfg.beam_widths]
    throughput = [emit(cfg, "beam_throughput", beam_throughput(cfg, w))
                  for w in cfg.beam_widths]
    return dict(blocks=blocks, throughput=throughput)


def beam_search_table(found: dict) -> str:
    blocks = table("KV blocks held at the peak: one beam-search request of W beams against W "
                   "independent sequences of the same lengths (no prefix cache)",
                   found["blocks"], "beam_width beam_blocks independent_blocks ratio "
                   "block_copies")
    throughput = table("Beam search, requests searched together", found["throughput"],
                       "beam_width requests wall_s beam_tokens_per_s best_tokens_per_s")
    return blocks + "\n\n" + throughput

# ----------------------------------------------------------------------------- disaggregation

DISAGG_LONG_OUTPUT = 8  # tokens each long prompt generates: its cost is its prefill
DISAGG_THREADS = 2      # the cores each configuration has in all: one instance of two threads,
                        # or a prefill and a decode instance of one each


@dataclass
class DisaggWorkload:
    """--disagg's requests, by arrival, a list entry each."""
    arrivals: list[float]    # seconds from the start
    prompts: list[list[int]]
    lengths: list[int]       # output tokens
    is_long: list[bool]      # a long prompt (else a short decoding request)


def disagg_workload(cfg: BenchConfig, with_long: bool) -> DisaggWorkload:
    """Short requests arriving every 1 / --disagg-rate seconds for --disagg-duration seconds,
    and (with_long) a long prompt every --disagg-long-every seconds from the first such
    interval on; by arrival."""
    rng = np.random.default_rng(cfg.seed)
    requests = []
    for k in range(int(cfg.disagg_duration * cfg.disagg_rate)):
        prompt = rng.integers(0, 256, cfg.prompt_len).tolist()
        requests.append((k / cfg.disagg_rate, prompt, cfg.disagg_short_output, False))
    for k in range(int(cfg.disagg_duration / cfg.disagg_long_every) if with_long else 0):
        prompt = rng.integers(0, 256, cfg.disagg_long_len).tolist()
        requests.append(((k + 0.5) * cfg.disagg_long_every, prompt, DISAGG_LONG_OUTPUT, True))
    requests.sort(key=arrival_time)
    return DisaggWorkload(arrivals=[request[0] for request in requests],
                          prompts=[request[1] for request in requests],
                          lengths=[request[2] for request in requests],
                          is_long=[request[3] for request in requests])


def arrival_time(request: tuple) -> float:
    return request[0]


class Stopwatch:
    """Wraps a function to add each call's wall time to `seconds`."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def disagg_one_instance(cfg: BenchConfig, workload: DisaggWorkload) -> list:
    """The workload on one instance of DISAGG_THREADS threads, chunked prefill: token times."""
    torch.set_num_threads(DISAGG_THREADS)
    engine = make_engine(cfg, "fcfs", max(workload.lengths))
    return run_online_engine(cfg, "fcfs", workload.arrivals, workload.prompts,
                             workload.lengths, engine=engine)


def disagg_two_instances(cfg: BenchConfig, workload: DisaggWorkload, folder: str
                         ) -> tuple[list, dict]:
    """The workload through a prefill instance (kv_producer, max_tokens 1, as the proxy asks)
    and then a decode instance (kv_consumer), one thread each, each on its own clock: the
    prefill instance's run first (nothing it does waits for the decode one), then the decode
    instance's with each request arriving when its prefill finished (its K/V saved). Token
    times (the decode instance's: a client streams from it), and the transfer's cost."""
    arrivals = workload.arrivals
    prompts = workload.prompts
    lengths = workload.lengths
    torch.set_num_threads(DISAGG_THREADS // 2)
    extra = {"shared_storage_path": folder}
    prefill = make_engine(cfg, "fcfs", 1, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": extra})
    prefill_step = prefill.step = Stopwatch(prefill.step)
    save = prefill.kv_connector.save_kv = Stopwatch(prefill.kv_connector.save_kv)
    prefilled = run_online_engine(cfg, "fcfs", arrivals, prompts, [1] * len(prompts),
                                  engine=prefill)
    ready_at = [t[0] for t in prefilled]  # its prefill done and its K/V saved
    ready = sorted(range(len(prompts)), key=ready_at.__getitem__)
    decode = make_engine(cfg, "fcfs", max(lengths), kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": extra})
    decoded = run_online_engine(cfg, "fcfs", [ready_at[i] for i in ready],
                                [prompts[i] for i in ready], [lengths[i] for i in ready],
                                engine=decode)
    times = [None] * len(prompts)
    for position, i in enumerate(ready):
        times[i] = decoded[position]
    computed = prefill.stats.num_batched_tokens - prefill.stats.num_generated_tokens
    loaded = decode.stats.num_kv_loaded_tokens
    transfer = save.seconds + decode.stats.kv_load_seconds
    return times, dict(prefill_s_per_token=(prefill_step.seconds - save.seconds) / computed,
                       transfer_s_per_token=transfer / loaded if loaded else None,
                       loaded_tokens=loaded, load_failures=decode.stats.num_kv_load_failures)


def disagg_figures(name: str, threads: str, workload: DisaggWorkload, times: list) -> dict:
    """A run's row: the short requests' ITL and TPOT, the long ones' TTFT, the throughput."""
    arrivals = workload.arrivals
    lengths = workload.lengths
    short = [i for i in range(len(times)) if not workload.is_long[i]]
    longs = [i for i in range(len(times)) if workload.is_long[i]]
    figures = latency_figures([arrivals[i] for i in short], [times[i] for i in short],
                              [lengths[i] for i in short])
    row = dict(run=name, threads=threads, itl_p50_ms=figures["itl"]["p50"] * 1e3,
               itl_p99_ms=figures["itl"]["p99"] * 1e3, tpot_ms=figures["tpot"]["mean"] * 1e3,
               tpot_p99_ms=figures["tpot"]["p99"] * 1e3, long_ttft_ms=None,
               itl_p99_vs_alone=None,
               output_throughput=sum(lengths) / (max(t[-1] for t in times) - arrivals[0]))
    if longs:
        row["long_ttft_ms"] = np.mean([times[i][0] - arrivals[i] for i in longs]) * 1e3
    return row


def disaggregation(cfg: BenchConfig) -> dict:
    """--disagg: the short stream alone, then with long prompts arriving, on one instance and
    through two; the p99 ITL of each against its own run without long prompts."""
    threads = torch.get_num_threads()
    rows, transfer = [], {}
    try:
        for with_long in (False, True):
            workload = disagg_workload(cfg, with_long)
            suffix = ", long prompts arriving" if with_long else ", short requests alone"
            times = disagg_one_instance(cfg, workload)
            rows.append(disagg_figures("one instance" + suffix, "1 x 2", workload, times))
            with tempfile.TemporaryDirectory() as folder:
                times, transfer = disagg_two_instances(cfg, workload, folder)
            rows.append(disagg_figures("prefill + decode" + suffix, "2 x 1", workload, times))
    finally:
        torch.set_num_threads(threads)
    for row, alone in zip(rows[2:], rows[:2]):  # each with long prompts against its own alone
        row["itl_p99_vs_alone"] = row["itl_p99_ms"] / alone["itl_p99_ms"]
    for row in rows:
        emit(cfg, "disagg", row)
    return dict(rows=rows, transfer=transfer)


def disagg_table(found: dict) -> str:
    runs = table("Disaggregated prefill and decode: the short requests' inter-token latency and "
                 "time a token, the long prompts' time to first token, output tokens/s",
                 found["rows"], "run threads itl_p50_ms itl_p99_ms itl_p99_vs_alone tpot_ms "
                 "tpot_p99_ms long_ttft_ms output_throughput")
    transfer = found["transfer"]
    per_token = transfer["transfer_s_per_token"]
    cost = "no tokens were loaded" if per_token is None else (
        f"{per_token * 1e6:.1f} us a token saved and loaded against "
        f"{transfer['prefill_s_per_token'] * 1e6:.1f} us a token to compute it "
        f"({transfer['loaded_tokens']} tokens loaded, {transfer['load_failures']} failures)")
    return runs + f"\n\nThe transfer (one machine, a shared folder): {cost}"


# ----------------------------------------------------------------------------- LoRA

def lora_targets(engine: Engine) -> list[str]:
    """Every projection an adapter of the engine's model family may target."""
    if engine.model.config.position_encoding == "learned":
        return list(lora.GPT2_TARGETS)
    return list(lora.LLAMA_TARGETS)


def run_lora_batches(engine: Engine, batches: list[list[tuple]], max_tokens: int) -> dict:
    """Serve each batch of (prompt, LoRARequest or None) to its end, one batch after another
    (one batch: everything queued at once); output tokens/s and mean end-to-end latency, every
    request having arrived at the start."""
    start = time.perf_counter()
    latencies = []
    for batch in batches:
        for prompt, lora_request in batch:
            engine.add_request(prompt, greedy(max_tokens), lora_request=lora_request)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    latencies.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    return dict(output_throughput=max_tokens * len(latencies) / wall,
                mean_e2e_ms=1000 * sum(latencies) / len(latencies))


def lora_sweep(cfg: BenchConfig) -> dict:
    """--lora: for each K, requests spread evenly over K adapters (request i: adapter i % K),
    through (a) the base model alone, (b) one engine batching every adapter (max_loras K, and
    K/2: adapters paged in and out), (c) one adapter at a time (each adapter's requests as a
    batch of their own: a server without multi-LoRA batching); then loading an adapter."""
    prompts, _ = make_workload(cfg, cfg.num_requests, 1)
    max_k = max(cfg.lora_adapters)
    base = make_engine(cfg)
    with tempfile.TemporaryDirectory() as directory:
        requests = []
        for i in range(max_k):
            path = os.path.join(directory, f"adapter{i}")
            lora.save_random_lora(path, base.model, lora_targets(base), r=cfg.lora_rank, seed=i)
            requests.append(lora.LoRARequest(f"adapter{i}", i + 1, path))
        run_lora_batches(base, [[(p, None) for p in prompts[:4]]], 4)  # warm-up, not timed
        base_row = dict(adapters=0, max_loras=0, mode="base", vs_base=None)
        base_row |= run_lora_batches(base, [[(p, None) for p in prompts]], cfg.lora_max_tokens)
        rows = [emit(cfg, "lora", base_row)]
        for k in cfg.lora_adapters:
            rows += lora_rows(cfg, prompts, requests[:k])
        load = lora_load_cost(cfg, base, requests)
    return dict(rows=rows, load=load)


def lora_rows(cfg: BenchConfig, prompts: list, requests: list) -> list[dict]:
    """(b) at max_loras K and K/2, then (c), for K = len(requests) adapters. Each row's
    vs_base: its throughput over the base model's on the same requests, run just before it on
    a fresh engine warmed the same way (this machine's speed drifts by 10-20% over a few
    minutes: a ratio to one base run at the start would carry that drift; and an engine that
    served these prompts before would find them in its prefix cache)."""
    k = len(requests)
    assigned = [(p, requests[i % k]) for i, p in enumerate(prompts)]
    rows = []
    one_at_a_time = [[(p, lora_request) for p, lora_request in assigned
                      if lora_request is requests[i]] for i in range(k)]
    runs = [(max_loras, "multi-lora", [assigned])
            for max_loras in sorted({k, max(1, k // 2)}, reverse=True)]
    runs.append((1, "one adapter at a time", one_at_a_time))
    for max_loras, mode, batches in runs:
        engine = make_engine(cfg, enable_lora=True, max_loras=max_loras,
                             max_lora_rank=cfg.lora_rank, max_cpu_loras=k)
        run_lora_batches(engine, [assigned[:1]], 2)  # warm-up, not timed
        base = make_engine(cfg)
        run_lora_batches(base, [[(assigned[0][0], None)]], 2)  # warm-up, not timed
        base_run = run_lora_batches(base, [[(p, None) for p in prompts]], cfg.lora_max_tokens)
        del base
        row = dict(adapters=k, max_loras=max_loras, mode=mode)
        row |= run_lora_batches(engine, batches, cfg.lora_max_tokens)
        row["vs_base"] = row["output_throughput"] / base_run["output_throughput"]
        rows.append(emit(cfg, "lora", row))
    return rows


def lora_load_cost(cfg: BenchConfig, engine: Engine, requests: list) -> dict:
    """An adapter's load: from disk into host memory (read and checked), then into a device
    slot (every projection's A and B copied), mean ms over the adapters."""
    manager = lora.LoRAManager(engine.model, 1, cfg.lora_rank, len(requests), cfg.device)
    start = time.perf_counter()
    for request in requests:
        manager.host[request.lora_int_id] = lora.load_lora(request, engine.model, cfg.lora_rank)
    disk = (time.perf_counter() - start) / len(requests)
    start = time.perf_counter()
    for request in requests:
        manager._load_slot(request.lora_int_id, 0)
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
    slot = (time.perf_counter() - start) / len(requests)
    for linear in manager.linears:  # the engine's model serves on without adapters
        linear.lora_mapping = None
    return dict(disk_ms=1000 * disk, slot_ms=1000 * slot, rank=cfg.lora_rank)


def lora_table(found: dict) -> str:
    rows = table("Multi-LoRA serving: requests spread over K adapters (adapters 0: the base "
                 "model alone)", found["rows"],
                 "adapters max_loras mode output_throughput vs_base mean_e2e_ms")
    load = found["load"]
    return rows + (f"\n\nLoading an adapter of rank {load['rank']}: {load['disk_ms']:.2f} ms "
                   f"from disk, {load['slot_ms']:.2f} ms into a device slot")


# ----------------------------------------------------------------------------- main

def run_in_process(cfg: BenchConfig, result: dict, progress) -> None:
    """The offline experiments and the hardware view, into `result`."""
    model = make_engine(cfg).model  # naive's weights: the engine's own
    warm_prompts, warm_lengths = make_workload(cfg, cfg.max_num_seqs, 8)
    for mode in cfg.modes:  # warm-up, not timed
        run_offline(cfg, mode, warm_prompts, warm_lengths, 8, model)
    result["offline"] = offline(cfg, model, False, progress)
    result["equal_memory"] = offline(cfg, model, True, progress)
    hw = hardware_view(cfg, model, decode_batches(cfg.max_num_seqs),
                       host_output_lens=cfg.host_output_lens)
    hw["sampling"] = sampling_time(cfg)
    result["hardware"] = hw
    progress("hardware view")
    if cfg.grouped_query:
        result["grouped_query"] = grouped_query(cfg, progress)


def online_modes(cfg: BenchConfig) -> list[str]:
    """With --url: the server, and fcfs in process to compare with --compare; else every paged
    mode in process."""
    if not cfg.url:
        return [m for m in cfg.modes if m != "naive"]
    if cfg.compare:
        return ["http", "fcfs"]
    return ["http"]


def online(cfg: BenchConfig, workload: tuple[list, list[int]], progress) -> dict:
    """The online sweep: each mode at each rate, on the same requests."""
    prompts, lengths = workload
    found = {}
    for rate in cfg.rates:
        runs = found[str(rate)] = {}
        for mode in online_modes(cfg):
            r = runs[mode] = run_online(cfg, mode, prompts, lengths, rate)
            progress(f"online, {rate} req/s, {mode}: TTFT p50 {r['ttft']['p50'] * 1e3:.0f} "
                     f"ms, {r['output_throughput']:.0f} tok/s")
    return found


def lm_head_cost(cfg: BenchConfig, reps: int = 20, rounds: int = 5) -> dict:
    """The LM head in bf16 on the CPU, as it was (the weight converted to fp32 every step) and
    as it is (converted once: LMHead.fp32_copy), in one run, alternating: ms per decode step of
    the gpt2 preset at batch 8 (the head is one part of it), and ms per head call alone at
    Qwen2.5-0.5B's head shape (151,936 x 896) for 1, 8 and 32 rows. Medians of `rounds`."""
    def before(self, hidden):  # the old LMHead.forward
        return F.linear(hidden.float(), self.weight.float())

    def timed(fn) -> tuple[float, float]:  # (before, now) ms per call, alternating rounds
        old, new = [], []
        for _ in range(rounds):
            with mock.patch.object(LMHead, "forward", before):
                old.append(1e3 * per_call(fn, reps, "cpu"))
            new.append(1e3 * per_call(fn, reps, "cpu"))
        return float(np.median(old)), float(np.median(new))

    gpt2 = replace(cfg, preset="gpt2", device="cpu")
    engine = engine_in_decode(gpt2, 8, 16, 1, rounds * reps * 2 + 2)
    engine.model.to(torch.bfloat16)
    engine.model_runner.k_caches = engine.model_runner.k_caches.to(torch.bfloat16)
    engine.model_runner.v_caches = engine.model_runner.v_caches.to(torch.bfloat16)
    result = {"gpt2 decode step, batch 8": timed(engine.step)}
    head = LMHead(896, 151936, bias=False).to(torch.bfloat16)
    for rows in (1, 8, 32):
        hidden = torch.randn(rows, 896).to(torch.bfloat16)
        result[f"head 151936 x 896, {rows} rows"] = timed(partial(head, hidden))
    return result


def lm_head_table(result: dict) -> str:
    rows = ["| what (bf16, CPU) | weight converted each step | converted once | ratio |",
            "| --- | ---: | ---: | ---: |"]
    for what, (old, new) in result.items():
        rows.append(f"| {what} | {old:.2f} ms | {new:.2f} ms | {old / new:.1f}x |")
    return "\n".join(rows)


# --sampling's requests, by what a row calls them: greedy, Qwen2.5-Instruct's
# generation_config (temperature 0.7, top-k 20, top-p 0.9: a topk of 20 candidates), and
# top-p alone (a sort of the whole vocabulary)
SAMPLING_KINDS = {"greedy": SamplingParams(temperature=0),
                  "t0.7 top-k 20 top-p 0.9": SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
                  "top-p 0.9": SamplingParams(top_p=0.9)}


@torch.inference_mode()
def lm_head_and_sampling(cfg: BenchConfig) -> list[dict]:
    """At each of --sampling-batches: the LM head (--sampling-hidden to --sampling-vocab, bf16
    weights and input with fp32 logits on CUDA, fp32 on a CPU: LMHead's forward) in ms and GB/s
    of its weight, then sample() on its logits for each of SAMPLING_KINDS, every row alike
    (its tensors made beforehand: sample()'s device work alone). Medians of --reps calls,
    between CUDA events on CUDA (median_ms). Each row to --jsonl as it is measured."""
    dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        head = LMHead(cfg.sampling_hidden, cfg.sampling_vocab, bias=False).to(dtype)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed)
    rows = []
    for batch in cfg.sampling_batches:
        hidden = torch.randn(batch, cfg.sampling_hidden, dtype=dtype, device=cfg.device)
        ms = median_ms(partial(head, hidden), cfg.device, cfg.reps)
        row = dict(batch=batch, vocab=cfg.sampling_vocab, what="lm_head", us=ms * 1e3,
                   gb_s=head.weight.nbytes / ms / 1e6)
        rows.append(emit(cfg, "sampling", row))
        logits = head(hidden)  # (batch, vocab) fp32
        for what, params in SAMPLING_KINDS.items():
            # a row's sequence: only its parameters are read (no tokens, no cache blocks)
            seqs = [Sequence(str(i), None, [0], params, None) for i in range(batch)]
            tensors = sampling_tensors(seqs, cfg.sampling_vocab, [], cfg.device)
            ms = median_ms(partial(sample, logits, tensors, generator), cfg.device, cfg.reps)
            row = dict(batch=batch, vocab=cfg.sampling_vocab, what=f"sample {what}",
                       us=ms * 1e3, gb_s=None)
            rows.append(emit(cfg, "sampling", row))
    return rows


def sampling_table(rows: list[dict]) -> str:
    return table("The LM head and sample() (us; GB/s of the head's weight)", rows,
                 "batch vocab what us gb_s")


# ----------------------------------------------------------------------------- structured output

STRUCTURED_ROUNDS = 2  # --structured-output: runs of each kind at a batch, alternating
# --structured-output's schema: what a client asks for (a string, bounded integers, an enum, an
# array with bounds, a nested object, required fields)
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                            "minItems": 1, "maxItems": 4},
                   "address": {"type": "object",
                               "properties": {"city": {"type": "string"},
                                              "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                               "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}


def structured_output_cost(cfg: BenchConfig) -> dict:
    """Structured output on --model (or --preset): llguidance's tokenizer built from ours and
    STRUCTURED_SCHEMA compiled at first use, then from the cache (ms); then, at each batch,
    decode steps of that many sequences under the schema against the same sequences
    unconstrained: the step (ms), the masks' build and application within it
    (apply_grammar_bitmask, ms), their share of the unconstrained step and the slowdown."""
    batches = cfg.structured_batches
    room = cfg.prompt_len + cfg.structured_steps + 2 * cfg.block_size
    engine = make_engine(cfg, max_num_seqs=max(batches), kv_cache_tokens=max(batches) * room,
                         max_num_batched_tokens=max(max(batches) * cfg.prompt_len, 512))
    manager = engine.structured_output_manager
    constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    start = time.perf_counter()
    manager.ll_tokenizer  # built at the first constrained request
    tokenizer_s = time.perf_counter() - start
    compile_s = timed_seconds(manager.compile, constraint)
    cached_s = timed_seconds(manager.compile, constraint)
    rows = [structured_step(cfg, engine, batch, constraint) for batch in batches]
    return dict(vocab=engine.vocab_size, tokenizer_ms=1e3 * tokenizer_s,
                compile_ms=1e3 * compile_s, cached_compile_ms=1e3 * cached_s, steps=rows)


def timed_seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def structured_step(cfg: BenchConfig, engine: Engine, batch: int,
                    constraint: StructuredOutputsParams) -> dict:
    """One batch's row of structured_output_cost: the median decode step of `batch` greedy
    sequences unconstrained and under the constraint, the runs alternating (STRUCTURED_ROUNDS
    of each, each kind first in turn: a shared machine's load falls on both alike), the
    constrained steps' apply_grammar_bitmask timed."""
    free_times = []
    constrained_times = []
    spent = {"masks": 0.0}
    for round_number in range(STRUCTURED_ROUNDS):
        if round_number % 2 == 1:  # constrained first in odd rounds: neither always goes first
            constrained_times += structured_step_times(cfg, engine, batch, constraint, spent)
        free_times += decode_step_times(cfg, engine, batch, None)
        if round_number % 2 == 0:
            constrained_times += structured_step_times(cfg, engine, batch, constraint, spent)
    free_ms = 1e3 * float(np.median(free_times))
    constrained_ms = 1e3 * float(np.median(constrained_times))
    mask_ms = 1e3 * spent["masks"] / len(constrained_times)
    return dict(batch=batch, vocab=engine.vocab_size, step_ms=free_ms,
                constrained_step_ms=constrained_ms, mask_ms=mask_ms,
                mask_pct=100 * mask_ms / free_ms, slowdown_pct=100 * (constrained_ms / free_ms - 1))


def structured_step_times(cfg: BenchConfig, engine: Engine, batch: int,
                          constraint: StructuredOutputsParams, spent: dict) -> list[float]:
    """decode_step_times under the constraint, its apply_grammar_bitmask timed into spent."""
    timed = partial(timed_call, model_runner.apply_grammar_bitmask, spent, "masks", cfg.device)
    with mock.patch.object(model_runner, "apply_grammar_bitmask", timed):
        return decode_step_times(cfg, engine, batch, constraint, spent)


def decode_step_times(cfg: BenchConfig, engine: Engine, batch: int,
                      constraint: StructuredOutputsParams | None, spent: dict | None = None
                      ) -> list[float]:
    """The seconds of --structured-steps decode steps of `batch` sequences of --prompt-len
    random tokens; spent["masks"] (if given) counts those steps' masks alone. Every sequence
    is aborted at the end."""
    params = SamplingParams(max_tokens=cfg.structured_steps + 8, temperature=0, ignore_eos=True,
                            structured_outputs=constraint)
    ids = [engine.add_request(prompt, params) for prompt in make_workload(cfg, batch, 1)[0]]
    times = []
    while len(times) < cfg.structured_steps and engine.has_unfinished():
        before = dict(spent or {})
        start = synced_clock(cfg.device)
        engine.step()
        seconds = synced_clock(cfg.device) - start
        phases = list(engine.last_step.phases.values())
        if phases.count("decode") == batch:  # every sequence decoding: a step to time
            times.append(seconds)
        elif spent is not None:  # a prefill's masks are not the decode steps'
            spent.update(before)
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return times


def structured_output_table(figures: dict) -> str:
    compile_line = (f"vocabulary {figures['vocab']}: llguidance's tokenizer "
                    f"{figures['tokenizer_ms']:.0f} ms; the schema's first compile "
                    f"{figures['compile_ms']:.1f} ms, cached {figures['cached_compile_ms']:.3f} ms")
    steps = table("Decode steps under a JSON schema (ms; the masks' time as a % of the "
                  "unconstrained step; the constrained step's slowdown, %)", figures["steps"],
                  "batch step_ms constrained_step_ms mask_ms mask_pct slowdown_pct")
    return compile_line + "\n" + steps


# ----------------------------------------------------------------------------- host overhead

HOST_VOCAB = 50257  # GPT-2's vocabulary: the stub's logits and its tokenizer's ids
HOST_PREFILL_TOKENS = 16384  # the stubbed engine's token budget: its prompts in a few steps
HOST_MAX_TOKENS = 512  # more than the prefill's steps and the timed ones: no sequence ends
HOST_PHASES = ("schedule", "inputs", "sampling_tensors", "penalties", "penalty_rows", "sample",
               "invalid_logits", "count_sampled", "update", "record")


def stub_tokenizer(vocab_size: int) -> Tokenizer:
    """vocab_size ids of ASCII text, for the detokenizer's real work: the 256 bytes and
    <|endoftext|> (the byte tokenizer's), then strings of 2, 3 and 4 lowercase letters."""
    ranks = byte_ranks()
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = itertools.chain.from_iterable(itertools.product(letters, repeat=length)
                                          for length in (2, 3, 4))
    num_words = vocab_size - 1 - len(ranks)  # less <|endoftext|>
    for chars in itertools.islice(words, num_words):
        ranks["".join(chars).encode()] = len(ranks) + 1  # 256 is <|endoftext|>
    return Tokenizer("stub", GPT2_PATTERN, ranks, {EOT: 256}, {256})


class StubModel(torch.nn.Module):
    """The engine's model without its work: forward gives one zero a token, compute_logits
    the first rows of fixed random logits (each row its own), so a step's time is the host's
    (and sampling's, timed apart)."""

    def __init__(self, config: GPTConfig, max_rows: int, device: str):
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, config.vocab_size, generator=generator).to(device)
        # what sample() makes of them for a greedy row without bias or penalties: its argmax
        self.greedy_token_ids = self.logits.argmax(dim=-1)

    def forward(self, input_ids, positions, attn_metadata, k_caches, v_caches, attention):
        return torch.zeros(len(input_ids), 1, device=input_ids.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:len(hidden)]


def stubbed_engine(cfg: BenchConfig, batch: int, context: int, max_tokens: int,
                   stream: bool = True) -> Engine:
    """An engine on StubModel holding `batch` sequences of `context` random prompt tokens,
    prefilled, each to generate max_tokens tokens, streamed or not (Engine.add_request's
    stream); tiny K/V (one layer, one head of 8)."""
    config = GPTConfig(vocab_size=HOST_VOCAB, n_positions=context + max_tokens + 1, n_embd=8,
                       n_layer=1, n_head=1)
    stub = Checkpoint(StubModel(config, batch, cfg.device), stub_tokenizer(HOST_VOCAB), [256],
                      torch.float32)
    kv_tokens = batch * (context + max_tokens + cfg.block_size)
    with mock.patch("nanoserve.load_model", return_value=stub):
        engine = Engine(EngineConfig(preset="tiny", device=cfg.device, max_num_seqs=batch,
                                     max_num_batched_tokens=HOST_PREFILL_TOKENS,
                                     kv_cache_tokens=kv_tokens,
                                     block_size=cfg.block_size))
    prompts = np.random.default_rng(cfg.seed).integers(0, HOST_VOCAB - 1, (batch, context))
    for prompt in prompts.tolist():
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True), stream=stream)
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) \
            or len(engine.scheduler.waiting):
        engine.step()
    return engine


def stub_sample(stub: StubModel, logits: torch.Tensor, tensors, generator) -> torch.Tensor:
    """sample()'s result on the stub's logits, without a pass over them: each row's argmax,
    as the stubbed engine's rows are greedy, without bias or penalties."""
    assert tensors.all_greedy and tensors.penalties is None and tensors.logit_bias is None
    return stub.greedy_token_ids[:len(logits)]


def stub_invalid_logits(logits: torch.Tensor) -> torch.Tensor:
    """invalid_logits()'s result on the stub's logits (finite), without a pass over them."""
    return torch.zeros(len(logits), dtype=torch.bool, device=logits.device)


@contextlib.contextmanager
def phase_timers(engine: Engine, device: str):
    """While open, each of HOST_PHASES adds its seconds in the step to the dict it yields."""
    spent = dict.fromkeys(HOST_PHASES, 0.0)
    targets = {"schedule": (engine.scheduler, "schedule"),
               "inputs": (engine.model_runner, "_prepare_inputs"),
               "sampling_tensors": (model_runner, "sampling_tensors"),
               "penalties": (engine.model_runner.input_batch, "penalties"),
               "penalty_rows": (engine.model_runner.input_batch, "penalty_rows"),
               "sample": (model_runner, "sample"),
               "invalid_logits": (model_runner, "invalid_logits"),
               "count_sampled": (engine.model_runner.input_batch, "count_sampled"),
               "update": (engine, "update"),
               "record": (engine, "record")}
    with contextlib.ExitStack() as stack:
        for phase, (owner, name) in targets.items():
            timed = partial(timed_call, getattr(owner, name), spent, phase, device)
            stack.enter_context(mock.patch.object(owner, name, timed))
        yield spent


def timed_call(fn, spent: dict, phase: str, device: str, *args, **kwargs):
    """fn(*args, **kwargs), its seconds added to spent[phase]."""
    start = synced_clock(device)
    result = fn(*args, **kwargs)
    spent[phase] += synced_clock(device) - start
    return result


@torch.inference_mode()
def host_step(cfg: BenchConfig, batch: int, context: int, penalty: bool, stream: bool,
              steps=24) -> dict:
    """The median ms of each phase of a decode step over `steps` steps, and of the whole step.
    device_ms: the step's (batch, vocab) work, sample() and the penalty state's gathers
    (penalty_rows, within penalties) and count (count_sampled): a GPU's work, which a CPU
    does in line; host_ms: the step less device_ms."""
    engine = stubbed_engine(cfg, batch, context, HOST_MAX_TOKENS, stream)
    if penalty:  # Qwen2.5-Instruct's generation_config default
        for seq in engine.scheduler.running:
            seq.params = replace(seq.params, repetition_penalty=1.05)
    for _ in range(3):  # warm-up
        engine.step()
    by_step = []
    with phase_timers(engine, cfg.device) as spent:
        for _ in range(steps):
            for phase in spent:
                spent[phase] = 0.0
            start = synced_clock(cfg.device)
            engine.step()
            step = dict(spent, step=synced_clock(cfg.device) - start)
            step["device"] = (step["sample"] + step["invalid_logits"] + step["penalty_rows"]
                              + step["count_sampled"])
            step["host"] = step["step"] - step["device"]
            by_step.append(step)
    result = dict(batch=batch, context=context, repetition_penalty=penalty, stream=stream)
    for phase in by_step[0]:
        result[f"{phase}_ms"] = 1e3 * float(np.median([step[phase] for step in by_step]))
    result["host_warm_ms"] = None  # a penalty's (batch, vocab) work cannot be handed over
    if not penalty:
        result["host_warm_ms"] = warm_host_ms(engine, cfg.device, steps)
    assert len(engine.scheduler.running) == batch, "a sequence ended while it was timed"
    return result


def warm_host_ms(engine: Engine, device: str, steps: int) -> float:
    """The median ms of `steps` decode steps with sample() handed its result (stub_sample):
    the host's work alone, with no (batch, vocab) pass between steps to evict the host's data
    from the CPU's caches, as a GPU runs that pass in its own memory. On a CPU, host_ms
    carries those misses (at batch 256, 51 MB of logits read a step), the more of them the
    more memory the sequences' tokens spread over: at a longer context."""
    given = partial(stub_sample, engine.model)
    times = []
    with mock.patch.object(model_runner, "sample", given), \
            mock.patch.object(model_runner, "invalid_logits", stub_invalid_logits):
        for _ in range(steps):
            start = synced_clock(device)
            engine.step()
            times.append(synced_clock(device) - start)
    return 1e3 * float(np.median(times))


DETOKENIZER_CHARS = (1000, 16000, 64000)  # a request's text not yet returned, in characters


def detokenizer_cost(cfg: BenchConfig, tokens: int = 5000) -> list[dict]:
    """Microseconds Detokenizer.append takes a token (the byte tokenizer's: a character each)
    once a request holds `chars` characters it has not returned (one that does not stream
    returns none until it ends), without a stop string and with one. A token should cost its
    own text, whatever came before it."""
    tokenizer = byte_tokenizer()
    num_chars = max(DETOKENIZER_CHARS) + tokens  # the longest text kept, then the timed tokens
    text = (b"word " * num_chars)[:num_chars]
    token_ids = [tokenizer.token_id(bytes([byte])) for byte in text]
    rows = []
    for stop in ([], ["the end"]):
        for chars in DETOKENIZER_CHARS:
            detokenizer = Detokenizer(tokenizer, stop)
            for token in token_ids[:chars]:
                detokenizer.append(token)
            start = time.perf_counter()
            for token in token_ids[chars:chars + tokens]:
                detokenizer.append(token)
            seconds = time.perf_counter() - start
            rows.append(dict(chars=chars, stop_strings=len(stop),
                             us_per_token=1e6 * seconds / tokens))
    return rows


def detokenizer_table(rows: list[dict]) -> str:
    return table("Detokenizer.append, us a token, by characters not yet returned", rows,
                 "chars stop_strings us_per_token")


# ----------------------------------------------------------------------------- attention kernel

def decode_attention_inputs(cfg: BenchConfig, shape: str, batch: int, context: int) -> tuple:
    """One decode's attention for `batch` sequences of `context` tokens at a KERNEL_SHAPES head
    shape, each K/V block shuffled in the cache: q, k_cache, v_cache, the metadata (its
    decodes marked: num_decodes = batch), and the block table's order of blocks. bf16 on CUDA,
    fp32 on a CPU."""
    num_heads, num_kv_heads, head_dim = KERNEL_SHAPES[shape]
    device = cfg.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    blocks_per_seq = cdiv(context, cfg.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, cfg.block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(cfg.seed)
    block_tables = torch.randperm(num_blocks, generator=generator).view(batch, -1)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device, torch.int32),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, num_decodes=batch)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, meta, block_tables.to(device).flatten()


def contiguous_attention(q, k_cache, v_cache, by_sequence, context: int):
    """torch's SDPA on the same K/V, gathered contiguous a sequence, as a function of nothing:
    (batch, H, D) when called."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[by_sequence].view(batch, -1, num_kv_heads, head_dim)[:, :context]
    v = v_cache[by_sequence].view(batch, -1, num_kv_heads, head_dim)[:, :context]
    # a K/V head's G query heads as G queries: one problem of Hkv heads, as the CPU path poses
    # it, which every SDPA backend takes (enable_gqa is not every backend's)
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    dense = partial(F.scaled_dot_product_attention, grouped_q, k.transpose(1, 2).contiguous(),
                    v.transpose(1, 2).contiguous(), scale=head_dim ** -0.5)
    return lambda: dense().reshape(batch, num_heads, head_dim)  # a GPU's may be strided


@torch.inference_mode()
def kernel_step(cfg: BenchConfig, shape: str, batch: int, context: int) -> dict:
    """One decode's attention (decode_attention_inputs') by each of --kernel-paths: the Triton
    kernel split over each context (split) and one program a sequence and K/V head
    (unsplit), both as paged_attention launches them (in Triton's interpreter on a CPU), and
    SDPA on the K/V made contiguous; each one's microseconds (cold_l2_ms), GB/s of K/V read
    (every K and V of every sequence, once) and share of the HBM peak; each paged path's
    largest difference from SDPA's result (the same attention, or the figures mean nothing);
    and the splits the split path launched on this device."""
    q, k_cache, v_cache, meta, by_sequence = decode_attention_inputs(cfg, shape, batch, context)
    scale = q.shape[2] ** -0.5
    paths = {"split": partial(paged_attention, q, k_cache, v_cache, meta, scale),
             "unsplit": partial(paged_attention, q, k_cache, v_cache,
                                replace(meta, num_decodes=0), scale),
             "sdpa": contiguous_attention(q, k_cache, v_cache, by_sequence, context)}
    num_kv_heads = k_cache.shape[2]
    grids = launch_grids(meta, num_kv_heads, q.shape[1] // num_kv_heads, cfg.block_size,
                         device_num_sms(q.device))
    kv_bytes = 2 * batch * context * k_cache[0, 0].nbytes
    peak = hbm_peak_gb_s(cfg.device)
    row = dict(shape=shape, batch=batch, context=context, kv_mb=kv_bytes / 1e6,
               splits=grids.decode[2], hbm_peak_gb_s=peak)
    want = paths["sdpa"]()
    for path in cfg.kernel_paths:
        if path != "sdpa":
            row[f"{path}_max_abs_diff"] = (paths[path]() - want).abs().max().item()
        ms = cold_l2_ms(paths[path], cfg.device, cfg.reps)
        row |= {f"{path}_us": ms * 1e3, f"{path}_gb_s": kv_bytes / ms / 1e6,
                f"{path}_of_peak": share_of(kv_bytes / ms / 1e6, peak)}
    return row


def kernel_sweep(cfg: BenchConfig) -> list[dict]:
    return [emit(cfg, "kernel", kernel_step(cfg, shape, batch, context))
            for shape in cfg.kernel_shapes for context in cfg.kernel_contexts
            for batch in cfg.kernel_batches]


def kernel_table(rows: list[dict]) -> str:
    paths = [path for path in KERNEL_PATHS if f"{path}_us" in rows[0]]
    keys = " ".join(f"{path}_us {path}_gb_s {path}_of_peak" for path in paths)
    return table("Decode attention over the paged cache: us (L2 cold on CUDA), GB/s of K/V read, "
                 "share of the HBM peak; split: the decode kernel (splits: its programs a "
                 "context), unsplit: a program a sequence and K/V head, sdpa: torch's on "
                 "contiguous K/V", rows, f"shape batch context kv_mb splits {keys}")


# ----------------------------------------------------------------------------- step and GEMMs

WARMUP_STEPS = 3  # decode steps before any is timed: Triton's compiles, cuBLAS's choices
STEP_ROUNDS = 5   # --step-gemms: rounds of reps // STEP_ROUNDS steps, the step's median round


def shape_checkpoint(name: str, device: str, seed: int) -> Checkpoint:
    """Seeded random weights of SHAPES[name] (or a preset's shape), drawn on the device (1.2B
    values take a GPU a moment, a CPU seconds), in bf16 on CUDA and fp32 on a CPU, served with
    a stub tokenizer of the whole vocabulary: a step's logits and sampling are as wide as the
    real model's."""
    config = SHAPES[name] if name in SHAPES else PRESETS[name]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(config)
    tokenizer = stub_tokenizer(config.vocab_size)
    return Checkpoint(model.to(device, dtype).eval(), tokenizer, [256], dtype)  # 256: its EOT


def context_len(engine: Engine) -> float:
    """The mean tokens of the engine's running sequences."""
    return float(np.mean([len(seq.token_ids) for seq in engine.scheduler.running]))


def step_modes(cfg: BenchConfig) -> list[str]:
    """--step-modes that run here: graphed needs CUDA (a CPU runs the eager half, saying so)."""
    if cfg.device.startswith("cuda") or "graphed" not in cfg.step_modes:
        return list(cfg.step_modes)
    print(f"--step-gemms: graphed steps skipped: CUDA graphs need CUDA, this is {cfg.device}",
          file=sys.stderr)
    return [mode for mode in cfg.step_modes if mode != "graphed"]


def step_engine(cfg: BenchConfig, checkpoint: Checkpoint | None, batch: int, mode: str,
                more: int) -> Engine:
    """engine_in_decode's engine for --step-gemms: batch sequences of --prompt-len tokens
    decoding, room for `more` steps, eager or graphed. A shape's engine serves up to
    STEP_MAX_MODEL_LEN tokens whatever the batch (its block tables, and the decode kernel's
    splits, as a server's), its cache holding at least that."""
    overrides = dict(enforce_eager=mode == "eager")
    if checkpoint is not None:
        max_model_len = min(checkpoint.model.config.n_positions, STEP_MAX_MODEL_LEN)
        needed = decode_kv_tokens(cfg, batch, cfg.prompt_len, 1, more)
        overrides |= dict(max_model_len=max_model_len,
                          kv_cache_tokens=max(needed, max_model_len))
    return engine_in_decode(cfg, batch, cfg.prompt_len, 1, more, checkpoint, **overrides)


def free_device_memory() -> None:
    """Collect what the last engine left (its cache, its graphs' pool), so the next one's
    memory is there: on CUDA, torch's allocator would otherwise keep it cached."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def read_bytes(model, batch: int, context: float) -> tuple[int, float]:
    """(weight bytes, K/V bytes) a decode step of `batch` sequences of `context` tokens reads:
    every parameter once (a tied embedding is the LM head's, read whole; an untied one gives
    a row a sequence, not counted), and every sequence's K/V in every layer."""
    untied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
              and m.weight is not model.lm_head.weight}
    weights = sum(p.nbytes for p in model.parameters() if id(p) not in untied)
    c = model.config
    dtype = model.lm_head.weight.dtype
    return weights, batch * context * kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim, dtype)


def captured(fn, device: str):
    """fn's launches replayed from a CUDA graph (on CUDA; elsewhere fn itself): the GEMMs of a
    graphed step are timed as that step runs them, without a launch each."""
    if not device.startswith("cuda"):
        return fn
    fn()  # outside the capture: cuBLAS picks its kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.inference_mode()
def step_against_gemms(cfg: BenchConfig, checkpoint: Checkpoint | None, batch: int,
                       mode: str) -> dict:
    """A decode step of `batch` sequences of --prompt-len tokens, eager or graphed (ms, the
    median of STEP_ROUNDS rounds, --reps steps in all), against its GEMMs alone: every
    nn.Linear of the model, the LM head last, in order, each called on a (batch, in_features)
    input of the model's dtype (the LM head's fp32 logits included), launched one by one for
    an eager step and replayed from a CUDA graph for a graphed one: what the step cannot go
    below on this machine. The floor: its weight and K/V bytes (read_bytes) over the HBM peak.
    Eager only: attention's share of the step (its calls timed around, each waiting for the
    device), and of that SDPA's kernel's (a CPU's); the rest of attention is bookkeeping."""
    steps = max(1, cfg.reps // STEP_ROUNDS)
    engine = step_engine(cfg, checkpoint, batch, mode, WARMUP_STEPS + 2 * STEP_ROUNDS * steps)
    model = engine.model
    dtype = model.lm_head.weight.dtype
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype, device=cfg.device)
              for m in linears}

    def gemms() -> None:  # the products are thrown away: only their time counts
        for m in linears:
            m(inputs[m.in_features])

    gemms_as_run = gemms if mode == "eager" else captured(gemms, cfg.device)
    for _ in range(WARMUP_STEPS):
        engine.step()
    first = context_len(engine)
    step_ms, gemm_ms, shares = [], [], []  # by round
    for _ in range(STEP_ROUNDS):
        step_ms.append(1e3 * per_call(engine.step, steps, cfg.device))
        gemm_ms.append(1e3 * per_call(gemms_as_run, steps, cfg.device))
        if mode == "eager":
            shares.append(attention_shares(engine, steps, cfg.device))
    step = float(np.median(step_ms))
    gemm = float(np.median(gemm_ms))
    context = (first + context_len(engine)) / 2  # the mean over the timed steps
    weight_bytes, kv_bytes = read_bytes(model, batch, context)
    peak = hbm_peak_gb_s(cfg.device)
    floor = None if peak is None else (weight_bytes + kv_bytes) / peak / 1e6
    attention, sdpa = np.median(shares, axis=0).tolist() if shares else (None, None)
    return dict(mode=mode, batch=batch, context=context, step_ms=step, gemm_ms=gemm,
                step_over_gemms=step / gemm, floor_ms=floor,
                floor_over_step=None if floor is None else floor / step,
                weight_mb=weight_bytes / 1e6, kv_mb=kv_bytes / 1e6, attention_share=attention,
                sdpa_share=sdpa, linears=len(linears), threads=torch.get_num_threads())


def attention_shares(engine: Engine, steps: int, device: str) -> tuple[float, float]:
    """The shares of `steps` eager decode steps spent in attention (each call timed around,
    waiting for the device) and, within it, in SDPA's kernel (the CPU path's)."""
    spent = {"attention": 0.0, "sdpa": 0.0}  # seconds inside each, in the timed steps
    attention = engine.model_runner.attention
    timed_sdpa = partial(timed_call, F.scaled_dot_product_attention, spent, "sdpa", device)
    engine.model_runner.attention = partial(timed_call, attention, spent, "attention", device)
    try:
        with mock.patch.object(F, "scaled_dot_product_attention", timed_sdpa):
            timed = per_call(engine.step, steps, device)
    finally:
        engine.model_runner.attention = attention
    return spent["attention"] / steps / timed, spent["sdpa"] / steps / timed


# What the CUDA runtime and driver calls that launch a kernel and a graph are named in
# torch.profiler's events (Triton launches through the driver's cuLaunchKernel)
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                       "cuLaunchKernelEx")
GRAPH_LAUNCH_CALL = "cudaGraphLaunch"


@torch.inference_mode()
def step_kernels(cfg: BenchConfig, checkpoint: Checkpoint | None, batch: int,
                 mode: str) -> dict:
    """What one decode step of `batch` sequences launches, after WARMUP_STEPS: the decode
    graphs it replays (counted at ModelRunner.graphs), and on CUDA, from torch.profiler's
    events over the step, the kernels the host launches itself (a graphed step's outside its
    graph: embedding's inputs, logits, sampling), the graphs it launches, and the kernels and
    copies the device ran (a graph's kernels among them, as CUPTI reports them); on a CPU the
    ATen calls it makes."""
    engine = step_engine(cfg, checkpoint, batch, mode, WARMUP_STEPS + 2)
    for _ in range(WARMUP_STEPS):
        engine.step()
    replays = []
    graphs = engine.model_runner.graphs
    for size, replay in graphs.items():
        graphs[size] = partial(counted_call, replay, replays)
    row = dict(mode=mode, batch=batch)
    if not cfg.device.startswith("cuda"):
        counter = OpCounter()
        counter.ops = []
        with counter:
            engine.step()
        return row | dict(graph_replays=len(replays), aten_calls=len(counter.ops))
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        engine.step()
        torch.cuda.synchronize()
    host = [e.name for e in profiler.events() if e.device_type == DeviceType.CPU]
    ran = [e.name for e in profiler.events() if e.device_type == DeviceType.CUDA]
    copies = sum(name.startswith(("Memcpy", "Memset")) for name in ran)
    return row | dict(graph_replays=len(replays),
                      kernel_launches=sum(name in KERNEL_LAUNCH_CALLS for name in host),
                      graph_launches=host.count(GRAPH_LAUNCH_CALL),
                      device_kernels=len(ran) - copies, device_copies=copies)


def counted_call(fn, calls: list, *args):
    """fn(*args), its call appended to `calls`."""
    calls.append(args)
    return fn(*args)


def step_sweep(cfg: BenchConfig) -> dict:
    """--step-gemms: step_against_gemms for every shape (or --preset, --model), batch and
    mode, then step_kernels for each: after every timing, so that no timing follows a
    profiler's session (CUPTI, once started, can slow later launches). Each row to --jsonl
    as it is measured."""
    found = dict(step_gemms=[], step_kernels=[])
    modes = step_modes(cfg)
    for measurement, measure in (("step_gemms", step_against_gemms),
                                 ("step_kernels", step_kernels)):
        for shape in cfg.step_shapes or (None,):
            checkpoint = shape_checkpoint(shape, cfg.device, cfg.seed) if shape else None
            model = dict(model=shape or cfg.model or cfg.preset)
            for batch in cfg.step_batches:
                for mode in modes:
                    row = model | measure(cfg, checkpoint, batch, mode)
                    found[measurement].append(emit(cfg, measurement, row))
                    free_device_memory()
            del checkpoint
            free_device_memory()
    return found


def step_gemms_table(found: dict) -> str:
    steps = table("Decode steps against their GEMMs alone (ms; eager: launched one by one, "
                  "graphed: from CUDA graphs) and the floor (weight + K/V bytes / HBM peak)",
                  found["step_gemms"], "model mode batch context step_ms gemm_ms step_over_gemms "
                  "floor_ms floor_over_step attention_share sdpa_share")
    on_cuda = "kernel_launches" in (found["step_kernels"] or [{}])[0]
    counts = ("graph_replays kernel_launches graph_launches device_kernels device_copies"
              if on_cuda else "graph_replays aten_calls")
    kernels = table("What one decode step launches", found["step_kernels"],
                    f"model mode batch {counts}")
    return steps + "\n\n" + kernels


# ----------------------------------------------------------------------------- ops a layer

class OpCounter(TorchDispatchMode):
    """The ATen ops torch runs while `ops` is a list (views included), by name, into it."""
    ops = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.ops is not None:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def layer_op_counts(model, device: str):
    """While open, each layer's forward records what it ran into the list it yields, a list
    of names per call: on CUDA its kernels (torch.profiler's CUDA events, each waited for),
    elsewhere its ATen calls (OpCounter). Its hooks come off as it closes."""
    runs = []
    counter = OpCounter()
    profiler = None

    def started(*_) -> None:  # a forward pre-hook
        nonlocal profiler
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.start()
        counter.ops = []

    def ended(*_) -> None:  # a forward hook
        ops, counter.ops = counter.ops, None
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.stop()
            ops = [e.name for e in profiler.events() if e.device_type == DeviceType.CUDA]
        runs.append(ops)

    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(started))
        handles.append(layer.register_forward_hook(ended))
    try:
        with counter if not device.startswith("cuda") else contextlib.nullcontext():
            yield runs
    finally:
        for handle in handles:
            handle.remove()


def decode_inputs(model, batch: int, context: int, block_size: int, device: str) -> tuple:
    """GPT.forward's arguments for one decode step of `batch` sequences of `context` tokens
    (the newest the one fed), each in blocks of its own, the KV cache zeros: input_ids,
    positions, meta, k_caches, v_caches."""
    c = model.config
    blocks = cdiv(context, block_size)
    dtype = model.lm_head.weight.dtype
    shape = (c.n_layer, batch * blocks, block_size, c.n_kv_head, c.head_dim)
    k_caches = torch.zeros(shape, dtype=dtype, device=device)
    v_caches = torch.zeros(shape, dtype=dtype, device=device)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    last = context - 1  # the new token's position
    meta = AttentionMetadata(
        slot_mapping=(tables[:, last // block_size] * block_size + last % block_size).long(),
        block_tables=tables,
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, num_decodes=batch)
    input_ids = torch.randint(c.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    positions = torch.full((batch,), last)
    return input_ids.to(device), positions.to(device), meta, k_caches, v_caches


@torch.inference_mode()
def count_ops(cfg: BenchConfig) -> dict:
    """What each layer runs in one decode step of --max-num-seqs sequences of --prompt-len
    tokens through GPT.forward (the engine's, with its attention), after a step to warm up
    (on CUDA: torch.compile's): on CUDA, in bf16, the kernels each launches; on a CPU, in fp32,
    the ATen calls it makes (views included). The first layer is the odd one out: its input
    has no residual to add, and on a CPU it plans the step's attention. `ops`: the last
    layer's, by name."""
    on_cuda = cfg.device.startswith("cuda")
    model = load_model(cfg.model or None, None if cfg.model else cfg.preset, cfg.seed,
                       cfg.device, torch.bfloat16 if on_cuda else torch.float32).model.eval()
    attention = select_attention("auto", cfg.device)
    step = partial(decode_inputs, model, cfg.max_num_seqs, cfg.prompt_len, cfg.block_size,
                   cfg.device)
    model(*step(), attention)  # a warm-up: on CUDA, torch.compile's
    inputs = step()  # new metadata: the step plans its attention anew
    with layer_op_counts(model, cfg.device) as runs:
        model(*inputs, attention)
    return dict(model=cfg.model or cfg.preset, device=cfg.device,
                dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
                counted="cuda_kernels" if on_cuda else "aten_calls", batch=cfg.max_num_seqs,
                context=cfg.prompt_len, per_layer=[len(ops) for ops in runs],
                ops=dict(collections.Counter(runs[-1])))


def count_ops_table(figures: dict) -> str:
    rows = [dict(layer=i, count=n) for i, n in enumerate(figures["per_layer"])]
    title = (f"{figures['counted']} a layer, one decode step of {figures['model']} on "
             f"{figures['device']} in {figures['dtype']}, batch {figures['batch']}, context "
             f"{figures['context']}")
    return table(title, rows, "layer count")


# ----------------------------------------------------------------------------- speculative decoding

def text_passages(path: str, n: int, lines: int = 6) -> list[str]:
    """n passages of `lines` lines each, evenly spread through the text at `path` (this
    file's docstring where it is absent)."""
    text = __doc__
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    all_lines = [line for line in text.splitlines() if line.strip()]
    step = max(1, (len(all_lines) - lines) // n)
    return ["\n".join(all_lines[i * step:i * step + lines]) for i in range(n)]


def spec_prompts(cfg: BenchConfig, engine: Engine, workload: str, n: int) -> list[str]:
    """n prompts of a workload. copy: a passage to repeat (an instruct model is asked to; a
    base model gets it once and then its first line again, which it goes on copying); free:
    a story to write (a base model: a passage's first line to go on from)."""
    passages = text_passages(cfg.spec_text, n)
    template = engine.chat_template
    prompts = []
    for i, passage in enumerate(passages):
        first_line = passage.splitlines()[0]
        if template is None and workload == "copy":
            prompts.append(f"{passage}\n\n{first_line}\n")
        elif template is None:
            prompts.append(first_line + "\n")
        elif workload == "copy":
            request = f"Repeat the following passage exactly, word for word:\n\n{passage}"
            prompts.append(template.render([dict(role="user", content=request)], {}))
        else:
            request = f"Write a short story about {SPEC_TOPICS[i % len(SPEC_TOPICS)]}."
            prompts.append(template.render([dict(role="user", content=request)], {}))
    return prompts


def spec_run(engine: Engine, prompts: list[str], batch: int, max_tokens: int) -> dict:
    """Serve prompts `batch` at a time, greedy: output tokens/s, and the speculation counters."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine.stats = EngineStats()  # this run's counters alone
    start = time.perf_counter()
    outputs = {}
    for first in range(0, len(prompts), batch):
        for prompt in prompts[first:first + batch]:
            engine.add_request(prompt, params, stream=False)
        while engine.has_unfinished():
            for output in engine.step():
                outputs[output.request_id] = output.outputs[0].token_ids
    wall = time.perf_counter() - start
    stats = engine.stats
    drafts = stats.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens
    acceptance_rate = None  # accepted / drafted tokens
    mean_accepted_length = None  # accepted tokens a verification
    if drafts:
        acceptance_rate = accepted / drafts
        mean_accepted_length = accepted / stats.spec_decode_num_drafts
    return dict(tokens_per_s=stats.num_generated_tokens / wall, steps=stats.num_steps,
                output_tokens=stats.num_generated_tokens, draft_tokens=drafts,
                acceptance_rate=acceptance_rate, mean_accepted_length=mean_accepted_length,
                drafts_wasted=drafts - accepted,
                outputs=[outputs[i] for i in sorted(outputs, key=int)])


def speculative_sweep(cfg: BenchConfig) -> list[dict]:
    """Each workload at each batch size: the engine without speculation, then with each of
    --spec-configs, on the same prompts (4 a batch size's worth, at least 4); greedy, so each
    must give the same tokens (checked)."""
    base = dict(model=cfg.model or None, preset=None if cfg.model else cfg.preset,
                device=cfg.device, seed=cfg.seed)
    engines = {"none": Engine(EngineConfig(**base))}
    for spec in cfg.spec_configs:
        engines[spec] = Engine(EngineConfig(**base, speculative_config=spec))
    rows = []
    for workload in SPEC_WORKLOADS:
        for batch in cfg.spec_batches:
            n = max(4, batch)
            prompts = spec_prompts(cfg, engines["none"], workload, n)
            without = None  # the run without speculation: its outputs and tokens/s
            for name, engine in engines.items():
                figures = spec_run(engine, prompts, batch, cfg.spec_max_tokens)
                outputs = figures.pop("outputs")
                without = without or (outputs, figures["tokens_per_s"])
                speedup = figures["tokens_per_s"] / without[1]
                row = dict(workload=workload, batch=batch, speculative_config=name, **figures,
                           speedup=speedup, same_tokens=outputs == without[0])
                rows.append(emit(cfg, "speculative", row))
    return rows


def speculative_table(rows: list[dict]) -> str:
    return table("speculative decoding: greedy output tokens/s without and with drafts", rows,
                 "workload batch speculative_config tokens_per_s speedup acceptance_rate "
                 "mean_accepted_length drafts_wasted steps same_tokens")


def host_overhead(cfg: BenchConfig) -> list[dict]:
    """Each batch and context: plain, with a penalty, and plain without streaming (one output
    a request, as LLM.generate asks)."""
    variants = [(False, True), (True, True), (False, False)]  # (penalty, stream)
    return [host_step(cfg, batch, context, penalty, stream) for context in cfg.host_contexts
            for batch in cfg.host_batches for penalty, stream in variants]


# --quantization's rows: name -> (quantization, kv_cache_dtype); the first is the reference
QUANT_SCHEMES = {"unquantized": (None, "auto"), "int8": ("int8", "auto"), "fp8": ("fp8", "auto"),
                 "fp8 KV": (None, "fp8"), "fp8 + fp8 KV": ("fp8", "fp8")}


def quant_engine(cfg: BenchConfig, quantization: str | None, kv_cache_dtype: str) -> Engine:
    return Engine(EngineConfig(model=cfg.model or None, device=cfg.device, dtype=cfg.quant_dtype,
                               quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                               max_num_seqs=max(cfg.quant_batches + (cfg.quant_prompts,)),
                               seed=cfg.seed))


def run_requests(engine: Engine, prompts: list, params: SamplingParams) -> list:
    """Every prompt's whole output, in order, served together."""
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            done[output.request_id] = output
    return [done[i] for i in ids]


def held_out_windows(cfg: BenchConfig, engine: Engine) -> list[list[int]]:
    """--quant-eval-bytes of the text's last 10% (train.py's held-out split), as token ids in
    windows of the model's context: each is a prompt whose tokens are scored."""
    text = __doc__
    if os.path.exists(cfg.spec_text):
        with open(cfg.spec_text, encoding="utf-8") as f:
            text = f.read()
    held_out = text[int(len(text) * 0.9):][:cfg.quant_eval_bytes]
    ids = engine.tokenizer.encode(held_out)
    window = engine.max_model_len - 1
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def prompt_logprob_list(output) -> list[float]:
    """Each prompt token's own log-probability (the first has none)."""
    return [next(iter(entry.values())) for entry in output.prompt_logprobs[1:]]


def decode_tokens_per_s(engine: Engine, prompts: list[str], batch: int, tokens: int) -> float:
    """Generated tokens a second for `batch` sequences of `tokens` tokens each, served together
    (their short prompts' prefill included), after a warm-up run."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    batch_prompts = [prompts[i % len(prompts)][:64] for i in range(batch)]
    run_requests(engine, batch_prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    run_requests(engine, batch_prompts, params)
    return batch * tokens / (time.perf_counter() - start)


def quant_row(cfg: BenchConfig, engine: Engine, prompts: list[str], windows: list) -> dict:
    """One scheme's figures, and its raw tokens and log-probabilities for the comparison."""
    linears = {m for m, _ in projections(engine.model).values()}
    projection_bytes = sum(m.weight.nbytes + m.weight_scale.nbytes if m.quant_method else
                           m.weight.nbytes for m in linears)
    params = SamplingParams(max_tokens=cfg.quant_tokens, temperature=0, ignore_eos=True,
                            prompt_logprobs=0)
    outputs = run_requests(engine, prompts, params)
    scored = run_requests(engine, windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    held_out = [lp for output in scored for lp in prompt_logprob_list(output)]
    row = dict(weight_bytes=engine.model_weights_bytes, projection_bytes=projection_bytes,
               projection_vs_bf16=projection_bytes / sum(m.weight.numel() * 2 for m in linears),
               kv_bytes_per_token=engine.model_runner.kv_bytes_per_token,
               kv_tokens_per_gib=engine.kv_tokens_per_gib,
               perplexity=math.exp(-sum(held_out) / len(held_out)))
    for batch in cfg.quant_batches:
        row[f"decode_tok_s_b{batch}"] = decode_tokens_per_s(engine, prompts, batch,
                                                            cfg.quant_tokens)
    raw = dict(tokens=[o.outputs[0].token_ids for o in outputs],
               logprobs=[prompt_logprob_list(o) for o in outputs])
    return row | {"raw": raw}


def agreement(row: dict, reference: dict) -> dict:
    """Greedy tokens and prompt log-probabilities against the unquantized row's."""
    tokens, expected = row["raw"]["tokens"], reference["raw"]["tokens"]
    first_differences = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                              len(want)) for got, want in zip(tokens, expected)]
    deltas = [abs(a - b) for got, want in zip(row["raw"]["logprobs"],
                                              reference["raw"]["logprobs"])
              for a, b in zip(got, want)]
    return dict(greedy_identical=sum(got == want for got, want in zip(tokens, expected)),
                mean_first_difference=sum(first_differences) / len(first_differences),
                mean_abs_delta_logprob=sum(deltas) / len(deltas),
                max_abs_delta_logprob=max(deltas))


def quantization_sweep(cfg: BenchConfig) -> dict:
    """Each of QUANT_SCHEMES on one model: memory, speed, and accuracy against the first."""
    rows = {}
    prompts = windows = None
    for name, (quantization, kv_cache_dtype) in QUANT_SCHEMES.items():
        engine = quant_engine(cfg, quantization, kv_cache_dtype)
        if prompts is None:
            prompts = text_passages(cfg.spec_text, cfg.quant_prompts, lines=4)
            windows = held_out_windows(cfg, engine)
        rows[name] = quant_row(cfg, engine, prompts, windows)
        del engine
        gc.collect()
    reference = rows[next(iter(QUANT_SCHEMES))]
    for name, row in rows.items():
        row |= agreement(row, reference)
        row["kv_capacity_vs_unquantized"] = reference["kv_bytes_per_token"] / \
            row["kv_bytes_per_token"]  # tokens at equal memory
        row["perplexity_vs_unquantized"] = row["perplexity"] / reference["perplexity"]
    for row in rows.values():
        del row["raw"]
    return dict(model=cfg.model or "shipped", dtype=cfg.quant_dtype, prompts=cfg.quant_prompts,
                tokens=cfg.quant_tokens, rows=[dict(scheme=name) | row
                                               for name, row in rows.items()])


def quantization_table(found: dict) -> str:
    batches = " ".join(key for key in found["rows"][0] if key.startswith("decode_tok_s"))
    keys = ("scheme weight_bytes projection_vs_bf16 kv_bytes_per_token "
            f"kv_capacity_vs_unquantized {batches} greedy_identical mean_first_difference "
            "mean_abs_delta_logprob max_abs_delta_logprob perplexity perplexity_vs_unquantized")
    return table(f"Quantization on {found['model']} ({found['dtype']}): greedy identical of "
                 f"{found['prompts']} prompts over {found['tokens']} tokens; log-probabilities "
                 "of their prompt tokens against the unquantized model's; perplexity on the "
                 "held-out text", found["rows"], keys)


def host_table(rows: list[dict]) -> str:
    keys = ("batch context repetition_penalty stream schedule_ms inputs_ms sampling_tensors_ms "
            "penalties_ms penalty_rows_ms invalid_logits_ms count_sampled_ms update_ms record_ms "
            "host_ms device_ms host_warm_ms")
    return table("Host work per decode step, ms (medians; device: sample(), invalid_logits(), "
                 "penalty_rows (the "
                 "penalty state's gathers, within penalties) and count_sampled; host_warm: "
                 "the step with sample() handed its result, no (batch, vocab) pass evicting "
                 "the host's caches, as on a GPU)", rows, keys)


def hardware_big(cfg: BenchConfig) -> dict:
    """The hardware view of --hardware-preset's shape, on all of torch's threads."""
    big = replace(cfg, preset=cfg.hardware_preset, threads=0)
    model = make_engine(big, kv_cache_tokens=big.block_size).model
    return hardware_view(big, model, (1, 8, 32, 64), steps=8)


def versions(cfg: BenchConfig) -> dict:
    """What the figures were measured on: on CUDA the GPU too, and its HBM peak if known."""
    found = dict(python=platform.python_version(), torch=torch.__version__,
                 numpy=np.__version__, device=cfg.device, threads=torch.get_num_threads(),
                 cpu_count=os.cpu_count(), processor=platform.processor(),
                 load_average_start=os.getloadavg())
    if cfg.device.startswith("cuda"):
        device = torch.device(cfg.device)
        found |= dict(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                      sms=device_num_sms(device), hbm_peak_gb_s=hbm_peak_gb_s(cfg.device))
    return found


# The flags of the measurements that run alone (run_single_measurement), each BenchConfig's
SINGLE_MEASUREMENTS = ("lm_head", "host_overhead", "detokenizer", "step_gemms", "kernel",
                       "count_ops", "sampling", "speculative", "structured_output", "goodput",
                       "swap", "lora", "quantization", "beam_search", "disagg",
                       "tensor_parallel")


def tensor_parallel_sweep(cfg: BenchConfig) -> list[dict]:
    """Each batch at each tensor_parallel_size: `batch` random prompts prefilled, then
    tp_steps decode steps timed; the all-reduces, the LM head's broadcast and gather, and the
    channel from rank 0's counters (tensor_parallel.CommStats). Greedy: every size must give N = 1's tokens (checked)."""
    rows = []
    for batch in cfg.tp_batches:
        first = None  # N = 1's tokens
        for size in cfg.tp_sizes:
            row, tokens = tensor_parallel_run(cfg, size, batch)
            first = first or tokens
            rows.append(emit(cfg, "tensor_parallel", row | dict(same_tokens=tokens == first)))
    return rows


def tensor_parallel_run(cfg: BenchConfig, size: int, batch: int) -> tuple[dict, list]:
    """One engine of `size` ranks: its decode steps' figures, and every request's tokens."""
    engine = Engine(EngineConfig(model=cfg.model or None, preset=None if cfg.model else
                                 cfg.preset, device=cfg.device, seed=cfg.seed,
                                 tensor_parallel_size=size, max_num_seqs=max(batch, 1)))
    generator = torch.Generator().manual_seed(cfg.seed)
    # enough that none finishes in the timed steps (the first ones prefilled decode sooner)
    params = SamplingParams(max_tokens=2 * cfg.tp_steps + 1, temperature=0, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (cfg.prompt_len,), generator=generator)
        engine.add_request(prompt.tolist(), params, stream=False)
    outputs = {}  # the prefills, until each sequence has sampled a token
    while any(len(seq.token_ids) == seq.num_prompt_tokens for seq in engine.seqs.values()):
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    tp = engine.tensor_parallel
    if tp is not None:
        tp.comm.stats = CommStats()
    start = time.perf_counter()
    for _ in range(cfg.tp_steps):
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    step_ms = (time.perf_counter() - start) * 1e3 / cfg.tp_steps
    stats = CommStats() if tp is None else tp.comm.stats
    engine.close()
    steps = cfg.tp_steps
    row = dict(tensor_parallel_size=size, batch=batch, step_ms=step_ms,
               all_reduces_a_step=stats.num_all_reduces / steps,
               all_reduce_kib_a_step=stats.all_reduce_bytes / steps / 1024,
               all_reduce_ms_a_step=stats.all_reduce_seconds * 1e3 / steps,
               all_reduce_share=stats.all_reduce_seconds * 1e3 / steps / step_ms,
               logits_gathers_a_step=stats.num_gathers / steps,
               logits_kib_a_step=stats.gather_bytes / steps / 1024,
               logits_ms_a_step=stats.gather_seconds * 1e3 / steps,
               channel_ms_a_step=stats.channel_seconds * 1e3 / steps,
               tokens_per_s=batch * 1e3 / step_ms)
    return row, [outputs[i] for i in sorted(outputs, key=int)]


def tensor_parallel_table(rows: list[dict]) -> str:
    return table("tensor parallelism: a decode step at N ranks (each one thread), its "
                 "all-reduces (rank 0's wait included) and the step channel (rank 0's send)",
                 rows, "tensor_parallel_size batch step_ms tokens_per_s all_reduces_a_step "
                 "all_reduce_kib_a_step all_reduce_ms_a_step all_reduce_share "
                 "logits_kib_a_step logits_ms_a_step channel_ms_a_step same_tokens")


def run_single_measurement(cfg: BenchConfig) -> bool:
    """The measurement a flag asks for alone (SINGLE_MEASUREMENTS): run it, print its table,
    write its figures to --out (and, --jsonl, the versions first, then each row as it is
    measured); False if none is asked."""
    modes = {"lm_head": (lm_head_cost, lm_head_table),
             "host_overhead": (host_overhead, host_table),
             "detokenizer": (detokenizer_cost, detokenizer_table),
             "step_gemms": (step_sweep, step_gemms_table),
             "kernel": (kernel_sweep, kernel_table),
             "count_ops": (count_ops, count_ops_table),
             "sampling": (lm_head_and_sampling, sampling_table),
             "speculative": (speculative_sweep, speculative_table),
             "structured_output": (structured_output_cost, structured_output_table),
             "goodput": (service_levels, service_levels_table),
             "swap": (swap_against_recompute, swap_table),
             "lora": (lora_sweep, lora_table),
             "quantization": (quantization_sweep, quantization_table),
             "beam_search": (beam_search_figures, beam_search_table),
             "disagg": (disaggregation, disagg_table),
             "tensor_parallel": (tensor_parallel_sweep, tensor_parallel_table)}
    for name in SINGLE_MEASUREMENTS:
        if not getattr(cfg, name):
            continue
        measure, draw = modes[name]
        emit(cfg, "versions", versions(cfg))
        figures = measure(cfg)
        print(draw(figures))
        with open(cfg.out, "w") as f:
            json.dump({name: figures, "versions": versions(cfg)}, f, indent=1)
        return True
    return False


def main(argv=None) -> None:
    cfg = parse_args(argv)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or default_threads)
    if run_single_measurement(cfg):
        return
    workload = make_workload(cfg, cfg.online_requests, cfg.online_limit, shared=True)
    result = dict(config=asdict(cfg), offline={}, online={}, online_lengths=workload[1],
                  versions=versions(cfg))
    start = time.perf_counter()

    def progress(message: str) -> None:  # a line on stderr, with the seconds since the start
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    if not cfg.url:
        run_in_process(cfg, result, progress)
    try:
        result["online"] = online(cfg, workload, progress)
    except ConnectionError as e:  # the server at --url: one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.hardware_preset and not cfg.url:  # the bigger shape, on all cores
        torch.set_num_threads(default_threads)
        result["hardware_big"] = hardware_big(cfg)
        progress(f"hardware view, {cfg.hardware_preset}")
    result["wall_s"] = time.perf_counter() - start
    result["versions"]["load_average_end"] = os.getloadavg()
    print(report(result))
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

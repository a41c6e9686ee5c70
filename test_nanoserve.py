"""nanoserve's guarantees, one test each. Run: python -m pytest -q test_nanoserve.py

Everything runs on CPU, offline; the engine tests pin cpu and fp32 wherever they run, and
the Triton kernel tests also run on CUDA where there is one. Tests that need ../shared/data
skip with the reason.
"""
import asyncio
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.client import HTTPConnection, HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench
import checkpoint
import cli
import display
import kernels
import model as M
import nanoserve
import sampling
from kernels import (AttentionMetadata, paged_attention, paged_attention_cpu, paged_attention_ref,
                     store_kv)
from nanoserve import LLM, Engine, EngineConfig, accumulate
from paged_cache import BlockPool, BlockTable, cdiv, hash_block
from sampling import SamplingParams, SamplingTensors, apply_top_k_top_p, sample
from scheduler import Scheduler, Sequence, SequenceStatus
from server import MAX_BODY_BYTES, SAMPLING_FIELDS, Server, ServerConfig, render_chat, token_text
from tokenizer import (EOT, ChatTemplate, Detokenizer, Tokenizer, byte_tokenizer,
                       chat_template_environment, gpt2_byte_chars, load_chat_template,
                       load_tokenizer)

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_GPT2 = os.path.join(HERE, "..", "shared", "data", "gpt2")
needs_shared = pytest.mark.skipif(
    not os.path.isdir(SHARED_GPT2), reason="../shared/data/gpt2 (GPT-2 tokenizer files) is absent")

# Prompt lengths 1..150 bytes: single-token, shorter than a block, several blocks, longer
# than the token budgets used below (so chunked prefill really chunks).
PROMPTS = ["A", "Hello there", "The quick brown fox jumps over the lazy dog. " * 3 + "And",
           "x" * 37, "0123456789" * 6, "ROMEO: " * 5]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def tiny(**kwargs) -> LLM:
    """The tiny preset (random weights) on CPU in fp32, with a small KV cache unless set."""
    return LLM(**{"preset": "tiny", "kv_cache_tokens": 4096, "device": "cpu",
                  "dtype": "float32"} | kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaks(engine: Engine) -> None:
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not any(engine.block_pool.ref_counts)
    assert not engine.has_unfinished() and not engine.seqs


def run_to_end(engine: Engine, deltas: dict | None = None, steps: int | None = None) -> dict:
    """Step until nothing is left (or `steps` times); every request's delta outputs, in order,
    added to `deltas`."""
    deltas = {} if deltas is None else deltas
    for _ in range(steps) if steps is not None else iter(engine.has_unfinished, False):
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas


def whole_token_ids(deltas: list) -> list[int]:
    """One request's output tokens: its delta outputs added up as every front end adds them."""
    whole = {}
    for delta in deltas:
        accumulate(whole, delta)
    return whole[deltas[0].request_id].outputs[0].token_ids


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Greedy outputs of each prompt served on its own: the reference for batching tests."""
    return [token_ids(tiny().generate([p], GREEDY))[0] for p in PROMPTS]


# ----------------------------------------------------------------------------- exactness

def new_seq(engine: Engine, tokens: list[int], seq_id: str = "s") -> Sequence:
    return Sequence(seq_id, "", tokens, GREEDY, BlockTable(engine.block_pool))


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("chunks", [[45], [16, 16, 13], [7, 20, 18], [30] + [1] * 15],
                         ids=["prefill", "chunked-prefill", "uneven-chunks", "decode"])
@torch.inference_mode()
def test_paged_logits_equal_dense_forward(chunks, preset):
    """Engine.run_batch, chunk by chunk: the logits at each chunk's end equal a dense forward's
    (GPT-2's layout, and Llama's with grouped heads and RoPE)."""
    engine = tiny(preset=preset, block_size=8).engine
    tokens = torch.randint(0, 257, (sum(chunks),), generator=torch.Generator().manual_seed(0))
    dense = engine.model.forward_dense(tokens[None])[0]
    seq, paged, ends = new_seq(engine, []), [], []
    for n in chunks:
        end = seq.num_computed_tokens + n
        seq.token_ids = tokens[:end].tolist()  # ends with the chunk: it samples there
        assert seq.block_table.ensure(end)
        paged.append(engine.run_batch({seq: n}).logits[0])
        seq.num_computed_tokens, ends = end, ends + [end - 1]
    seq.block_table.release()
    rel = (torch.stack(paged) - dense[ends]).abs().max() / dense.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    assert_no_leaks(engine)


@torch.inference_mode()
def test_paged_logits_equal_dense_forward_at_every_position():
    """One run_batch over 30 sequences, the prefixes of one text: row i is position i's logits."""
    engine = tiny(block_size=8).engine
    tokens = torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(1))
    assert_paged_equals_dense_at_every_position(engine, tokens)


def assert_paged_equals_dense_at_every_position(engine: Engine, tokens: torch.Tensor) -> None:
    """One run_batch over the prefixes of tokens (T,), one sequence each: row i of its logits
    is position i's of a dense forward over tokens."""
    dense = engine.model.forward_dense(tokens[None])[0]
    seqs = [new_seq(engine, tokens[:i + 1].tolist(), str(i)) for i in range(len(tokens))]
    for seq in seqs:
        assert seq.block_table.ensure(len(seq.token_ids))
    paged = engine.run_batch({seq: len(seq.token_ids) for seq in seqs}).logits
    assert (paged - dense).abs().max() / dense.abs().max() < 1e-4


def test_block_tables_are_padded_on_the_device_to_a_multiple_of_16_columns():
    """_prepare_inputs's example: three tables end to end, [3, 7], [5, 2] and [1]."""
    tables = nanoserve.padded_block_tables(torch.tensor([3, 7, 5, 2, 1]), torch.tensor([2, 2, 1]),
                                           max_num_blocks=2)
    assert tables.dtype == torch.int32 and tables.shape == (3, 16)
    assert tables[:, :3].tolist() == [[3, 7, 0], [5, 2, 0], [1, 0, 0]] and not tables[:, 3:].any()
    assert nanoserve.padded_block_tables(torch.arange(17), torch.tensor([17]), 17).shape == (1, 32)


def test_block_tables_are_as_wide_as_the_batch_needs_not_as_max_model_len():
    """A step's block tables cost what its sequences' blocks are: 20 tokens in blocks of 8
    take a 16-column table, where max_model_len 1024 would take 128 columns."""
    engine = tiny(block_size=8).engine
    assert engine.max_model_len == 1024
    seq = new_seq(engine, list(range(20)))
    assert seq.block_table.ensure(20)
    tables = engine._prepare_inputs({seq: 20}).attn_metadata.block_tables
    assert tables.shape == (1, 16) and tables[0, :3].tolist() == seq.block_table.block_ids
    seq.block_table.release()


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "static"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_greedy_output_is_independent_of_batching(alone, policy, chunked):
    llm = tiny(policy=policy, enable_chunked_prefill=chunked,
               max_num_batched_tokens=64 if chunked else 256, max_num_seqs=4)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.stats.peak_batch_size > 1
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "static"])
def test_greedy_output_survives_preemption(alone, policy):
    llm = tiny(policy=policy, kv_cache_tokens=192, block_size=16, max_num_batched_tokens=64)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_logprobs_survive_chunking_batching_and_preemption():
    """Prompt and output log-probabilities (top 3) computed in 16-token chunks, in a batch that
    is preempted, equal those of each prompt alone in one step; each prompt token is scored
    once (the first is None) though preemption recomputes it."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    alone = [tiny().generate([p], params)[0] for p in PROMPTS]
    llm = tiny(kv_cache_tokens=192, max_num_batched_tokens=16)
    together = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, together):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                        b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()),
                                                                            abs=1e-5)
    assert_no_leaks(llm.engine)


def test_seeded_sample_is_independent_of_batch():
    """A seeded request samples the same tokens alone and beside rows with other top-k, top-p,
    temperatures, seeds and greedy rows."""
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    others = [SamplingParams(max_tokens=30, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for t, k, p, s in [(1.0, 0, 1.0, None), (0.7, 5, 1.0, 3), (0, 0, 1.0, None),
                                 (1.3, 0, 0.5, None), (1.0, 50, 0.8, 9), (2.0, 0, 1.0, 1)]]
    solo = tiny().generate(["Hello"], params)[0].outputs[0].token_ids
    crowd = tiny(kv_cache_tokens=256).generate(PROMPTS + ["Hello"], others + [params])
    assert crowd[-1].outputs[0].token_ids == solo
    assert tiny().generate(["Hello"], SamplingParams(max_tokens=30, seed=8, ignore_eos=True)
                           )[0].outputs[0].token_ids != solo


def test_greedy_output_is_the_same_with_triton_attention(alone):
    llm = tiny(attention="triton", max_num_batched_tokens=24, block_size=8, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:3], params)) == [a[:8] for a in alone[:3]]
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- Triton kernel
# Without CUDA, kernels.py runs the kernel in Triton's interpreter on CPU, so inputs are small
# (and its bf16 dots take fp32 inputs: kernels._dot says why). Compilation for real GPUs
# is checked ahead of time, in a subprocess without the interpreter (it patches
# triton.language, and then triton.compile cannot run).

NUM_HEADS = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter
needs_cuda = pytest.mark.skipif(
    DEVICE != "cuda", reason="no CUDA GPU: the CPU runs Triton's interpreter, which says nothing "
    "of a GPU's launch, its waits or its numerics")
MAX_MODEL_LEN = 256  # the engine's block tables are cdiv(max_model_len, block_size) wide

# (context_len, q_len) per sequence; context_len counts this step's tokens, as in the engine.
BATCHES = {
    # decodes (one at position 0) mixed with a whole prompt of 2 query tiles and a prefill chunk
    # whose sequence already cached 70 tokens (2 key steps of TILE_KEYS = 64)
    "mixed": [(37, 1), (20, 20), (83, 13), (1, 1), (130, 1), (9, 9)],
    "decode_only": [(5, 1), (64, 1), (71, 1), (16, 1)],
}


def make_batch(seq_shapes, block_size, head_dim, dtype=torch.float32, seed=0, width=None,
               device=DEVICE, num_heads=NUM_HEADS, num_kv_heads=None):
    """Random q (N, num_heads, D), caches (NB, BS, num_kv_heads, D) (default: num_heads) and
    metadata as Engine._prepare_inputs builds them: shuffled blocks, 0-padding.

    Block tables are `width` columns wide (default: just wide enough for the longest sequence),
    padded with block 0, as the engine pads them to cdiv(max_model_len, block_size).
    """
    num_kv_heads = num_kv_heads or num_heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [cdiv(ctx, block_size) for ctx, _ in seq_shapes]
    width = width or max(num_blocks)
    total = sum(num_blocks) + 3  # a few blocks no sequence owns
    cache_shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    free = torch.randperm(total, generator=gen).tolist()  # non-contiguous, any order
    tables, slots, starts = [], [], [0]
    for (ctx, q_len), n in zip(seq_shapes, num_blocks):
        table, free = free[:n], free[n:]
        tables.append(table + [0] * (width - n))
        slots += [table[t // block_size] * block_size + t % block_size
                  for t in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor([ctx for ctx, _ in seq_shapes], dtype=torch.int32,
                                  device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q for _, q in seq_shapes))
    # This step's K/V go in through store_kv, as in the model; q is a strided view, as there.
    qkv = torch.randn(starts[-1], num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("width", ["tight", "engine"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_kernel_matches_reference(block_size, head_dim, batch, width):
    width = cdiv(MAX_MODEL_LEN, block_size) if width == "engine" else None
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], block_size, head_dim, width=width)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # fp32 throughout; only the order of the sums differs from the reference.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# Grouped-query attention, (query heads, KV heads): G = 2, 4, 3 and 7 query heads a KV head.
# At G = 3 and 7 a 16-row tile ends inside a query's group of rows.
GROUPED_HEADS = [pytest.param(4, 2, id="G2"), pytest.param(8, 2, id="G4"),
                 pytest.param(6, 2, id="G3"), pytest.param(7, 1, id="G7")]


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("num_heads, num_kv_heads", GROUPED_HEADS)
def test_triton_kernel_matches_reference_with_grouped_query_heads(num_heads, num_kv_heads,
                                                                  head_dim, batch):
    """Each program serves the G query heads of one KV head, its (query, head) rows stacked
    query by query in a tile: a decode fills G rows, a chunk of L queries L * G."""
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], 16, head_dim, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads,
                                           width=cdiv(MAX_MODEL_LEN, 16))
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, scale),
                               atol=1e-5, rtol=1e-5)


def test_reference_attention_query_head_h_reads_kv_head_h_floordiv_g():
    """The specification's GQA mapping, head by head: of H = 6 query heads over Hkv = 2 KV
    heads (G = 3), head h attends KV head h // G alone (Hugging Face's repeat_kv: a KV head's
    query heads are contiguous). The other plausible mapping, h % Hkv, fails here."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 8, 16, device="cpu",
                                           num_heads=6, num_kv_heads=2)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    for head in range(6):
        kv = slice(head // 3, head // 3 + 1)
        alone = paged_attention_ref(q[:, head:head + 1], k_cache[:, :, kv], v_cache[:, :, kv],
                                    meta, 0.25)
        torch.testing.assert_close(out[:, head:head + 1], alone)


# More decodes than a DECODE_BATCH, of contexts that differ and tie, beside prefill chunks.
MANY_DECODES = [(5 + 23 * i % 97, 1) for i in range(19)] + [(40, 40), (70, 9)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [
    pytest.param(NUM_HEADS, NUM_HEADS, id="G1"), *GROUPED_HEADS])
@pytest.mark.parametrize("decode_bytes, num_batches", [(8 << 20, 3), (1, 19)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_cpu_attention_matches_reference_in_every_layer(block_size, decode_bytes, num_batches,
                                                        num_heads, num_kv_heads, monkeypatch):
    """paged_attention_cpu plans a step's decodes in its first layer and reuses the plan (and
    its buffers) in the others: each layer, its own caches, must still get the reference,
    whether the decodes go DECODE_BATCH together or one by one (K/V past DECODE_BYTES). With
    GQA the K/V it gathers are the cache's Hkv heads, never copied per query head."""
    monkeypatch.setattr("kernels.DECODE_BYTES", decode_bytes)
    q, k_cache, v_cache, meta = make_batch(MANY_DECODES, block_size, 32, device="cpu",
                                           num_heads=num_heads, num_kv_heads=num_kv_heads)
    layers = [(q, k_cache, v_cache), (q.flip(0), v_cache.flip(0), k_cache * 2)]
    for q, k_cache, v_cache in layers:
        out = paged_attention_cpu(q, k_cache, v_cache, meta, 0.2)
        # fp32; the order of the sums differs (G query rows a GEMM): up to 2e-6 seen
        torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2),
                                   atol=1e-5, rtol=1e-5)
    assert len(meta.decode_plan.batches) == num_batches
    assert all(b.shape[1:] == k_cache.shape[1:] for b in meta.decode_plan.buffers)


# Tolerances: a few roundings of the type (p cast for the P @ V dot, the output), |out| < 4.
LOW_PRECISION = [pytest.param(torch.float16, 4e-3, id="fp16"),
                 pytest.param(torch.bfloat16, 3e-2, id="bf16")]


@pytest.mark.parametrize("dtype, tol", LOW_PRECISION)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads", [
    pytest.param(NUM_HEADS, NUM_HEADS, id="G1"), pytest.param(8, 2, id="G4"),
    pytest.param(7, 1, id="G7")])
def test_triton_kernel_low_precision_matches_fp32_reference(num_heads, num_kv_heads, head_dim,
                                                            batch, dtype, tol):
    """fp16 and bf16 inputs, accumulated in fp32, against the fp32 reference (on CPU in the
    interpreter, on a GPU as launched), with one head a KV head and with grouped heads."""
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], 16, head_dim, dtype,
                                           width=cdiv(MAX_MODEL_LEN, 16), num_heads=num_heads,
                                           num_kv_heads=num_kv_heads)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    # The reference sees the same rounded inputs, in fp32.
    expected = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_cuda
def test_triton_launch_never_waits_for_the_gpu():
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 64, torch.bfloat16)
    paged_attention(q, k_cache, v_cache, meta, 0.125)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync now raises
    try:
        paged_attention(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_a_cuda_step_waits_for_the_device_only_to_read_its_results(monkeypatch):
    """Whole engine steps (a prompt chunk beside decodes; greedy, seeded and unseeded samples,
    top-k and top-p; log-probabilities) under set_sync_debug_mode("error"): any wait for the
    GPU raises, except in nanoserve.to_host, where the step reads its tokens on purpose. A
    step that fails fails its requests (finish_reason "error"), so none may."""
    engine = Engine(EngineConfig(preset="tiny", device="cuda", dtype="bfloat16",
                                 max_num_batched_tokens=32))
    kinds = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=20, logprobs=2),
             SamplingParams(top_p=0.9, prompt_logprobs=1)]

    def add_requests(prompt_len: int) -> None:
        for params in kinds:
            engine.add_request(list(range(1, prompt_len + 1)),
                               dataclasses.replace(params, max_tokens=8, ignore_eos=True))
    add_requests(4)
    outputs = engine.step() + engine.step()  # compiled and warmed: the next steps are steady
    add_requests(40)  # chunked over the next steps, beside the first three's decodes
    to_host = nanoserve.to_host
    reads = []

    def read_on_purpose(tensor: torch.Tensor) -> list:
        reads.append(tuple(tensor.shape))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return to_host(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(nanoserve, "to_host", read_on_purpose)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            outputs += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reads  # the steps read their tokens
    assert not [o for o in outputs if o.finished and o.outputs[0].finish_reason == "error"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_triton_kernel_runs_on_its_tensors_device():
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 64, torch.float16,
                                           device="cuda:1")
    with torch.cuda.device(0):  # the current device is not the tensors' one
        out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.125),
                               atol=4e-3, rtol=4e-3)


def test_triton_launcher_refuses_metadata_it_would_misread():
    """The kernel reads context_lens and query_start_loc as dense int32 arrays: a strided
    view would be read wrong, silently, so the launcher refuses it."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 32)
    lens = meta.context_lens
    meta.context_lens = torch.stack([lens, lens], dim=1)[:, 0]  # the same values, strided
    assert torch.equal(meta.context_lens, lens) and not meta.context_lens.is_contiguous()
    with pytest.raises(AssertionError, match="dense"):
        paged_attention(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu, paged_attention])
def test_attention_refuses_query_heads_the_kv_heads_do_not_divide(attention):
    """3 query heads over 2 KV heads have no head-to-KV-head mapping: refused, by count, before
    any K/V is read (the kernel would read the wrong KV heads)."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 32, num_heads=4,
                                           num_kv_heads=2)
    with pytest.raises(ValueError, match="3 heads, not a multiple of the cache's 2 KV heads"):
        attention(q[:, :3], k_cache, v_cache, meta, 0.125)


# Compiling for GPUs without one: the test after these functions runs print_compiled_variants
# in a fresh process, where Triton compiles for real.

COMPILE_CAPABILITIES = (80, 90)  # sm_80 (A100), sm_90 (H100)
# (dtype, head dim, query heads, KV heads). 128: Llama's and Qwen's head dim. Grouped (GQA):
# 14/2 (G = 7, not a power of 2) at 64 is Qwen2.5-0.5B, 32/8 at 64 Llama-3.2-1B, 16/8 at 128
# Qwen3-0.6B, 32/8 at 128 Llama-3.1-8B.
COMPILE_VARIANTS = [("float16", 64, 12, 12), ("float16", 48, 12, 12), ("bfloat16", 64, 12, 12),
                    ("float32", 64, 12, 12), ("float16", 128, 12, 12), ("bfloat16", 128, 12, 12),
                    ("float16", 64, 14, 2), ("bfloat16", 64, 32, 8),
                    ("float16", 128, 16, 8), ("bfloat16", 128, 16, 8), ("bfloat16", 128, 32, 8)]
# Batches unlike each other: one decode; 64 decodes and a 200-token chunk; two chunks.
VARIED_BATCHES = [((1, 1),), ((900, 1),) * 64 + ((200, 200),), ((16, 16), (1000, 512))]


class CompileOnlyDriver:
    """All that JITFunction.run asks of the driver before it compiles; there is no GPU to ask."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch  # one kernel cache per target

    def get_current_stream(self, device):
        return 0


def engine_args(dtype, head_dim, seq_shapes=((100, 1), (7, 1), (300, 1), (37, 37)),
                num_heads=12, num_kv_heads=None, block_size=16, width=64, num_blocks=512):
    """paged_attention's arguments as the engine passes them for sequences of
    (context_len, q_len), by default 3 decodes and a 37-token prefill chunk: q a view of the
    fused qkv projection, contiguous caches of num_kv_heads heads (default: num_heads, GPT-2's),
    int32 metadata, block tables cdiv(1024, 16) wide."""
    num_kv_heads = num_kv_heads or num_heads
    num_tokens = sum(q_len for _, q_len in seq_shapes)
    qkv = torch.zeros(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # rows qkv-strided
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    starts = [0]
    for _, q_len in seq_shapes:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.zeros(len(seq_shapes), width, dtype=torch.int32),
        context_lens=torch.tensor([ctx for ctx, _ in seq_shapes], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_len for _, q_len in seq_shapes))
    return q, k_cache, torch.zeros_like(k_cache), meta, head_dim ** -0.5


def launch_specialization(args) -> str:
    """paged_attention(*args) as on a GPU: JITFunction.run binds the arguments and hands its
    specialization to jit_cache_hook, whose True skips the compile and the launch. The launch
    must not read a tensor's value (on a GPU, a wait for the device)."""
    import triton  # here, not at the top: kernels.py chooses the interpreter before importing it
    seen = []

    def hook(*, compile, **_):
        seen.append(compile["specialization_data"])
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with CountSyncs() as counter:
            paged_attention(*args)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert counter.syncs == [], counter.syncs
    assert len(seen) == 1, seen
    return seen[0]


def ptxas_counts(ptx: str, cc: int) -> tuple[int, int]:
    """Registers and spills as ptxas reports them; Triton only learns them when loading on a
    GPU."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        command = [get_ptxas(cc).path, "-v", "--regAllocOptLevel=2",  # flags as Triton's
                   f"--gpu-name={sm_arch_from_capability(cc)}", f.name, "-o", os.devnull]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(regs) == len(spills) == 1, log  # one kernel, one report
    return int(regs[0]), int(spills[0][0]) + int(spills[0][1])


def compile_as_launched(cc: int, dtype: str, head_dim: int, num_heads: int,
                        num_kv_heads: int) -> dict:
    """Compile the kernel exactly as paged_attention would launch it on compute capability cc,
    for q of num_heads heads over caches of num_kv_heads, and report what the compile gave:
    the specialization (which parameters are bound to 1, which pointers are 16-byte aligned),
    ptxas's registers and spills, shared memory, and whether K/V are loaded by cp.async with
    copies still in flight."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    fn = kernels._paged_attention_kernel
    data = launch_specialization(engine_args(getattr(torch, dtype), head_dim,
                                             num_heads=num_heads, num_kv_heads=num_kv_heads))
    compiled = fn.preload(data)  # Triton compiles exactly that specialization
    spec = json.loads(data)
    ptx = compiled.asm["ptx"]
    names = [p.name for p in fn.params]
    ones = [names[i] for (i,), v in zip(spec["constant_keys"], spec["constant_vals"])
            if v == 1 and not fn.params[i].is_constexpr]
    aligned = [names[i] for (i,), v in zip(spec["attrs_keys"], spec["attrs_vals"])
               if ["tt.divisibility", 16] in v]
    regs, spills = ptxas_counts(ptx, cc)
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return dict(cc=cc, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                num_kv_heads=num_kv_heads, regs=regs, spills=spills,
                smem=compiled.metadata.shared, cp_async="cp.async.cg.shared.global" in ptx,
                copies_in_flight=max(waits, default=0), ones=ones, aligned=aligned,
                target=f".target {sm_arch_from_capability(cc)}" in ptx,
                cubin=len(compiled.asm["cubin"]), stages=compiled.metadata.num_stages)


def print_compiled_variants() -> None:
    """Compile every variant for every capability; print one JSON line each, or "SKIP: why"
    when this Triton lacks an internal used here (triton is unpinned). Run it in a process of
    its own with TRITON_INTERPRET=0: the interpreter patches triton.language, and then
    triton.compile cannot run."""
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401 (ptxas_counts's)
        from triton.runtime.driver import driver
        assert hasattr(triton.knobs.runtime, "jit_cache_hook")
        assert hasattr(kernels._paged_attention_kernel, "preload")
    except (ImportError, AssertionError) as e:
        print(f"SKIP: Triton {triton.__version__} lacks an internal this test uses: {e!r}")
        return
    assert not triton.knobs.runtime.interpret
    # First, before anything is compiled (a compiled one would be launched, on no GPU): the
    # specialisations that varied batches ask for, with GPT-2's heads and grouped ones.
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", COMPILE_CAPABILITIES[0], 32)))
    keys = [{launch_specialization(engine_args(torch.float16, 64, shapes, *heads))
             for shapes in VARIED_BATCHES} for heads in [(12, 12), (14, 2)]]
    for cc in COMPILE_CAPABILITIES:
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", cc, 32)))
        for variant in COMPILE_VARIANTS:  # head dim 48 (padded to 64) once, in fp16
            print(json.dumps(compile_as_launched(cc, *variant)))
    print(json.dumps(dict(specializations=[len(k) for k in keys])))


def test_triton_kernel_as_launched_compiles_for_sm80_and_sm90_without_spills():
    """The kernel paged_attention would launch on sm_80 and sm_90, compiled without a GPU,
    with as many KV heads as query heads (GPT-2) and grouped (GQA).

    Triton's own JITFunction.run specialises the engine's real arguments (built on CPU); the
    compile of that specialisation must fit: ptxas's registers and spills, shared memory, and
    K/V loaded by cp.async, with the next tile's copies in flight during this tile's math.
    """
    env = dict(os.environ, TRITON_INTERPRET="0")  # kernels.py keeps an explicit 0
    run_it = "import test_nanoserve; test_nanoserve.print_compiled_variants()"
    result = subprocess.run([sys.executable, "-c", run_it], env=env, capture_output=True,
                            text=True, timeout=600, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout[6:].strip())
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # Varied batches (sizes, decodes and chunks) launch one specialisation a model: one compile.
    assert rows.pop() == dict(specializations=[1, 1])
    assert [(r["cc"], r["dtype"], r["head_dim"], r["num_heads"], r["num_kv_heads"])
            for r in rows] == [(cc, *variant) for cc in COMPILE_CAPABILITIES
                               for variant in COMPILE_VARIANTS]
    for r in rows:
        assert r["target"] and r["cubin"] > 0, r
        # The launch binds unit strides as constants and every pointer as 16-byte aligned.
        assert set(r["ones"]) == {"stride_qd", "stride_kd", "stride_vd", "stride_od"}, r
        assert {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "block_tables_ptr",
                "context_lens_ptr", "query_start_loc_ptr"} <= set(r["aligned"]), r
        if r["dtype"] == "float32":  # fp32 (not the GPU default) only has to compile
            continue
        assert r["spills"] == 0 and r["cp_async"] and r["copies_in_flight"] > 0, r
        if r["head_dim"] <= 64:  # GPT-2's: room for 3 programs an SM (4 warps, 64 KB each)
            assert r["regs"] <= 128 and r["smem"] < 64 * 1024, r
        else:  # 128: it must launch at all (sm_80 lets a program have 163 KB); not tuned yet
            assert r["smem"] < 163 * 1024, r
    # A grouped program's K/V tiles serve its G heads: the shared memory of one head's.
    smem = {(r["cc"], r["dtype"], r["head_dim"]): r["smem"] for r in rows
            if r["num_heads"] == r["num_kv_heads"]}
    for r in rows:
        assert r["smem"] == smem[r["cc"], r["dtype"], r["head_dim"]], r


# ----------------------------------------------------------------------------- sampling

def test_logits_are_computed_in_fp32_even_from_bf16_weights():
    """In bf16, the logits come from an fp32 product of the bf16 values, not a bf16 product
    cast afterwards: GPT-2's logits are tens in size, where bf16's rounding moves them by
    tenths (the test checks that the difference is there to be made)."""
    model = M.GPT(M.PRESETS["tiny"]).to(torch.bfloat16)
    hidden = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 4)
    hidden = hidden.to(torch.bfloat16)
    fp32_product = hidden.float() @ model.lm_head.weight.float().T
    assert torch.equal(model.compute_logits(hidden), fp32_product)
    bf16_product = torch.nn.functional.linear(hidden, model.lm_head.weight)
    assert not torch.equal(bf16_product.float(), fp32_product)


def test_top_k_1_is_greedy(alone):
    params = SamplingParams(max_tokens=40, temperature=5.0, top_k=1, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS, params)) == alone


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-45], ids=["1e-6", "1e-30", "denormal"])
def test_tiny_temperature_is_greedy(alone, temperature):
    params = SamplingParams(max_tokens=40, temperature=temperature, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS[:2], params)) == alone[:2]


def test_top_p_too_small_to_round_keeps_the_most_likely_token(alone):
    params = SamplingParams(max_tokens=40, top_p=1e-45, seed=0, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS[:2], params)) == alone[:2]


def test_top_k_and_top_p_mask_each_row_by_its_own_params():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    masked = apply_top_k_top_p(logits, torch.tensor([4, 4, 2, 4]),
                               torch.tensor([0.6, 0.45, 1.0, 1.0]))
    kept = [torch.isfinite(row).nonzero().flatten().tolist() for row in masked]
    # top_p 0.6: 0.5 < 0.6, so token 1 (which crosses 0.6) stays; top_p 0.45: token 0 alone
    assert kept == [[0, 1], [0], [0, 1], [0, 1, 2, 3]]
    assert torch.equal(masked[3], logits[3])  # top_k = vocab and top_p = 1: untouched


def test_sampling_draws_from_the_top_p_nucleus_of_the_tempered_distribution():
    """Temperature first, then top-p, then the Gumbel-max draw: frequencies over 4000 seeded
    draws follow softmax(logits / T) cut to its nucleus and renormalised.

    The order matters here: tempered by T = 2, the probabilities [0.5, 0.3, 0.15, 0.05] become
    [0.38, 0.29, 0.21, 0.12], whose top-p 0.7 nucleus has 3 tokens; top-p on the raw ones
    keeps 2, and token 2's frequency (0.24 expected) would be 0."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # most likely first
    temperature = 2.0
    top_p = 0.7
    tempered = (probs.log() / temperature).softmax(-1)
    more_likely = tempered.cumsum(0) - tempered  # the mass of the tokens above each
    nucleus = torch.where(more_likely < top_p, tempered, 0)  # the token crossing top_p stays
    expected = nucleus / nucleus.sum()
    n = 4000
    t = SamplingTensors(temperature=torch.full((n,), temperature), top_k=torch.full((n,), 4),
                        top_p=torch.full((n,), top_p), greedy=torch.zeros(n, dtype=torch.bool),
                        generators=[None] * n, all_greedy=False, any_top_k_top_p=True)
    tokens = sample(probs.log().expand(n, 4), t, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4) / n
    assert (freq - expected).abs().max() < 0.025, (freq, expected)


# ----------------------------------------------------------------------------- streaming

def test_deltas_add_up_to_the_whole_output():
    llm = LLM(device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=3)
    whole = llm.generate(["ROMEO:"], params)[0].outputs[0]
    llm.engine.add_request("ROMEO:", params, "r")
    deltas = run_to_end(llm.engine)["r"]
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(deltas) == len(whole.token_ids) > 1


def test_streamed_text_is_always_a_prefix_of_the_final_text():
    """Stop strings that the text starts and abandons many times ("e", "th", "the ..."): text
    that could begin one is held back until it cannot, and what was streamed is never cut."""
    llm = LLM(device="cpu", dtype="float32")
    text = llm.generate(["ROMEO:"], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
                        )[0].outputs[0].text
    at = next(i for i in range(60, 140) if text.find(text[i:i + 6]) == i)  # its first place
    stops = ["e\nX", "the q", text[at:at + 6], text[100:103] + "\x00"]
    llm.engine.add_request("ROMEO:", SamplingParams(max_tokens=150, temperature=0, stop=stops,
                                                    ignore_eos=True), "r")
    streamed, final = "", None
    for delta in run_to_end(llm.engine)["r"]:
        streamed += delta.outputs[0].text
        final = delta.outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", text[at:at + 6])
    assert streamed == text[:at] and "the " in streamed  # "the q" started and abandoned


def test_detokenizer_holds_back_a_possible_stop_string_and_split_utf8():
    enc = byte_tokenizer()
    detok = Detokenizer(enc, ["the end"])
    pieces = []
    for byte in "us in th\u00e9 the x".encode():
        assert detok.append(enc.token_id(bytes([byte]))) is None
        pieces.append(detok.new_text(finished=False))
    # "th" might begin "the end"; then é's first byte waits for its second
    assert pieces[:10] == ["u", "s", " ", "i", "n", " ", "", "", "", "th\u00e9"]
    assert pieces[10:] == [" ", "", "", "", "", "the x"]  # "the " is held until the "x"
    assert "".join(pieces) + detok.new_text(finished=True) == "us in th\u00e9 the x"


def test_stop_string_ends_generation_and_is_cut():
    llm = LLM(device="cpu", dtype="float32")  # the shipped model writes ASCII
    full = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    stop = full.text[10:13]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert out.outputs[0].text == full.text[:full.text.find(stop)]
    assert_no_leaks(llm.engine)


def test_stop_accepts_any_iterable_of_strings():
    llm = LLM(device="cpu", dtype="float32")
    full = llm.generate(["Hello"], GREEDY)[0].outputs[0].text
    params = SamplingParams(max_tokens=40, temperature=0, stop=(s for s in [full[10:13]]))
    assert llm.generate(["Hello"], params)[0].outputs[0].text == full[:full.find(full[10:13])]


class TextTokens:
    """A tokenizer whose token i is the text texts[i]: one token can complete two stop strings
    at once (the byte tokenizer adds one character at a time)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def token_bytes(self, token: int) -> bytes:
        return self.texts[token].encode()


@pytest.mark.parametrize("stop, expected", [
    (["ab", "bc"], "ab"), (["bc", "ab"], "ab"),      # "ab" starts first in "xabc"
    (["ab", "abc"], "abc"), (["abc", "ab"], "abc"),  # both start at 1: the longer
], ids=["earliest-listed-first", "earliest-listed-last", "longer-listed-last",
        "longer-listed-first"])
def test_stop_string_earliest_in_the_text_wins_then_the_longest(stop, expected):
    """Text "x", then one token "abc" that completes both stop strings: the one that starts
    first in the text ends it, whatever the list's order; of two starting at the same place,
    the longer. The text is cut where the winner starts."""
    detokenizer = Detokenizer(TextTokens(["x", "abc"]), stop)
    assert detokenizer.append(0) is None
    assert detokenizer.append(1) == expected
    assert detokenizer.text == "x"


def test_max_tokens_and_end_of_text_set_finish_reason():
    llm = tiny()
    assert llm.generate(["Hi"], GREEDY)[0].outputs[0].finish_reason == "length"
    eot = llm.engine.tokenizer.token_id(EOT)

    def always_end_of_text(hidden):
        return torch.nn.functional.one_hot(torch.full((len(hidden),), eot), 257).float()
    llm.engine.model.compute_logits = always_end_of_text
    out = llm.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [eot], "")


def test_completion_ending_inside_a_utf8_character_shows_its_bytes_as_u_fffd(monkeypatch):
    """The model writes "a" and then the first byte of "é" (2 bytes) and max_tokens ends it:
    the unfinished character is shown as U+FFFD, in the whole text and in the last delta."""
    llm = tiny()
    tokenizer = llm.engine.tokenizer
    tokens = [tokenizer.token_id(b) for b in (b"a", "é".encode()[:1])]
    written = iter(tokens)

    def compute_logits(hidden):
        return torch.nn.functional.one_hot(torch.tensor([next(written)]), 257).float()
    monkeypatch.setattr(llm.engine.model, "compute_logits", compute_logits)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    out = llm.generate(["Hi"], params)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == (tokens, "a\ufffd", "length")
    written = iter(tokens)
    llm.engine.add_request("Hi", params, "r")
    assert [d.outputs[0].text for d in run_to_end(llm.engine)["r"]] == ["a", "\ufffd"]


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


def test_a_step_synchronises_with_the_device_at_most_once(monkeypatch):
    engine = tiny(max_num_batched_tokens=64).engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9,
                                             seed=i if i % 2 else None, ignore_eos=True))

    def sync_free_attention(q, k_cache, v_cache, meta, scale):  # the CPU path reads lists
        return q
    engine.attention = sync_free_attention
    counter = CountSyncs()

    def counted(method: str):
        """Tensor.<method>, which also records that it read a tensor's values."""
        real = getattr(torch.Tensor, method)

        def read_values(tensor, *args, **kwargs):
            counter.syncs.append(method)
            return real(tensor, *args, **kwargs)
        return read_values
    for method in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, counted(method))
    for _ in range(6):  # prefill chunks, mixed steps and decodes
        with counter:
            engine.step()
        assert len(counter.syncs) <= 1, counter.syncs
        counter.syncs.clear()


# ----------------------------------------------------------------------------- bad input

BAD_PARAMS = {
    "temperature": [float("nan"), float("inf"), -1, "1", True],
    "top_p": [float("nan"), 0, 1.5, float("-inf")],
    "top_k": [True, 1.5, -2],
    "max_tokens": [True, 0, 2.0],
    "seed": [-1, 2**64, 1.5, True],
    "stop": [[""], [1], 5],
    "ignore_eos": ["yes"],
    "presence_penalty": [float("nan"), 2.5, True, "0.1"],
    "frequency_penalty": [-3, float("inf")],
    "repetition_penalty": [0, -1, float("nan"), True],
    "min_p": [-0.1, 1.5, float("nan")],
    "min_tokens": [-1, 1.5, True],
    "stop_token_ids": [[-1], [True], 5, ["a"]],
    "include_stop_str_in_output": ["yes"],
    "logit_bias": [{1: 101}, {1: float("nan")}, {-1: 0}, {"a": 1}, [1], {True: 1}],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_PARAMS.items() for v in vs])
def test_bad_sampling_param_is_rejected_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


# ----------------------------------------------------------------------------- penalties and stops
# vLLM's sampling fields beyond temperature, top-k and top-p. The reference is a dense loop
# written here from the definitions; it is compared only where its top two logits differ by
# more than NEAR_TIE (random weights make near-ties, which rounding may decide either way).

NEAR_TIE = 1e-3  # top-two logits this close: two float32 implementations may pick either
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)


def penalized_reference(model: M.GPT, prompt: list[int], num_tokens: int, presence: float,
                        frequency: float, repetition: float) -> tuple[list[int], int]:
    """Greedy decoding from dense forwards with the penalties applied as their definitions say
    (repetition over prompt and output, then frequency and presence over the output); the
    tokens, and how many of them were decided by more than NEAR_TIE."""
    ids = list(prompt)
    num_decided = None
    for _ in range(num_tokens):
        logits = model.forward_dense(torch.tensor([ids]))[0, -1].double()
        output = ids[len(prompt):]
        counts = Counter(output)
        for token_id in set(ids):
            if logits[token_id] > 0:
                logits[token_id] /= repetition
            else:
                logits[token_id] *= repetition
        for token_id, count in counts.items():
            logits[token_id] -= frequency * count + presence
        top_two = logits.topk(2).values
        if num_decided is None and top_two[0] - top_two[1] < NEAR_TIE:
            num_decided = len(output)  # this token may go either way, and the next follow it
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], num_decided or num_tokens


def test_penalties_equal_a_dense_reference_loop():
    llm = tiny()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **PENALTIES)
    compared = 0
    for prompt in ([5, 6, 5, 6, 7], [100, 101, 102], [65] * 8):
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        want, num_decided = penalized_reference(llm.engine.model, prompt, 24, 0.7, 0.4, 1.6)
        assert got[:num_decided] == want[:num_decided]
        compared += num_decided
    plain = tiny().generate([[65] * 8], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    assert compared >= 24 and plain != got  # the penalties changed something


def test_penalties_do_not_depend_on_batching_chunking_or_preemption():
    """Penalized greedy requests, alone, equal themselves in a batch beside plain ones, in
    16-token chunks, in a KV cache that forces preemption; a seeded one equals itself too."""
    penalized = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **PENALTIES)
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = [tiny().generate([p], penalized)[0].outputs[0].token_ids for p in PROMPTS]
    llm = tiny(kv_cache_tokens=192, max_num_batched_tokens=16)
    mixed = [penalized, plain] * len(PROMPTS)
    together = llm.generate([p for p in PROMPTS for _ in range(2)], mixed)
    assert token_ids(together)[0::2] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
    seeded = SamplingParams(max_tokens=12, seed=3, ignore_eos=True, **PENALTIES)
    assert tiny().generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids == \
        tiny().generate([PROMPTS[0], PROMPTS[1]], [seeded, plain])[0].outputs[0].token_ids


def test_no_count_tensor_is_built_when_no_row_has_a_penalty(monkeypatch):
    built = []
    penalty_counts = sampling.penalty_counts

    def counting(seqs, vocab_size, device):
        built.append(len(seqs))
        return penalty_counts(seqs, vocab_size, device)
    monkeypatch.setattr(sampling, "penalty_counts", counting)
    llm = tiny()
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, seed=1, top_k=5, min_p=0.1))
    assert built == []
    llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=4), SamplingParams(
        max_tokens=4, presence_penalty=0.5), SamplingParams(max_tokens=4)])
    assert built and max(built) == 3


def test_logprobs_are_the_models_own_before_penalties_and_bias():
    llm = tiny()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                            repetition_penalty=3.0, logit_bias={7: 5.0})
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    ids = [5, 6, 7] + out.token_ids
    dense = llm.engine.model.forward_dense(torch.tensor([ids])).log_softmax(-1)[0]
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token_id] == pytest.approx(dense[2 + i, token_id].item(), abs=1e-5)


def test_logit_bias_forces_and_bans_a_token():
    llm = tiny()
    forced = SamplingParams(max_tokens=5, seed=0, ignore_eos=True, logit_bias={65: 100})
    assert llm.generate(["ab"], forced)[0].outputs[0].token_ids == [65] * 5
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first = llm.generate(["ab"], greedy)[0].outputs[0].token_ids[0]
    banned = dataclasses.replace(greedy, logit_bias={first: -100})
    assert first not in llm.generate(["ab"], banned)[0].outputs[0].token_ids


def test_min_p_of_one_keeps_only_the_most_likely_token():
    llm = tiny()
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0,
                                                      ignore_eos=True))
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=1.5, seed=4,
                                                       min_p=1.0, ignore_eos=True))
    assert token_ids(sampled) == token_ids(greedy)


def test_min_tokens_holds_back_end_of_text_and_stop_tokens():
    """End-of-text biased to certain: never among the first min_tokens tokens, then at once."""
    llm = tiny()
    eot = llm.engine.tokenizer.token_id(EOT)
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias={eot: 100})
    out = llm.generate(["ab"], params)[0].outputs[0]
    assert out.token_ids[5:] == [eot] and eot not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stop_id = 66
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=3, ignore_eos=True,
                            stop_token_ids=[stop_id], logit_bias={stop_id: 100})
    out = llm.generate(["ab"], params)[0].outputs[0]
    assert out.token_ids[3:] == [stop_id] and (out.finish_reason, out.stop_reason) == (
        "stop", stop_id)


def test_stop_token_ids_end_the_request_with_the_token_kept_out_of_the_text():
    llm = tiny()
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True)
    tokens = llm.generate(["ROMEO:"], free)[0].outputs[0].token_ids
    stop_id = tokens[5]
    end = tokens.index(stop_id) + 1
    params = dataclasses.replace(free, stop_token_ids=[stop_id])
    out = llm.generate(["ROMEO:"], params)[0].outputs[0]
    assert out.token_ids == tokens[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    tokenizer = llm.engine.tokenizer
    assert out.text == tokenizer.decode(tokens[:end - 1])
    kept = llm.generate(["ROMEO:"], dataclasses.replace(params, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == tokenizer.decode(tokens[:end])


def test_include_stop_str_in_output_keeps_the_stop_string():
    llm = tiny()
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True)
    text = llm.generate(["ROMEO:"], free)[0].outputs[0].text
    stop = text[4:6]
    cut = llm.generate(["ROMEO:"], dataclasses.replace(free, stop=[stop]))[0].outputs[0]
    kept = llm.generate(["ROMEO:"], dataclasses.replace(
        free, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert kept.stop_reason == cut.stop_reason == stop


def test_stop_strings_count_only_after_min_tokens():
    """Every token the same (biased to certain) and its text the stop string: the first token
    ends it; with min_tokens 8 the stop string is looked for only once the output is longer,
    as vLLM does."""
    llm = tiny()
    text = llm.engine.tokenizer.decode([65])
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True, logit_bias={65: 100},
                          stop=[text])
    early = llm.generate(["ROMEO:"], free)[0].outputs[0]
    held = llm.generate(["ROMEO:"], dataclasses.replace(free, min_tokens=8))[0].outputs[0]
    assert len(early.token_ids) == 1 and early.text == ""
    assert len(held.token_ids) == 9 and held.text == text * 8


def test_the_repl_and_the_command_line_take_the_new_sampling_fields(capsys):
    engine = tiny().engine
    args = cli.parse_args(["--presence-penalty", "0.5", "--min-p", "0.1",
                                 "--stop-token-ids", "7", "8", "--n", "2"])
    params = cli.cli_params(engine, args, "x")
    assert (params.presence_penalty, params.min_p, params.stop_token_ids, params.n) == (
        0.5, 0.1, [7, 8], 2)
    settings = {}
    reply = cli.repl_command('/set logit_bias {"65": 5}', settings, engine,
                                   cli.parse_args([]))
    assert reply == "logit_bias = {'65': 5}" and settings == {"logit_bias": {"65": 5}}
    reply = cli.repl_command("/set repetition_penalty 0", settings, engine,
                                   cli.parse_args([]))
    assert reply.startswith("error: repetition_penalty must be a number in (0, inf]")


@pytest.mark.parametrize("field, value", [("stop_token_ids", [10**6]),
                                          ("logit_bias", {10**6: 1.0})])
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}: token id 1000000 is not in the vocabulary"):
        tiny().engine.add_request("x", SamplingParams(**{field: value}))


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must be at most max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)


# ----------------------------------------------------------------------------- n samples
# A request with n > 1 is n sequences (vLLM's fan-out) and one request: one id, one abort, one
# finished output, its completions indexed 0..n-1.

def test_n_samples_are_one_request_each_equal_to_its_seed_alone():
    llm = tiny()
    params = SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True)
    together = llm.generate(["ab"], params)
    assert len(together) == 1 and [c.index for c in together[0].outputs] == [0, 1, 2]
    for completion in together[0].outputs:
        alone = dataclasses.replace(params, n=1, seed=5 + completion.index)
        assert completion.token_ids == llm.generate(["ab"], alone)[0].outputs[0].token_ids
    greedy = llm.generate(["ab"], SamplingParams(n=2, max_tokens=6, temperature=0))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_a_request_of_n_samples_says_finished_once_in_its_last_output():
    engine = tiny().engine
    request_id = engine.add_request("ab", SamplingParams(n=4, seed=1, max_tokens=12))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    assert {d.request_id for d in deltas} == {request_id}
    assert_no_leaks(engine)


def test_abort_ends_every_sample_of_a_request():
    engine = tiny().engine
    request_id = engine.add_request("ab", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(request_id)
    last = engine.step()
    assert sorted(c.index for d in last for c in d.outputs) == [0, 1, 2]
    assert all(c.finish_reason == "abort" for d in last for c in d.outputs)
    assert [d.finished for d in last].count(True) == 1 and not engine.has_unfinished()
    assert_no_leaks(engine)


def test_a_request_id_that_names_another_requests_sample_is_refused():
    """Sample 1 of request "5" is sequence "1_5": a request "1_5" beside it is refused."""
    engine = tiny().engine
    engine.add_request("ab", SamplingParams(n=2, max_tokens=4), "5")
    with pytest.raises(ValueError, match="request id '1_5' is already in use"):
        engine.add_request("ab", SamplingParams(max_tokens=4), "1_5")


def test_the_trace_draws_a_request_of_n_samples_as_its_first_sample(capsys):
    llm = tiny(max_num_seqs=2)
    outputs = llm.generate(["ab", "cd"], SamplingParams(n=2, max_tokens=3, ignore_eos=True),
                           trace=True)
    rows = capsys.readouterr().err.splitlines()
    marks = [row.split(" | ")[1] for row in rows[1:3]]
    assert marks[0] == "oo*" and marks[1].startswith("...")  # two sequences at a time
    assert [len(o.outputs) for o in outputs] == [2, 2]


def test_cli_n_prints_each_sample_under_its_index(capsys):
    status, out, _ = nanoserve_main(capsys, "--preset", "tiny", "--device", "cpu", "--prompt",
                                    "ab", "--n", "2", "--max-tokens", "3", "--seed", "0")
    assert status == 0 and out.startswith("ab\n[0] ") and "\n[1] " in out


def test_piped_lines_refuse_n_above_one(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "ab", "n": 2}\n'))
    status, out, _ = nanoserve_main(capsys, "--preset", "tiny", "--device", "cpu", "--jsonl")
    assert status == 1 and "n is 2, but piped lines and the REPL print one completion" in out


BAD_CONFIGS = [("max_num_seqs", 1.5), ("block_size", 16.0), ("max_num_batched_tokens", math.nan),
               ("kv_cache_tokens", True), ("max_model_len", 0), ("seed", -1),
               ("enable_chunked_prefill", 1), ("policy", "lifo"), ("dtype", "int8"),
               ("attention", "flash"), ("device", "foo"), ("preset", 3),
               ("device", f"cuda:{torch.cuda.device_count()}")]  # one past the last GPU


@pytest.mark.parametrize("name, value", BAD_CONFIGS)
def test_bad_engine_setting_is_rejected_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{"preset": "tiny", name: value})


@pytest.mark.parametrize("kv_cache_tokens", [16, None], ids=["given", "default"])
def test_block_larger_than_the_kv_cache_is_rejected(kv_cache_tokens):
    with pytest.raises(ValueError, match=r"block_size \(\d+ tokens\) is larger than the KV cache"):
        Engine(EngineConfig(preset="tiny", block_size=10**6 if kv_cache_tokens is None else 32,
                            kv_cache_tokens=kv_cache_tokens))


def test_max_model_len_is_capped_by_what_the_kv_cache_holds():
    """A context the cache cannot hold is never served: by default max_model_len is the
    model's context or the cache's capacity, the smaller; asked for past the cache, refused."""
    assert Engine(EngineConfig(preset="tiny", kv_cache_tokens=200)).max_model_len == 192
    assert Engine(EngineConfig(preset="tiny", kv_cache_tokens=4096)).max_model_len == 1024
    with pytest.raises(ValueError, match=r"max_model_len 300 does not fit in the KV cache "
                                         r"\(192 tokens\)"):
        Engine(EngineConfig(preset="tiny", kv_cache_tokens=200, max_model_len=300))


def test_kv_cache_too_big_for_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot allocate a KV cache of 1000000000000 tokens"):
        Engine(EngineConfig(preset="tiny", kv_cache_tokens=10**12))


@pytest.mark.parametrize("make, message", [
    (lambda e: e.add_request("", SamplingParams()), "prompt is empty"),
    (lambda e: e.add_request("x" * 1000, SamplingParams(max_tokens=100)), "context is 512"),
    (lambda e: e.add_request([0, 300], SamplingParams()), "token ids"),
    (lambda e: e.add_request([0, True], SamplingParams()), "token ids"),
    (lambda e: e.add_request(b"hello", SamplingParams()), "got bytes"),
    (lambda e: e.add_request({"prompt_ids": [1]}, SamplingParams()), "got dict"),
    (lambda e: e.add_request("hi", {"max_tokens": 5}), "SamplingParams"),
    (lambda e: e.add_request("hi", SamplingParams(), 7), "request_id"),
], ids=["empty", "too-long", "bad-token-id", "bool-token-id", "bytes",
        "unknown-dict", "params-dict", "int-request-id"])
def test_bad_request_is_rejected_and_engine_keeps_serving(alone, make, message):
    llm = tiny(kv_cache_tokens=512)
    with pytest.raises(ValueError, match=message):
        make(llm.engine)
    assert_no_leaks(llm.engine)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == alone[:2]


def test_request_that_exactly_fills_the_context_runs_and_one_token_more_is_refused():
    """max_model_len 64: a 60-token prompt with max_tokens 4 is accepted and gets its 4
    tokens; with max_tokens 5 it is refused, the error giving the numbers."""
    llm = tiny(max_model_len=64)
    prompt = list(range(60))
    exact = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], exact)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    with pytest.raises(ValueError, match="prompt has 60 tokens and max_tokens is 5: 65 tokens; "
                                         "the model's context is 64"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=5))
    assert_no_leaks(llm.engine)


def test_torch_attention_on_cuda_is_refused_with_the_reason():
    """The CPU attention path reads its metadata on the host every layer: on CUDA that is a
    wait for the GPU per layer, so it is refused by name (before CUDA is even looked for)."""
    with pytest.raises(ValueError, match="attention torch is the CPU path.*use triton"):
        EngineConfig(preset="tiny", device="cuda", attention="torch")


def test_unchunked_prompt_over_token_budget_is_rejected():
    with pytest.raises(ValueError, match="chunked prefill is off"):
        tiny(enable_chunked_prefill=False, max_num_batched_tokens=32
             ).engine.add_request("x" * 40, GREEDY)


def test_prompt_forms_give_the_same_output():
    llm = tiny()
    ids = llm.engine.tokenizer.encode("Hello there")
    forms = ["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert llm.generate(ids, GREEDY)[0].prompt is None  # one prompt, of token ids, as in vLLM


@pytest.mark.parametrize("prompts", [None, 5, b"hello"])
def test_generate_rejects_what_is_not_a_prompt_or_a_list_of_them(prompts):
    with pytest.raises(ValueError, match="prompt"):
        tiny().generate(prompts, GREEDY)


def test_generate_rejects_whole_batch_if_one_prompt_is_bad():
    llm = tiny()
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    assert_no_leaks(llm.engine)


def test_generate_withdraws_its_batch_on_any_exception(alone):
    llm, calls = tiny(), []
    real_step = llm.engine.step

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()
    llm.engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    llm.engine.step = real_step
    assert_no_leaks(llm.engine)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == alone[:2]


def progress_frames(err: str) -> list[str]:
    """What each redraw of the progress line wrote (each starts with "\\r")."""
    assert err.startswith("\r") and "\n" not in err, f"not one line redrawn in place: {err!r}"
    return err.split("\r")[1:]


def test_generate_progress_line_counts_every_prompt_then_is_blanked(capsys):
    tiny().generate(PROMPTS, GREEDY, use_tqdm=True)
    *drawn, blank, after = progress_frames(capsys.readouterr().err)
    assert drawn[-1].startswith(f"{len(PROMPTS)}/{len(PROMPTS)} prompts, ")
    assert re.search(r"input \d+ tok/s, output \d+ tok/s", drawn[-1])
    assert (blank, after) == (" " * len(drawn[-1]), "")  # blanked, the cursor at column 0


def test_generate_progress_by_default_only_when_stderr_is_a_terminal(capsys, monkeypatch):
    llm = tiny()
    llm.generate(PROMPTS[:2], GREEDY)
    assert capsys.readouterr().err == ""  # capsys's stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # now it says it is
    llm.generate(PROMPTS[:2], GREEDY)
    assert "2/2 prompts, " in capsys.readouterr().err


def test_generate_progress_off_draws_nothing_even_at_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # capsys's stderr, as a terminal
    tiny().generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("use_tqdm", [1, 0, "yes"])
def test_generate_rejects_a_use_tqdm_that_is_not_none_or_a_bool(use_tqdm):
    with pytest.raises(ValueError, match="use_tqdm must be None, True or False"):
        tiny().generate(PROMPTS[:2], GREEDY, use_tqdm=use_tqdm)


def test_automatic_request_ids_never_collide_with_chosen_ones():
    engine = tiny().engine
    chosen = [engine.add_request("a", GREEDY, request_id=str(i)) for i in (0, 1, 3)]
    automatic = [engine.add_request("b", GREEDY) for _ in range(3)]
    assert len(set(chosen + automatic)) == 6


def test_outputs_and_params_are_copies(alone):
    """Changing a returned output, or the SamplingParams after add_request, changes nothing."""
    engine = tiny().engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request(PROMPTS[1], params, "r")
    params.max_tokens, params.temperature = 1, 2.0
    params.stop.append("e")
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            out.outputs[0].token_ids.append(999)
            out.prompt_token_ids.clear()
    assert tokens == alone[1]


# ----------------------------------------------------------------------------- failure, abort

def test_a_failing_request_fails_alone(alone, monkeypatch):
    """The model raises whenever one request's token is in the batch: that request alone ends
    with finish_reason "error" and the error; the others' tokens do not change."""
    llm = tiny(max_num_batched_tokens=64)
    real_forward = llm.engine.model.forward

    def forward(input_ids, *args):
        if (input_ids == 256).any():  # <|endoftext|>: only the poisoned prompt has it
            raise RuntimeError("poisoned batch")
        return real_forward(input_ids, *args)
    monkeypatch.setattr(llm.engine.model, "forward", forward)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, str(i))
    engine.add_request("bad<|endoftext|>", GREEDY, "bad")
    deltas = run_to_end(engine)
    last = deltas["bad"][-1].outputs[0]
    assert (last.finish_reason, last.error, last.stop_reason) == (
        "error", "RuntimeError: poisoned batch", None)
    assert [whole_token_ids(deltas[str(i)])
            for i in range(len(PROMPTS))] == alone
    assert_no_leaks(engine)


@pytest.mark.parametrize("method", ["append", "new_text"])
def test_a_request_failing_in_update_fails_alone(alone, method):
    engine = tiny().engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, GREEDY, str(i))
    deltas = run_to_end(engine, steps=1)
    setattr(engine.seqs["1"].detokenizer, method, lambda *args: 1 / 0)
    run_to_end(engine, deltas)
    last = deltas["1"][-1].outputs[0]
    assert (last.finish_reason, last.error) == ("error", "ZeroDivisionError: division by zero")
    assert [whole_token_ids(deltas[i]) for i in "02"] == \
        [alone[0], alone[2]]
    assert_no_leaks(engine)


def poison_the_device(engine: Engine) -> list:
    """Make every forward raise what CUDA raises after a device-side assert; returns the list
    of the forwards tried."""
    tried = []

    def forward(*args):
        tried.append(args)
        raise RuntimeError("CUDA error: device-side assert triggered")
    engine.model.forward = forward
    return tried


def test_a_device_error_ends_the_engine_at_once_without_retrying_each_request():
    """A CUDA error leaves the context unusable whichever request caused it: the engine stops
    with one EngineDeadError (not a retry that aborts the requests one by one), and every
    later step and generate() says so at once."""
    llm = tiny()
    for prompt in PROMPTS:
        llm.engine.add_request(prompt, GREEDY)
    tried = poison_the_device(llm.engine)
    with pytest.raises(nanoserve.EngineDeadError, match="device-side assert.*restarted"):
        llm.engine.step()
    assert len(tried) == 1
    with pytest.raises(nanoserve.EngineDeadError):
        llm.engine.step()
    with pytest.raises(nanoserve.EngineDeadError):
        llm.generate(["hi"], GREEDY)
    assert len(tried) == 1


def test_server_answers_every_open_request_when_the_engine_dies():
    """The server's engine dies under a streamed and a non-streamed request: each gets its
    500 at once (the stream as an error event, then [DONE]), the server stops, and run()
    raises the EngineDeadError (the command line then exits 1)."""
    engine = tiny().engine
    working_forward = engine.model.forward

    def forward(*args):  # the device works until both requests are in, then fails
        if len(engine.seqs) < 2:
            return working_forward(*args)
        raise RuntimeError("CUDA error: device-side assert triggered")
    engine.model.forward = forward
    server = Server(engine, ServerConfig(port=0))
    raised = []

    def run_server() -> None:
        try:
            asyncio.run(server.run())
        except nanoserve.EngineDeadError as e:
            raised.append(e)
    thread = threading.Thread(target=run_server)
    thread.start()
    assert server.started.wait(30)
    results = {}

    def client(stream: bool) -> None:
        results[stream] = http(server.url, "/v1/completions", dict(
            prompt="hi", max_tokens=900, ignore_eos=True, stream=stream))
    clients = [threading.Thread(target=client, args=(stream,)) for stream in (True, False)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(60)
    thread.join(30)
    assert not thread.is_alive() and len(raised) == 1
    status, body = results[False]
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "the device failed" in body["error"]["message"]
    status, text = results[True]
    events = parse_events(text)
    assert status == 200 and events[-2]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("victim_state, blocks_freed, left_the_queue", [
    ("running", 1, 0),   # "A" holds one block of its own
    ("waiting", 0, 1),   # holds none, but leaves the waiting queue
])
def test_abort_frees_blocks_and_leaves_others_unchanged(alone, victim_state, blocks_freed,
                                                        left_the_queue):
    engine = tiny(max_num_seqs=len(PROMPTS) - 1, max_num_batched_tokens=64).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    deltas = run_to_end(engine, steps=3)
    victim = ids[0] if victim_state == "running" else ids[-1]
    assert engine.seqs[victim].status.value == victim_state
    free_before = engine.block_pool.num_free_blocks
    waiting_before = len(engine.scheduler.waiting)
    engine.abort(victim)
    assert engine.block_pool.num_free_blocks == free_before + blocks_freed
    assert len(engine.scheduler.waiting) == waiting_before - left_the_queue
    run_to_end(engine, deltas)
    last = deltas[victim][-1]
    assert last.finished and (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == (
        "abort", None)
    others = [i for i, request_id in enumerate(ids) if request_id != victim]
    assert [whole_token_ids(deltas[ids[i]]) for i in others] == \
        [alone[i] for i in others]
    assert_no_leaks(engine)


def test_abort_from_another_thread_waits_for_the_step_in_flight(alone, monkeypatch):
    """engine.abort, called from another thread while a step runs, waits for the step to end
    (the engine's lock), then frees the requests; the others' tokens do not change. The
    abort surely comes during the step: the model's forward starts the aborting thread and
    goes on only once that thread is about to call abort."""
    engine = tiny(max_num_batched_tokens=64).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    deltas = run_to_end(engine, steps=1)
    events = []
    calling_abort = threading.Event()

    def abort_odd_ones():
        calling_abort.set()
        for request_id in ids[1::2]:
            engine.abort(request_id)
            events.append(f"aborted {request_id}")
    aborter = threading.Thread(target=abort_odd_ones)
    real_forward = engine.model.forward
    real_record = engine.record

    def forward(*args):
        aborter.start()
        calling_abort.wait()
        return real_forward(*args)

    def record(*args):  # the step's last part
        real_record(*args)
        events.append("step ends")
    monkeypatch.setattr(engine.model, "forward", forward)
    monkeypatch.setattr(engine, "record", record)
    run_to_end(engine, deltas, steps=1)
    monkeypatch.undo()
    aborter.join()
    assert events == ["step ends"] + [f"aborted {i}" for i in ids[1::2]]
    run_to_end(engine, deltas)
    assert all(deltas[i][-1].outputs[0].finish_reason == "abort" for i in ids[1::2])
    assert [whole_token_ids(deltas[i]) for i in ids[::2]] == alone[::2]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- scheduler rules

def make_scheduler(num_blocks=64, budget=512, max_num_seqs=8, policy="fcfs", **kwargs):
    block_pool = BlockPool(num_blocks, block_size=4)
    return Scheduler(block_pool, max_num_seqs, budget, True, policy, **kwargs), block_pool


def running_seq(scheduler, block_pool, seq_id, prompt_len, computed, max_tokens=10) -> Sequence:
    """A running sequence with `computed` of its prompt's tokens already cached."""
    seq = Sequence(seq_id, "", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                   BlockTable(block_pool))
    assert seq.block_table.ensure(computed)
    seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def test_decodes_are_scheduled_before_prefills():
    scheduler, block_pool = make_scheduler(budget=8)
    prefill = running_seq(scheduler, block_pool, "p", 30, 8)  # admitted first
    decode = running_seq(scheduler, block_pool, "d", 5, 4)     # one uncomputed token
    assert list(scheduler.schedule().num_scheduled_tokens.items()) == [(decode, 1), (prefill, 7)]


def test_newest_running_sequence_is_preempted_first():
    scheduler, block_pool = make_scheduler(num_blocks=4)
    old, mid, new = (running_seq(scheduler, block_pool, s, 5, 4) for s in "omn")  # 1 block each
    output = scheduler.schedule()  # each needs a 2nd block for token 5; none is free
    assert new.status == SequenceStatus.WAITING and new.block_table.block_ids == []
    assert output.num_scheduled_tokens == {old: 1, mid: 1} and output.preempted == [new]
    assert scheduler.num_preemptions == 1


def test_chunks_never_exceed_the_token_budget():
    llm = tiny(max_num_batched_tokens=24)
    sizes = []
    real_schedule = llm.engine.scheduler.schedule

    def schedule():
        output = real_schedule()
        sizes.append(sum(output.num_scheduled_tokens.values()))
        return output
    llm.engine.scheduler.schedule = schedule
    llm.generate(PROMPTS, GREEDY)
    assert max(sizes) == 24 and len(sizes) > 40


def test_sjf_runs_the_shortest_job_first_and_bounds_starvation():
    scheduler, _ = make_scheduler(max_num_seqs=1, policy="sjf", sjf_max_wait_steps=2)
    jobs = {name: Sequence(name, "", [1, 2], SamplingParams(max_tokens=n), BlockTable(_))
            for name, n in [("long", 50), ("short", 5), ("medium", 10)]}
    for seq in jobs.values():
        scheduler.add(seq)
    order = []
    for _ in range(3):
        order += [seq.seq_id for seq in scheduler.schedule().num_scheduled_tokens]
        scheduler.finish(scheduler.running[0], SequenceStatus.FINISHED_LENGTH)
    assert order == ["short", "long", "medium"]  # at step 2 "long" has waited 2 steps


def test_static_admits_only_when_nothing_runs():
    scheduler, block_pool = make_scheduler(policy="static", max_num_seqs=2)
    seqs = [Sequence(str(i), "", [1, 2, 3], SamplingParams(), BlockTable(block_pool))
            for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert list(scheduler.schedule().num_scheduled_tokens) == seqs[:2]
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [seqs[1]]  # seqs[2] waits
    scheduler.finish(seqs[1], SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [seqs[2]]


def test_tight_kv_cache_never_preempts_and_computes_each_token_once():
    """16 requests of 8 blocks each (64 + 64 tokens, blocks of 16) on a cache of 9, 16
    tokens a step. The first's prefill spends the budget; once it decodes it holds 5 blocks,
    and the second would need 5 for its prompt and one more token: 5 > 4 free. So each is
    admitted only when the one before has finished, nothing is preempted, and every token is
    computed exactly once. Admitting on a chunk's worth of blocks, or counting the prompt
    without its one more token (4 <= 4), lets the second in, and the two preempt each
    other."""
    prompts = [[i + 1] * 64 for i in range(16)]
    llm = tiny(kv_cache_tokens=144, block_size=16, max_num_batched_tokens=16)
    llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions == 0
    # every token but the last sampled one is computed, once
    assert llm.engine.stats.num_batched_tokens == 16 * (64 + 64 - 1)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("num_blocks, admitted", [(7, True), (6, False)])
def test_admission_needs_blocks_for_its_prompt_and_the_running_ones_next_token(
        num_blocks, admitted):
    """A waiting sequence is admitted only if the free blocks cover its prompt and one more
    token, and every running sequence's tokens and one more: exactly enough admits, one block
    fewer does not. Blocks of 4: the running prefill (12 tokens) takes its 3rd block this step
    and will need a 4th for token 13; the waiting 8-token prompt needs 3 for 9 tokens: 4 free
    blocks are needed, and 7 - 3 = 4 are free. (Both lengths are whole blocks, so that the
    one more token is what takes another block.)"""
    scheduler, block_pool = make_scheduler(num_blocks=num_blocks)
    prefill = running_seq(scheduler, block_pool, "p", 12, 8)
    waiting = Sequence("w", "", [100 + i for i in range(8)], SamplingParams(max_tokens=10),
                       BlockTable(block_pool))
    scheduler.add(waiting)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens[prefill] == 4 and len(prefill.block_table.block_ids) == 3
    assert (waiting in output.num_scheduled_tokens) == admitted


def test_worked_example_of_preemption_runs_the_oldest_and_requeues_the_others_in_order():
    """Scheduler._schedule_running's docstring: four blocks of 4, all held; A (8 computed),
    B (4) and C (3) each decode. C is preempted for A's 3rd block, then B preempts itself for
    its 2nd: A runs alone, and B, then C, are next at the front of the queue."""
    scheduler, block_pool = make_scheduler(num_blocks=4)
    a = running_seq(scheduler, block_pool, "A", 9, 8)
    b = running_seq(scheduler, block_pool, "B", 5, 4)
    c = running_seq(scheduler, block_pool, "C", 4, 3)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {a: 1} and output.preempted == [c, b]
    assert scheduler.running == [a] and block_pool.num_free_blocks == 1
    scheduler.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [b, c]


def test_sjf_puts_a_preempted_sequence_before_shorter_jobs():
    """Under sjf too, a preempted sequence goes back to the front of the waiting queue: it
    was admitted before any job waiting now, even a shorter one."""
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="sjf")
    old, mid, new = (running_seq(scheduler, block_pool, s, 5, 4) for s in "omn")  # 1 block each
    short = Sequence("s", "", [100, 101], SamplingParams(max_tokens=1), BlockTable(block_pool))
    scheduler.add(short)
    assert scheduler.schedule().preempted == [new]
    assert new.estimated_remaining() > short.estimated_remaining()
    scheduler.finish(old, SequenceStatus.FINISHED_LENGTH)
    scheduler.finish(mid, SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [new, short]


def test_failed_admission_leaves_the_lru_order_of_cached_blocks_unchanged():
    """The head of the queue has 3 cached blocks but too few free blocks for the rest: it
    looks up its prefix without taking it, so the free queue (the eviction order) is the
    same after the step. Taking the prefix and giving it back would have moved its blocks
    behind the more recently used one."""
    scheduler, block_pool = make_scheduler(num_blocks=8)
    decode = running_seq(scheduler, block_pool, "d", 14, 13)  # 4 blocks, none needed soon
    prefix = [100 + i for i in range(12)]
    for tokens in (prefix, [200, 201, 202, 203]):  # cache 3 blocks, then 1 used after them
        table = BlockTable(block_pool)
        assert table.ensure(len(tokens))
        table.cache_full_blocks(tokens, len(tokens))
        table.release()
    lru_order = list(block_pool.free_queue)
    waiting = Sequence("w", "", prefix + [7] * 9, SamplingParams(max_tokens=10),
                       BlockTable(block_pool))  # 21 tokens and 1 more: 6 blocks, 3 cached
    scheduler.add(waiting)
    assert scheduler.schedule().num_scheduled_tokens == {decode: 1}
    assert list(block_pool.free_queue) == lru_order and len(block_pool.hash_to_block_id) == 4
    assert waiting.status == SequenceStatus.WAITING and waiting.block_table.block_ids == []


# ----------------------------------------------------------------------------- paged cache

def test_slot_of_a_token_follows_its_block_table():
    """The module docstring's example: block table [7, 2, 9], block size 16, token 36 -> 148."""
    table = BlockTable(BlockPool(10, block_size=16))
    table.block_ids = [7, 2, 9]
    assert table.slot_mapping(36, 37) == [148] and table.slot_mapping(15, 17) == [127, 32]


def test_a_block_returns_to_the_free_queue_when_its_count_reaches_zero():
    block_pool = BlockPool(4, block_size=16)
    table = BlockTable(block_pool)
    assert table.ensure(40) and block_pool.num_free_blocks == 1  # 40 tokens: 3 blocks
    shared = table.block_ids[0]
    block_pool.ref_counts[shared] += 1  # a second owner, as a prefix-cache hit makes
    table.release()
    assert block_pool.num_free_blocks == 3 and block_pool.ref_counts[shared] == 1
    block_pool.free([shared])
    assert block_pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        block_pool.free([shared])


# ----------------------------------------------------------------------------- prefix caching
# Every engine test serves the same requests with the cache on and off and asserts the same
# tokens, and after every step checks the block pool's books: each reference count is the
# number of block tables holding the block, the free queue is exactly the blocks nobody holds,
# uncached ones first, the cache map and the blocks' hashes agree, and no sequence is about
# to write into a shared or cached block.

CACHE_GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PREFIX = list(range(40, 40 + 37))  # 37 tokens: 4 full blocks of 8 and 5 tokens of a 5th


def caching_engine(cache: bool, **kwargs) -> Engine:
    """The tiny preset on CPU in fp32, block_size 8, with the prefix cache on or off."""
    return LLM(preset="tiny", **{"kv_cache_tokens": 2048, "device": "cpu", "dtype": "float32",
                                 "block_size": 8, "enable_prefix_caching": cache} | kwargs).engine


def check_books(engine: Engine) -> None:
    """The pool's invariants, at any point between steps."""
    pool, bs = engine.block_pool, engine.block_pool.block_size
    owners = Counter(b for seq in engine.seqs.values() for b in seq.block_table.block_ids)
    assert pool.ref_counts == [owners[b] for b in range(pool.num_blocks)]
    assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if not owners[b]}
    cached_in_order = [pool.block_id_to_hash[b] is not None for b in pool.free_queue]
    assert cached_in_order == sorted(cached_in_order)  # uncached blocks first, then cached
    assert {pool.block_id_to_hash[b] for b in pool.hash_to_block_id.values()} == set(pool.hash_to_block_id)
    assert sum(h is not None for h in pool.block_id_to_hash) == len(pool.hash_to_block_id)
    for seq in engine.scheduler.running:  # the blocks its next tokens go to: its own, uncached
        for b in seq.block_table.block_ids[seq.num_computed_tokens // bs:]:
            assert owners[b] == 1 and pool.block_id_to_hash[b] is None, f"{seq.seq_id} writes {b}"


def serve_steps(engine: Engine, arrivals: dict[int, list], aborts: dict[int, list] | None = None,
                seqs: dict | None = None) -> dict[str, list[int]]:
    """Step the engine; before step i add the requests arrivals[i] ((id, prompt, params)) and
    abort the ids aborts[i]; check the books after every step. Each request's output tokens;
    each one's Sequence into `seqs`."""
    aborts = aborts or {}
    seqs = {} if seqs is None else seqs
    whole = {}  # request id -> its whole output so far
    step = 0
    while engine.has_unfinished() or step <= max(arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            seqs[request_id] = engine.seqs[engine.add_request(prompt, params, request_id)]
        for request_id in aborts.get(step, []):
            engine.abort(request_id)
        for delta in engine.step():
            accumulate(whole, delta)
        check_books(engine)
        step += 1
        assert step < 1000, "the engine stopped making progress"
    assert_no_leaks(engine)
    return {request_id: out.outputs[0].token_ids for request_id, out in whole.items()}


def serve_both(arrivals, aborts=None, probe=None, **kwargs) -> tuple[dict, dict]:
    """serve_steps() with the cache off and on: the same tokens (but of aborted requests, whose
    length depends on the timing). The tokens and the Sequences of the run that cached;
    probe(engine) is called on its engine first."""
    off = serve_steps(caching_engine(False, **kwargs), arrivals, aborts)
    engine = caching_engine(True, **kwargs)
    if probe is not None:
        probe(engine)
    seqs = {}
    on = serve_steps(engine, arrivals, aborts, seqs)
    aborted = sum((aborts or {}).values(), [])
    assert {k: v for k, v in on.items() if k not in aborted} == \
        {k: v for k, v in off.items() if k not in aborted}
    assert engine.stats.num_cached_tokens > 0
    return on, seqs


def shared(seq) -> bool:
    """Whether seq holds a block that another sequence holds too."""
    return any(seq.block_table.block_pool.ref_counts[b] > 1 for b in seq.block_table.block_ids)


def spy(engine: Engine, name: str, before) -> None:
    """Call before(*args) ahead of each call of engine.scheduler's method `name`."""
    real = getattr(engine.scheduler, name)

    def spied(*args):
        before(*args)
        return real(*args)
    setattr(engine.scheduler, name, spied)


def test_shared_prefix_outputs_equal_without_the_cache():
    """Long shared prefix; requests diverging mid-block and at a block boundary, identical
    ones (n samples of one prompt, greedy and seeded), some arriving while the first still
    prefills the prefix (16 tokens a step), some after it finished."""
    seeded = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    arrivals = {
        0: [("first", PREFIX + [1, 2, 3], CACHE_GREEDY)],
        1: [("mid-block", PREFIX[:20] + [9] * 30, CACHE_GREEDY),  # diverges inside block 2
            ("same", PREFIX + [1, 2, 3], CACHE_GREEDY)],           # prefix half prefilled
        3: [("boundary", PREFIX[:24] + [7] * 9, CACHE_GREEDY)]
        + [(f"n{i}", PREFIX + [5], p) for i, p in enumerate(seeded)],
        30: [("late", PREFIX + [1, 2, 3], CACHE_GREEDY),
             ("late-longer", PREFIX + [1, 2, 3, 4], CACHE_GREEDY)],
    }
    _, seqs = serve_both(arrivals, max_num_batched_tokens=16)
    assert {k: seq.num_cached_tokens for k, seq in seqs.items()} == {
        "first": 0, "same": 32, "mid-block": 16, "boundary": 24, "n0": 32, "n1": 32, "n2": 32,
        "late": 32, "late-longer": 40}  # "same" waited for the budget while 32 were computed


def test_hit_counts_are_whole_cached_blocks_and_never_the_last_token():
    engine = caching_engine(True)
    cases = [  # (prompt, tokens found cached)
        (PREFIX, 0),                      # nothing cached yet
        (PREFIX, 32),                     # 37 tokens: the 4 full blocks
        (PREFIX[:32], 24),                # a whole-block prompt recomputes its last block
        (PREFIX[:20] + [9, 9], 16),       # diverges in block 2: blocks 0 and 1
        ([9] + PREFIX[1:], 0),            # the first block differs, so every hash does
    ]
    for i, (prompt, expected) in enumerate(cases):
        before, seqs = engine.stats.num_cached_tokens, {}
        serve_steps(engine, {0: [(str(i), prompt, CACHE_GREEDY)]}, seqs=seqs)
        assert seqs[str(i)].num_cached_tokens == expected
        assert engine.stats.num_cached_tokens - before == expected


def test_generated_tokens_are_cached_too():
    """A follow-up whose prompt is an earlier prompt plus its output finds both cached."""
    engine, seqs = caching_engine(True), {}
    follow_up = PREFIX + serve_steps(engine, {0: [("a", PREFIX, CACHE_GREEDY)]})["a"] + [3]
    serve_steps(engine, {0: [("b", follow_up, CACHE_GREEDY)]}, seqs=seqs)
    # computed: 37 + 23 tokens (the last sampled one never is): 7 full blocks of 8
    assert seqs["b"].num_cached_tokens == 56


def test_a_fully_cached_prompt_leaves_its_shared_blocks_untouched():
    """A prompt of 4 whole blocks, served once, then twice at once: the two share 3 cached
    blocks and each computes the 4th into a block of its own; no cached block's K/V change,
    and the outputs are the uncached ones."""
    prompt = PREFIX[:32]
    off = serve_steps(caching_engine(False), {0: [("a", prompt, CACHE_GREEDY)]})
    engine = caching_engine(True)
    serve_steps(engine, {0: [("a", prompt, CACHE_GREEDY)]})
    _, cached = engine.block_pool.find_cached_prefix(prompt + [0])
    assert len(cached) == 4  # the prompt's 4 blocks are cached
    kv = engine.k_caches[:, cached].clone(), engine.v_caches[:, cached].clone()
    on = serve_steps(engine, {0: [("b", prompt, CACHE_GREEDY), ("c", prompt, CACHE_GREEDY)]},
                     seqs=(seqs := {}))
    assert on["b"] == on["c"] == off["a"]
    assert seqs["b"].num_cached_tokens == seqs["c"].num_cached_tokens == 24
    assert torch.equal(engine.k_caches[:, cached], kv[0])
    assert torch.equal(engine.v_caches[:, cached], kv[1])


def test_eviction_under_memory_pressure_keeps_outputs_right():
    """A cache of 24 blocks for requests that need up to 9 each, three at a time: cached
    blocks are evicted, least recently used first, to make room; prefixes are still found;
    the outputs do not change."""
    prompts = [PREFIX[:8 * (i % 3 + 1)] + [100 + i] * 20 for i in range(9)]
    arrivals = {2 * i: [(str(i), p, CACHE_GREEDY)] for i, p in enumerate(prompts)}
    evictions = []

    def count_evictions(engine):
        pool, allocate = engine.block_pool, engine.block_pool.allocate

        def counting(n):
            cached, block_ids = len(pool.hash_to_block_id), allocate(n)
            evictions.append(cached - len(pool.hash_to_block_id))
            return block_ids
        pool.allocate = counting
    _, seqs = serve_both(arrivals, probe=count_evictions, kv_cache_tokens=192, max_num_seqs=3)
    assert sum(evictions) > 0 and all(seq.num_cached_tokens for seq in list(seqs.values())[3:])


def test_preemption_of_sequences_sharing_blocks_keeps_counts_and_outputs():
    """A cache too small for the running sequences' outputs: the newest is preempted while
    it shares its prefix blocks, and recomputed later from what is still cached."""
    arrivals = {0: [(str(i), PREFIX + [i] * 3, CACHE_GREEDY) for i in range(4)],
                4: [(str(i), PREFIX + [i] * 3, CACHE_GREEDY) for i in range(4, 8)]}
    preempted = []
    _, seqs = serve_both(arrivals, probe=lambda engine: spy(
        engine, "_preempt", lambda seq: preempted.append(shared(seq))),
        kv_cache_tokens=160, max_num_batched_tokens=32)
    assert any(preempted)


def test_abort_of_sequences_sharing_blocks_keeps_counts_right():
    """Aborts of running sequences that share their prefix and of waiting ones; the others'
    outputs do not change."""
    arrivals = {0: [(str(i), PREFIX + [i], CACHE_GREEDY) for i in range(6)]}
    aborts = {2: ["0"], 3: ["3"], 6: ["1", "5"]}
    aborted = []  # (the state it was aborted in, whether it shared a block then)

    def note_abort(seq, status) -> None:
        if status == SequenceStatus.FINISHED_ABORTED:
            aborted.append((seq.status.value, shared(seq)))

    def probe(engine) -> None:
        spy(engine, "finish", note_abort)
    on, _ = serve_both(arrivals, aborts, probe=probe, max_num_seqs=3, max_num_batched_tokens=24)
    assert ("running", True) in aborted and ("waiting", False) in aborted
    assert {"2", "4"} <= set(on)


def test_free_queue_hands_out_uncached_blocks_first_then_least_recently_used():
    pool = BlockPool(4, block_size=2)
    a, b, c, d = pool.allocate(4)
    for block_id, token in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(block_id, hash_block(b"", [token, token]))
    pool.free([b, a])         # b used less recently than a
    pool.free([d])            # no hash: handed out first
    pool.free([c])
    pool.touch([b])           # a hit takes b back out of the free queue
    assert pool.num_free_blocks == 3 and pool.ref_counts[b] == 1
    assert pool.allocate(2) == [d, a]
    assert hash_block(b"", [1, 1]) not in pool.hash_to_block_id  # a was evicted
    assert pool.hash_to_block_id == {hash_block(b"", [2, 2]): b, hash_block(b"", [3, 3]): c}


def test_the_first_block_cached_for_a_prefix_stays_cached():
    """Two sequences computed the same block at once: the second copy stays uncached."""
    pool = BlockPool(6, block_size=2)
    one, two = BlockTable(pool), BlockTable(pool)
    for table in (one, two):
        assert table.ensure(5)
        table.cache_full_blocks([1, 2, 3, 4, 5], 4)
    assert list(pool.hash_to_block_id.values()) == one.block_ids[:2]
    assert two.block_hashes == one.block_hashes  # the chain goes on from either
    first = one.block_ids[0]
    one.release()
    two.release()
    assert pool.ref_counts == [0] * 6 and pool.num_free_blocks == 6
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([first])


def test_block_hash_names_the_whole_prefix():
    first = hash_block(b"", [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(b"", [9, 2]), [3, 4])
    assert hash_block(first, [3, 4]) == hash_block(hash_block(b"", [1, 2]), [3, 4])


X, Y, B = PREFIX[:8], PREFIX[8:16], PREFIX[16:24]  # blocks of 8 tokens


@pytest.mark.parametrize("arrivals, num_cached_tokens", [
    ({0: [("XY", X + Y + [1, 2, 3], CACHE_GREEDY)],
      2: [("Y", Y + [4, 5, 6], CACHE_GREEDY), ("XY again", X + Y + [7], CACHE_GREEDY)]},
     {"XY": 0, "Y": 0, "XY again": 16}),
    ({0: [("BBBB", B * 4 + [1], CACHE_GREEDY)], 2: [("BBBB again", B * 4 + [2], CACHE_GREEDY)]},
     {"BBBB": 0, "BBBB again": 32}),
], ids=["shifted-by-a-block", "repeated-blocks"])
def test_a_block_is_found_only_behind_the_same_prefix(arrivals, num_cached_tokens):
    """A block's K/V depend on its position and on every token before it, so a cached block
    may serve only the same block behind the same prefix. Block Y, cached at position 1, is
    not served to a prompt that starts with Y; in B B B B, each B is its own block. The
    outputs equal those without the cache (positions are learned embeddings: the K/V of one
    block at two positions differ)."""
    _, seqs = serve_both(arrivals)
    assert {k: seq.num_cached_tokens for k, seq in seqs.items()} == num_cached_tokens


def test_a_released_prefix_is_evicted_from_its_last_block():
    """A released sequence gives its blocks back last first, so memory pressure evicts its
    prefix from the end and the prefix's first blocks are still found. Evicting the first
    block would lose them all: a lookup stops at the first block it cannot find."""
    pool = BlockPool(3, block_size=2)
    table = BlockTable(pool)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert table.ensure(6)
    table.cache_full_blocks(tokens, 6)
    first_two = table.block_ids[:2]
    table.release()
    pool.allocate(1)  # memory pressure: one of the three cached blocks is evicted
    assert pool.find_cached_prefix(tokens)[1] == first_two


def test_prompt_logprobs_requests_compute_every_prompt_token():
    """A request that asks for prompt logprobs does not read the cache: it needs them all."""
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    results = []
    for cache in (False, True):
        engine = caching_engine(cache)
        serve_steps(engine, {0: [("a", PREFIX, CACHE_GREEDY)]})
        serve_steps(engine, {0: [("b", PREFIX, params)]}, seqs=(seqs := {}))
        assert seqs["b"].num_cached_tokens == 0
        results.append(seqs["b"].prompt_logprobs)
    assert len(results[0]) == len(PREFIX) and results[0] == results[1]


def test_prefix_caching_off_caches_nothing():
    arrivals = {0: [(str(i), PREFIX + [i], CACHE_GREEDY) for i in range(3)],
                5: [("3", PREFIX, CACHE_GREEDY)]}
    engine = caching_engine(False)
    serve_steps(engine, arrivals)
    assert engine.stats.num_cached_tokens == 0 and not engine.block_pool.hash_to_block_id
    assert engine.stats.num_prompt_tokens == 3 * 38 + 37


# ----------------------------------------------------------------------------- checkpoints

def hf_gpt2_state(config: M.GPTConfig) -> dict[str, torch.Tensor]:
    """Random GPT-2 weights in Hugging Face's own layout: Conv1D (in, out) weights, mask buffers."""
    g = torch.Generator().manual_seed(0)
    C, V, T = config.n_embd, config.vocab_size, config.n_positions

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    state = {"transformer.wte.weight": r(V, C), "transformer.wpe.weight": r(T, C),
             "transformer.ln_f.weight": 1 + r(C), "transformer.ln_f.bias": r(C)}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        state |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C),
                  h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
                  h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                  h + "attn.bias": torch.tril(torch.ones(1, 1, T, T)),
                  h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
                  h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
                  h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C)}
    return state | {"lm_head.weight": state["transformer.wte.weight"]}


def hf_gpt2_logits(state: dict, config: M.GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2 written directly against the HF tensors (x @ W + b): independent of model.py."""
    F, C, H = torch.nn.functional, config.n_embd, config.n_head

    def w(name):
        return state["transformer." + name]

    def ln(x, name):
        return F.layer_norm(x, (C,), w(name + ".weight"), w(name + ".bias"))
    T = len(idx)
    x = w("wte.weight")[idx] + w("wpe.weight")[:T]
    for i in range(config.n_layer):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ w(h + "attn.c_attn.weight") + w(h + "attn.c_attn.bias")
        q, k, v = qkv.split(C, -1)
        q, k, v = (t.view(T, H, C // H).transpose(0, 1) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / (C // H) ** 0.5).masked_fill(
            torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        y = (att @ v).transpose(0, 1).reshape(T, C)
        x = x + y @ w(h + "attn.c_proj.weight") + w(h + "attn.c_proj.bias")
        m = F.gelu(ln(x, h + "ln_2") @ w(h + "mlp.c_fc.weight") + w(h + "mlp.c_fc.bias"),
                   approximate="tanh")
        x = x + m @ w(h + "mlp.c_proj.weight") + w(h + "mlp.c_proj.bias")
    return ln(x, "ln_f") @ w("wte.weight").T


def write_hf_checkpoint(path, state: dict, config: M.GPTConfig, fmt: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "n_layer": config.n_layer, "n_head": config.n_head,
                   "n_embd": config.n_embd, "n_positions": config.n_positions,
                   "vocab_size": config.vocab_size, "layer_norm_epsilon": 1e-5}, f)
    if fmt == "bin":
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0  # safetensors, by hand
    for name, t in state.items():
        blob = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


SMALL = M.GPTConfig(vocab_size=257, n_positions=64, n_embd=48, n_layer=2, n_head=3)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_checkpoint_loads_with_identical_logits(tmp_path, fmt):
    state = saved = hf_gpt2_state(SMALL)
    if fmt == "safetensors":  # HF's safetensors files drop the tied head and the prefix
        saved = {k.removeprefix("transformer."): v for k, v in state.items()
                 if k != "lm_head.weight"}
    write_hf_checkpoint(tmp_path, saved, SMALL, fmt)
    loaded = checkpoint.load_checkpoint(str(tmp_path))
    idx = torch.randint(0, 257, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_dense(idx[None])[0],
                                   hf_gpt2_logits(state, SMALL, idx), rtol=1e-4, atol=1e-4)


def test_gpt2_checkpoint_round_trips_through_our_llama_names(tmp_path):
    """The shipped GPT-2 checkpoint, loaded (renamed to our Llama-style names, q, k, v split
    out of c_attn, Conv1D weights transposed) and saved again, is the same file's tensors."""
    shipped = os.path.join(HERE, "checkpoints", "shakespeare")
    checkpoint.save_checkpoint(checkpoint.load_checkpoint(shipped), str(tmp_path))
    before = checkpoint.read_safetensors(os.path.join(shipped, "model.safetensors"))
    after = checkpoint.read_safetensors(str(tmp_path / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), "missing tensor h.1.mlp.c_fc.bias"),
    (lambda s: s.update({"transformer.wpe.weight": torch.zeros(10, 48)}), "wpe.weight has shape"),
], ids=["missing-tensor", "wrong-shape"])
def test_bad_checkpoint_names_the_problem(tmp_path, damage, message):
    state = hf_gpt2_state(SMALL)
    damage(state)
    write_hf_checkpoint(tmp_path, state, SMALL, "safetensors")
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("header", [b"\xff" * 4, struct.pack("<Q", 10**9) + b"{}",
                                    struct.pack("<Q", 5) + b"nope!"],
                         ids=["truncated", "length-past-end", "not-json"])
def test_corrupt_safetensors_header_is_reported(tmp_path, header):
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "safetensors")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(header)
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        checkpoint.load_checkpoint(str(tmp_path))


# ----------------------------------------------------------------------------- chat, defaults
# The shipped checkpoint copied with a tokenizer_config.json (its chat template) and a
# generation_config.json: chat is the template rendered as transformers' apply_chat_template
# renders it, and the file's sampling values fill the fields a request leaves unset.

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
GENERATION_CONFIG = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, max_new_tokens=7, do_sample=True)
SAMPLING_DEFAULTS = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, max_tokens=7)  # SamplingParams' names
DEFAULTS_LINE = ("using the checkpoint's sampling defaults (generation_config.json): "
                 "temperature 0.6, top_p 0.9, top_k 20, min_p 0.05, repetition_penalty 1.1, "
                 "max_tokens 7")


def chatml(messages: list[dict]) -> str:
    """CHAT_TEMPLATE's text for messages, written out by hand (transformers' own rendering of
    the template was checked to be this text)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages
                    if m["content"])
    return f"<|endoftext|>{time.strftime('%Y')}\n{turns}<|im_start|>assistant\n"


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


def record_params(monkeypatch, engine: Engine) -> list[SamplingParams]:
    """The SamplingParams of each request the engine is given from now on, as it holds them."""
    seen = []
    add_request = engine.add_request

    def add_and_record(prompt, params=None, request_id=None):
        request_id = add_request(prompt, params, request_id)
        seen.append(engine.seqs[request_id].params)
        return request_id
    monkeypatch.setattr(engine, "add_request", add_and_record)
    return seen


def test_chat_prompt_is_the_checkpoints_template_rendered_as_transformers_does(tmp_path):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    messages = [dict(role="system", content="Be brief."), dict(role="user", content=""),
                dict(role="user", content="Hi")]
    want = llm.generate(chatml(messages), SamplingParams(max_tokens=8, temperature=0))[0]
    assert want.prompt_token_ids[0] == 256 != want.prompt_token_ids[1]  # bos_token, once
    with server_in_process(llm.engine) as url:
        tokenized = http(url, "/tokenize", dict(messages=messages))[1]
        status, got = http(url, "/v1/chat/completions", dict(messages=messages, max_tokens=8,
                                                              temperature=0))
    assert tokenized["tokens"] == want.prompt_token_ids
    assert status == 200 and got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert got["choices"][0]["message"]["content"] == want.outputs[0].text


def test_chat_template_kwargs_reach_the_template(tmp_path):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    messages = [dict(role="user", content="Hi")]
    _, want = llm.engine.parse_prompt(chatml(messages) + "<think>\n\n</think>\n\n")
    body = dict(messages=messages, chat_template_kwargs=dict(enable_thinking=False))
    with server_in_process(llm.engine) as url:
        assert http(url, "/tokenize", body)[1]["tokens"] == want
        status, got = http(url, "/v1/chat/completions", body | dict(max_tokens=2))
    assert status == 200 and got["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("body, param, message", [
    (dict(messages=[dict(role="user", content="x"), dict(role="tool", content="{}")]),
     "messages", "the chat template refused the messages: no role tool in this template"),
    (dict(messages=[dict(role="user", content="x")], chat_template_kwargs=[1]),
     "chat_template_kwargs", "chat_template_kwargs must be of type dict"),
    (dict(messages=[dict(role="bot", content="x")]), "messages", "messages must be"),
], ids=["raise_exception", "kwargs-not-an-object", "unknown-role"])
def test_a_chat_the_template_cannot_render_gets_400_naming_why(tmp_path, body, param, message):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    with server_in_process(llm.engine) as url:
        status, got = http(url, "/v1/chat/completions", body)
        assert (status, got["error"]["param"]) == (400, param)
        assert message in got["error"]["message"]
        assert http(url, "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                                      max_tokens=1))[0] == 200


@pytest.mark.parametrize("files, want", [
    (dict(chat_template="{{ bos_token }}config"), "<|endoftext|>config"),
    (dict(chat_template=[dict(name="tool_use", template="tools"),
                         dict(name="default", template="default")]), "default"),
    (dict(chat_template="config", jinja="{{ eos_token }}file"), "<|endoftext|>file"),
    (dict(chat_template="{{ bos_token }}", bos_token=dict(content="<s>", lstrip=False)), "<s>"),
], ids=["tokenizer-config", "named-default", "jinja-file-first", "token-as-object"])
def test_chat_template_is_read_where_transformers_reads_it(tmp_path, files, want):
    jinja = files.pop("jinja", None)
    path = chat_checkpoint(tmp_path, template=None, **files)
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    template = load_chat_template(path)
    assert template.render([dict(role="user", content="x")], {}) == want


CHAT_TEMPLATE_FIXTURE = os.path.join(HERE, ".ci", "fixtures", "chat_templates", "rendered.json")


def chat_template_fixture() -> dict:
    """Templates in the style of Llama 3's, Qwen3's and SmolLM2's, with the prompts that
    transformers' renderer gave for them (.ci/fixtures/chat_templates/, with the script that
    made them, which needs transformers; the tests do not)."""
    with open(CHAT_TEMPLATE_FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def fixture_template(text: str) -> ChatTemplate:
    template = chat_template_environment().from_string(text)
    return ChatTemplate(template, {}, CHAT_TEMPLATE_FIXTURE)


@pytest.mark.parametrize("case", chat_template_fixture()["cases"], ids=lambda case: case["name"])
def test_chat_templates_render_as_transformers_renders_them(case):
    """Whitespace control, namespaces, reversed loops, tojson (indented, non-ASCII), tools,
    a date_string default and chat_template_kwargs: the prompt, character for character."""
    rendered = fixture_template(case["template"]).render(case["messages"], case["kwargs"])
    assert rendered == case["rendered"]


def test_a_template_refusal_carries_the_message_transformers_gives():
    fixture = chat_template_fixture()
    qwen3 = next(case for case in fixture["cases"] if case["name"] == "qwen3")
    with pytest.raises(ValueError, match=re.escape(fixture["refusal"])):
        fixture_template(qwen3["template"]).render([dict(role="robot", content="beep")], {})


@pytest.mark.parametrize("template, message", [
    ("{% for %}", "tokenizer_config.json: the chat template does not compile"),
    ([dict(name="tool_use", template="x")], "no chat template is named default"),
], ids=["syntax", "no-default"])
def test_a_broken_chat_template_stops_the_engine_at_start_up(tmp_path, template, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_llm(chat_checkpoint(tmp_path, template))


def test_a_checkpoint_without_a_template_chats_in_the_documented_transcript(tmp_path):
    path = chat_checkpoint(tmp_path, template=None)
    llm = checkpoint_llm(path)
    messages = [dict(role="user", content="Hi")]
    _, want = llm.engine.parse_prompt(render_chat(messages))
    assert load_chat_template(path) is None
    with server_in_process(llm.engine) as url:
        assert http(url, "/tokenize", dict(messages=messages))[1]["tokens"] == want


def test_the_repl_chats_through_the_template_one_conversation_until_clear(tmp_path, monkeypatch,
                                                                         capsys):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    hi = [dict(role="user", content="Hi")]
    reply = llm.generate(chatml(hi), greedy)[0].outputs[0].text
    lines = iter(["Hi", "And?", "/clear", "Again"])

    def next_line(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line
    monkeypatch.setattr("builtins.input", next_line)
    seen = []
    add_request = llm.engine.add_request

    def add_and_record(prompt, params=None, request_id=None):
        seen.append(prompt)
        return add_request(prompt, params, request_id)
    monkeypatch.setattr(llm.engine, "add_request", add_and_record)
    cli.run_terminal(llm.engine, cli.parse_args(["--max-tokens", "4",
                                                             "--temperature", "0"]))
    conversation = hi + [dict(role="assistant", content=reply), dict(role="user", content="And?")]
    assert seen == [chatml(hi), chatml(conversation), chatml([dict(role="user", content="Again")])]
    assert "a new conversation" in capsys.readouterr().out


def test_generate_without_params_takes_the_checkpoints_defaults(tmp_path, monkeypatch):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    seen = record_params(monkeypatch, llm.engine)
    llm.generate("ROMEO:")
    llm.generate("ROMEO:", SamplingParams(max_tokens=3))
    assert seen == [SamplingParams(**SAMPLING_DEFAULTS), SamplingParams(max_tokens=3)]
    assert llm.get_default_sampling_params() == SamplingParams(**SAMPLING_DEFAULTS)


def test_http_fields_absent_or_null_take_the_checkpoints_defaults(tmp_path, monkeypatch):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    seen = record_params(monkeypatch, llm.engine)
    with server_in_process(llm.engine) as url:
        assert http(url, "/v1/completions", dict(prompt="x", top_p=None, top_k=5))[0] == 200
        assert http(url, "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                                      temperature=0.3))[0] == 200
    assert [(p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens)
            for p in seen] == [(0.6, 0.9, 5, 0.05, 1.1, 7), (0.3, 0.9, 20, 0.05, 1.1, 7)]


def test_cli_flags_given_win_over_the_checkpoints_defaults_which_win_over_its_own(tmp_path):
    engine = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG)).engine
    args = cli.parse_args(["--temperature", "0.8", "--top-p", "0.5"])  # 0.8: its own
    params = cli.cli_params(engine, args, "x")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.8, 0.5, 20, 7)
    params = cli.cli_params(engine, cli.parse_args([]), "x", max_tokens=2)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 2)


def test_generation_config_vllm_ignores_the_checkpoints_defaults(tmp_path):
    path = chat_checkpoint(tmp_path, None, GENERATION_CONFIG)
    llm = checkpoint_llm(path, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    params = cli.cli_params(llm.engine, cli.parse_args([]), "x")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.8, 0.95, 0, cli.CLI_MAX_TOKENS)


def test_the_start_up_line_names_the_defaults_taken(tmp_path, capsys):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    with server_in_process(llm.engine):
        pass
    assert DEFAULTS_LINE in capsys.readouterr().err
    status, _, err = nanoserve_main(capsys, "--model", str(tmp_path), "--device", "cpu",
                                    "--prompt", "x", "--max-tokens", "1")
    assert status == 0 and DEFAULTS_LINE in err
    status, _, err = nanoserve_main(capsys, "--model", str(tmp_path), "--device", "cpu",
                                    "--prompt", "x", "--max-tokens", "1",
                                    "--generation-config", "vllm")
    assert status == 0 and "sampling defaults" not in err


def test_a_default_max_tokens_past_the_context_is_cut_to_what_each_prompt_leaves(tmp_path):
    """generation_config.json's max_new_tokens 5000, max_model_len 32: a completion without
    max_tokens gets what its prompt's context leaves (vLLM's rule); one that asks for more
    than that itself is refused, naming why."""
    path = chat_checkpoint(tmp_path, None, dict(max_new_tokens=5000))
    llm = checkpoint_llm(path, max_model_len=32)
    with server_in_process(llm.engine) as url:
        status, reply = http(url, "/v1/completions", dict(prompt=["ROMEO:", "JULIET, my love:"],
                                                          temperature=0, ignore_eos=True))
        assert status == 200
        assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
        assert reply["usage"]["completion_tokens"] == (32 - 6) + (32 - 16)
        status, reply = http(url, "/v1/completions", dict(prompt="ROMEO:", max_tokens=100))
        assert status == 400 and "context is 32" in reply["error"]["message"]
    outputs = llm.generate(["ROMEO:", "JULIET, my love:"])  # generate() without params, the same
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    assert lengths[0] <= 32 - 6 and lengths[1] <= 32 - 16


@pytest.mark.parametrize("key, value, message", [
    ("temperature", -1, "temperature must be a number in [0, inf], got -1"),
    ("top_p", 0, "top_p must be a number in (0, 1], got 0"),
    ("top_k", 1.5, "top_k must be an integer >= -1, got 1.5"),
    ("max_new_tokens", 0, "max_tokens must be an integer >= 1, got 0"),
])
def test_a_bad_generation_config_value_is_a_clear_error_at_start_up(tmp_path, capsys, key,
                                                                      value, message):
    path = chat_checkpoint(tmp_path, None, {key: value})
    said = f"generation_config.json: {key} {value!r} is not a valid default ({message})"
    with pytest.raises(ValueError, match=re.escape(said)):
        checkpoint_llm(path)
    status, _, err = nanoserve_main(capsys, "--model", path, "--device", "cpu", "--prompt", "x")
    assert status == 2 and err.startswith("error: ") and said in err


# ----------------------------------------------------------------------------- tokenizer.json
# Small tokenizer.json files configured as Llama 3's, Qwen2's, GPT-2's and SmolLM2's are, with
# the ids Hugging Face tokenizers gives for a text of mixed scripts (and for two others), and a
# SentencePiece-style one: .ci/fixtures/tokenizers/make_tokenizer_fixtures.py made them, so the
# tests need no tokenizers.
TOKENIZER_FIXTURES = os.path.join(HERE, ".ci", "fixtures", "tokenizers")
TOKENIZER_KINDS = ["llama3", "qwen2", "gpt2", "smollm2"]


def tokenizer_fixture(kind: str) -> tuple[Tokenizer, list[dict]]:
    """A fixture's tokenizer, as load_tokenizer reads its directory, and its reference cases
    ({text, ids, decoded})."""
    path = os.path.join(TOKENIZER_FIXTURES, kind)
    with open(os.path.join(path, "reference.json"), encoding="utf-8") as f:
        return load_tokenizer(path), json.load(f)["cases"]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_encodes_to_the_ids_hugging_face_tokenizers_gives(kind):
    """Exactly tokenizers' ids: accents in NFC and NFD, CJK, Cyrillic, emoji, digit runs,
    runs of spaces, tabs and newlines, contractions, added tokens written in the text, the
    empty text; Llama 3's BOS first."""
    tokenizer, cases = tokenizer_fixture(kind)
    for case in cases:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_decode_leaves_out_special_tokens(kind):
    """decode is tokenizers' decode(skip_special_tokens=True), as vLLM decodes outputs."""
    tokenizer, cases = tokenizer_fixture(kind)
    for case in cases:
        assert tokenizer.decode(case["ids"]) == case["decoded"]


def test_tokenizer_json_added_tokens_not_marked_special_are_text():
    """Qwen's <tool_call> is an added token (one id) but not special: decoded text keeps it;
    skip_special_tokens=False (vLLM's /detokenize) keeps the special ones too."""
    qwen2, _ = tokenizer_fixture("qwen2")
    ids = qwen2.encode("<|im_start|>a<tool_call>b<|im_end|>")
    assert qwen2.decode(ids) == "a<tool_call>b"
    assert qwen2.decode(ids, skip_special_tokens=False) == "<|im_start|>a<tool_call>b<|im_end|>"


def test_tokenizer_json_bos_is_added_once():
    """Llama 3's post-processor puts <|begin_of_text|> before a text, the empty one too; a text
    that starts with it (a chat template writes it) gets no second one. Without such a
    post-processor, no BOS."""
    llama3, _ = tokenizer_fixture("llama3")
    bos = llama3.token_id("<|begin_of_text|>")
    assert llama3.bos_token_id == bos and llama3.bos_token == "<|begin_of_text|>"
    hi = llama3.encode("Hi")
    assert hi[0] == bos and hi[1:].count(bos) == 0
    assert llama3.encode("<|begin_of_text|>Hi") == hi
    assert llama3.encode("") == [bos]
    assert llama3.encode("x<|begin_of_text|>") == [bos, llama3.token_id(b"x"), bos]  # as written
    qwen2, _ = tokenizer_fixture("qwen2")
    assert qwen2.bos_token_id is None and qwen2.encode("") == []


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_added_tokens_in_a_text_are_their_ids(kind):
    """Each added token written in a text is its one id, wherever it stands; one less a
    character is ordinary text."""
    tokenizer, _ = tokenizer_fixture(kind)
    prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ordinary = tokenizer.encoding.encode_ordinary  # BPE alone: no added tokens, no BOS
    for text, token_id in tokenizer.added_tokens.items():
        if token_id == tokenizer.bos_token_id:
            continue
        assert tokenizer.encode(text) == prefix + [token_id]
        between = prefix + ordinary("a ") + [token_id] + ordinary("b")
        assert tokenizer.encode(f"a {text}b") == between
        assert token_id not in tokenizer.encode(text[:-1])


def test_tokenizer_json_nfc_applies_where_declared():
    """Qwen2's normalizer is NFC: decomposed text (e + U+0301) encodes as composed text does.
    Llama 3 declares none: there the two differ, as in tokenizers."""
    composed, decomposed = "café naïve Ångström", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m"
    qwen2, _ = tokenizer_fixture("qwen2")
    assert qwen2.encode(decomposed) == qwen2.encode(composed)
    llama3, _ = tokenizer_fixture("llama3")
    assert llama3.encode(decomposed) != llama3.encode(composed)


def test_tokenizer_json_ids_past_the_vocabulary_have_no_text():
    """Qwen's embedding has rows past its tokenizer's ids: such an id (or a negative one)
    decodes to nothing, in decode and in a request's Detokenizer."""
    qwen2, _ = tokenizer_fixture("qwen2")
    ids = qwen2.encode("ab")
    assert qwen2.decode([qwen2.n_vocab, *ids, qwen2.n_vocab + 100, -1]) == "ab"
    detokenizer = Detokenizer(qwen2, [])
    for token in [*ids, qwen2.n_vocab, qwen2.token_id("<|im_end|>")]:
        detokenizer.append(token)
    assert detokenizer.text == "ab"


def test_sentencepiece_style_tokenizer_is_refused_by_name(tmp_path):
    """Llama 2's kind (Metaspace, byte_fallback) is refused saying what it is and who uses it,
    from its tokenizer.json or from a directory holding only tokenizer.model."""
    with pytest.raises(ValueError, match=re.escape(
            "a SentencePiece-style tokenizer (Metaspace pre_tokenizer, Metaspace decoder, "
            "byte_fallback), which is not served: Llama 2, TinyLlama and Mistral 7B use it")):
        load_tokenizer(os.path.join(TOKENIZER_FIXTURES, "sentencepiece"))
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x05<unk>")
    with pytest.raises(ValueError, match=re.escape(
            "has only a SentencePiece model (tokenizer.model, no tokenizer.json), which is not "
            "served: Llama 2, TinyLlama and Mistral 7B use it")):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("where, value, message", [
    ("model.type", "WordPiece", "a WordPiece model is not served"),
    ("model.dropout", 0.1, "BPE's dropout 0.1 is not served"),
    ("model.merges.0", ["e", "r"], "the merges are not in the order of their tokens' ids"),
    ("normalizer", {"type": "NFKC"}, "normalizer NFKC is not served"),
    ("pre_tokenizer", {"type": "Whitespace"}, "pre-tokenizer Whitespace is not served"),
    ("pre_tokenizer.pretokenizers.0.behavior", "Removed", "a Split pre-tokenizer is served as"),
    ("pre_tokenizer.pretokenizers.1.add_prefix_space", True, "add_prefix_space is not served"),
    ("pre_tokenizer.pretokenizers.1.use_regex", True, "(ByteLevel use_regex True) is not served"),
    ("post_processor.processors.1.single", [{"Sequence": {"id": "A", "type_id": 0}},
                                            {"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}}],
     "template '$A <|eot_id|>' is not served"),
    ("decoder", {"type": "WordPiece"}, "decoder WordPiece is not served"),
    ("added_tokens.1.lstrip", True, "added token '<|end_of_text|>' takes the spaces beside it"),
    ("model.vocab", {}, "256 of the 256 bytes are no token"),
])
def test_tokenizer_json_not_served_is_refused_by_name(tmp_path, where, value, message):
    """Llama 3's tokenizer.json with one thing changed to what is not served: a ValueError
    naming the file and that thing, at load time."""
    with open(os.path.join(TOKENIZER_FIXTURES, "llama3", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    *parents, last = where.split(".")
    part = spec
    for key in parents:
        part = part[int(key)] if isinstance(part, list) else part[key]
    part[int(last) if isinstance(part, list) else last] = value
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_tokenizer(str(tmp_path))
    assert str(refused.value).startswith(str(tmp_path / "tokenizer.json") + ": ")


def test_engine_encodes_a_text_prompt_with_the_checkpoints_tokenizer_json(tmp_path):
    """A checkpoint with a Llama 3 tokenizer.json (its bytes only: the fixture models embed
    257 ids, <|begin_of_text|> = 256) and vocab.json beside it: tokenizer.json is read, a text
    prompt gets the BOS once, and the output's text leaves it out."""
    shutil.copytree(os.path.join(MODEL_FIXTURES, "llama3-tied"), tmp_path, dirs_exist_ok=True)
    write_byte_tokenizer(tmp_path)  # read only if tokenizer.json were not there
    with open(os.path.join(TOKENIZER_FIXTURES, "llama3", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["model"]["vocab"] = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())}
    spec["model"]["merges"] = []
    spec["added_tokens"] = [spec["added_tokens"][0] | {"id": 256}]  # <|begin_of_text|>
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    tokenizer = llm.engine.tokenizer
    assert tokenizer.bos_token_id == 256
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={256: 100})
    for prompt in ["Hi", "<|begin_of_text|>Hi"]:
        out = llm.generate([prompt], params)[0]
        assert out.prompt_token_ids == [256, tokenizer.token_id(b"H"), tokenizer.token_id(b"i")]
        assert out.outputs[0].token_ids == [256] * 4 and out.outputs[0].text == ""


# ----------------------------------------------------------------------------- architectures
# Tiny random Llama, Qwen2, Qwen3 and Mistral checkpoints in Hugging Face's layout, with
# transformers' logits for them (in fp64): .ci/fixtures/make_model_fixtures.py made them, so
# the tests need no transformers. Grouped heads in each; tied and untied heads; llama3-tied
# has Llama 3's rope_scaling, qwen2 q/k/v biases, qwen3 q/k norms and its own head_dim.
MODEL_FIXTURES = os.path.join(HERE, ".ci", "fixtures", "models")
ARCHITECTURES = ["llama3-tied", "llama-untied", "qwen2", "qwen3", "mistral"]
PARITY_TOL = 1e-4  # max |logit - transformers' logit|, our fp32 against its fp64 (measured: 1.7e-5)


def reference_logits(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's input ids (2, 40) and transformers' logits for them (2, 40, vocab)."""
    tensors = checkpoint.read_safetensors(os.path.join(MODEL_FIXTURES, name, "reference.safetensors"))
    return tensors["input_ids"], tensors["logits"]


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_logits_equal_transformers(name):
    model = checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, name))
    input_ids, want = reference_logits(name)
    assert (model.forward_dense(input_ids) - want).abs().max() < PARITY_TOL


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_greedy_tokens_equal_transformers_where_decided(name):
    """Wherever transformers' top two logits are further apart than twice the tolerance (tiny
    random weights give near-ties elsewhere), the greedy token is its token."""
    model = checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, name))
    input_ids, want = reference_logits(name)
    top_two = want.topk(2, dim=-1).values
    decided = top_two[..., 0] - top_two[..., 1] > 2 * PARITY_TOL
    assert decided.sum() >= 75  # of 80 positions: the comparison says something
    got = model.forward_dense(input_ids).argmax(-1)
    assert torch.equal(got[decided], want.argmax(-1)[decided])


def fixture_llm(name: str, path, **kwargs) -> LLM:
    """An LLM serving a fixture model (copied to path, with the byte-level tokenizer's files:
    the fixtures' 257 ids are its ids), on CPU in fp32."""
    shutil.copytree(os.path.join(MODEL_FIXTURES, name), path, dirs_exist_ok=True)
    write_byte_tokenizer(path)
    return checkpoint_llm(path, **{"kv_cache_tokens": 1024} | kwargs)


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_paged_logits_equal_dense_at_every_position(name, tmp_path):
    """The engine's paged forward (rotations from the flat batch's positions, K/V of grouped
    heads through the cache) gives the dense forward's logits at every position."""
    engine = fixture_llm(name, tmp_path, block_size=8).engine
    tokens = reference_logits(name)[0][0, :30]
    assert_paged_equals_dense_at_every_position(engine, tokens)


def test_grouped_query_kv_cache_holds_n_kv_head_heads():
    """llama-tiny: 8 query heads share 2 K/V heads, so a token's K/V take a quarter of what
    they would with a K/V head per query head, and 1 GiB holds 4 times the tokens."""
    engine = tiny(preset="llama-tiny").engine
    c = engine.model.config
    assert (c.n_head, c.n_kv_head) == (8, 2)
    assert engine.k_caches.shape[-2:] == (2, 32)
    assert engine.kv_bytes_per_token == 2 * c.n_layer * 2 * 32 * 4
    full = dataclasses.replace(c, n_kv_head=c.n_head)
    assert M.GPT(full).config.n_kv_head == 8
    assert cli.kv_cache_description(engine) == "524288 a GiB (2 K/V heads for 8)"


def llama_tiny(**kwargs) -> LLM:
    return tiny(preset="llama-tiny", **kwargs)


@pytest.fixture(scope="module")
def llama_alone() -> list[list[int]]:
    """llama-tiny's greedy outputs of each prompt on its own."""
    return [token_ids(llama_tiny().generate([p], GREEDY))[0] for p in PROMPTS]


GQA_SERVING = {  # engine settings, each exercising one way a step's batch can differ
    "batching": dict(max_num_seqs=4, enable_chunked_prefill=False, max_num_batched_tokens=256),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(kv_cache_tokens=192, max_num_batched_tokens=64)}


@pytest.mark.parametrize("how", list(GQA_SERVING))
def test_grouped_query_greedy_output_is_unchanged_by(llama_alone, how):
    llm = llama_tiny(**GQA_SERVING[how])
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == llama_alone
    if how == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_grouped_query_greedy_output_is_unchanged_by_prefix_caching(llama_alone):
    llm = llama_tiny()
    llm.generate(PROMPTS, GREEDY)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == llama_alone
    assert llm.engine.stats.num_cached_tokens > 100
    assert_no_leaks(llm.engine)


def test_grouped_query_greedy_output_is_the_same_with_triton_attention(llama_alone):
    llm = llama_tiny(attention="triton", max_num_batched_tokens=24, block_size=8, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:3], params)) == [a[:8] for a in llama_alone[:3]]
    assert_no_leaks(llm.engine)


def write_fixture_config(path, name: str, **changes) -> None:
    """A fixture model's config.json, with `changes` (None: the key removed), at path."""
    with open(os.path.join(MODEL_FIXTURES, name, "config.json")) as f:
        hf = json.load(f)
    for key, value in changes.items():
        hf.pop(key, None)
        if value is not None:
            hf[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


@pytest.mark.parametrize("name, changes, message", [
    ("mistral", dict(num_local_experts=8), "key 'num_local_experts' is not served"),
    ("llama3-tied", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling type 'yarn' is not served"),
    ("llama3-tied", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "lacks 'high_freq_factor'"),
    ("mistral", dict(sliding_window=64), "sliding_window 64 is shorter than the context 256"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64), "sliding_window 64"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    ("llama-untied", dict(hidden_act="gelu"), "hidden_act 'gelu' is not served"),
    ("qwen2", dict(architectures=["Qwen2ForSequenceClassification"]), "architectures"),
    ("qwen2", dict(model_type="gemma"), "model_type 'gemma' is not served"),
], ids=["moe", "yarn", "llama3-incomplete", "mistral-window", "qwen-window", "layer-types",
        "activation", "head", "model-type"])
def test_config_that_changes_the_computation_is_refused_by_name(tmp_path, name, changes, message):
    write_fixture_config(tmp_path, name, **changes)
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size="64"), "n_embd must be a positive integer, got '64'"),
    (dict(num_hidden_layers=True), "n_layer must be a positive integer, got True"),
    (dict(num_key_value_heads=3), "n_head 4 is not a multiple of n_kv_head 3"),
    (dict(head_dim=33), "head_dim 33 is odd"),
    (dict(hidden_size=None), "config.json lacks 'hidden_size'"),
], ids=["string-size", "bool-size", "heads-not-grouped", "odd-head-dim", "missing-size"])
def test_malformed_config_is_a_clear_error(tmp_path, changes, message):
    write_fixture_config(tmp_path, "qwen3", **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint.load_checkpoint(str(tmp_path))


def test_sliding_window_that_does_not_apply_is_accepted(tmp_path):
    """Qwen's published configs set a sliding_window with use_sliding_window false: full
    attention, served; Mistral's window as long as the context is full attention too."""
    for name, changes in (("qwen2", dict(sliding_window=64)), ("mistral", dict(sliding_window=256))):
        write_fixture_config(tmp_path, name, **changes)
        with open(tmp_path / "config.json") as f:
            checkpoint.config_from_hf(json.load(f), str(tmp_path))


def test_transformers5_config_form_gives_the_same_config():
    """transformers 5 writes rope_parameters (rope_theta inside it) where published configs
    write rope_theta and rope_scaling: both read the same."""
    with open(os.path.join(MODEL_FIXTURES, "llama3-tied", "config.json")) as f:
        published = json.load(f)
    newer = dict(published, rope_parameters=dict(published["rope_scaling"],
                                                 rope_theta=published["rope_theta"]))
    del newer["rope_scaling"], newer["rope_theta"]
    assert checkpoint.config_from_hf(newer, "x") == checkpoint.config_from_hf(published, "x")
    assert checkpoint.config_from_hf(published, "x").rope_scaling["factor"] == 8.0



# ----------------------------------------------------------------------------- checkpoints as published

def test_sharded_checkpoint_loads_as_the_whole_one(tmp_path):
    """model.safetensors.index.json: each tensor from the shard its weight_map names."""
    source = os.path.join(MODEL_FIXTURES, "mistral")
    tensors = checkpoint.read_safetensors(os.path.join(source, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    for shard, shard_names in shards.items():
        checkpoint.write_safetensors({name: tensors[name] for name in shard_names}, str(tmp_path / shard))
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    whole = checkpoint.load_checkpoint(source).state_dict()
    sharded = checkpoint.load_checkpoint(str(tmp_path)).state_dict()
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="lists shard model-00002-of-00002.safetensors, which is "
                                         "missing"):
        checkpoint.load_checkpoint(str(tmp_path))


def test_every_eos_id_of_the_checkpoint_ends_a_request(tmp_path):
    """eos_token_id as an int or a list, in generation_config.json and config.json: each one
    ends a request (the union, generation_config's first), and min_tokens bans them all."""
    llm = fixture_llm("qwen3", tmp_path)
    prompt = [5, 6, 7]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, second = llm.generate([prompt], greedy)[0].outputs[0].token_ids[:2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [second, 256]}))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"eos_token_id": [first]}))
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    assert llm.engine.eos_token_ids == [second, 256, first]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, min_tokens=3))[0]
    assert not {first, second} & set(out.outputs[0].token_ids[:3])


def test_checkpoint_without_eos_ids_ends_at_the_tokenizers_end_of_text(tmp_path):
    llm = fixture_llm("qwen3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = checkpoint_llm(tmp_path, kv_cache_tokens=1024).engine
    assert engine.eos_token_ids == [256] and llm.engine.eos_token_ids == [256]


def test_embedding_rows_past_the_tokenizer_are_never_sampled(tmp_path):
    """A model that embeds 300 ids served with a 257-id tokenizer (as Qwen pads its embedding
    past its tokenizer): the extra rows' logits are the largest, yet never sampled, never
    scored, and a request may not name them."""
    config = dataclasses.replace(SMALL, vocab_size=300)
    state = {k: v for k, v in hf_gpt2_state(config).items() if k != "lm_head.weight"}
    state["transformer.wte.weight"][257:] = 0
    write_hf_checkpoint(tmp_path, state, config, "safetensors")
    with torch.no_grad():  # the padding rows made 10x the last hidden state: their logits win
        hidden = checkpoint.load_checkpoint(str(tmp_path)).dense_hidden_states(torch.tensor([[1, 2, 3]]))
    state["transformer.wte.weight"][257:] = 10 * hidden[0, -1]
    write_hf_checkpoint(tmp_path, state, config, "safetensors")
    write_byte_tokenizer(tmp_path)
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    assert llm.engine.vocab_size == 257
    dense = llm.engine.model.forward_dense(torch.tensor([[1, 2, 3]]))[0, -1]
    assert dense.argmax() >= 257  # the padding wins, where it is not cut off
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, temperature=1.5, seed=0,
                                                   logprobs=5))[0].outputs[0]
    first = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert first.outputs[0].token_ids[0] < 257
    assert max(out.token_ids) < 257
    assert all(token_id < 257 for entry in out.logprobs for token_id in entry)
    with pytest.raises(ValueError, match="token ids must be integers in"):
        llm.generate([[1, 299]], SamplingParams(max_tokens=1))


def test_a_model_name_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    """--model Org/Name: the snapshot in $HF_HUB_CACHE that has a config.json; else the error
    says where it looked and how to download it."""
    snapshot = tmp_path / "models--Org--Tiny-Llama" / "snapshots" / "abc123"
    fixture_llm("llama3-tied", snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    llm = LLM(model="Org/Tiny-Llama", kv_cache_tokens=1024, device="cpu")
    assert llm.engine.checkpoint.path == str(snapshot)
    with pytest.raises(ValueError, match=r"nor in the Hugging Face cache .*huggingface-cli "
                                         r"download Org/Missing"):
        LLM(model="Org/Missing", device="cpu")


def test_dtype_auto_is_float32_on_a_cpu_and_the_checkpoints_on_cuda(tmp_path):
    """The fixtures say torch_dtype bfloat16: auto on a CPU computes in float32 (exact), on
    CUDA it would take bfloat16 from the checkpoint (Engine._dtype, called here directly)."""
    engine = fixture_llm("qwen3", tmp_path, dtype="auto").engine
    assert engine.checkpoint.dtype == torch.bfloat16
    assert next(engine.model.parameters()).dtype == torch.float32
    engine.config.dtype = "auto"  # as EngineConfig leaves it on CUDA
    assert engine._dtype(engine.checkpoint.dtype) == torch.bfloat16
    assert engine._dtype(None) == torch.bfloat16



def write_published_qwen(path) -> Tokenizer:
    """A tiny Qwen2 checkpoint laid out as Qwen2.5-Instruct is published: config.json (bf16,
    a sliding_window that use_sliding_window turns off), two safetensors shards and their
    index, the embedding padded past the tokenizer, a tokenizer.json (the Qwen2-style
    fixture), a ChatML template in tokenizer_config.json, and generation_config.json with two
    EOS ids and sampling defaults. Random weights in bf16. Returns its tokenizer."""
    tokenizer_dir = os.path.join(HERE, ".ci", "fixtures", "tokenizers", "qwen2")
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), path)
    tokenizer = load_tokenizer(tokenizer_dir)
    hf = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_theta=1e6, rope_scaling=None, hidden_act="silu", tie_word_embeddings=True,
              vocab_size=tokenizer.n_vocab + 42, sliding_window=64, use_sliding_window=False,
              max_window_layers=2, torch_dtype="bfloat16", eos_token_id=800)
    (path / "config.json").write_text(json.dumps(hf))
    torch.manual_seed(0)
    model = M.GPT(checkpoint.config_from_hf(hf, str(path)))
    state = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()
             if name != "lm_head.weight"}  # tied: published without it
    names = sorted(state)
    weight_map = {}
    for i, shard_names in enumerate((names[:9], names[9:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        checkpoint.write_safetensors({name: state[name] for name in shard_names}, str(path / shard))
        weight_map |= dict.fromkeys(shard_names, shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                     "<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        chat_template=chat_template, eos_token="<|im_end|>", bos_token=None)))
    (path / "generation_config.json").write_text(json.dumps(dict(
        eos_token_id=[802, 800], temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=12)))
    return tokenizer


@torch.inference_mode()
def test_a_checkpoint_as_published_serves_end_to_end(tmp_path):
    """Everything a published checkpoint brings, at once: the greedy reply to a chat equals a
    dense greedy loop over the model's own weights (bf16 on disk, fp32 here) on the prompt
    the template renders, taking only the tokenizer's ids, ending at an EOS of
    generation_config.json; an unset field takes the checkpoint's default."""
    tokenizer = write_published_qwen(tmp_path)
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=2048)
    engine = llm.engine
    assert engine.eos_token_ids == [802, 800] and engine.vocab_size == tokenizer.n_vocab
    assert engine.sampling_defaults == dict(temperature=0.7, top_p=0.8, top_k=20, max_tokens=12)
    messages = [dict(role="user", content="Wherefore art thou?")]
    prompt = engine.chat_template.render(messages, {})
    assert prompt == "<|im_start|>user\nWherefore art thou?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    want = []
    for _ in range(12):  # the dense greedy loop, over the tokenizer's ids only
        logits = engine.model.forward_dense(torch.tensor([ids + want]))[0, -1, :tokenizer.n_vocab]
        want.append(int(logits.argmax()))
        if want[-1] in (802, 800):
            break
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    default = llm.generate([prompt])[0].outputs[0]  # the checkpoint's defaults: at most 12
    assert len(default.token_ids) <= 12 and max(default.token_ids) < tokenizer.n_vocab
    with server_in_process(engine) as url:
        status, reply = http(url, "/v1/chat/completions", dict(messages=messages, temperature=0,
                                                              max_tokens=12))
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == out.outputs[0].text
    assert_no_leaks(engine)



REPETITION_PENALTY_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".ci",
                                          "fixtures", "repetition_penalty.json")


def straddling_gpt2_state() -> dict[str, torch.Tensor]:
    """hf_gpt2_state(SMALL) with the most likely tokens' logits straddling 0, so that both of
    the repetition penalty's rules (divide a positive logit, multiply a negative one) pick
    tokens: every token's embedding is -1 in channel 0 (the position embeddings' +1 there
    cancels it in the input), so the tied head adds the same -h[0] to every logit, and ln_f's
    bias in channel 0 is raised by 1.5 to make that about -1.5: it moves all logits alike, so
    their ranking is what it would be without it."""
    state = hf_gpt2_state(SMALL)
    state["transformer.wte.weight"][:, 0] = -1.0  # lm_head.weight is the same tensor
    state["transformer.wpe.weight"][:, 0] += 1.0
    state["transformer.ln_f.bias"][0] += 1.5
    return state


def write_random_gpt2(path) -> None:
    """straddling_gpt2_state() as a Hugging Face GPT-2 directory that LLM(model=path) loads:
    the weights plus byte-level tokenizer files (ids 0-255 the bytes, 256 <|endoftext|>).
    .ci/make_repetition_penalty_fixture.py loads the same directory."""
    write_hf_checkpoint(path, straddling_gpt2_state(), SMALL, "safetensors")
    write_byte_tokenizer(path)


def write_byte_tokenizer(path) -> None:
    """The byte-level tokenizer's files in directory path (ids 0-255 the bytes, 256
    <|endoftext|>), as Hugging Face's vocab.json and merges.txt."""
    vocab = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: 256}
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")  # bytes only: no merges


def tokens_before_near_tie(gaps: list[float]) -> int:
    """How many leading tokens of a greedy reference any correct implementation must match:
    those before the first whose top-two logits were within NEAR_TIE (there either token is
    right, and after it the two continue from different texts)."""
    return next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps))


def test_greedy_repetition_penalty_equals_transformers(tmp_path):
    """Greedy decoding with repetition_penalty picks the tokens that Hugging Face transformers'
    generate(do_sample=False, repetition_penalty=p) picks on the same random GPT-2, several
    penalties (above and below 1) batched together. The reference is a fixture that
    .ci/make_repetition_penalty_fixture.py recorded, so the tests do not need transformers."""
    if not os.path.exists(REPETITION_PENALTY_FIXTURE):
        pytest.skip(f"{REPETITION_PENALTY_FIXTURE} is missing; make it with "
                    "python .ci/make_repetition_penalty_fixture.py (needs transformers)")
    with open(REPETITION_PENALTY_FIXTURE) as f:
        cases = json.load(f)["cases"]
    write_random_gpt2(tmp_path)
    llm = checkpoint_llm(tmp_path)
    params = [SamplingParams(max_tokens=len(case["token_ids"]), temperature=0, ignore_eos=True,
                             repetition_penalty=case["repetition_penalty"]) for case in cases]
    outputs = token_ids(llm.generate([case["prompt_token_ids"] for case in cases], params))
    compared = 0
    for case, got in zip(cases, outputs):
        n = tokens_before_near_tie(case["top_two_gaps"])
        assert got[:n] == case["token_ids"][:n], case
        compared += n
    total = sum(len(case["token_ids"]) for case in cases)
    assert compared >= total // 2, f"near-ties left only {compared} of {total} tokens to compare"


@needs_shared
def test_gpt2_tokenizer_from_shared_files_gives_gpt2_ids_and_round_trips_text():
    enc = load_tokenizer(SHARED_GPT2)
    assert enc.encode("Hello world") == [15496, 995]
    text = "héllo wörld, 你好, привет, 👋🏽 \u200b\ufeff\t\n"
    assert enc.decode(enc.encode(text)) == text
    assert enc.encode("<|endoftext|>") == [50256] == [enc.token_id(EOT)]
    assert enc.encoding.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_gpt2_name_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    checkpoint.save_checkpoint(M.GPT(SMALL), str(snapshot))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert checkpoint.hub_checkpoint("gpt2") == str(snapshot)
    assert LLM(model="gpt2").engine.model.config == SMALL


def test_download_writes_the_file_with_a_progress_line(tmp_path, capsys):
    import functools
    import http.server
    import threading
    (tmp_path / "model.safetensors").write_bytes(b"w" * 2_500_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # loopback only
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "hub" / "snapshot" / "model.safetensors"
        checkpoint._download(f"http://127.0.0.1:{server.server_address[1]}/model.safetensors", str(target))
    finally:
        server.shutdown()
    assert target.read_bytes() == b"w" * 2_500_000 and not os.path.exists(f"{target}.part")
    assert "downloading model.safetensors: 2/2 MB" in capsys.readouterr().err


def test_gpt2_name_offline_without_cache_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ValueError, match="not in the Hugging Face cache.*pass --model DIR"):
        LLM(model="gpt2")


def test_shipped_model_loads_and_seeded_sample_is_reproducible():
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=1)
    first = LLM(device="cpu").generate(["ROMEO:"], params)[0].outputs[0]
    assert LLM(device="cpu").generate(["ROMEO:"], params)[0].outputs[0] == first
    assert len(first.text) > 20


# ----------------------------------------------------------------------------- command line

def nanoserve_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "nanoserve.py", *args], cwd=HERE, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_streams_the_text_then_a_summary():
    run = nanoserve_cli("--prompt", "ROMEO:", "--prompt", "JULIET:", "--max-tokens", "30")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ROMEO:") and "\n\nJULIET:" in run.stdout
    assert "generated tokens" in run.stderr and "peak batch 2" in run.stderr


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


def test_cli_runs_are_reproducible_and_seeded(capsys):
    args = ["--prompt", "KING:", "--max-tokens", "40"]
    first, again, other = (nanoserve_main(capsys, *args, *seed)[1]
                           for seed in ([], ["--seed", "0"], ["--seed", "1"]))
    assert first == again != other


@pytest.mark.parametrize("args, message", [
    (["--top-p", "2"], "top_p must be a number in (0, 1], got 2.0"),
    (["--temperature", "nan"], "temperature must be a number"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--max-num-seqs", "1.5"], "argument --max-num-seqs: invalid int value: '1.5'"),
    (["--device", "foo"], "unknown device 'foo'"),
    (["--block-size", "32", "--kv-cache-tokens", "16"], "block_size (32 tokens) is larger"),
    (["--model", "/nonexistent"], "neither a checkpoint directory"),
    (["--threads", "0"], "--threads must be an integer >= 1"),
    (["--prompt", "x" * 1100], "the model's context is 1024"),
], ids=["top-p", "nan", "max-tokens", "float-int", "device", "block-size", "model", "threads",
        "too-long"])
def test_cli_reports_bad_input_in_one_line(capsys, args, message):
    status, out, err = nanoserve_main(capsys, *(["--prompt", "x"] if args and "--prompt" not in
                                                args else []), *args)
    assert (status, out) == (2, "")
    assert err == f"error: {err[7:].strip()}\n" and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_says_cuda_is_missing_in_one_line():
    run = nanoserve_cli("--prompt", "x", "--device", "cuda")
    assert (run.returncode, run.stderr) == (2, "error: device 'cuda': CUDA is not available on "
                                               "this machine\n")


def start_cli(*args) -> subprocess.Popen:
    """nanoserve.py generating for long, once its first generated bytes are out."""
    proc = subprocess.Popen([sys.executable, "nanoserve.py", "--preset", "tiny", "--prompt", "x",
                             "--max-tokens", "1000", "--ignore-eos", *args], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(8)  # the prompt and some generated text
    return proc


def test_ctrl_c_ends_a_run_with_the_summary():
    proc = start_cli()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err
    assert b"generated tokens" in err and b"[interrupted]" in err


def test_closed_stdout_ends_a_run_quietly():
    proc = start_cli()
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err == b""


def test_help_shows_every_default(capsys):
    from cli import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--temperature", "0.8"), ("--top-p", "0.95"), ("--seed", "0"),
                          ("--max-num-batched-tokens", "512"), ("--block-size", "16"),
                          ("--policy", "fcfs"), ("--enable-chunked-prefill", "True")]:
        assert flag in text and f"(default: {default})" in text.rsplit(flag, 1)[1][:300], flag


def test_cli_prints_control_characters_as_escapes(capsys):
    status, out, _ = nanoserve_main(capsys, "--preset", "tiny", "--prompt", "x", "--max-tokens",
                                    "200", "--ignore-eos", "--temperature", "1")
    assert status == 0 and "\\x" in out  # random weights emit every byte
    assert not any(ord(c) < 32 and c not in "\n\t" for c in out)


def test_cli_says_once_that_triton_on_a_cpu_is_interpreted():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = nanoserve_cli("--preset", "tiny", "--prompt", "x", "--prompt", "y", "--max-tokens", "2",
                        "--attention", "triton")
    assert run.returncode == 0 and run.stderr.count("interpreter") == 1, run.stderr


# ----------------------------------------------------------------------------- REPL

def test_piped_lines_print_whole_completions_in_input_order(capsys, monkeypatch):
    prompts = ["ROMEO:", "JULIET:", "KING:"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(prompts[:2] + [""] + prompts[2:])))
    status, out, err = nanoserve_main(capsys, "--max-tokens", "30", "--temperature", "0")
    want = LLM().generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    assert status == 1 and out == "".join(p + o.outputs[0].text + "\n\n"
                                          for p, o in zip(prompts, want))
    assert err == ("error: line 3: prompt is empty: it needs at least one token\n"
                   "error: 1 of 4 lines failed\n")


def test_jsonl_answers_every_line_in_order(capsys, monkeypatch):
    lines = ['{"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}', "not json",
             '{"prompt": "KING:", "max_tokens": 20, "temperature": 0, "stop": ["e"]}',
             '{"prompt": "x", "foo": 1}', '{"prompt": "x", "temperature": NaN}',
             '{"prompt": [75, 73], "max_tokens": 5, "temperature": 0}']
    with_blank_lines = lines[:3] + ["", "  "] + lines[3:]  # skipped, but counted as lines
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(with_blank_lines) + "\n"))
    status, out, err = nanoserve_main(capsys, "--jsonl")
    got = [json.loads(line) for line in out.splitlines()]
    llm = LLM()
    for i in (0, 2, 5):
        fields = json.loads(lines[i])
        want = llm.generate(fields.pop("prompt"), SamplingParams(**fields))[0].outputs[0]
        assert (got[i]["text"], got[i]["token_ids"], got[i]["finish_reason"]) == (
            want.text, want.token_ids, want.finish_reason)
    assert got[1]["error"].startswith("line 2: not JSON (Expecting value")
    fields = ", ".join(f.name for f in dataclasses.fields(SamplingParams))
    assert got[3] == {"error": "line 6: unknown field 'foo'; a line holds \"prompt\" and any of "
                      + fields}
    assert "max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos" in fields
    assert got[4] == {"error": "line 7: temperature must be a number in [0, inf], got nan"}
    assert got[2]["stop_reason"] == "e" and got[5]["prompt"] is None
    assert (status, err) == (1, "error: 3 of 6 lines failed\n")


def read_until_closed(fd: int, chunks: list[bytes]) -> None:
    """Append what comes out of a pseudo-terminal to `chunks` until its other end is closed
    (Linux: EIO; elsewhere: an empty read). A thread's target: a full terminal blocks writers."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return
        if not chunk:
            return
        chunks.append(chunk)


def test_piped_lines_draw_progress_on_a_terminal_stderr_and_leave_stdout_alone():
    """stdin and stdout pipes, stderr a terminal: stderr holds the progress line, redrawn in
    place, counting to the end and blanked; stdout is what it is with stderr a pipe (which
    gets no progress line): the results alone."""
    import pty
    command = [sys.executable, "nanoserve.py", "--preset", "tiny", "--device", "cpu", "--dtype",
               "float32", "--max-tokens", "30", "--temperature", "0"]
    prompts = "ROMEO:\nJULIET:\nKING:\n"
    piped = subprocess.run(command, cwd=HERE, input=prompts, capture_output=True, text=True,
                           timeout=120)
    assert (piped.returncode, piped.stderr) == (0, "")
    terminal, child_end = pty.openpty()
    run = subprocess.Popen(command, cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=child_end, text=True)
    os.close(child_end)
    chunks = []
    reader = threading.Thread(target=read_until_closed, args=(terminal, chunks), daemon=True)
    reader.start()
    try:
        out, _ = run.communicate(prompts, timeout=120)
        reader.join(timeout=30)
    finally:
        run.kill()
        run.wait()
        os.close(terminal)
    *drawn, blank, after = progress_frames(b"".join(chunks).decode())
    assert (run.returncode, out) == (0, piped.stdout) and out.startswith("ROMEO:")
    assert drawn[-1].startswith("3/3 prompts, ")
    assert (blank, after) == (" " * len(drawn[-1]), "")


def test_repl_at_a_terminal_streams_sets_and_stops_on_ctrl_c():
    import pty
    import select
    pid, fd = pty.fork()
    if pid == 0:  # the child, with the pseudo-terminal as its controlling terminal
        os.chdir(HERE)
        os.execv(sys.executable, [sys.executable, "nanoserve.py", "--preset", "tiny"])
    seen = b""

    def expect(text: str, timeout: float = 60) -> None:
        nonlocal seen
        deadline = time.time() + timeout
        while text.encode() not in seen:
            ready, _, _ = select.select([fd], [], [], max(0, deadline - time.time()))
            assert ready, f"no {text!r} in {seen[-500:]!r}"
            seen += os.read(fd, 4096)
        seen = seen[seen.index(text.encode()) + len(text):]

    def send(line: str, answer: str) -> None:
        os.write(fd, line.encode())
        expect(answer)
    try:
        expect("> ")
        send("/set temperature 0\n", "temperature = 0")
        send("/set top_p 2\n", "error: top_p must be a number in (0, 1], got 2")
        send("/bogus\n", "error: unknown command")
        send("/set max_tokens 1000\n", "max_tokens = 1000")
        send("/set ignore_eos true\n", "ignore_eos = True")
        send("Hello\n", "Hello\r\n")
        expect("\\x", timeout=30)  # generating (random weights: escaped bytes)
        os.write(fd, b"\x03")  # Ctrl-C: the line discipline sends SIGINT
        expect("[interrupted]")
        send("/set max_tokens 3\n", "max_tokens = 3")
        send("/help\n", "max_tokens=3")
        send("Hi\n", "> ")  # a completion after the interrupted one runs to its end
        os.write(fd, b"/quit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


# ----------------------------------------------------------------------------- trace

TRACE_PROMPTS = ["ab", "x" * 40, "hello", "hi"]  # 2 to 40 tokens: one prefill spans 3 steps
TRACE_PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 8, 5, 4)]


@pytest.mark.parametrize("policy, grid", [
    ("static", ["request | 0         1",
                "      0 | oo*",
                "      1 | ==ooooooo*",
                "      2 | ..........oooo*",
                "      3 | ..........ooo*"]),
    ("fcfs", ["request | 0         1",
              "      0 | oo*",
              "      1 | ==ooooooo*",
              "      2 | ...oooo*",
              "      3 | ........ooo*"])])
def test_trace_draws_each_request_step_by_step(capsys, policy, grid):
    """Two at a time, 16 tokens a step: static waits for the whole batch, fcfs admits a request
    as soon as one ends. The 40-token prompt takes two chunks (=) before its first token."""
    tiny(max_num_seqs=2, max_num_batched_tokens=16, policy=policy).generate(
        TRACE_PROMPTS, TRACE_PARAMS, trace=True)
    assert capsys.readouterr().err == "\n".join(grid + ["", display.TRACE_LEGEND]) + "\n"


def test_trace_marks_a_preemption():
    llm = tiny(max_num_seqs=4, max_num_batched_tokens=16, kv_cache_tokens=48, block_size=8)
    llm.engine.step_records = []
    for i, prompt in enumerate(["ab" * 10, "x" * 20, "hello" * 4, "hi" * 10]):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True), str(i))
    run_to_end(llm.engine)
    rows = display.render_trace(llm.engine.step_records, ["0", "1", "2", "3"]).split("\n")
    assert rows[2] == "      1 | .=oooox......ooooooo*"  # preempted, back from the cache
    assert sum(len(r.preempted) for r in llm.engine.step_records) == \
        llm.engine.scheduler.num_preemptions == 2


def test_trace_marks_prefix_cache_hits(capsys):
    """Three prompts behind one 29-byte prefix, 16 tokens a step: the first computes it; each
    other starts from its cached whole blocks (c) as soon as they are written."""
    llm = tiny(max_num_seqs=4, max_num_batched_tokens=16, block_size=8)
    prefix, params = "The same long system prompt. ", SamplingParams(max_tokens=5, temperature=0)
    llm.generate([prefix + x for x in "abc"], params, trace=True)
    rows = capsys.readouterr().err.split("\n")[1:4]
    assert rows == ["      0 | =oooo*", "      1 | .coooo*", "      2 | ..coooo*"]
    assert llm.engine.stats.num_cached_tokens == 16 + 24


def test_cli_summary_gives_the_prefix_hit_rate_and_the_cache_turns_off(capsys):
    args = ["--preset", "tiny", "--prompt", "y" * 40 + "a", "--prompt", "y" * 40 + "b",
            "--max-tokens", "2", "--max-num-batched-tokens", "16"]
    assert "prefix cache hits 39%;" in nanoserve_main(capsys, *args)[2]  # 32 of 82 tokens
    assert "prefix cache hits 0%;" in nanoserve_main(capsys, *args, "--no-prefix-caching")[2]


def test_cli_summary_gives_the_kv_cache_size_and_its_tokens_a_gib(capsys):
    args = ["--preset", "llama-tiny", "--prompt", "x", "--max-tokens", "2",
            "--kv-cache-tokens", "1000"]
    assert "KV cache 992 tokens, 524288 a GiB (2 K/V heads for 8)]" in \
        nanoserve_main(capsys, *args)[2]


def test_cli_trace_needs_prompts_and_is_printed_after_the_summary(capsys):
    assert nanoserve_main(capsys, "--trace")[::2] == (2, "error: --trace needs --prompt\n")
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--prompt", "a", "--prompt", "b",
                                    "--max-tokens", "3", "--ignore-eos", "--trace")
    assert status == 0 and err.endswith("      0 | oo*\n      1 | oo*\n\n" + display.TRACE_LEGEND
                                        + "\n") and "generated tokens" in err, err


# ----------------------------------------------------------------------------- the README

# A README command that cannot run offline in a few seconds -> why it is not run here.
README_SKIPS = {
    "pip install": "installs packages",
    "pytest": "it is this test suite",
    "--serve": "starts a server that runs until stopped",
    "curl ": "needs that server running",
}


def readme_commands() -> list[tuple[str, str]]:
    """(language, command) for each bash command and each python block of README.md's code
    blocks, a bash command's continuation lines joined."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    commands = []
    for language, body in re.findall(r"```(bash|python)\n(.*?)```", readme, flags=re.DOTALL):
        if language == "python":
            commands.append((language, body))
            continue
        for command in body.replace("\\\n", " ").splitlines():
            if command.strip():
                commands.append((language, command))
    return commands


def readme_command_id(command: tuple[str, str]) -> str:
    return command[1].strip().splitlines()[0][:60]


@pytest.mark.parametrize("language, command", readme_commands(), ids=readme_command_id)
def test_readme_command_runs_as_written(language, command):
    """Every command in the README's code blocks runs offline as written, exits 0 and prints
    no error, so the README cannot drift from the code."""
    for pattern, why in README_SKIPS.items():
        if language == "bash" and pattern in command:
            pytest.skip(f"{pattern.strip()}: {why}")
    argv = ["bash", "-c", command] if language == "bash" else [sys.executable, "-c", command]
    result = subprocess.run(argv, cwd=HERE, stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "error" not in result.stderr.lower() and "Traceback" not in result.stderr, \
        result.stderr[-2000:]


# ----------------------------------------------------------------------------- HTTP server
# A real server (the tiny preset, seed 0) on a free loopback port, and the same weights in
# this process through LLM.generate: every HTTP answer must equal the offline one exactly.



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


def wait_for_log(proc: subprocess.Popen, text: str, seconds: float = 30) -> bool:
    """Whether a line of the server's stderr holds `text` (polled for up to `seconds`)."""
    deadline = time.time() + seconds
    while not any(text in line for line in proc.log.lines) and time.time() < deadline:
        time.sleep(0.05)
    return any(text in line for line in proc.log.lines)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    stop(proc)


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


@pytest.fixture(scope="module")
def offline():
    return tiny(kv_cache_tokens=None)


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
    for i in range(1, 8):
        assert lp["token_logprobs"][i] == pytest.approx(dense[i - 1, ids[i]].item(), abs=1e-4)
        top = dense[i - 1].topk(3)
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
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


@contextlib.contextmanager
def server_in_process(engine: Engine):
    """Server on a thread of this process (its loop there), serving `engine`: its
    URL; stopped at the end (shutdown without waiting, then the thread joined)."""
    server = Server(engine, ServerConfig(port=0))
    thread = threading.Thread(target=asyncio.run, args=(server.run(),), daemon=True)
    thread.start()
    try:
        assert server.started.wait(30)
        yield server.url
    finally:
        server.shutdown(timeout=0)
        thread.join(30)
    assert not thread.is_alive()


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
]


@pytest.mark.parametrize("raw, status", MALFORMED,
                         ids=["garbage", "headers-over-64k", "chunked", "length-and-chunked"])
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


def test_health_is_503_on_an_open_connection_while_the_server_drains():
    """After SIGTERM, while a request in flight may still finish, the server takes no new
    connection, and /health on one opened before says 503 (a load balancer stops sending)."""
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
        assert request(probe, "GET", "/health")[0] == 503
        thread.join(60)
        assert proc.wait(timeout=30) == 0
    finally:
        probe.close()
        stop(proc)


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
        assert "serving tiny on http://0.0.0.0:" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)  # never left running, whatever failed


# ----------------------------------------------------------------------------- bench.py
# bench.py at a tiny scale: every figure is there and agrees with the others. Never its speed.
# A 64-token KV cache (4 blocks; a request needs up to 2, and 4 run at once) lets a mode that
# admits past what fits (static, here) preempt and recompute: no greedy token may change.

TINY = ("--num-requests 8 --prompt-len 16 --limits 8 16 --online-requests 6 --online-limit 12 "
        "--mean-output-len 6 --rates 40 inf --max-num-seqs 4 --max-num-batched-tokens 24 "
        "--kv-cache-tokens 64 --host-output-lens 4 40 --kv-budget 80").split()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, str]:
    out, threads = tmp_path_factory.mktemp("bench") / "bench.json", torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            bench.main(TINY + ["--hardware-preset", "tiny", "--out", str(out)])  # sets threads
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text()), printed.getvalue()


def check_recompute(computed: int, needed: int, preemptions: int, most_per_preemption: int):
    """Tokens computed = tokens needed + what each preemption threw away: at least one token
    (a running sequence has computed some) and at most the most a sequence can hold."""
    assert needed + preemptions <= computed <= needed + preemptions * most_per_preemption
    assert (preemptions == 0) == (computed == needed)


def test_bench_offline_and_online_figures_agree(bench_run):
    result, printed = bench_run
    cfg = result["config"]
    P = 16
    assert cfg["max_num_batched_tokens"] == 24 and cfg["host_output_lens"] == [4, 40]
    assert list(result["offline"]) == ["8", "16"] and cfg["modes"] == list(bench.MODES)[:-1]
    for limit, runs in result["offline"].items():
        lengths = runs["lengths"]
        assert len(lengths) == 8 and all(1 <= n <= int(limit) for n in lengths)
        assert list(runs["modes"]) == cfg["modes"]
        needed = sum(P + n - 1 for n in lengths)  # each prompt, and each output fed back
        for mode, r in runs["modes"].items():
            assert r["output_tokens"] == sum(lengths), (limit, mode)
            assert r["same_tokens"] == 1.0, (limit, mode)  # greedy: no mode changes a token
            assert 0 < r["kv_real_share"] <= 1 and 0 < r["seqs_per_step"] <= 4
            assert r["steps"] >= max(lengths)  # one token per request per step at most
            if mode == "naive":  # its step log is its own arithmetic: nothing to check there
                continue
            assert r["kv_slots_peak"] <= 64  # the cache's size
            check_recompute(r["tokens_computed"], needed, r["preemptions"], P + int(limit) - 2)
            if mode != "no-chunk":
                assert r["tokens_per_step"] <= 24
    assert list(result["online"]) == ["40.0", "inf"]
    for runs in result["online"].values():
        assert list(runs) == [m for m in cfg["modes"] if m != "naive"]
        for r in runs.values():
            assert r["requests"] == 6 and r["output_tokens"] == sum(result["online_lengths"])
            assert r["ttft"]["mean"] <= r["e2e"]["mean"]  # the first token, then the last
    for title in ("Offline", "Online", "Decode step, tiny, 1 threads"):
        assert title in printed


def test_bench_grouped_query_runs_more_sequences_in_the_same_kv_memory(bench_run):
    """llama-tiny's 2 K/V heads for 8 make a token's K/V a quarter of llama-tiny-mha's: in the
    memory of 80 tokens of the latter, 320 of the former, and more sequences a step."""
    result, printed = bench_run
    assert list(result["grouped_query"]) == ["8", "16"]
    for limit, runs in result["grouped_query"].items():
        mha, gqa = runs["llama-tiny-mha"], runs["llama-tiny"]
        assert (mha["kv_heads"], mha["kv_tokens"]) == (8, 80)
        assert (gqa["kv_heads"], gqa["kv_tokens"]) == (2, 320)
        assert gqa["output_tokens"] == mha["output_tokens"]  # the same requests, EOS ignored
        assert mha["kv_slots_peak"] <= 80 and gqa["kv_slots_peak"] <= 320
        assert gqa["seqs_peak"] > mha["seqs_peak"] and gqa["seqs_per_step"] > mha["seqs_per_step"]
        assert gqa["vs_mha"] == gqa["tok_s"] / mha["tok_s"]
    assert "Grouped-query attention at equal KV memory" in printed


def test_bench_naive_dense_baseline_equals_the_engine_on_a_grouped_query_model():
    """On llama-tiny the naive baseline (a dense cache, left-padded batches, RoPE from each
    row's shifted positions, grouped heads through SDPA) gives the paged engine's tokens."""
    status, result, _, _ = run_bench(TINY + ["--preset", "llama-tiny", "--modes", "naive", "fcfs",
                                             "--no-grouped-query", "--rates", "inf"])
    assert status == 0
    for experiment in ("offline", "equal_memory"):
        for runs in result[experiment].values():
            assert runs["modes"]["fcfs"]["same_tokens"] == 1.0  # fcfs against naive, token by token


def test_bench_equal_memory_holds_every_mode_to_the_kv_budget(bench_run):
    """80 tokens of KV each: naive and static reserve prompt + limit a sequence (80 // 24 = 3 at
    limit 8, 80 // 32 = 2 at 16); the paged modes hold what fits, preempting if they must."""
    result, _ = bench_run
    P = 16
    budget = result["config"]["kv_budget"]
    assert budget == 80 and list(result["equal_memory"]) == ["8", "16"]
    for limit, runs in result["equal_memory"].items():
        assert runs["lengths"] == result["offline"][limit]["lengths"]  # the same requests
        contiguous = min(8, budget // (P + int(limit)))
        for mode, r in runs["modes"].items():
            assert r["kv_slots_peak"] <= budget, (limit, mode)
            assert r["same_tokens"] == 1.0, (limit, mode)  # greedy: no mode changes a token
            assert r["output_tokens"] == sum(runs["lengths"]), (limit, mode)
            if mode in ("naive", "static"):
                assert r["max_num_seqs"] == contiguous and r["seqs_peak"] <= contiguous
            else:
                assert r["max_num_seqs"] == 256
        assert runs["modes"]["naive"]["seqs_peak"] == contiguous  # every row, every step
    assert bench.parse_args(["--prompt-len", "100"]).kv_budget == 32 * (100 + 128)
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        bench.parse_args(["--kv-budget", "600"])  # 128 + 512 tokens do not fit
    assert "--kv-budget 600 holds no sequence" in err.getvalue()


def test_bench_shared_prefix_compares_the_prefix_cache_on_and_off(tmp_path):
    """Every prompt behind one 32-token prefix, two turns a conversation: the same tokens with
    the cache on (fcfs) and off (no-cache); only fcfs finds the prefix, and so computes fewer
    tokens for the same outputs."""
    out, threads = tmp_path / "bench.json", torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            bench.main(TINY + ["--shared-prefix-len", "32", "--modes", "fcfs", "no-cache",
                               "--limits", "8", "--turns", "2", "--kv-cache-tokens", "256",
                               "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    fcfs, off = (result["offline"]["8"]["modes"][m] for m in ("fcfs", "no-cache"))
    assert fcfs["same_tokens"] == off["same_tokens"] == 1.0
    assert fcfs["output_tokens"] == 2 * sum(result["offline"]["8"]["lengths"])  # both turns
    assert fcfs["prefix_hit_rate"] > 0
    assert off["prefix_hit_rate"] == 0
    assert fcfs["tokens_computed"] < off["tokens_computed"]  # the prefix's K/V, reused


def test_bench_hardware_view_figures_agree(bench_run):
    """Both views' decode rows: the forward (timed by hooks) and the host part inside the step,
    the roofline from the rates the table quotes; the batches, lengths, bytes and FLOPs the
    configuration implies; the host-cost rows at one context."""
    result, _ = bench_run
    hw = result["hardware"]
    big = result["hardware_big"]
    host = hw["host_cost"]
    for view in (hw, big):
        copy_rate = view["copy_gb_s"] * 1e9         # bytes/s
        matmul_rate = view["matmul_gflops"] * 1e9   # FLOP/s
        for d in view["decode"] + view["host_cost"]:
            # timed in separate rounds (no wait for the device inside a timed step), so the
            # split is a difference of medians: measured, not bounded here
            assert all(math.isfinite(d[k]) for k in ("paged_step_ms", "forward_ms", "host_ms"))
            roofline = max(d["weight_bytes"] / copy_rate, d["flops"] / matmul_rate) * 1e3
            assert d["roofline_ms"] == pytest.approx(roofline)
    assert [d["batch"] for d in hw["decode"]] == [1, 2, 4]  # the sequences the engine held
    assert [d["batch"] for d in big["decode"]] == [1, 8, 32, 64] and big["preset"] == "tiny"
    # 3 rounds of 2 x 16 steps (whole, then with the forward timed) from output 1
    assert all(d["output_len"] == 1 + 95 / 2 for d in hw["decode"])
    # FLOPs grow with the batch; the weights read do not (3.5M parameters less wpe, fp32)
    config = M.GPTConfig()
    params = sum(p.numel() for p in M.GPT(config).parameters())
    weights = params - config.n_positions * config.n_embd
    for d in hw["decode"] + big["decode"]:
        assert d["weight_bytes"] == 4 * weights
    one = big["decode"][0]
    many = big["decode"][-1]
    assert many["flops"] > 64 * 2 * weights > one["flops"]
    # Host cost rows: batch 4, the same context (40 + 16) for output lengths 4 and 40: the
    # engine stepped until every sequence had max(1, n - 20) output tokens, then 40 steps timed
    assert [(d["batch"], d["prompt_len"], d["output_len"]) for d in host] == [
        (4, 52, 1 + 39 / 2), (4, 16, 20 + 39 / 2)]
    sampling = hw["sampling"]
    assert set(sampling) == {"rows", "vocab", "tokens_per_row", "sample_ms",
                             "sample_with_penalties_ms"}
    assert (sampling["rows"], sampling["vocab"], sampling["tokens_per_row"]) == (64, 257, 16)


def test_bench_naive_baseline_pads_and_matches_the_engine():
    llm = LLM(preset="tiny", device="cpu", dtype="float32")
    prompts = [[5, 6, 7], list(range(40, 60)), [9] * 11]  # left-padded to 20 in one batch
    lengths = [7, 3, 12]
    outputs = llm.generate(prompts, [bench.greedy(n) for n in lengths])
    want = [o.outputs[0].token_ids for o in outputs]
    log = []
    assert bench.naive_batch(llm.engine.model, prompts, lengths, log) == want
    assert len(log) == max(lengths)  # every row runs until the longest finishes


def test_bench_refuses_a_limit_past_the_models_context(capsys):
    """gpt2's context is 1024 tokens: a 512-token prompt with a limit of 1536 would read the
    position table past its end (on CUDA, an assert that poisons the process), so bench.py
    refuses it before running anything."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "gpt2", "--prompt-len", "512", "--limits", "32", "1536"])
    assert "make 2048 tokens; the gpt2 preset's context is 1024" in capsys.readouterr().err
    bench.parse_args(["--preset", "gpt2", "--prompt-len", "512", "--limits", "32", "512"])


def test_bench_naive_baseline_reads_the_padding_once():
    """Whether a batch is padded is read from the device once, not at every decode step (on a
    GPU, a read is a wait)."""
    model = tiny().engine.model
    with CountSyncs() as counter:
        bench.naive_batch(model, [[1, 2, 3], [4, 5]], [6, 6], [])
    assert counter.syncs == ["is_nonzero"]  # bool(pads.any()), before the decode steps


def test_bench_forward_timer_leaves_no_hook_behind():
    """The forward is timed by hooks that wait for the device; a whole step is timed without
    them, so none may be left on the model once the timer closes."""
    engine = tiny().engine
    engine.add_request("hi", GREEDY)
    with bench.forward_timer(engine, "cpu") as spent:
        engine.step()
    assert len(spent) == 4  # the forward's and the logits' start and end
    assert not engine.model._forward_hooks and not engine.model._forward_pre_hooks
    assert not engine.model.lm_head._forward_hooks and not engine.model.lm_head._forward_pre_hooks


def test_ci_gpu_dry_run_checks_its_bench_flags_and_runs_them_on_the_cpu():
    """.ci/gpu runs where a failure is expensive (a lent GPU, for minutes): its bench flags
    and sizes are checked here (gpt2's context included), and its bench command runs at a
    tiny scale on the CPU, so a flag that does not exist fails here first."""
    env = dict(os.environ, DRY_RUN="1")
    result = subprocess.run(["bash", ".ci/gpu"], cwd=HERE, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open("/tmp/bench-gpu-dry-run.json") as f:  # TINY_ARGS' --out
        ran = json.load(f)
    assert list(ran["offline"]["16"]["modes"]) == ["naive", "static", "fcfs"]
    assert ran["config"]["preset"] == "tiny" and ran["hardware"]["decode"]


def test_bench_flags_come_from_its_config():
    cfg = bench.parse_args(["--max-num-batched-tokens", "7", "--modes", "fcfs", "sjf",
                            "--rates", "1", "inf"])
    assert cfg.max_num_batched_tokens == 7
    assert (cfg.modes, cfg.rates) == (("fcfs", "sjf"), (1.0, math.inf))
    for bad in (["--token-budget", "7"], ["--modes", "fifo"], ["--preset", "huge"],
                ["--max-num-seqs", "0"], ["--kv-budget", "-5"], ["--threads", "-1"],
                ["--limits", "0"], ["--rates", "nan"], ["--mean-output-len", "inf"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            bench.parse_args(bad)


# ----------------------------------------------------------------------------- bench.py --url
# The HTTP client at a tiny scale: against a stub that streams two tokens a chunk (so tokens
# must be counted from the usage chunk), against nanoserve's server with --compare, and its
# one-line errors.

URL_TINY = ("--online-requests 8 --online-limit 9 --mean-output-len 5 --prompt-len 12 "
            "--rates 25 inf --max-num-seqs 4").split()


def run_bench(argv: list[str]) -> tuple[int, dict | None, str, str]:
    """bench.main in this process: (exit status, its JSON, stdout, stderr); torch's threads put
    back after (bench sets them)."""
    threads, out, status = torch.get_num_threads(), io.StringIO(), 0
    err, path = io.StringIO(), os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                            f"bench_url_{os.getpid()}_{time.monotonic_ns()}.json")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            bench.main(argv + ["--out", path])
    except SystemExit as e:
        status = e.code
    finally:
        torch.set_num_threads(threads)
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.remove(path)
    return status, result, out.getvalue(), err.getvalue()


class Stub(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/completions streamed two tokens a chunk, then usage, [DONE]."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/v1/models":
            return self.answer(404, {"error": {"message": f"no {self.path}"}})
        self.answer(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((time.perf_counter(), body,
                                     self.headers.get("Content-Type")))
        if body.get("model") != "stub-model" or body["max_tokens"] > 100:
            return self.answer(400, {"error": {"message": "no such model, or too many tokens",
                                               "type": "invalid_request_error"}})
        if self.server.plain:  # a server that does not stream: one JSON answer
            return self.answer(200, {"object": "text_completion", "choices": [{"text": "ab"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()
        n = body["max_tokens"]
        for i in range(0, n, 2):  # a chunk of two tokens (one at the end of an odd n)
            time.sleep(0.002)
            event(json.dumps({"object": "text_completion", "choices": [{
                "index": 0, "text": "ab"[:min(2, n - i)],
                "finish_reason": "length" if i + 2 >= n else None}]}))
        event(json.dumps({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                   "completion_tokens": n}}))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture()
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.daemon_threads, server.requests, server.plain = True, [], False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def check_online(result: dict, modes: list[str]) -> None:
    """Every request counted, every requested token counted, and the figures agree."""
    lengths, cfg = result["online_lengths"], result["config"]
    want = bench.make_workload(bench.parse_args(URL_TINY), 8, 9)[1]
    assert lengths == want and len(lengths) == 8 and cfg["online_limit"] == 9
    assert list(result["online"]) == ["25.0", "inf"] and not result["offline"]
    assert "hardware" not in result
    for rate, runs in result["online"].items():
        assert list(runs) == modes
        for mode, r in runs.items():
            assert r["requests"] == 8 and r["output_tokens"] == sum(lengths), (rate, mode)
            assert r["ttft"]["p50"] <= r["e2e"]["p50"] and r["ttft"]["mean"] <= r["e2e"]["mean"]
            assert r["ttft"]["p99"] <= r["e2e"]["p99"] <= r["duration_s"]
            assert r["tpot"]["mean"] is not None  # measured: requests of several tokens
            assert r["output_throughput"] == pytest.approx(sum(lengths) / r["duration_s"])
            assert r["request_throughput"] == pytest.approx(8 / r["duration_s"])
    # Poisson arrivals on the wall clock: the last request is sent no earlier than its arrival
    gaps = np.random.default_rng(cfg["seed"] + 1).exponential(1 / 25, 8)
    assert result["online"]["25.0"]["http"]["duration_s"] >= gaps[:-1].sum()


def test_bench_url_sends_the_workload_and_counts_usage_tokens(stub):
    server, url = stub
    status, result, printed, err = run_bench(URL_TINY + ["--url", url + "/"])
    assert status == 0, err
    check_online(result, ["http"])
    assert "Online, limit 9" in printed and "Offline" not in printed and "Decode" not in printed
    # 8 requests per rate, each exactly the workload's, as OpenAI's /v1/completions asks
    prompts, lengths = bench.make_workload(bench.parse_args(URL_TINY), 8, 9)
    bodies = [body for _, body, _ in server.requests]
    assert len(bodies) == 16 and all(kind == "application/json" for *_, kind in server.requests)
    want = [dict(model="stub-model", prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                 stream=True, stream_options=dict(include_usage=True))
            for prompt, n in zip(prompts * 2, lengths * 2)]
    assert sorted(bodies, key=json.dumps) == sorted(want, key=json.dumps)  # in any order
    # chunks hold two tokens: ITL is per chunk, TPOT per token, so TPOT < ITL at the median
    r = result["online"]["inf"]["http"]
    assert r["tpot"]["p50"] < r["itl"]["p50"]


def test_bench_url_compares_with_the_engine_in_process():
    proc, url = start_server("--max-num-seqs", "4")
    try:
        status, result, printed, err = run_bench(URL_TINY + ["--url", url, "--compare"])
    finally:
        proc.kill()
        proc.wait()
    assert status == 0, err
    check_online(result, ["http", "fcfs"])  # the same tokens counted over HTTP and in process
    assert "| 25.0 | http |" in printed and "| 25.0 | fcfs |" in printed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:{port}", "error: cannot reach http://127.0.0.1:{port}: "),
    ("127.0.0.1:{port}", "error: cannot reach 127.0.0.1:{port}: "),
    ("http://127.0.0.1:{port}x", "error: cannot reach http://127.0.0.1:{port}x: ")])
def test_bench_url_unreachable_is_one_line_and_exit_2(url, message):
    port = free_port()
    status, result, printed, err = run_bench(URL_TINY + ["--url", url.format(port=port)])
    assert status == 2 and result is None and printed == ""
    assert err.startswith(message.format(port=port)) and err.count("\n") == 1, err


def test_bench_url_reports_the_servers_error(stub):
    server, url = stub
    status, result, printed, err = run_bench(URL_TINY + ["--url", url, "--online-limit", "200",
                                                         "--mean-output-len", "500"])
    assert status == 2 and result is None and err.count("\n") == 1, err
    assert err.startswith(f"error: {url}/v1/completions answered 400: ")
    assert "no such model, or too many tokens" in err
    status, _, _, err = run_bench(URL_TINY + ["--url", url + "/nowhere"])
    assert status == 2 and err.startswith(f"error: {url}/nowhere/v1/models answered 404: ")


def test_bench_url_needs_a_stream(stub):
    server, url = stub
    server.plain = True
    status, result, printed, err = run_bench(URL_TINY + ["--url", url])
    assert status == 2 and result is None and err.count("\n") == 1, err
    assert err == f"error: {url}/v1/completions streamed no choices\n"


def test_presence_and_frequency_penalties_count_the_output_not_the_prompt():
    """OpenAI's presence and frequency penalties lower the logits of the tokens generated so
    far, never the prompt's: a prompt made of the very tokens greedy decoding picks next is
    no penalty (the first token is the plain greedy one, though penalizing the prompt would
    change it), and the rest equal the dense reference loop that counts only the output."""
    llm = tiny()
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = llm.engine.tokenizer.encode(PROMPTS[3])  # "x" * 37: the model loops on one token
    prompt = base + llm.generate([base], plain)[0].outputs[0].token_ids[:8]
    first = llm.generate([prompt], plain)[0].outputs[0].token_ids[0]
    logits = llm.engine.model.forward_dense(torch.tensor([prompt]))[0, -1].detach().double()
    runner_up = logits.topk(2).values[1].item()
    compared = 0
    for presence, frequency in ((1.0, 0.0), (0.0, 0.5)):
        # counted in the prompt, `first` would lose to the runner-up
        assert logits[first] - presence - frequency * prompt.count(first) < runner_up
        params = dataclasses.replace(plain, presence_penalty=presence,
                                     frequency_penalty=frequency)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got[0] == first, (presence, frequency)
        want, num_decided = penalized_reference(llm.engine.model, prompt, 24, presence,
                                                frequency, 1.0)
        assert got[:num_decided] == want[:num_decided], (presence, frequency)
        compared += num_decided
    assert compared >= 24


def test_each_rows_logit_bias_and_min_tokens_ban_apply_to_that_row_alone():
    """Requests with different logit_bias and min_tokens in one batch each get their own
    bias and their own end-of-text ban: every one's greedy tokens equal its tokens alone,
    and every bias changes what plain greedy decoding would give."""
    llm = tiny()
    eot = llm.engine.tokenizer.token_id(EOT)
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    greedy = token_ids(llm.generate(PROMPTS[:5], plain))
    ends = dataclasses.replace(plain, ignore_eos=False, logit_bias={eot: 100})
    params = [ends,                                                  # end-of-text at once
              dataclasses.replace(plain, logit_bias={65: 100}),      # forces one token
              dataclasses.replace(plain, logit_bias={200: 100}),     # forces another
              dataclasses.replace(ends, min_tokens=4),               # end-of-text held back 4
              dataclasses.replace(plain, logit_bias={greedy[4][0]: -100})]  # bans a token
    alone = [token_ids(llm.generate([p], sp))[0] for p, sp in zip(PROMPTS, params)]
    assert alone[:3] == [[eot], [65] * 10, [200] * 10]
    assert alone[3][4:] == [eot] and eot not in alone[3][:4]
    assert alone[4][0] != greedy[4][0]
    assert all(a != g for a, g in zip(alone, greedy))
    for order in (range(5), reversed(range(5))):
        order = list(order)
        together = token_ids(llm.generate([PROMPTS[i] for i in order],
                                          [params[i] for i in order]))
        assert together == [alone[i] for i in order], order


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

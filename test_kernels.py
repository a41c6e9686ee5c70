"""kernels.py's guarantees: paged attention (the CPU path and the Triton kernel, in Triton's
interpreter) equals the reference; the kernel as launched compiles for sm_80 and sm_90.
"""
import ast
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import kernels
import model_runner
from conftest import DEVICE, HERE, CountSyncs
from kernels import (AttentionMetadata, paged_attention, paged_attention_cpu, paged_attention_ref,
                     store_kv)
from nanoserve import Engine, EngineConfig
from paged_cache import cdiv
from sampling import SamplingParams


# ----------------------------------------------------------------------------- Triton kernel

NUM_HEADS = 2


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
               device=DEVICE, num_heads=NUM_HEADS, num_kv_heads=None, num_decodes=0):
    """Random q (N, num_heads, D), caches (NB, BS, num_kv_heads, D) (default: num_heads) and
    metadata as ModelRunner._prepare_inputs builds them: shuffled blocks, 0-padding.

    Block tables are `width` columns wide (default: just wide enough for the longest sequence),
    padded with block 0, as the engine pads them to cdiv(max_model_len, block_size). The first
    num_decodes sequences, of one query each, are the metadata's decodes.
    """
    assert all(q_len == 1 for _, q_len in seq_shapes[:num_decodes])
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
        max_query_len=max(q for _, q in seq_shapes), num_decodes=num_decodes)
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
@pytest.mark.parametrize("decode_bytes, num_batches", [(8 << 20, 4), (1, 19)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_cpu_attention_matches_reference_in_every_layer(block_size, decode_bytes, num_batches,
                                                        num_heads, num_kv_heads, monkeypatch):
    """paged_attention_cpu plans a step's decodes in its first layer and reuses the plan (and
    its buffers) in the others: each layer, its own caches, must still get the reference,
    whether the decodes go up to DECODE_BATCH together (contexts 5 to 101: four batches, none
    padding a context past twice its length) or one by one (K/V past DECODE_BYTES). With
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
    assert len(meta.step_plan.batches) == num_batches
    assert all(b.shape[1:] == k_cache.shape[1:] for b in meta.step_plan.buffers)


# Three beam groups among other decodes and prefill chunks: (sequences, blocks they share).
BEAM_DECODES = [(37, 1), (38, 1), (40, 1), (21, 1), (29, 1), (70, 1), (75, 1), (9, 1),
                (40, 40), (70, 9)]
BEAM_GROUPS = [([0, 1, 2], 2), ([3, 4], 1), ([5, 6], 4)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [
    pytest.param(NUM_HEADS, NUM_HEADS, id="G1"), pytest.param(8, 2, id="G4")])
@pytest.mark.parametrize("decode_bytes", [8 << 20, 1])
def test_cpu_cascade_attention_over_beams_shared_prefixes_matches_reference(
        decode_bytes, num_heads, num_kv_heads, monkeypatch):
    """Beams that share their first P blocks (meta.shared_prefixes) attend those once for all
    of them and their own blocks apart, the two softmaxes merged by log-sum-exp: the result is
    the reference's, in every layer, for groups of 3 and 2 beams (padded to one width), of
    prefixes of 1 and 2 blocks of 8 tokens (one batch: padded to one width, masked to one
    length) and of 4 (alone: twice the shortest), or each group a batch."""
    monkeypatch.setattr("kernels.DECODE_BYTES", decode_bytes)
    q, k_cache, v_cache, meta = make_batch(BEAM_DECODES, 8, 32, device="cpu",
                                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                                           num_decodes=8)
    for group, num_shared in BEAM_GROUPS:  # the group's tables share its first beam's blocks
        meta.block_tables[group, :num_shared] = meta.block_tables[group[0], :num_shared]
    meta.shared_prefixes = BEAM_GROUPS
    layers = [(q, k_cache, v_cache), (q.flip(0), v_cache.flip(0), k_cache * 2)]
    for q, k_cache, v_cache in layers:
        out = paged_attention_cpu(q, k_cache, v_cache, meta, 0.2)
        torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2),
                                   atol=1e-5, rtol=1e-5)
    num_prefix_batches = 2 if decode_bytes > 1 else 3
    assert len(meta.step_plan.prefix_batches) == num_prefix_batches


def test_decode_batches_put_a_long_context_alone_not_beside_short_ones():
    assert kernels.decode_batches([3, 1, 2, 0], [900, 100, 110, 90], 1024) == [[3, 1, 2], [0]]
    assert kernels.decode_batches(list(range(10)), [100] * 10, 1024) == [
        list(range(kernels.DECODE_BATCH)), [8, 9]]
    one_over = kernels.DECODE_BYTES // 2  # a token's K: one decode's K and V fill the bytes
    assert kernels.decode_batches([0, 1], [1, 1], one_over) == [[0], [1]]


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


# ----------------------------------------------------------------------------- decode kernel

# Decodes first (as the engine orders them), then prefill chunks: long cached contexts that are
# multiples of nothing, one at position 0; a chunk over a 70-token prefix and a whole prompt.
DECODES_FIRST = [(37, 1), (1, 1), (150, 1), (61, 1), (83, 13), (20, 20)]
NUM_DECODES = 4
DECODES_ONLY = DECODES_FIRST[:NUM_DECODES]


class RecordedKernel:
    """A kernel of kernels.py that appends each launch's (its name, grid) to `launches`, then
    launches it, or (run=False) does nothing."""

    def __init__(self, name: str, launches: list, run: bool):
        self.name, self.kernel = name, getattr(kernels, name)
        self.launches, self.run = launches, run

    def __getitem__(self, grid):
        self.launches.append((self.name, grid))
        return self.kernel[grid] if self.run else lambda *args, **kwargs: None


def record_launches(monkeypatch, run: bool = True) -> list:
    """The (kernel name, grid) of every launch paged_attention makes from now on."""
    launches = []
    for name in ("_paged_attention_kernel", "_paged_attention_decode_kernel",
                 "_reduce_splits_kernel"):
        monkeypatch.setattr(kernels, name, RecordedKernel(name, launches, run))
    return launches


def set_num_sms(monkeypatch, num_sms: int) -> None:
    """paged_attention sees a device of num_sms SMs, a CPU's (the interpreter) or a GPU's."""
    monkeypatch.setattr(kernels, "device_num_sms", lambda device: num_sms)


@pytest.fixture
def small_splits(monkeypatch):
    """Key tiles of 16 and splits of 16 keys and up, over 24 SMs: the short contexts the
    interpreter's speed allows still cut into several splits, and a split's range ends inside
    a block and a context."""
    monkeypatch.setattr(kernels, "TILE_KEYS", 16)
    monkeypatch.setattr(kernels, "MIN_SPLIT_KEYS", 16)
    set_num_sms(monkeypatch, 24)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty's floating tensors filled with NaN: an output, or a split's partial, that no
    program writes shows, where fresh memory could hold zeros by chance."""
    empty = torch.empty

    def empty_of_nans(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
    monkeypatch.setattr(torch, "empty", empty_of_nans)


def assert_matches_reference(q, k_cache, v_cache, meta, tol=1e-5):
    """paged_attention equals the reference (in fp32, on q's rounded inputs) up to tol."""
    scale = q.shape[2] ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    expected = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# (block size, query heads, KV heads, head dim): block sizes 1, 8, 16 and 17; G = 1, 2, 7
# (Qwen2.5-0.5B's 14 over 2) and 16 (no padding to tl.dot's 16); head dims 64, 80 (padded to
# 128) and 128.
DECODE_SHAPES = [(1, 2, 2, 64), (8, 4, 2, 80), (17, 14, 2, 64), (16, 16, 1, 128),
                 (17, 1, 1, 128), (8, 7, 1, 80), (1, 16, 1, 80)]


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim", DECODE_SHAPES)
def test_decode_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim,
                                         small_splits, nan_empty, monkeypatch):
    """A batch of only decodes: the decode kernel alone, each context split over 24 // (4 *
    Hkv) programs (3 splits of 64 keys for the context of 150 over 2 KV heads, of 16 for 37;
    a context of 1 leaves all splits but one empty), then the reduce."""
    launches = record_launches(monkeypatch)
    q, k_cache, v_cache, meta = make_batch(DECODES_ONLY, block_size, head_dim,
                                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                                           num_decodes=NUM_DECODES)
    assert_matches_reference(q, k_cache, v_cache, meta)
    num_splits = 24 // (NUM_DECODES * num_kv_heads)
    assert launches == [
        ("_paged_attention_decode_kernel", (NUM_DECODES, num_kv_heads, num_splits)),
        ("_reduce_splits_kernel", (NUM_DECODES, num_heads))]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (14, 2)])
@pytest.mark.parametrize("num_decodes", [NUM_DECODES, 2, 0])
def test_mixed_batch_with_decodes_first_matches_reference(num_decodes, num_heads, num_kv_heads,
                                                          small_splits, nan_empty, monkeypatch):
    """Decodes first, then prefill chunks: the first num_decodes sequences go to the decode
    kernel, the others (two decodes among them when num_decodes is 2; all six when 0) to
    the prefill kernel, whose grid holds them alone. Every output written, each once."""
    launches = record_launches(monkeypatch)
    q, k_cache, v_cache, meta = make_batch(DECODES_FIRST, 16, 80, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, num_decodes=num_decodes)
    assert_matches_reference(q, k_cache, v_cache, meta)
    group_size = num_heads // num_kv_heads
    grids = {name: grid for name, grid in launches}
    assert len(grids) == len(launches)  # each kernel once at most
    assert grids["_paged_attention_kernel"] == (len(DECODES_FIRST) - num_decodes, num_kv_heads,
                                                cdiv(20 * group_size, 16))
    if num_decodes:
        assert grids["_paged_attention_decode_kernel"][:2] == (num_decodes, num_kv_heads)
        assert "_reduce_splits_kernel" in grids  # 24 SMs: every case splits
    else:
        assert list(grids) == ["_paged_attention_kernel"]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (14, 2)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernel_with_one_or_two_splits(num_splits, num_heads, num_kv_heads, small_splits,
                                              nan_empty, monkeypatch):
    """SMs for num_splits programs a (decode, KV head): one split writes its output itself,
    normalized, with no reduce; two, their partials, then the reduce."""
    set_num_sms(monkeypatch, num_splits * NUM_DECODES * num_kv_heads)
    launches = record_launches(monkeypatch)
    q, k_cache, v_cache, meta = make_batch(DECODES_ONLY, 8, 64, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, num_decodes=NUM_DECODES)
    assert_matches_reference(q, k_cache, v_cache, meta)
    reduce = [("_reduce_splits_kernel", (NUM_DECODES, num_heads))] if num_splits > 1 else []
    assert launches == [
        ("_paged_attention_decode_kernel", (NUM_DECODES, num_kv_heads, num_splits)), *reduce]


@pytest.mark.parametrize("dtype, tol", LOW_PRECISION)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (14, 2)])
def test_decode_kernel_low_precision_matches_fp32_reference(num_heads, num_kv_heads, dtype, tol,
                                                            small_splits):
    """fp16 and bf16 K/V and queries, their splits' partials in fp32, beside a prefill chunk."""
    q, k_cache, v_cache, meta = make_batch(DECODES_FIRST[:5], 16, 64, dtype, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, num_decodes=NUM_DECODES)
    assert_matches_reference(q, k_cache, v_cache, meta, tol)


def test_decode_launch_reads_no_tensor_value(small_splits, monkeypatch):
    """The launch of decodes, splits and reduce reads no tensor's value (on a GPU, a wait;
    under a CUDA graph, a value of the capture): the number of splits comes from shapes alone,
    so contexts of other lengths in the same shapes launch the same grids."""
    launches = record_launches(monkeypatch, run=False)
    q, k_cache, v_cache, meta = make_batch(DECODES_FIRST, 16, 64, num_heads=14, num_kv_heads=2,
                                           num_decodes=NUM_DECODES)
    with CountSyncs() as counter:
        paged_attention(q, k_cache, v_cache, meta, 0.125)
        meta.context_lens = torch.ones_like(meta.context_lens)  # values only: same grids
        paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert counter.syncs == []
    grids = kernels.launch_grids(meta, 2, 7, 16, 24)
    assert launches == 2 * [("_paged_attention_kernel", grids.prefill),
                            ("_paged_attention_decode_kernel", grids.decode),
                            ("_reduce_splits_kernel", grids.reduce)]
    assert grids.decode == (NUM_DECODES, 2, 3) and grids.prefill == (2, 2, cdiv(20 * 7, 16))


def test_decodes_get_no_program_of_the_prefill_kernel():
    """Issue 39's step: 63 decodes beside a 449-token chunk, 14 query heads over 2 KV heads
    (G = 7). With its decodes apart the step launches 520 programs, not the 25,216 of one
    grid that gives each decode as many as the chunk (cdiv(449 * 7, 16) = 197 a KV head)."""
    meta = engine_args(torch.float16, 64, ((900, 1),) * 63 + ((449, 449),),
                       num_heads=14, num_kv_heads=2)[3]
    meta.num_decodes = 63
    grids = kernels.launch_grids(meta, 2, 7, 16, 132)
    assert grids == kernels.LaunchGrids(decode=(63, 2, 1), reduce=None, prefill=(1, 2, 197))
    meta.num_decodes = 0
    assert kernels.launch_grids(meta, 2, 7, 16, 132) == kernels.LaunchGrids(
        decode=None, reduce=None, prefill=(64, 2, 197))


def test_a_chunk_past_cudas_grid_limit_is_refused_by_the_launch_and_at_the_start():
    """The prefill kernel's grid has cdiv(chunk * G, TILE_M) programs in its third dimension,
    which CUDA limits to 65,535: 131,070 tokens at G = 8 fit, one more does not. The engine
    refuses a token budget past it when it starts, and the launch any chunk past it."""
    assert kernels.max_chunk_tokens(8) == 131070
    meta = engine_args(torch.float16, 64, ((449, 449),), num_heads=8, num_kv_heads=1)[3]
    meta.max_query_len = 131070
    assert kernels.launch_grids(meta, 1, 8, 16, 132).prefill == (1, 1, 65535)
    meta.max_query_len = 131071
    with pytest.raises(ValueError, match="needs 65536 programs in a grid dimension CUDA limits "
                                         "to 65535: at most 131070 tokens"):
        kernels.launch_grids(meta, 1, 8, 16, 132)
    limit = kernels.max_chunk_tokens(4)  # llama-tiny's G
    with pytest.raises(ValueError, match=f"max_num_batched_tokens {limit + 1} is more than "
                                         f"Triton attention can prefill at once .* {limit}"):
        Engine(EngineConfig(preset="llama-tiny", device="cpu", dtype="float32",
                            attention="triton", kv_cache_tokens=256,
                            max_num_batched_tokens=limit + 1))


def test_a_cuda_devices_sms_come_from_the_runtime(fake_cuda):
    """On CUDA the decode splits fill the device's own SMs (on a CPU, CPU_NUM_SMS)."""
    assert kernels.device_num_sms(torch.device("cuda")) == fake_cuda.NUM_SMS
    assert fake_cuda.NUM_SMS != kernels.CPU_NUM_SMS


@pytest.mark.parametrize("num_decodes, num_kv_heads, max_context, num_sms, num_splits", [
    (1, 2, 32768, 132, 64),   # batch 1, Qwen2.5-0.5B: every SM, up to MAX_KV_SPLITS
    (1, 2, 1024, 132, 4),     # a table of 1024 keys: 4 splits of MIN_SPLIT_KEYS
    (1, 2, 100, 132, 1),      # shorter than MIN_SPLIT_KEYS: no split
    (8, 2, 32768, 132, 8),    # fewer splits for more sequences: 8 * 2 * 8 = 128 programs
    (33, 2, 32768, 132, 2),   # 66 (decode, KV head) on 132 SMs: 2 splits
    (66, 2, 32768, 132, 1),   # the decodes fill the SMs alone
    (200, 8, 32768, 132, 1),  # more than fill them
    (1, 2, 32768, 24, 12),    # another device's SMs
])
def test_num_kv_splits_from_shapes(num_decodes, num_kv_heads, max_context, num_sms, num_splits):
    assert kernels.num_kv_splits(num_decodes, num_kv_heads, max_context, num_sms) == num_splits


@needs_cuda
@pytest.mark.parametrize("seq_shapes, num_decodes", [(BATCHES["mixed"], 0),
                                                     (DECODES_FIRST, NUM_DECODES)])
def test_triton_launch_never_waits_for_the_gpu(seq_shapes, num_decodes):
    q, k_cache, v_cache, meta = make_batch(seq_shapes, 16, 64, torch.bfloat16,
                                           num_decodes=num_decodes)
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
    GPU raises, except in model_runner.to_host, where the step reads its tokens on purpose. A
    step that fails fails its requests (finish_reason "error"), so none may."""
    # the KV cache sized by the profile (the one CUDA test engine that is), within a tenth of
    # the GPU; graphs of 1 to 8 sequences alone
    engine = Engine(EngineConfig(preset="tiny", device="cuda", dtype="bfloat16",
                                 max_num_batched_tokens=32, max_num_seqs=8,
                                 gpu_memory_utilization=0.1))
    kinds = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=20, logprobs=2),
             SamplingParams(top_p=0.9, prompt_logprobs=1)]

    def add_requests(prompt_len: int) -> None:
        for params in kinds:
            engine.add_request(list(range(1, prompt_len + 1)),
                               dataclasses.replace(params, max_tokens=8, ignore_eos=True))
    add_requests(4)
    outputs = engine.step() + engine.step()  # compiled and warmed: the next steps are steady
    add_requests(40)  # chunked over the next steps, beside the first three's decodes
    to_host = model_runner.to_host
    reads = []

    def read_on_purpose(tensor: torch.Tensor) -> list:
        reads.append(tuple(tensor.shape))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return to_host(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(model_runner, "to_host", read_on_purpose)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            outputs += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reads  # the steps read their tokens
    assert not [o for o in outputs if o.finished and o.outputs[0].finish_reason == "error"]


# the modules whose code runs in a CUDA step with tensors of counts (kernels.py repeats by an
# int, in the CPU's attention: no wait)
STEP_MODULES = ("model_runner", "input_batch", "sampling", "spec_decode", "structured_output")


def test_no_repeat_interleave_in_a_step_waits_for_the_device():
    """repeat_interleave by a tensor of repeats reads their sum from the device, a wait in the
    middle of a step, unless output_size gives it: every call in the step's modules does
    (a CUDA test finds such a wait only on a GPU; this, on every CI)."""
    unsized = []
    for name in STEP_MODULES:
        with open(os.path.join(HERE, name + ".py")) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == \
                    "repeat_interleave" and "output_size" not in [k.arg for k in node.keywords]:
                unsized.append(f"{name}.py:{node.lineno}")
    assert unsized == []


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
# The same with their leading decodes apart (the one split, the 64 not), and 3 decodes (split)
# before the two chunks: the prefill kernel starts at sequence 64, 3 or 0.
DECODES_APART_BATCHES = [*VARIED_BATCHES, ((900, 1),) * 3 + ((16, 16), (1000, 512))]


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
                num_heads=12, num_kv_heads=None, block_size=16, width=64, num_blocks=512,
                num_decodes=0):
    """paged_attention's arguments as the engine passes them for sequences of
    (context_len, q_len), by default 3 decodes and a 37-token prefill chunk: q a view of the
    fused qkv projection, contiguous caches of num_kv_heads heads (default: num_heads, GPT-2's),
    int32 metadata, block tables cdiv(1024, 16) wide, the first num_decodes sequences decodes."""
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
        max_query_len=max(q_len for _, q_len in seq_shapes), num_decodes=num_decodes)
    return q, k_cache, torch.zeros_like(k_cache), meta, head_dim ** -0.5


def launch_specializations(args) -> list[tuple[str, str]]:
    """paged_attention(*args) as on a GPU: JITFunction.run binds the arguments and hands its
    specialization to jit_cache_hook, whose True skips the compile and the launch; (kernel
    name, specialization) of each launch, in order. The launch must not read a tensor's value
    (on a GPU, a wait for the device)."""
    import triton  # here, not at the top: kernels.py chooses the interpreter before importing it
    seen = []

    def hook(*, fn, compile, **_):
        seen.append((fn.name, compile["specialization_data"]))
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with CountSyncs() as counter:
            paged_attention(*args)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert counter.syncs == [], counter.syncs
    return seen


def launch_specialization(args) -> str:
    """The specialization of the one kernel paged_attention(*args) launches (no decodes)."""
    seen = launch_specializations(args)
    assert [name for name, _ in seen] == ["_paged_attention_kernel"], seen
    return seen[0][1]


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
    for q of num_heads heads over caches of num_kv_heads, and report what the compile gave
    (compile_report)."""
    data = launch_specialization(engine_args(getattr(torch, dtype), head_dim,
                                             num_heads=num_heads, num_kv_heads=num_kv_heads))
    return dict(cc=cc, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                num_kv_heads=num_kv_heads) | compile_report("_paged_attention_kernel", data, cc)


# The decode kernel and its reduce as launched for 3 decodes (each split in 4: the tables'
# 64 blocks of 16 hold 1024 keys, 4 splits of MIN_SPLIT_KEYS) and for 132 (unsplit, with
# CPU_NUM_SMS = 132), with GPT-2's heads and grouped ones: (dtype, head dim, query heads, KV
# heads).
DECODE_COMPILE_VARIANTS = [("float16", 64, 12, 12), ("bfloat16", 64, 14, 2),
                           ("float16", 128, 16, 8), ("bfloat16", 128, 32, 8),
                           ("float32", 64, 12, 12)]
DECODE_BATCHES = [((100, 1), (7, 1), (300, 1)), ((100, 1),) * 132]


def compile_decodes_as_launched(cc: int) -> list[dict]:
    """Compile the decode kernel and its reduce exactly as paged_attention would launch them on
    cc for DECODE_COMPILE_VARIANTS' batches, each distinct specialization once (first all are
    seen, none compiled: a compiled one would be launched), and report what each gave."""
    launched = {}  # (kernel name, specialization): the first variant and batch to launch it
    for dtype, head_dim, num_heads, num_kv_heads in DECODE_COMPILE_VARIANTS:
        for shapes in DECODE_BATCHES:
            args = engine_args(getattr(torch, dtype), head_dim, shapes, num_heads, num_kv_heads,
                               num_decodes=len(shapes))
            for name, data in launch_specializations(args):
                launched.setdefault((name, data), dict(
                    cc=cc, kernel=name, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, num_decodes=len(shapes)))
    return [report | compile_report(name, data, cc)
            for (name, data), report in launched.items()]


def compile_report(name: str, data: str, cc: int) -> dict:
    """Compile kernels.py's kernel `name` for specialization `data` on compute capability cc
    and report what the compile gave: the specialization (which parameters are bound to 1,
    which pointers are 16-byte aligned), ptxas's registers and spills, shared memory, and
    whether K/V are loaded by cp.async with copies still in flight."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    fn = getattr(kernels, name)
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
    return dict(regs=regs, spills=spills,
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
    launched = [{spec for shapes in DECODES_APART_BATCHES for spec in launch_specializations(
        engine_args(torch.float16, 64, shapes, *heads, num_decodes=leading_decodes(shapes)))}
        for heads in [(12, 12), (14, 2)]]
    for cc in COMPILE_CAPABILITIES:
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", cc, 32)))
        for variant in COMPILE_VARIANTS:  # head dim 48 (padded to 64) once, in fp16
            print(json.dumps(compile_as_launched(cc, *variant)))
        for report in compile_decodes_as_launched(cc):
            print(json.dumps(report))
    print(json.dumps(dict(specializations=[len(k) for k in keys], with_decodes_apart=[
        dict(collections.Counter(name for name, _ in specs)) for specs in launched])))


def leading_decodes(seq_shapes) -> int:
    """How many sequences of (context_len, q_len) lead the batch with one query each."""
    return next((i for i, (_, q_len) in enumerate(seq_shapes) if q_len > 1), len(seq_shapes))


@pytest.fixture(scope="module")
def compiled_variants() -> list[dict]:
    """print_compiled_variants' lines, parsed, run in a process of its own (it needs
    TRITON_INTERPRET=0); skips when this Triton lacks an internal it uses."""
    env = dict(os.environ, TRITON_INTERPRET="0")  # kernels.py keeps an explicit 0
    run_it = "import test_kernels; test_kernels.print_compiled_variants()"
    result = subprocess.run([sys.executable, "-c", run_it], env=env, capture_output=True,
                            text=True, timeout=600, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout[6:].strip())
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_triton_kernel_as_launched_compiles_for_sm80_and_sm90_without_spills(
        compiled_variants):
    """The kernel paged_attention would launch on sm_80 and sm_90, compiled without a GPU,
    with as many KV heads as query heads (GPT-2) and grouped (GQA).

    Triton's own JITFunction.run specialises the engine's real arguments (built on CPU); the
    compile of that specialisation must fit: ptxas's registers and spills, shared memory, and
    K/V loaded by cp.async, with the next tile's copies in flight during this tile's math.
    """
    rows = [r for r in compiled_variants if "kernel" not in r]  # the decode kernels' have it
    # Varied batches (sizes, decodes and chunks) launch one specialisation a model: one compile.
    assert rows.pop()["specializations"] == [1, 1]
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


def test_decode_kernels_as_launched_compile_for_sm80_and_sm90_without_spills(compiled_variants):
    """The decode kernel (split, writing partials, and not, writing out) and its reduce, as
    paged_attention would launch them on sm_80 and sm_90: no spills, and the decode kernel's
    K/V by cp.async with copies in flight, in the prefill kernel's shared memory. Varied
    batches with their decodes apart compile each kernel once a model, the decode kernel
    twice (split or not), the prefill kernel still once whichever sequence it starts at."""
    reports = [r for r in compiled_variants if "kernel" in r]
    assert compiled_variants[-1]["with_decodes_apart"] == 2 * [{
        "_paged_attention_kernel": 1, "_paged_attention_decode_kernel": 2,
        "_reduce_splits_kernel": 1}]
    decode = "_paged_attention_decode_kernel"
    assert sorted((r["cc"], r["kernel"], r["dtype"], r["head_dim"], r["num_heads"],
                   r["num_kv_heads"], r["num_decodes"]) for r in reports) == sorted(
        (cc, name, *variant, num_decodes)
        for cc in COMPILE_CAPABILITIES for variant in DECODE_COMPILE_VARIANTS
        for name, num_decodes in [(decode, 3), (decode, 132), ("_reduce_splits_kernel", 3)])
    prefill_smem = {(r["cc"], r["dtype"], r["head_dim"]): r["smem"] for r in compiled_variants
                    if "kernel" not in r and "smem" in r}
    for r in reports:
        assert r["target"] and r["cubin"] > 0 and r["spills"] == 0, r
        assert {"out_ptr", "query_start_loc_ptr", "partial_out_ptr"} <= set(r["aligned"]), r
        if r["kernel"] == "_reduce_splits_kernel":
            assert r["ones"] == ["stride_od"], r
            continue
        assert set(r["ones"]) == {"stride_qd", "stride_kd", "stride_vd", "stride_od"}, r
        assert r["smem"] == prefill_smem[r["cc"], r["dtype"], r["head_dim"]], r
        if r["dtype"] != "float32":  # fp32 (not the GPU default) only has to compile
            assert r["cp_async"] and r["copies_in_flight"] > 0 and r["regs"] <= 128, r


# ----------------------------------------------------------------------------- LoRA shrink/expand

# each token's slot: a prefill segment, base tokens, decodes of mixed slots (-1: the base model)
LORA_SLOTS = [2, 2, 2, 2, 2, -1, 0, 1, -1, 1, 0, 0, 3]


@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_triton_shrink_and_expand_match_the_reference(rank, dtype):
    """Into a merged projection's middle slice (a strided view), as qkv_proj's k part."""
    torch.manual_seed(0)
    num_tokens, in_features, out_features, num_slots = len(LORA_SLOTS), 200, 150, 4
    x = torch.randn(num_tokens, in_features, device=DEVICE, dtype=dtype)
    lora_a = torch.randn(num_slots, rank, in_features, device=DEVICE, dtype=dtype) / 10
    lora_b = torch.randn(num_slots, out_features, rank, device=DEVICE, dtype=dtype) / 10
    slots = torch.tensor(LORA_SLOTS, device=DEVICE)
    y = torch.randn(num_tokens, 3 * out_features, device=DEVICE, dtype=dtype)
    expected = y.clone()
    shrunk = kernels.lora_shrink(x, lora_a, slots)
    reference = kernels.lora_shrink_ref(x, lora_a, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(shrunk, reference, atol=tolerance, rtol=tolerance)
    shrunk = torch.randn(num_tokens, rank, device=DEVICE, dtype=dtype)  # base rows too
    kernels.lora_expand(shrunk, lora_b, slots, y[:, out_features:2 * out_features])
    kernels.lora_expand_ref(shrunk, lora_b, slots, expected[:, out_features:2 * out_features])
    torch.testing.assert_close(y, expected, atol=tolerance, rtol=tolerance)
    base_rows = slots < 0
    assert torch.equal(y[base_rows], expected[base_rows])  # the base model's rows untouched


def test_lora_reference_runs_one_gemm_per_adapter_slot_of_the_step():
    groups = kernels.slot_groups(torch.tensor(LORA_SLOTS))
    assert [(slot, rows.tolist()) for slot, rows in groups] == [
        (0, [6, 10, 11]), (1, [7, 9]), (2, [0, 1, 2, 3, 4]), (3, [12])]


def test_lora_segments_are_the_runs_of_one_adapters_tokens():
    assert kernels.lora_segments(LORA_SLOTS) == [
        (2, 0, 5), (0, 6, 7), (1, 7, 8), (1, 9, 10), (0, 10, 12), (3, 12, 13)]
    assert kernels.lora_segments([-1, -1]) == []


def test_lora_padded_slots_pad_each_slot_to_the_longest_unless_that_doubles_the_work():
    padded = kernels.lora_padded_slots([0, 1, 0, -1])
    assert (padded.num_slots, padded.rows) == (2, 2)
    assert padded.gather.tolist() == [0, 2, 1, 0]  # slot 1's padding row reads row 0
    assert padded.positions.tolist() == [0, 1, 2] and padded.tokens.tolist() == [0, 2, 1]
    assert kernels.lora_padded_slots([1, 1, 1, 0, 0, 0]).gather.tolist() == [3, 4, 5, 0, 1, 2]
    assert kernels.lora_padded_slots([0] * 5 + [3]) is None  # 4 slots x 5 rows for 6 tokens


def test_lora_padded_slots_take_x_as_it_stands_only_when_sorted_evenly_and_all_adapters():
    padded = kernels.lora_padded_slots([0, 0, 1, 1, 2, 2])
    assert (padded.num_slots, padded.rows, padded.gather) == (3, 2, None)
    for slots in ([0, 1, 0, 1], [0, 0, 1, 1, -1, -1], [0, 0, 2, 2]):  # unsorted, base, slot 1
        assert kernels.lora_padded_slots(slots).gather is not None, slots


def cpu_lora_weights(num_slots: int, rank: int, in_features: int, out_sizes) -> tuple:
    """Random adapter slots laid out as Linear.create_lora_weights lays them out on a CPU:
    every part's A a view of one (L, parts * R, I), each B a view of a dense B^T (L, R, O)."""
    lora_a = torch.randn(num_slots, len(out_sizes) * rank, in_features)
    lora_bs = [torch.randn(num_slots, rank, rows).mT for rows in out_sizes]
    return lora_a, list(lora_a.split(rank, dim=1)), lora_bs


@pytest.mark.parametrize("slots", [LORA_SLOTS, [0, 0, 0, 1, 1, 1, 2, 2, 2]],
                         ids=["gathered", "in-place"])
def test_lora_cpu_layouts_give_the_references_terms(slots):
    """sgmv_shrink/sgmv_expand over runs, and add_lora_padded over every part at once, into a
    merged projection's output (three parts side by side), equal the reference's per part,
    the padded layout gathered (slots mixed, base tokens) or read in place (sorted, even);
    fewer slots in the step than the weights hold."""
    torch.manual_seed(0)
    num_tokens, in_features, out_sizes, rank = len(slots), 24, (6, 10, 3), 4
    x = torch.randn(num_tokens, in_features)
    lora_a, lora_as, lora_bs = cpu_lora_weights(5, rank, in_features, out_sizes)
    token_slots = torch.tensor(slots)
    y = torch.randn(num_tokens, sum(out_sizes))
    expected, by_runs, padded = y.clone(), y.clone(), y.clone()
    segments = kernels.lora_segments(slots)
    start = 0
    for part_a, part_b in zip(lora_as, lora_bs):
        end = start + part_b.shape[1]
        kernels.lora_expand_ref(kernels.lora_shrink_ref(x, part_a, token_slots), part_b,
                                token_slots, expected[:, start:end])
        kernels.sgmv_expand(kernels.sgmv_shrink(x, part_a, segments), part_b, segments,
                            by_runs[:, start:end])
        start = end
    kernels.add_lora_padded(padded, x, lora_a, lora_bs, kernels.lora_padded_slots(slots))
    torch.testing.assert_close(by_runs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
    base_rows = token_slots < 0
    assert torch.equal(padded[base_rows], y[base_rows])
    assert torch.equal(by_runs[base_rows], y[base_rows])

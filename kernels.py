"""Attention over the paged KV cache: a PyTorch reference (the specification), a faster CPU
path and a Triton kernel with the same signature (the GPU path); and the write of new K/V
into their slots.

One forward pass carries every scheduled token of every sequence in one flat batch: decode
tokens (one query each) and prefill chunks (many queries). The new tokens' K/V are first
written into the paged cache at `slot_mapping`; then each query attends to every token of its
own sequence that has K/V in the cache, up to and including its own position (causal within
the chunk, full over what earlier steps computed). Shape legend: N tokens in the flat batch,
S sequences, H query heads, Hkv KV heads (H a multiple of Hkv), D head dim, NB blocks in the
cache, BS block size (tokens per block), MB max blocks a sequence.

Grouped-query attention (GQA: Llama 3, Qwen) keeps Hkv < H heads of K/V, a G = H // Hkv times
smaller cache; query head h reads KV head h // G, so each KV head serves a contiguous group
of G query heads (Hugging Face's repeat_kv): G is the group size (group_size in code,
vLLM's num_queries_per_kv), and "group" means those G heads and nothing else here. Hkv == H
(G = 1) is plain multi-head attention (GPT-2). The fast paths read each K/V once per KV head
for its whole group, never copying it per query head.

In this file, in order: AttentionMetadata and store_kv; paged_attention_ref (the spec), then
paged_attention_cpu (the CPU default, with cascade attention for beam search's shared
prefixes: plan_prefixes, add_shared_prefix) and the Triton path (the CUDA default), all with one
signature: _paged_attention_kernel for prefill chunks, _paged_attention_decode_kernel and
_reduce_splits_kernel for decodes (flash-decoding: each decode's context split over programs,
so that a few decodes still fill the GPU), launch_grids and the launcher paged_attention;
select_attention. model.py calls the attention function it is given; the engine builds the
metadata, its decodes first (num_decodes).

An FP8 cache (kv_cache_dtype fp8) holds float8_e4m3fn K/V with a scale a layer (store_kv
divides, every reader multiplies back: quantize_kv, dequantize_kv; the kernels upcast each
tile in registers, KV_FP8). Left out on purpose: sliding windows, ALiBi. Checked on a CPU only
(test_kernels.py): the kernels against the reference in Triton's interpreter (fp32, fp16,
bf16; G = 1, 2, 3, 4, 7, 16; decodes split, unsplit and beside prefill chunks), and their
sm_80/sm_90 builds as launched (fp16/bf16, head dims 64 and 128, G = 1 to 7: no spills, K/V
by pipelined cp.async; at head dim 64 <= 128 registers and < 64 KB of shared memory). Not
checked: speed, or results, on a GPU; MIN_SPLIT_KEYS and the splits rule are not tuned."""
import contextlib
import ctypes
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # CPU tensors need Triton's interpreter, set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import cuda_runtime  # noqa: E402
from paged_cache import cdiv  # noqa: E402

FP8_DTYPE = torch.float8_e4m3fn  # an FP8 KV cache's (and linear.py's FP8 weights'): E4M3, no inf
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0, its largest finite value
DECODE_BATCH = 8         # paged_attention_cpu: the most decodes attended together
DECODE_BYTES = 8 << 20   # paged_attention_cpu: the most K/V bytes one batch of them gathers


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its K/V sit in the cache."""
    slot_mapping: torch.Tensor      # (N,) int64: cache slot (block_id * BS + offset) per new token
    block_tables: torch.Tensor      # (S, MB) int32: physical block ids, padded with 0 past the end
    context_lens: torch.Tensor      # (S,) int32: tokens with K/V per sequence, this step's included
    query_start_loc: torch.Tensor   # (S + 1,) int32: sequence s owns the flat batch's tokens
                                    # [start[s], start[s+1])
    max_query_len: int              # longest query run in the batch (1 for a decode-only batch)
    num_decodes: int = 0            # sequences [0, num_decodes) have one query each: the Triton
                                    # path attends them apart (split over their context)
    shared_prefixes: list | None = None  # beam search: (decodes, P) for each request's beams,
                                    # sequences that all hold the same first P blocks (the CPU
                                    # attends those once for all of them: cascade attention)
    step_plan: object = None        # paged_attention_cpu's, made by its step's first layer


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             num_clipped: torch.Tensor | None = None) -> None:
    """Write new keys/values (N, Hkv, D) into the caches (NB, BS, Hkv, D) at their flat slots
    (N,): one indexed copy, a slot being an index into the cache viewed as (NB * BS, Hkv, D).
    An FP8 cache stores k / k_scale and v / v_scale (quantize_kv), copied as bytes (a CPU's
    index_copy_ has no fp8 kernel), and adds the values it clipped to num_clipped (a () int64
    tensor on the device, if given: counted there, never read by the step)."""
    if k_cache.dtype == FP8_DTYPE:
        if num_clipped is not None:
            num_clipped += (k.abs() > FP8_MAX * k_scale).sum() \
                + (v.abs() > FP8_MAX * v_scale).sum()
        k, k_cache = quantize_kv(k, k_scale).view(torch.uint8), k_cache.view(torch.uint8)
        v, v_cache = quantize_kv(v, v_scale).view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V (..., D) -> float8_e4m3fn: x / scale, clipped to +-448 first (E4M3 has no
    infinity: past 448 a cast may give NaN on some devices, 448 on others). vLLM's per-layer
    scale, 1.0 unless given: K/V of today's models lie well within +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """quantize_kv undone, into dtype: x * scale in fp32, rounded once (what the kernels do in
    registers); a cache in dtype already is returned as it is."""
    if x.dtype == dtype:
        return x
    return (x.float() * scale).to(dtype)


def keep_freed_memory() -> None:
    """Let glibc reuse freed memory rather than return large blocks to the OS, which made every
    large temporary (K/V gathers above all) pay a page fault per 4 KiB: a batch-32 decode step
    went from 34 ms to 11 ms. (vLLM's CPU backend asks for tcmalloc for the same reason.)"""
    with contextlib.suppress(OSError):  # not glibc (macOS, musl): nothing to do
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MiB of freed heap


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Attention of queries q (N, H, D) over the paged caches k_cache, v_cache (NB, BS, Hkv, D),
    H a multiple of Hkv; an FP8 cache's K/V read as K * k_scale, V * v_scale in q's dtype.

    Returns (N, H, D). Query j of sequence s (of q_len queries, context_len tokens with K/V in
    the cache, its own included) sits at position context_len - q_len + j and sees positions
    0..that position. Query head h reads KV head h // G, G = H // Hkv: here each KV head is
    repeated G times over (repeat_interleave, as Hugging Face's repeat_kv), and query head h
    reads head h of that.
    The specification of paged_attention (Triton) and paged_attention_cpu: one sequence at a
    time, its blocks gathered in the order of its block table."""
    group_size = group_size_of(q, k_cache)
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        tokens = slice(starts[s], starts[s + 1])
        k, v = _gather_sequence(k_cache, v_cache, meta, s)  # (T, Hkv, D) each
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        k = k.repeat_interleave(group_size, dim=1)        # (T, H, D): KV heads 0,0,..,1,1,..
        v = v.repeat_interleave(group_size, dim=1)        # (T, H, D)
        out[tokens] = _attend(q[tokens], k, v, scale)
    return out


def group_size_of(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """G = H // Hkv, the query heads of q (N, H, D) that share each KV head of the cache
    (NB, BS, Hkv, D). An H that Hkv does not divide would pair heads with the wrong K/V."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's "
                         f"{num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def _gather_sequence(k_cache, v_cache, meta, s):
    """Sequence s's K and V, its T tokens in order, from the caches (NB, BS, Hkv, D):
    (T, Hkv, D) each."""
    ctx_len = int(meta.context_lens[s])
    blocks = meta.block_tables[s, :cdiv(ctx_len, k_cache.shape[1])]       # (nb,)
    # index_select, not k_cache[blocks]: twice as fast on a CPU
    k = torch.index_select(k_cache, 0, blocks).flatten(0, 1)[:ctx_len]    # (T, Hkv, D)
    v = torch.index_select(v_cache, 0, blocks).flatten(0, 1)[:ctx_len]    # (T, Hkv, D)
    return k, v


def _attend(q, k, v, scale):
    """Causal attention of a sequence's last L queries q (L, H, D) over its T tokens' keys and
    values k, v (T, Hkv, D): (L, H, D), query head h reading KV head h // (H // Hkv).

    SDPA's enable_gqa maps heads so (a no-op when Hkv == H). Inputs are 4-D, a batch of one:
    on a CPU that takes SDPA's flash kernel, which reads each KV head in place for its query
    heads, where 3-D inputs take its math path, which copies K/V per query head and was slower
    even without GQA (a 256-token chunk over 512 tokens, 14 heads: 4.4 ms, now 3.3 ms, 2-core
    EPYC)."""
    num_queries, ctx_len = len(q), len(k)
    q_pos = ctx_len - num_queries + torch.arange(num_queries, device=q.device)  # (L,)
    visible = torch.arange(ctx_len, device=q.device) <= q_pos[:, None]          # (L, T)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=visible, scale=scale, enable_gqa=True)  # (1, H, L, D)
    return out[0].transpose(0, 1)


@dataclass
class DecodeBatch:
    """Decodes attended together: the run decode_tokens[start:end] of a StepPlan (b of them)."""
    start: int
    end: int
    block_ids: torch.Tensor  # (b * nb,) int64: each one's first nb blocks, flat
    mask: torch.Tensor       # (b, 1, 1, T): -inf past each one's context, T = nb * BS


@dataclass
class PrefixBatch:
    """Beam groups whose shared prefixes are attended together (cascade attention): a group's
    W beams are W * G queries of each KV head, over the P blocks they all hold, read once."""
    block_ids: torch.Tensor  # (g * P,) int64: each group's first P blocks, flat
    mask: torch.Tensor       # (g, 1, 1, T): -inf past each group's prefix, T = P * BS
    rows: torch.Tensor       # (g, W) each group's beams as rows of the decodes (by context
                             # length), a group of fewer padded with its first beam again
    picked: torch.Tensor     # (n,) the real beams among rows, flattened: their indices
    beams: torch.Tensor      # (n,) and their rows of the decodes


@dataclass
class StepPlan:
    """How paged_attention_cpu attends a step, worked out by its first layer for all: which
    sequences are prefill chunks and which decodes, and how the decodes go in batches."""
    prefills: list             # (sequence, its tokens of q as a slice), a chunk of many queries
    decode_tokens: torch.Tensor  # (d,) the decodes' tokens in q, by context length
    batches: list              # DecodeBatch runs of decode_tokens, in order
    buffers: tuple             # K and V gathered for one batch: (b * nb, BS, Hkv, D) each
    prefix_batches: list = ()  # PrefixBatch: beams' shared prefixes (the decodes' batches then
                               # attend each beam's own blocks after its prefix only)


def plan_step(meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype) -> StepPlan:
    """The step's prefill chunks, and its decodes sorted by context length, so each batch pads
    only to its longest context, in batches whose K/V stay in the CPU's caches while attended
    (decode_batches). A beam whose request's beams share their first P blocks
    (meta.shared_prefixes) counts only its own tokens past them: the prefix batches attend
    those P blocks once for all the beams (plan_prefixes). dtype: the queries' (the masks')."""
    starts = meta.query_start_loc.tolist()
    prefills = []
    decodes = []
    for s, (start, end) in enumerate(zip(starts, starts[1:])):
        if end - start == 1:
            decodes.append(s)
        else:
            prefills.append((s, slice(start, end)))
    if not decodes:
        return StepPlan(prefills=prefills, decode_tokens=None, batches=[], buffers=())
    block_size = k_cache.shape[1]
    token_bytes = k_cache[0, 0].nbytes  # one token's K: (Hkv, D)
    own_lens = meta.context_lens.tolist()  # each one's tokens past its shared prefix, if any
    own_lens_t = meta.context_lens
    skipped_t = None
    if meta.shared_prefixes:  # beam search
        skipped = [0] * len(own_lens)  # each sequence's blocks a prefix batch attends
        for group, num_shared in meta.shared_prefixes:
            for s in group:
                skipped[s] = num_shared
                own_lens[s] -= num_shared * block_size
        own_lens_t = torch.tensor(own_lens, device=k_cache.device)
        skipped_t = torch.tensor(skipped, device=k_cache.device)
    decodes.sort(key=own_lens.__getitem__)
    batches = []
    start = 0
    largest = 0  # the blocks of the largest batch's gather, which the buffers hold
    for batch in decode_batches(decodes, own_lens, token_bytes):
        num_blocks = cdiv(own_lens[batch[-1]], block_size)
        largest = max(largest, len(batch) * num_blocks)
        positions = torch.arange(num_blocks * block_size, device=k_cache.device)
        mask = _mask_past(positions >= own_lens_t[batch, None], dtype)             # (b, T)
        tables = meta.block_tables[batch, :num_blocks]
        if skipped_t is not None:  # each one's blocks from its first own, padding masked
            columns = skipped_t[batch, None] + torch.arange(num_blocks, device=k_cache.device)
            last_column = meta.block_tables.shape[1] - 1
            tables = meta.block_tables[batch].gather(1, columns.clamp(max=last_column))
        batches.append(DecodeBatch(start=start, end=start + len(batch),
                                   block_ids=tables.flatten().to(torch.int64),
                                   mask=mask[:, None, None]))
        start += len(batch)
    prefix_batches = plan_prefixes(meta, decodes, block_size, token_bytes, dtype)
    for batch in prefix_batches:
        largest = max(largest, len(batch.block_ids))
    decode_tokens = meta.query_start_loc[decodes].to(torch.int64)                  # (d,)
    buffer_shape = (largest, *k_cache.shape[1:])
    buffers = (k_cache.new_empty(buffer_shape), k_cache.new_empty(buffer_shape))
    return StepPlan(prefills=prefills, decode_tokens=decode_tokens, batches=batches,
                    buffers=buffers, prefix_batches=prefix_batches)


def _mask_past(past_end: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask from a boolean one: -inf where past_end, else 0."""
    return past_end.new_zeros(past_end.shape, dtype=dtype).masked_fill_(past_end, float("-inf"))


def plan_prefixes(meta: AttentionMetadata, decodes: list[int], block_size: int,
                  token_bytes: int, dtype: torch.dtype) -> list[PrefixBatch]:
    """Cascade attention's batches: each beam group's shared prefix (meta.shared_prefixes),
    attended once by all its beams' queries, groups batched as decodes are (decode_batches, by
    prefix length). decodes: the step's decodes in the order of their rows."""
    groups = meta.shared_prefixes
    if not groups:
        return []
    row_of = {s: row for row, s in enumerate(decodes)}
    prefix_lens = [num_shared * block_size for _, num_shared in groups]
    by_length = sorted(range(len(groups)), key=prefix_lens.__getitem__)
    batches = []
    for batch in decode_batches(by_length, prefix_lens, token_bytes):
        num_blocks = groups[batch[-1]][1]
        width = max(len(groups[g][0]) for g in batch)
        first_beams = [groups[g][0][0] for g in batch]
        positions = torch.arange(num_blocks * block_size, device=meta.block_tables.device)
        group_lens = torch.tensor([prefix_lens[g] for g in batch], device=positions.device)
        mask = _mask_past(positions >= group_lens[:, None], dtype)                  # (g, T)
        rows = []    # (g, W): each group's beams' rows, padded with its first beam
        picked = []  # the real ones' places among the rows, flattened
        for i, g in enumerate(batch):
            beams = [row_of[s] for s in groups[g][0]]
            rows.append(beams + beams[:1] * (width - len(beams)))
            picked += range(i * width, i * width + len(beams))
        block_ids = meta.block_tables[first_beams, :num_blocks].flatten().to(torch.int64)
        rows_t = torch.tensor(rows)
        picked_t = torch.tensor(picked)
        batches.append(PrefixBatch(block_ids=block_ids, mask=mask[:, None, None],
                                   rows=rows_t, picked=picked_t,
                                   beams=rows_t.flatten()[picked_t]))
    return batches


def decode_batches(decodes: list[int], lens: list[int], token_bytes: int) -> list[list[int]]:
    """The step's decodes, sorted by context length, in the batches attended together: each as
    many as keep its K and V, padded to its longest context, within DECODE_BYTES (one at the
    least), at most DECODE_BATCH, and none padding a context past twice its length. So a long
    context among short ones goes alone, where batches sized for it would shrink every batch
    and pad its neighbours to it: contexts [90, 100, 110, 900] -> [90, 100, 110], [900].
    token_bytes: one token's K (or V) in the cache."""
    batches = [[decodes[0]]]
    for s in decodes[1:]:
        batch = batches[-1]
        padded_bytes = (len(batch) + 1) * 2 * lens[s] * token_bytes
        fits = len(batch) < DECODE_BATCH and padded_bytes <= DECODE_BYTES \
            and lens[s] <= 2 * lens[batch[0]]
        if fits:
            batch.append(s)
        else:
            batches.append([s])
    return batches


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention_ref's result, faster on a CPU: same arguments. Prefill chunks go one
    sequence at a time, as there; decodes a batch at a time, by a StepPlan made once a step,
    not per layer. Every batch of every layer gathers K/V into the same two buffers, which stay
    in the CPU's caches while attention reads them: each K/V in the cache is read once from
    memory, where a fresh gather per batch wrote then re-read it (38% of a batch-32 decode
    step, 2-core EPYC). The decodes' queries are gathered once a layer, in the plan's order,
    and their outputs put back once, so that a batch is a slice of them, not an index. With
    GQA each KV head is gathered once and serves its G query heads as one (G, D) matrix: K/V are
    never copied per query head. An FP8 cache's K/V are gathered as they are stored, then
    upcast (dequantize_kv). A beam-search request's beams (meta.shared_prefixes) attend the
    blocks they share once, together (cascade attention, add_shared_prefix), and their own
    blocks in the decodes' batches: at W = 4 on a 128-token prompt the shared prefix is most
    of each context, read once instead of four times."""
    _, num_heads, head_dim = q.shape
    group_size = group_size_of(q, k_cache)
    if meta.step_plan is None:
        meta.step_plan = plan_step(meta, k_cache, q.dtype)
    plan = meta.step_plan
    out = torch.empty_like(q)
    for s, chunk in plan.prefills:
        k, v = _gather_sequence(k_cache, v_cache, meta, s)  # (T, Hkv, D) each
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        out[chunk] = _attend(q[chunk], k, v, scale)
    if not plan.batches:
        return out
    num_decodes = len(plan.decode_tokens)
    # A KV head's G query heads (contiguous in q) are one (G, D) matrix; the mask broadcasts.
    q_decodes = q[plan.decode_tokens].view(num_decodes, -1, group_size, head_dim)  # (d, Hkv, G, D)
    out_decodes = torch.empty_like(q_decodes)
    k_buffer, v_buffer = plan.buffers
    # cascade attention: each beam's own blocks here, its request's shared prefix after, the two
    # softmaxes merged by their log-sum-exps (lse_decodes)
    lse_decodes = None
    if plan.prefix_batches:
        lse_decodes = q_decodes.new_empty(q_decodes.shape[:3], dtype=torch.float32)
    for batch in plan.batches:
        num_seqs = batch.end - batch.start
        k = _gather_blocks(k_cache, batch.block_ids, k_buffer, num_seqs)  # (b, Hkv, T, D)
        v = _gather_blocks(v_cache, batch.block_ids, v_buffer, num_seqs)  # (b, Hkv, T, D)
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        q_batch = q_decodes[batch.start:batch.end]
        if lse_decodes is None:
            out_decodes[batch.start:batch.end] = F.scaled_dot_product_attention(
                q_batch, k, v, attn_mask=batch.mask, scale=scale)
            continue
        out_decodes[batch.start:batch.end], lse_decodes[batch.start:batch.end] = \
            attend_with_lse(q_batch, k, v, batch.mask, scale)
    for batch in plan.prefix_batches:
        num_groups = len(batch.rows)
        k = _gather_blocks(k_cache, batch.block_ids, k_buffer, num_groups)  # (g, Hkv, T, D)
        v = _gather_blocks(v_cache, batch.block_ids, v_buffer, num_groups)
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        add_shared_prefix(batch, q_decodes, k, v, scale, out_decodes, lse_decodes)
    out[plan.decode_tokens] = out_decodes.view(num_decodes, num_heads, head_dim)
    return out


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's result on a CPU, q (b, Hkv, L, D) over k, v (b, Hkv, T, D), and each query's
    log-sum-exp of its scaled scores (b, Hkv, L) in fp32, which merges two attentions of one
    query over disjoint keys (add_shared_prefix). The op is the one SDPA runs on a CPU (its
    flash kernel): the output is SDPA's, bit for bit; SDPA's public call drops the lse."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale)
    return out, lse.float()


def add_shared_prefix(batch: PrefixBatch, q_decodes: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, scale: float, out_decodes: torch.Tensor,
                      lse_decodes: torch.Tensor) -> None:
    """Cascade attention's second half: each group's W beams' queries, q_decodes
    (d, Hkv, G, D) at batch.rows, attend their shared prefix k, v (g, Hkv, T, D) as one
    (W * G, D) matrix a KV head, a GEMM where W beams apart were W matrix-vector products over
    the same keys; then each beam's result is merged into out_decodes, which holds its
    attention over its own blocks, lse_decodes (d, Hkv, G) their log-sum-exps. The merge is
    the softmax over both key sets: with a, b the two log-sum-exps and m = logaddexp(a, b),
    out = prefix_out * exp(a - m) + own_out * exp(b - m). Example, one head, one prefix key
    of score 0 and value 1, one own key of score 0 and value 3: a = b = 0, m = log 2,
    out = 1 / 2 + 3 / 2 = 2, the mean of the two values, as one softmax over both gives."""
    num_groups, width = batch.rows.shape
    _, num_kv_heads, group_size, head_dim = q_decodes.shape
    q = q_decodes[batch.rows.flatten()].view(num_groups, width, num_kv_heads, group_size,
                                             head_dim)
    q = q.transpose(1, 2).reshape(num_groups, num_kv_heads, width * group_size, head_dim)
    out, lse = attend_with_lse(q, k, v, batch.mask, scale)  # (g, Hkv, W * G, D), (g, Hkv, W * G)
    out = out.view(num_groups, num_kv_heads, width, group_size, head_dim).transpose(1, 2)
    lse = lse.view(num_groups, num_kv_heads, width, group_size).transpose(1, 2)
    prefix_out = out.flatten(0, 1)[batch.picked].float()   # (n, Hkv, G, D)
    prefix_lse = lse.flatten(0, 1)[batch.picked]           # (n, Hkv, G)
    own_out = out_decodes[batch.beams].float()
    own_lse = lse_decodes[batch.beams]
    total = torch.logaddexp(prefix_lse, own_lse)
    merged = prefix_out * (prefix_lse - total).exp()[..., None] \
        + own_out * (own_lse - total).exp()[..., None]
    out_decodes[batch.beams] = merged.to(out_decodes.dtype)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, buffer: torch.Tensor,
                   num_seqs: int) -> torch.Tensor:
    """A batch's blocks (b * nb,) of cache (NB, BS, Hkv, D) gathered into buffer:
    (b, Hkv, T, D)."""
    gathered = torch.index_select(cache, 0, blocks, out=buffer[:len(blocks)])  # (b*nb, BS, Hkv, D)
    return gathered.view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)


@triton.jit
def _dot(a, b, IN_FP32: tl.constexpr):
    """a @ b accumulated in fp32. ieee keeps fp32 inputs out of TF32, so fp32 matches the
    reference (a no-op for fp16/bf16). IN_FP32 is set only for bf16 in Triton's interpreter,
    whose tl.dot multiplies bf16 bit patterns (triton issue #11584): a product of two bf16
    values is exact in fp32, so upcasting first gives what a GPU's bf16 dot accumulating in
    fp32 gives, up to the order of the sum."""
    if IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_key_tile(q, m_i, l_i, acc, offs_n, mask_n, visible, seq, kv_head, offs_d, mask_d,
                     sm_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bts,
                     stride_kb, stride_kt, stride_kh, stride_kd,
                     stride_vb, stride_vt, stride_vh, stride_vd, k_scale, v_scale,
                     BLOCK_SIZE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                     KV_FP8: tl.constexpr):
    """One step of the online softmax, shared by both kernels: the K/V of key positions offs_n
    (TILE_KEYS,) of sequence `seq` gathered through its block table (mask_n: the keys to
    read), scored against q (R, TILE_DIM) where `visible` (R, TILE_KEYS) allows, and folded
    into the running max m_i (R,), sum l_i (R,) and unnormalized output acc (R, TILE_DIM), all
    fp32. The first step must give every row a visible key, so that its max is finite from
    then on (exp(-inf - -inf) would be NaN). KV_FP8: the cache holds float8_e4m3fn, each tile
    upcast in registers, times k_scale or v_scale in fp32, rounded to q's dtype once
    (dequantize_kv's arithmetic)."""
    # Block ids (TILE_KEYS,) of these tokens: masked past the end, where the table may be padding.
    block_ids = tl.load(block_tables_ptr + seq * stride_bts + offs_n // BLOCK_SIZE,
                        mask=mask_n, other=0).to(tl.int64)  # int64: big caches pass 2**31
    offs_in_block = offs_n % BLOCK_SIZE
    # K tile, loaded transposed (TILE_DIM, TILE_KEYS): masked past the end and the real head dim.
    k_offs = (block_ids * stride_kb + offs_in_block * stride_kt)[None, :] \
        + kv_head * stride_kh + offs_d[:, None] * stride_kd
    k = tl.load(k_cache_ptr + k_offs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
    if KV_FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    scores = _dot(q, k, DOT_IN_FP32) * sm_scale  # (R, TILE_KEYS) fp32
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # V tile (TILE_KEYS, TILE_DIM): masked like K; masked keys give 0 and have p == 0 anyway.
    v_offs = (block_ids * stride_vb + offs_in_block * stride_vt)[:, None] \
        + kv_head * stride_vh + offs_d[None, :] * stride_vd
    v = tl.load(v_cache_ptr + v_offs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if KV_FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_IN_FP32)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["first_seq"])  # any first_seq, one compile
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr, sm_scale, k_scale, v_scale,
    first_seq,
    stride_qn, stride_qh, stride_qd,             # q (N, H, D)
    stride_kb, stride_kt, stride_kh, stride_kd,  # k_cache (NB, BS, Hkv, D)
    stride_vb, stride_vt, stride_vh, stride_vd,  # v_cache (NB, BS, Hkv, D)
    stride_on, stride_oh, stride_od, stride_bts,  # out (N, H, D); block_tables (S, MB), dense
    GROUP_SIZE: tl.constexpr,                         # G = H // Hkv, query heads a KV head serves
    HEAD_DIM: tl.constexpr, TILE_DIM: tl.constexpr,   # D; D padded to a power of 2 >= 16 (tl.dot)
    BLOCK_SIZE: tl.constexpr,                         # BS, tokens per KV block
    TILE_M: tl.constexpr, TILE_KEYS: tl.constexpr,  # pairs per program; keys per step (any BS)
    DOT_IN_FP32: tl.constexpr,                      # only Triton's interpreter on bf16: see _dot
    KV_FP8: tl.constexpr,                           # an FP8 cache: K/V upcast, times k/v_scale
):
    """FlashAttention-style forward over a paged cache; one program per (sequence, KV head,
    tile of TILE_M pairs), for sequences first_seq onwards (those before are decodes, which
    _paged_attention_decode_kernel attends).

    A pair is a (query, query head) of the KV head's group of G heads, stacked query by query
    (the tile's M dimension): pair m is query m // G for query head kv_head * G + m % G. A
    decode fills G pairs, a chunk of L queries L * G, and each K/V tile, loaded once, serves
    the whole group (with G = 1, a pair is a query). The tile's queries are loaded once; keys
    and values stream past TILE_KEYS tokens at a time, each token's K/V gathered through the
    block table, with an online softmax (m_i, l_i, acc) in fp32. Keys stop at the last
    position the tile's last query can see."""
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    pid_m = tl.program_id(2)  # which tile of TILE_M pairs
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if pid_m * TILE_M >= q_len * GROUP_SIZE:  # this sequence has fewer tiles than the longest
        return
    context_len = tl.load(context_lens_ptr + seq)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)  # pair index within the sequence's pairs
    offs_q = offs_m // GROUP_SIZE                   # its query index within the sequence
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # its query head
    offs_d = tl.arange(0, TILE_DIM)
    mask_q = offs_q < q_len       # past the sequence's last query
    mask_d = offs_d < HEAD_DIM    # past the real head dim
    q_pos = context_len - q_len + offs_q  # absolute position of each pair's query
    # each pair's query token in the flat batch, int64: tokens * stride_qn passes 2**31 at ~900k
    # tokens a step
    tokens = (q_start + offs_q).to(tl.int64)
    mask_qd = mask_q[:, None] & mask_d[None, :]  # past the last query or the real head dim
    q_offs = tokens[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=mask_qd, other=0.0)  # (TILE_M, TILE_DIM)
    m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)  # running max of each pair's scores
    l_i = tl.zeros([TILE_M], dtype=tl.float32)                # running softmax denominator
    acc = tl.zeros([TILE_M, TILE_DIM], dtype=tl.float32)       # running unnormalized output
    # The tile's pairs reach query num_seen - 1 (its last pair's, or the sequence's last query):
    # keys stop at the last position that query sees.
    num_seen = tl.minimum(q_len, ((pid_m + 1) * TILE_M - 1) // GROUP_SIZE + 1)
    kv_end = context_len - q_len + num_seen
    for start_n in range(0, kv_end, TILE_KEYS):
        offs_n = start_n + tl.arange(0, TILE_KEYS)  # token positions in this step
        mask_n = offs_n < kv_end
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]  # causal + tail
        # every pair sees position 0 in the first step, so each row has a visible key
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, offs_n, mask_n, visible, seq, kv_head, offs_d, mask_d, sm_scale,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bts,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
            stride_vd, k_scale, v_scale, BLOCK_SIZE, DOT_IN_FP32, KV_FP8)
    o_offs = tokens[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_qd)


@triton.jit
def _split_range(context_len, split, num_splits, TILE_KEYS: tl.constexpr,
                 MIN_SPLIT_KEYS: tl.constexpr):
    """Keys [start, end) of a decode's context that split `split` of num_splits attends: the
    context spread evenly over the splits in whole key tiles, at least MIN_SPLIT_KEYS each. A
    context shorter than the splits leaves the last ones empty (start >= end); split 0 always
    holds key 0. Worked out per sequence from its own length, so a short context in a wide
    table still spreads over every split, as the host could not (it reads no lengths)."""
    split_keys = tl.cdiv(tl.cdiv(context_len, num_splits), TILE_KEYS) * TILE_KEYS
    split_keys = tl.maximum(split_keys, MIN_SPLIT_KEYS)
    start = split * split_keys
    return start, tl.minimum(start + split_keys, context_len)


@triton.jit
def _paged_attention_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr, sm_scale, k_scale, v_scale,
    stride_qn, stride_qh, stride_qd,             # q (N, H, D)
    stride_kb, stride_kt, stride_kh, stride_kd,  # k_cache (NB, BS, Hkv, D)
    stride_vb, stride_vt, stride_vh, stride_vd,  # v_cache (NB, BS, Hkv, D)
    stride_on, stride_oh, stride_od, stride_bts,  # out (N, H, D); block_tables (S, MB), dense
    GROUP_SIZE: tl.constexpr,                         # G = H // Hkv, query heads a KV head serves
    HEAD_DIM: tl.constexpr, TILE_DIM: tl.constexpr,   # D; D padded to a power of 2 >= 16 (tl.dot)
    BLOCK_SIZE: tl.constexpr,                         # BS, tokens per KV block
    TILE_G: tl.constexpr, TILE_KEYS: tl.constexpr,  # G padded to >= 16 (tl.dot); keys per step
    MIN_SPLIT_KEYS: tl.constexpr,                   # the fewest keys a split is given
    PARTIAL: tl.constexpr,                          # several splits: write partials, not out
    DOT_IN_FP32: tl.constexpr,                      # only Triton's interpreter on bf16: see _dot
    KV_FP8: tl.constexpr,                           # an FP8 cache: K/V upcast, times k/v_scale
):
    """Flash-decoding (vLLM's paged attention v2) over a paged cache: one program per (decode,
    KV head, split of its context); decodes are sequences [0, num_decodes) of the batch.

    The group's G query heads of the decode's one query are a (TILE_G, TILE_DIM) tile, G padded
    with zero queries to tl.dot's 16: a decode reads K/V and does little math on them, so the
    padding's products cost nothing that shows, and one path (the one _paged_attention_kernel
    takes, _dot's bf16 workaround included) serves G = 1 to 16. Each K/V tile, loaded once,
    serves the group. The program attends keys [start, end) of _split_range with an online
    softmax (m_i, l_i, acc) in fp32; one query sees every key of its context, so no causal mask.
    With PARTIAL it writes, per query head, its max m_i, sum l_i and unnormalized acc to the
    scratch (num_decodes, H, num_splits[, D]) for _reduce_splits_kernel (an empty split: -inf,
    0, 0: nothing); without (one split), acc / l_i to out."""
    seq = tl.program_id(0)    # the decode, and its sequence in the batch
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # its one query's token in the flat batch, int64 as in _paged_attention_kernel
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq)
    start, end = _split_range(context_len, split, num_splits, TILE_KEYS, MIN_SPLIT_KEYS)
    offs_g = tl.arange(0, TILE_G)          # query head within the group
    heads = kv_head * GROUP_SIZE + offs_g  # its query head
    offs_d = tl.arange(0, TILE_DIM)
    mask_g = offs_g < GROUP_SIZE  # past the group's G heads: padding for tl.dot
    mask_d = offs_d < HEAD_DIM    # past the real head dim
    mask_gd = mask_g[:, None] & mask_d[None, :]
    # The group's queries (TILE_G, TILE_DIM), once: masked past G heads and the real head dim.
    q_offs = token * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=mask_gd, other=0.0)
    m_i = tl.full([TILE_G], float("-inf"), dtype=tl.float32)  # running max of each head's scores
    l_i = tl.zeros([TILE_G], dtype=tl.float32)                # running softmax denominator
    acc = tl.zeros([TILE_G, TILE_DIM], dtype=tl.float32)       # running unnormalized output
    for start_n in range(start, end, TILE_KEYS):
        offs_n = start_n + tl.arange(0, TILE_KEYS)  # token positions in this step
        mask_n = offs_n < end  # past the split's end (or the context's)
        # one query sees every key of its split: no causal mask; start_n < end, so a key each
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, offs_n, mask_n, mask_n[None, :], seq, kv_head, offs_d, mask_d,
            sm_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bts,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
            stride_vd, k_scale, v_scale, BLOCK_SIZE, DOT_IN_FP32, KV_FP8)
    if PARTIAL:
        # This split's entry of each real head in the dense scratch (num_decodes, H, num_splits).
        parts = (seq * tl.num_programs(1) * GROUP_SIZE + heads) * num_splits + split
        tl.store(partial_max_ptr + parts, m_i, mask=mask_g)
        tl.store(partial_sum_ptr + parts, l_i, mask=mask_g)
        tl.store(partial_out_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_gd)
    else:
        o_offs = token * stride_on + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit(do_not_specialize=["num_splits"])  # any number of splits, one compile
def _reduce_splits_kernel(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, query_start_loc_ptr, num_splits,
    stride_on, stride_oh, stride_od,                  # out (N, H, D)
    HEAD_DIM: tl.constexpr, TILE_DIM: tl.constexpr,   # D; D padded to a power of 2
    TILE_SPLITS: tl.constexpr,                        # MAX_KV_SPLITS: every split in one tile
):
    """One program per (decode, query head): its splits' partials combined into its output.
    Split j summed exp(s - m_j) over its keys: rescaled by exp(m_j - m_max), the splits' sums
    share one max, so out = sum_j w_j acc_j / sum_j w_j l_j with w_j = exp(m_j - m_max)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, TILE_SPLITS)
    offs_d = tl.arange(0, TILE_DIM)
    mask_s = offs_s < num_splits  # past the splits launched
    mask_d = offs_d < HEAD_DIM    # past the real head dim
    parts = (seq * tl.num_programs(1) + head) * num_splits + offs_s  # its entries in the scratch
    # Each split's max (TILE_SPLITS,) and sum: -inf and 0 past num_splits, as an empty split's.
    m = tl.load(partial_max_ptr + parts, mask=mask_s, other=float("-inf"))
    l = tl.load(partial_sum_ptr + parts, mask=mask_s, other=0.0)
    # Each split's unnormalized output (TILE_SPLITS, TILE_DIM): masked past num_splits and D.
    acc = tl.load(partial_out_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    # Split 0 holds key 0 (a decode sees at least its own), so m_max is finite and an empty
    # split's (or a padding lane's) weight exp(-inf - m_max) is 0: it adds nothing.
    weights = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(l * weights, axis=0)  # (TILE_DIM,)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)  # the decode's query in the batch
    tl.store(out_ptr + token * stride_on + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


TILE_M = 16  # (query, head) pairs per program: tl.dot's minimum (a decode fills G of them)
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (the prefill kernel's tiles)
TILE_KEYS = 64  # keys per inner step
# K/V addresses come from a block-id load, so Triton's pipeliner needs 5 stages to keep step
# n+1's K/V copies in flight during step n's math (at 3 it waits for every copy): 37 KB of
# shared memory in fp16/bf16. fp32 tiles are twice that, so fp32 keeps 3 stages (41 KB).
NUM_WARPS = 4
NUM_STAGES = {2: 5, 4: 3}  # pipeline stages by element size in bytes
# Decode splits. A split's partials (G * (D + 2) fp32 a split) cost a few % of its K/V at 256
# keys (2 * 256 * D * 2 bytes), and 4 key steps keep its loads pipelined; a guess, not tuned
# on a GPU. 64 splits fill an H100's 132 SMs for a decode of 2 KV heads (Qwen2.5-0.5B), and the
# reduce loads all of a head's in one (64, D) fp32 tile.
MIN_SPLIT_KEYS = 256  # the fewest keys a split is given (a multiple of TILE_KEYS)
MAX_KV_SPLITS = 64    # the most splits a decode's context is cut into
CPU_NUM_SMS = 132     # SMs on a CPU (Triton's interpreter): an H100's, so splits happen there


def num_kv_splits(num_decodes: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many programs split each decode's context: as many as give each of num_sms SMs a
    (decode, KV head, split), within what lets the longest context the block table holds
    (max_context) give each split MIN_SPLIT_KEYS, and MAX_KV_SPLITS; 1 once the decodes' KV
    heads fill the SMs alone. From shapes only: the launch reads no tensor's value (on a GPU, a
    wait; and a CUDA graph fixes shapes, not values)."""
    fill = num_sms // (num_decodes * num_kv_heads)
    return max(1, min(fill, cdiv(max_context, MIN_SPLIT_KEYS), MAX_KV_SPLITS))


@dataclass
class LaunchGrids:
    """The programs paged_attention launches, a grid per kernel (None: not launched)."""
    decode: tuple | None   # (num_decodes, Hkv, num_splits): _paged_attention_decode_kernel
    reduce: tuple | None   # (num_decodes, H): _reduce_splits_kernel, when num_splits > 1
    prefill: tuple | None  # (S - num_decodes, Hkv, tiles of TILE_M pairs): _paged_attention_kernel


def launch_grids(meta: AttentionMetadata, num_kv_heads: int, group_size: int, block_size: int,
                 num_sms: int) -> LaunchGrids:
    """The grids for meta's batch: its num_decodes decodes split over their context, then the
    other sequences, max_query_len * G pairs each at most, in tiles of TILE_M. No decode gets
    a program of the prefill kernel, which would exit at once (63 decodes beside a 449-token
    chunk, G = 7: 25,000 of them). Shapes and host ints only."""
    num_seqs, num_decodes = len(meta.context_lens), meta.num_decodes
    assert 0 <= num_decodes <= num_seqs, f"num_decodes {num_decodes} of {num_seqs} sequences"
    decode = reduce = prefill = None
    if num_decodes:
        max_context = meta.block_tables.shape[1] * block_size  # the longest the table holds
        num_splits = num_kv_splits(num_decodes, num_kv_heads, max_context, num_sms)
        decode = (num_decodes, num_kv_heads, num_splits)
        if num_splits > 1:
            reduce = (num_decodes, num_kv_heads * group_size)
    if num_decodes < num_seqs:
        tiles = cdiv(meta.max_query_len * group_size, TILE_M)
        if tiles > MAX_GRID_Z:
            raise ValueError(f"a chunk of {meta.max_query_len} tokens at {group_size} query "
                             f"heads a K/V head needs {tiles} programs in a grid dimension "
                             f"CUDA limits to {MAX_GRID_Z}: at most "
                             f"{max_chunk_tokens(group_size)} tokens")
        prefill = (num_seqs - num_decodes, num_kv_heads, tiles)
    return LaunchGrids(decode=decode, reduce=reduce, prefill=prefill)


def max_chunk_tokens(group_size: int) -> int:
    """The most tokens of one sequence a step may prefill through the Triton kernel: its
    grid's third dimension (tiles of TILE_M query-head pairs) within CUDA's MAX_GRID_Z, 131,070
    tokens at G = 8. The engine refuses a larger max_num_batched_tokens at its start."""
    return MAX_GRID_Z * TILE_M // group_size


def device_num_sms(device: torch.device) -> int:
    """The SMs of a CUDA device; on a CPU (Triton's interpreter), CPU_NUM_SMS."""
    if cuda_runtime.is_cuda(device):
        return cuda_runtime.num_sms(device)
    return CPU_NUM_SMS


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Triton twin of paged_attention_ref: same arguments, same result. The launch reads no
    tensor's value (so never waits for the GPU) and runs on q's device, current or not.
    The first meta.num_decodes sequences (one query each) go to the decode kernel, their
    contexts split over programs to fill the GPU, then the reduce; the others to
    _paged_attention_kernel. The grids are launch_grids'."""
    num_tokens, num_heads, head_dim = q.shape
    group_size = group_size_of(q, k_cache)  # G; the caches' heads divide q's, or ValueError
    _check_launch(q, k_cache, v_cache, meta)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    grids = launch_grids(meta, num_kv_heads, group_size, block_size, device_num_sms(q.device))
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), tables.stride(0))
    tile_dim = max(16, triton.next_power_of_2(head_dim))  # D padded for tl.dot
    dot_in_fp32 = triton.knobs.runtime.interpret and q.dtype == torch.bfloat16  # see _dot
    both = dict(GROUP_SIZE=group_size, HEAD_DIM=head_dim, TILE_DIM=tile_dim,
                BLOCK_SIZE=block_size, TILE_KEYS=TILE_KEYS, DOT_IN_FP32=dot_in_fp32,
                KV_FP8=k_cache.dtype == FP8_DTYPE,
                num_warps=NUM_WARPS, num_stages=NUM_STAGES[q.element_size()])
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if grids.prefill:
            _paged_attention_kernel[grids.prefill](
                q, k_cache, v_cache, out, tables, lens, starts, scale, k_scale, v_scale,
                meta.num_decodes,
                *strides, TILE_M=TILE_M, **both)
        if grids.decode:
            partials = split_scratch(grids.decode, num_heads, head_dim, q.device)
            _paged_attention_decode_kernel[grids.decode](
                q, k_cache, v_cache, out, *partials, tables, lens, starts, scale, k_scale,
                v_scale, *strides,
                TILE_G=max(16, triton.next_power_of_2(group_size)),
                MIN_SPLIT_KEYS=MIN_SPLIT_KEYS, PARTIAL=grids.reduce is not None, **both)
            if grids.reduce:
                _reduce_splits_kernel[grids.reduce](
                    *partials, out, starts, grids.decode[2], *out.stride(), HEAD_DIM=head_dim,
                    TILE_DIM=tile_dim, TILE_SPLITS=MAX_KV_SPLITS, num_warps=NUM_WARPS)
    return out


def split_scratch(decode_grid: tuple, num_heads: int, head_dim: int,
                  device: torch.device) -> tuple:
    """The decode kernel's scratch for its splits' partials, fp32 and dense: each query head's
    unnormalized output (num_decodes, H, num_splits, D), its max and its sum (num_decodes, H,
    num_splits). Allocated by the launch, so that a CUDA graph captured around it owns it;
    unread with one split, and then small."""
    num_decodes, _, num_splits = decode_grid
    shape = (num_decodes, num_heads, num_splits)
    return (torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))


def _check_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> None:
    """What the kernels assume of their arguments, asserted: one device, one dtype, dense
    caches and metadata, int32 metadata."""
    tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
    assert all(t.device == q.device for t in (k_cache, v_cache, tables, lens, starts)), \
        "q, caches and metadata must share one device"
    assert k_cache.dtype in (q.dtype, FP8_DTYPE) and k_cache.dtype == v_cache.dtype \
        and k_cache.shape == v_cache.shape \
        and k_cache.shape[3] == q.shape[2] and k_cache.is_contiguous() \
        and v_cache.is_contiguous(), \
        f"q {q.dtype} {tuple(q.shape)} vs caches {k_cache.dtype} {tuple(k_cache.shape)}, " \
        f"{tuple(v_cache.shape)}: q's dtype or fp8, one head dim, caches contiguous and alike"
    assert q.stride(-1) == 1, "q's head dim must be contiguous"  # tokens may be qkv-strided
    assert tables.dtype == lens.dtype == starts.dtype == torch.int32, "metadata must be int32"
    assert tables.stride(1) == 1 and starts.shape == (len(lens) + 1,), "bad block_tables/starts"
    assert lens.is_contiguous() and starts.is_contiguous(), "context_lens and query_start_loc " \
        "are read as dense arrays"


ATTENTION_BACKENDS = {"torch": paged_attention_cpu, "triton": paged_attention}
_noted = set()  # notes printed once per process


def select_attention(name: str, device: str):
    """The attention function for a backend on a device; "auto": Triton on CUDA, else torch."""
    on_cuda = str(device).startswith("cuda")
    name = ("triton" if on_cuda else "torch") if name == "auto" else name
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {name!r}; choose auto, torch or triton")
    if name == "triton" and not on_cuda and "interpreter" not in _noted:
        _noted.add("interpreter")
        print("note: Triton attention on a CPU runs in Triton's interpreter: exact but slow",
              file=sys.stderr)
    return ATTENTION_BACKENDS[name]


# ---------------------------------------------------------------------- LoRA: shrink and expand
# A step's LoRA term for one projection, all adapters at once (Punica's SGMV and BGMV, vLLM's
# lora_shrink and lora_expand): each token t carries its adapter's slot s_t among the L slots
# resident on the device (-1: the base model, no term). The shrink takes x (N, I) down to the
# rank, x[t] A[s_t]^T (N, R); the expand takes that up to the output, adding it B[s_t]^T into
# y (N, O). A and B are each slot's, stacked (L, R, I) and (L, O, R), zero past the adapter's
# own rank r <= R, so one launch serves adapters of every rank. lora.py tells the story.

def slot_groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its tokens' indices (n,)) for each adapter slot of the step, base tokens (-1)
    left out: [2, 2, -1, 0, 2] -> [(0, [3]), (2, [0, 1, 4])]. Each is SGMV's segment, the
    tokens of one adapter, gathered wherever they sit in the batch: a decode batch's tokens
    alternate adapters, and one GEMM a run of them would be one a token."""
    slots = token_slots.unique().tolist()
    return [(slot, (token_slots == slot).nonzero().flatten()) for slot in slots if slot >= 0]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    """The shrink's spec: x (N, I), lora_a (L, R, I), token_slots (N,) -> (N, R) in x's dtype,
    row t x[t] A[s_t]^T, zero for a base token: one GEMM per slot of the step."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in slot_groups(token_slots):
        out[rows] = x[rows] @ lora_a[slot].T
    return out


def lora_expand_ref(shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                    y: torch.Tensor) -> None:
    """The expand's spec: y (N, O) += shrunk[t] B[s_t]^T, in place (y may be a slice of a
    merged projection's output), lora_b (L, O, R); base tokens' rows are left untouched."""
    for slot, rows in slot_groups(token_slots):
        y.index_add_(0, rows, shrunk[rows] @ lora_b[slot].T)


def lora_segments(token_slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) for each run of consecutive tokens of one adapter, base tokens (-1)
    left out: [2, 2, -1, 0, 0] -> [(2, 0, 2), (0, 3, 5)]. These are Punica's SGMV segments:
    the model runner orders a step's sequences by adapter (model_runner.adapter_order), so
    each adapter's decodes are one run and its prefills another, and the CPU runs a GEMM pair
    a run (sgmv_shrink, sgmv_expand) with no gather or scatter. Made on the host, once a
    step, from the list the slots were uploaded from."""
    segments = []
    start = 0
    for slot, run in itertools.groupby(token_slots):
        end = start + len(list(run))
        if slot >= 0:
            segments.append((slot, start, end))
        start = end
    return segments


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor,
                segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """lora_shrink_ref's result on the CPU, its tokens given as lora_segments' runs: one GEMM
    a run, on x's rows in place. x (N, I), lora_a (L, R, I) -> (N, R), zero for base tokens."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, start, end in segments:
        torch.mm(x[start:end], lora_a[slot].T, out=out[start:end])
    return out


def sgmv_expand(shrunk: torch.Tensor, lora_b: torch.Tensor,
                segments: list[tuple[int, int, int]], y: torch.Tensor) -> None:
    """lora_expand_ref's result on the CPU: y[run] += shrunk[run] B[slot]^T, one GEMM a run,
    added in place (y may be a merged projection's slice)."""
    for slot, start, end in segments:
        y[start:end] += shrunk[start:end] @ lora_b[slot].T


@dataclass
class PaddedSlots:
    """A step's adapter tokens as add_lora_padded reads them: slots 0..S-1 (S: the step's
    highest slot plus one), each slot's tokens as P rows (P: the most one slot has), the short
    ones padded. lora_padded_slots makes it, on the host, once a step."""
    num_slots: int                    # S
    rows: int                         # P
    # (S * P,) x's row for each padded row (a padding row reads row 0, its result dropped);
    # None: x's rows are the layout as they stand, every token has an adapter, sorted by slot,
    # P each (the model runner's order of a batch spread evenly over slots 0..S-1)
    gather: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # (n,) the padded rows that hold the step's n
    tokens: torch.Tensor | None = None     # adapter tokens, and (n,) which token each holds


def lora_padded_slots(token_slots: list[int]) -> PaddedSlots | None:
    """The step's slots padded to one length: [0, 1, 0, -1] -> S = 2, P = 2, gather
    [0, 2, 1, 0], positions [0, 1, 2], tokens [0, 2, 1]; [0, 0, 1, 1] -> S = 2, P = 2, no
    gather. None when the padding more than doubles the adapters' tokens (a long prefill
    beside a few decodes), where a GEMM pair a run (sgmv_shrink) does less."""
    num_slots = max(token_slots) + 1
    tokens_of = [[] for _ in range(num_slots)]
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            tokens_of[slot].append(token)
    num_lora_tokens = sum(len(tokens) for tokens in tokens_of)
    rows = max(len(tokens) for tokens in tokens_of)
    if num_slots * rows > 2 * num_lora_tokens:
        return None
    is_sorted = all(a <= b for a, b in zip(token_slots, token_slots[1:]))
    if num_slots * rows == len(token_slots) == num_lora_tokens and is_sorted:
        return PaddedSlots(num_slots, rows)  # x as it stands: no gather, no scatter
    gather = [tokens + [0] * (rows - len(tokens)) for tokens in tokens_of]
    positions = [slot * rows + i for slot, tokens in enumerate(tokens_of)
                 for i in range(len(tokens))]
    return PaddedSlots(num_slots, rows, torch.tensor(gather).flatten(), torch.tensor(positions),
                       torch.tensor([token for tokens in tokens_of for token in tokens]))


def add_lora_padded(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_bs: list[torch.Tensor], padded: PaddedSlots) -> None:
    """Every part's LoRA term at once on the CPU, batched over the slots (lora_padded_slots'
    layout) instead of a GEMM pair a run: a decode batch spread over 16 adapters has 16 runs
    a part, and on a CPU a small GEMM's call costs more than its math. y (N, sum O) += x's
    rows through their slots' A then B, the parts side by side as the merged projection's
    output; the first S slots are read. lora_a (L, parts * R, I): every part's A stacked
    along the rank (Linear.lora_a_merged), so one shrink serves every part, taken as
    A x^T (S, parts * R, P): a decode's shrink is bound by reading A, and this form streams
    A's rows (half the time of x A^T there). lora_bs[p] (L, O, R) (O: part p's rows), read as
    B^T (L, R, O), which a CPU's create_lora_weights stores dense. Each part's expand is added
    in place: into its slice of y, read as (S, P, sum O), when x's rows are the layout as
    they stand; else into the padded rows' terms, added back into y token by token. Equals
    lora_expand_ref(lora_shrink_ref(...)) for each part, to float rounding."""
    num_slots, rows = padded.num_slots, padded.rows
    x_rows = x if padded.gather is None else x.index_select(0, padded.gather)
    x_rows = x_rows.reshape(num_slots, rows, -1)  # (S, P, I)
    shrunk = torch.bmm(lora_a[:num_slots], x_rows.mT).mT  # (S, P, parts * R)
    term = y if padded.gather is None else y.new_zeros(num_slots * rows, y.shape[1])
    term = term.view(num_slots, rows, -1)  # (S, P, sum O): y itself, or the padded rows' terms
    rank = lora_bs[0].shape[2]  # R: each part's rows of shrunk
    start = 0  # the part's first column of y
    for part, lora_b in enumerate(lora_bs):
        end = start + lora_b.shape[1]
        term[:, :, start:end].baddbmm_(shrunk[:, :, part * rank:(part + 1) * rank],
                                       lora_b[:num_slots].mT)  # += (S, P, R) @ (S, R, O)
        start = end
    if padded.gather is not None:  # each token's padded row added back into its row of y
        y.index_add_(0, padded.tokens, term.flatten(0, 1).index_select(0, padded.positions))


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, stride_xn, stride_al, stride_ar,
                        stride_on, IN_FEATURES, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_I: tl.constexpr):
    """One program per token (BGMV): its row of x against its slot's A, BLOCK_I columns at a
    time, accumulated in fp32."""
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid)
    has_adapter = slot >= 0
    safe_slot = tl.maximum(slot, 0)  # a base token reads slot 0's A, masked out below
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, IN_FEATURES, BLOCK_I):
        offs_i = start + tl.arange(0, BLOCK_I)
        mask_i = offs_i < IN_FEATURES  # the last tile may run past the row
        # the token's x tile (BLOCK_I,)
        x = tl.load(x_ptr + pid * stride_xn + offs_i, mask=mask_i, other=0.0)
        # its slot's A tile (BLOCK_R, BLOCK_I); rows past RANK are padding
        a = tl.load(a_ptr + safe_slot * stride_al + offs_r[:, None] * stride_ar + offs_i[None, :],
                    mask=(offs_r[:, None] < RANK) & mask_i[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    acc = tl.where(has_adapter, acc, 0.0)  # a base token's row is zero, as the reference's
    tl.store(out_ptr + pid * stride_on + offs_r, acc.to(out_ptr.dtype.element_ty),
             mask=offs_r < RANK)


@triton.jit
def _lora_expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, stride_sn, stride_bl, stride_bo,
                        stride_yn, OUT_FEATURES, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_O: tl.constexpr):
    """One program per (token, BLOCK_O outputs): its shrunk row against its slot's B rows,
    added into y; a base token's program writes nothing."""
    pid = tl.program_id(0)
    pid_o = tl.program_id(1)
    slot = tl.load(slots_ptr + pid)
    safe_slot = tl.maximum(slot, 0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    # past the slice, or a base token: no write (its slot is -1)
    mask_o = (offs_o < OUT_FEATURES) & (tl.full((BLOCK_O,), 0, tl.int64) + slot >= 0)
    # the token's shrunk row (BLOCK_R,), padded past RANK
    s = tl.load(s_ptr + pid * stride_sn + offs_r, mask=offs_r < RANK, other=0.0)
    # its slot's B tile (BLOCK_O, BLOCK_R)
    b = tl.load(b_ptr + safe_slot * stride_bl + offs_o[:, None] * stride_bo + offs_r[None, :],
                mask=mask_o[:, None] & (offs_r[None, :] < RANK), other=0.0)
    acc = tl.sum(b.to(tl.float32) * s.to(tl.float32)[None, :], axis=1)  # (BLOCK_O,)
    # y's tile, read and written back with the term added (y may be a strided slice)
    y = tl.load(y_ptr + pid * stride_yn + offs_o, mask=mask_o, other=0.0)
    tl.store(y_ptr + pid * stride_yn + offs_o, (y.to(tl.float32) + acc).to(y.dtype),
             mask=mask_o)


LORA_BLOCK_I = 128  # the shrink's tile of x's row: 128 columns a loop
LORA_BLOCK_O = 128  # the expand's outputs a program


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink_ref's signature and result, by _lora_shrink_kernel: no host wait, no shape
    that depends on the slots, so a CUDA graph can capture it (the slots a static buffer)."""
    _check_lora_launch(x, lora_a, token_slots)
    num_tokens, rank = x.shape[0], lora_a.shape[1]
    out = torch.empty((num_tokens, rank), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _lora_shrink_kernel[(num_tokens,)](  # a program per token
        x, lora_a, token_slots, out, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        out.stride(0), x.shape[1], RANK=rank, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_I=LORA_BLOCK_I)
    return out


def lora_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                y: torch.Tensor) -> None:
    """lora_expand_ref's signature and result, by _lora_expand_kernel (graph-safe, as
    lora_shrink)."""
    _check_lora_launch(shrunk, lora_b, token_slots)
    assert y.shape == (shrunk.shape[0], lora_b.shape[1]) and y.stride(1) == 1, \
        f"y {tuple(y.shape)} must be (N, O) with dense rows"
    num_tokens, out_features = y.shape
    if num_tokens == 0:
        return
    rank = lora_b.shape[2]
    grid = (num_tokens, cdiv(out_features, LORA_BLOCK_O))  # tokens x tiles of the output
    _lora_expand_kernel[grid](
        shrunk, lora_b, token_slots, y, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), out_features, RANK=rank, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_O=LORA_BLOCK_O)


def _check_lora_launch(x: torch.Tensor, weights: torch.Tensor, token_slots: torch.Tensor) -> None:
    """What the LoRA kernels assume: x (N, K) with dense rows; weights (L, M, K), K dense (the
    shrink's A (L, R, I) against x (N, I); the expand's B (L, O, R) against its input (N, R));
    int64 slots (N,); one device."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)} must be (N, K), rows dense"
    assert weights.dim() == 3 and weights.shape[2] == x.shape[1] and weights.stride(2) == 1, \
        f"weights {tuple(weights.shape)} do not fit x {tuple(x.shape)}"
    assert token_slots.shape == (x.shape[0],) and token_slots.dtype == torch.int64, \
        "token_slots must be (N,) int64"
    assert x.device == weights.device == token_slots.device, "one device"

"""Paged attention: a PyTorch reference (the CPU path and the specification) and a Triton
kernel with the same signature (the GPU path), plus the write of new K/V into their slots.

One forward pass carries every scheduled token of every sequence in one flat batch:
decode tokens (one query each) and prefill chunks (many queries). The new tokens' K/V are
first written into the paged cache at `slot_mapping`; then each query attends to every
cached token of its own sequence up to and including its own position (causal within
the chunk, full over what earlier steps cached).

Shape legend: N tokens in the flat batch, S sequences, H heads, D head dim,
NB blocks in the cache, BS block size (tokens per block), MB max blocks per sequence.

Left out on purpose: sliding windows, ALiBi, GQA, fp8 caches, split-K decode.
"""
import os
from dataclasses import dataclass

import torch

# Triton runs on CPU tensors only in its interpreter, which must be chosen before import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its K/V sit in the cache."""
    slot_mapping: torch.Tensor      # (N,) int64: flat cache slot (block_id * BS + offset) per new token
    block_tables: torch.Tensor      # (S, MB) int32: physical block ids, padded with 0 past the end
    context_lens: torch.Tensor      # (S,) int32: cached tokens per sequence, this step's included
    query_start_loc: torch.Tensor   # (S + 1,) int32: sequence s owns query rows [start[s], start[s+1])
    max_query_len: int              # longest query run in the batch (1 for a decode-only batch)
    max_context_len: int            # longest context in the batch


# ----------------------------------------------------------------------------- K/V write

def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values (N, H, D) into the caches (NB, BS, H, D) at their flat slots (N,).

    One indexed copy on either device: a slot is a row of the cache viewed as (NB * BS, H, D).
    """
    num_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, v)


# ----------------------------------------------------------------------------- reference

def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of queries q (N, H, D) over the paged caches k_cache, v_cache (NB, BS, H, D).

    Returns (N, H, D). Query j of sequence s (of q_len queries, context_len cached tokens)
    sits at position context_len - q_len + j and sees cached positions 0..that position.
    Decodes are done together in one gather; each prefill chunk is done on its own, so no
    sequence is padded to the longest chunk in the batch.
    """
    starts = meta.query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    out = torch.empty_like(q)
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([starts[s] for s in decode], device=q.device)
        out[rows] = _attend(q[rows].unsqueeze(1), k_cache, v_cache, meta, decode, scale).squeeze(1)
    for s in (s for s, n in enumerate(q_lens) if n > 1):
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _attend(q[rows].unsqueeze(0), k_cache, v_cache, meta, [s], scale).squeeze(0)
    return out


def _attend(q, k_cache, v_cache, meta, seqs, scale):
    """Causal attention for sequences `seqs` with equal query counts; q is (len(seqs), L, H, D)."""
    ctx_lens = meta.context_lens[seqs].to(q.device)                        # (s,)
    num_blocks = (int(ctx_lens.max()) + k_cache.shape[1] - 1) // k_cache.shape[1]
    tables = meta.block_tables[seqs, :num_blocks]                          # (s, nb)
    k = k_cache[tables].flatten(1, 2)                                      # (s, T, H, D)
    v = v_cache[tables].flatten(1, 2)
    q_len, t = q.shape[1], k.shape[1]
    q_pos = ctx_lens[:, None] - q_len + torch.arange(q_len, device=q.device)  # (s, L)
    visible = torch.arange(t, device=q.device)[None, None, :] <= q_pos[:, :, None]  # (s, L, T)
    y = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=visible[:, None], scale=scale)                          # (s, H, L, D)
    return y.transpose(1, 2)


# ----------------------------------------------------------------------------- Triton
# (kernel and launcher follow)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Triton twin of paged_attention_ref: same arguments, same result."""
    raise NotImplementedError


ATTENTION_BACKENDS = {"torch": paged_attention_ref, "triton": paged_attention}

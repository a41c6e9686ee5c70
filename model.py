"""model.py: a decoder-only transformer shaped for serving (GPT-2, Llama, Qwen2, Qwen3, Mistral),
and what loads and trains it.

In order:
- the model: GPTConfig (the few fields in which those families differ) and its PRESETS;
  RMSNorm, RotaryEmbedding (RoPE, Llama 3's rescaling included), Attention (grouped-query: fewer
  K/V heads than query heads), MLP (GELU or SwiGLU), Block, GPT. Two forward paths run the same
  layers. `GPT.forward` is the engine's: one flat batch of tokens (N, C), every op but attention
  on all scheduled tokens at once (Orca's "selective batching"), positions rotating q and k per
  token, attention reading and writing the paged KV cache through kernels.py, told where
  everything is by an AttentionMetadata. `GPT.forward_dense` is the plain model on (B, T): the
  training path and the paged path's reference; `GPT.dense_hidden_states` is its body, which
  can also keep K/V in a DenseKVCache, contiguous per sequence as Hugging Face keeps them
  (bench.py's naive baseline).
- tokenizers: Tokenizer (tiktoken does the byte-level BPE; around it what a tokenizer.json adds:
  added tokens, NFC, a BOS), made from the presets' byte-level vocabulary, GPT-2's BPE files
  or a Hugging Face tokenizer.json (Llama 3, Qwen2/3, SmolLM2; SentencePiece refused), and the
  Detokenizer that turns a request's tokens into text a step at a time, stop strings included
  (each request's scheduler.Sequence holds one).
- configs: config_from_hf, an allow-list from a Hugging Face config.json to a GPTConfig.
- checkpoints: Hugging Face directories read (safetensors by hand, sharded or not; parameters
  named as in Hugging Face's Llama, GPT-2's renamed and its Conv1D weights transposed) and
  GPT-2's written, the Hugging Face cache, load_model and its Checkpoint (what nanoserve.py
  gets: the model, its tokenizer, its EOS ids, dtype and generation_config.json).
- training: `python model.py --train FILE` trains the shipped byte-level model.

Left out: dropout, sliding-window attention, mixture-of-experts, RoPE scalings but Llama 3's,
tensor parallelism and quantisation.
Shape legend: N tokens in the flat batch, B batch, T time, C n_embd, H query heads, Hkv K/V
heads, D head dim.
"""
import argparse
import codecs
import inspect
import json
import math
import os
import re
import sys
import time
import unicodedata
import urllib.request
from dataclasses import dataclass, field

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import AttentionMetadata, paged_attention_ref, store_kv


@dataclass
class GPTConfig:
    """The model's shape. GPT-2 and the Llama family (Llama, Qwen2, Qwen3, Mistral) differ only
    in these fields, so one set of modules serves them all; config_from_hf maps a Hugging Face
    config.json onto them. The defaults are the byte-level GPT-2 of the "tiny" preset."""
    vocab_size: int = 257             # 256 bytes + <|endoftext|> (GPT-2: 50257)
    n_positions: int = 1024           # context length: prompt + generated tokens
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None      # K/V heads (grouped-query attention); None: n_head
    head_dim: int | None = None       # None: n_embd // n_head (Qwen3 sets its own)
    intermediate_size: int | None = None  # the MLP's hidden width; None: 4 * n_embd
    norm: str = "layernorm"           # "layernorm" (GPT-2, with a bias) or "rmsnorm" (Llama)
    norm_eps: float = 1e-5
    position_encoding: str = "learned"  # "learned" (a table added to x) or "rope" (q, k rotated)
    mlp: str = "gelu"                 # "gelu" (GPT-2's) or "swiglu" (Llama's gated MLP)
    qkv_bias: bool = True             # biases on the q, k, v projections (GPT-2, Qwen2)
    o_bias: bool = True               # a bias on attention's output projection (GPT-2)
    mlp_bias: bool = True             # biases in the MLP (GPT-2)
    qk_norm: bool = False             # Qwen3: RMSNorm over each head of q and k, before RoPE
    tie_word_embeddings: bool = True  # the LM head is the token embedding
    rope_theta: float = 10000.0       # RoPE's base: head-dim pair i turns at theta ** (-2i / D)
    rope_scaling: dict | None = None  # Llama 3's {"rope_type": "llama3", "factor": ...} or None

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_kv_head",
                     "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_head", "head_dim", "intermediate_size"):
                continue  # derived below
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
            self.head_dim = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.position_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: RoPE turns pairs of dimensions")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head "
                             f"{self.n_kv_head}: each K/V head serves a whole group")
        for name, value, allowed in (("norm", self.norm, ("layernorm", "rmsnorm")),
                                     ("position_encoding", self.position_encoding,
                                      ("learned", "rope")),
                                     ("mlp", self.mlp, ("gelu", "swiglu"))):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: choose {' or '.join(allowed)}")


# The fields of the presets in Llama's layout (no biases anywhere, as Llama 3)
LLAMA_LAYOUT = dict(norm="rmsnorm", position_encoding="rope", mlp="swiglu", qkv_bias=False,
                    o_bias=False, mlp_bias=False, norm_eps=1e-6)
PRESETS = {"tiny": GPTConfig(),  # 3.5M parameters: tests, benchmarks, quick runs
           "gpt2": GPTConfig(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
           # Llama's layout at tiny's size (3.4M parameters), 8 query heads sharing 2 K/V heads:
           # a quarter of tiny's KV cache a token
           "llama-tiny": GPTConfig(n_head=8, n_kv_head=2, head_dim=32, intermediate_size=688,
                                   **LLAMA_LAYOUT),
           # the same with a K/V head per query head: bench.py's grouped-query experiment
           "llama-tiny-mha": GPTConfig(n_head=8, head_dim=32, intermediate_size=688,
                                       **LLAMA_LAYOUT)}


@dataclass
class DenseKVCache:
    """K/V kept contiguous per sequence, as Hugging Face's generate keeps them: per layer, keys
    and values (B, Hkv, max_len, D), a row per sequence. Positions 0..length hold K/V; a
    forward writes its T new tokens' at length..length + T, then length moves past them.
    Memory for max_len positions is taken up front for every row, whatever each will use:
    what the paged cache (kernels.py, paged_cache.py) avoids. bench.py's naive baseline runs
    on it."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def zeros(cls, config: GPTConfig, batch: int, max_len: int,
              like: torch.Tensor) -> "DenseKVCache":
        """An empty cache of `batch` rows, max_len positions each, in like's dtype and device."""
        shape = (batch, config.n_kv_head, max_len, config.head_dim)
        keys = [like.new_zeros(shape) for _ in range(config.n_layer)]
        values = [like.new_zeros(shape) for _ in range(config.n_layer)]
        return cls(keys, values)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new tokens' k, v (B, Hkv, T, D) into `layer` at length..length + T; return
        the layer's keys and values so far, (B, Hkv, length + T, D) each."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, as Llama's: the mean square taken in fp32, the product in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(config: GPTConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoPE): a position enters attention as a rotation of q and k,
    head-dim pair (i, i + D/2) turned by position x inv_freq[i], so q.k depends on how far apart
    two tokens are, not where they are. Computed from the flat batch's positions, so a token's
    rotation is the same whatever its step, chunk or batch."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,) fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (...,) -> cos, sin (..., D) in dtype: each angle once per pair's half."""
        angles = positions.float()[..., None] * self.inv_freq.float()  # (..., D/2), fp32
        angles = torch.cat((angles, angles), dim=-1)                     # (..., D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Each pair's turn per position (D/2,) fp32, computed as Hugging Face computes it (in fp32,
    so the angles are bit-equal), then Llama 3's rescaling if asked for."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    return llama3_inv_freq(inv_freq, scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's long context: pairs that turn slower than once per low_freq_wavelen (longer
    wavelengths than the original context trained) turn `factor` times slower; pairs faster than
    once per high_freq_wavelen keep their speed; those between are interpolated. Worked example,
    original 8192, factors 1 and 4: wavelengths over 8192 positions are stretched by `factor`,
    under 2048 untouched, 2048..8192 blended linearly in original_context / wavelength."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    stretched = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    blend = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * stretched / factor + blend * stretched
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, stretched)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., heads, D) by cos, sin (..., D): pair (i, i + D/2) as the complex number
    x_i + i x_{i+D/2} times e^{i angle} (Hugging Face's "rotate_half" layout, not interleaved)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[..., None, :] + rotated_half * sin[..., None, :]


class Attention(nn.Module):
    """Causal self-attention with n_head query heads and n_kv_head K/V heads: query head h reads
    K/V head h // (n_head // n_kv_head), so the cache holds n_kv_head heads a token (GPT-2:
    as many as the queries; Llama-3.2-1B: 8 for 32)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        q_size = config.n_head * config.head_dim
        kv_size = config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(config.n_embd, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.n_embd, bias=config.o_bias)
        self.q_norm = None
        self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """x (..., C) -> q (..., H, D), k and v (..., Hkv, D): projected, q and k normed per head
        (Qwen3), then rotated by rope = (cos, sin) (..., D) unless it is None (GPT-2)."""
        q = self.q_proj(x).unflatten(-1, (self.n_head, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        return q, k, v

    def forward(self, x, rope, meta, k_cache, v_cache, attention):
        """Paged: x is the flat batch (N, C); each token's K/V are stored at its slot in the
        layer's k_cache, v_cache (NB, BS, Hkv, D), then `attention` (kernels.py) reads each
        sequence's context back through its block table."""
        q, k, v = self.qkv(x, rope)  # (N, H, D), (N, Hkv, D), (N, Hkv, D)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        y = attention(q, k_cache, v_cache, meta, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(y.flatten(1))

    def forward_dense(self, x, rope, cache: DenseKVCache | None = None, layer: int = 0,
                      mask=None):
        """Dense: x is (B, T, C). No cache: causal attention within x. A cache: x's K/V go into
        `layer` of it, and x attends to every cached position that `mask` allows."""
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, rope))  # (B, H or Hkv, T, D)
        grouped = self.n_kv_head != self.n_head
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        else:
            keys, values = cache.store(layer, k, v)  # (B, Hkv, length + T, D)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                               enable_gqa=grouped)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """GPT-2's: down(gelu(up(x))). Llama's SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.intermediate_size
        self.gate_proj = None
        if config.mlp == "swiglu":
            self.gate_proj = nn.Linear(config.n_embd, hidden, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.n_embd, hidden, bias=config.mlp_bias)
        self.down_proj = nn.Linear(hidden, config.n_embd, bias=config.mlp_bias)

    def forward(self, x):
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A transformer layer, pre-norm as in GPT-2 and Llama: x + attention, then x + MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = make_norm(config, config.n_embd)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rope, meta, k_cache, v_cache, attention):
        """Paged: x (N, C); the arguments after x are Attention.forward's."""
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, k_cache, v_cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x, rope, cache: DenseKVCache | None = None, layer: int = 0,
                      mask=None):
        """Dense: x (B, T, C); the arguments after x are Attention.forward_dense's."""
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), rope, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHead(nn.Linear):
    """The logits, computed in fp32 whatever the model's dtype: rounded to bf16 first, GPT-2's
    logits (tens in size) would lose up to a few tenths, moving log-probabilities and deciding
    near-ties in greedy by rounding. In bf16 the weight's fp32 copy costs a read of it a step
    (0.15 GB for GPT-2, on the few rows that sample); in fp32 both casts are free."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, C) -> (n, vocab) fp32
        return F.linear(hidden.float(), self.weight.float())


class GPT(nn.Module):
    """The decoder, its parameters named as in Hugging Face's Llama (model.layers.0.self_attn.
    q_proj.weight, ...), so a Llama-family checkpoint loads by name; a GPT-2 checkpoint is
    renamed on load (from_gpt2_state)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
            layers=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            norm=make_norm(config, config.n_embd)))
        self.rotary = None
        if config.position_encoding == "learned":
            self.model["embed_positions"] = nn.Embedding(config.n_positions, config.n_embd)
        else:
            self.rotary = RotaryEmbedding(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in self.modules():  # GPT-2's init (norms keep their ones and zeros)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token ids and their positions (...,) -> x (..., C) and rope: GPT-2 adds a learned
        position embedding to x (rope None); RoPE models leave x alone and return the (cos,
        sin) (..., D) that every layer rotates its q and k by."""
        x = self.model.embed_tokens(input_ids)
        if self.rotary is None:
            return x + self.model.embed_positions(positions), None
        return x, self.rotary(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: torch.Tensor, v_caches: torch.Tensor, attention=paged_attention_ref):
        """Paged forward of the flat batch: input_ids, positions (N,) -> hidden states (N, C).
        Caches K/V in k_caches, v_caches (n_layer, NB, BS, Hkv, D); `attention` is from
        kernels.py."""
        x, rope = self.embed(input_ids, positions)  # (N, C); cos, sin (N, D) or None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, meta, k_caches[i], v_caches[i], attention)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, C) -> logits (n, vocab) in fp32 (see LMHead)."""
        return self.lm_head(hidden)

    def forward_dense(self, idx: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of token ids (B, T) at positions 0..T -> logits (B, T, vocab)."""
        return self.compute_logits(self.dense_hidden_states(idx))

    def dense_hidden_states(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                            cache: DenseKVCache | None = None, mask=None) -> torch.Tensor:
        """Token ids idx (B, T) -> hidden states (B, T, C), the logits left to the caller (a
        cached decode wants only the last position's). positions (B, T): each row's, where left
        padding shifts them; None: 0..T. cache: K/V of the positions before, the new ones
        appended. mask (B or 1, 1, T, cache.length + T) bool, True where a query may attend,
        with a cache only; None: causal without a cache, every cached position with one."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape)
        x, rope = self.embed(idx, positions)  # (B, T, C); cos, sin (B, T, D) or None
        for layer, block in enumerate(self.model.layers):
            x = block.forward_dense(x, rope, cache, layer, mask)
        if cache is not None:  # every layer wrote its K/V at length..length + T
            cache.length += idx.shape[1]
        return self.model.norm(x)


# ----------------------------------------------------------------------------- tokenizers
EOT = "<|endoftext|>"
GPT2_PATTERN = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"
# SmolLM2's pre-tokenizer as one regex: Digits(individual_digits) makes each digit a piece and
# ByteLevel splits the text between digits with GPT2_PATTERN, where spaces before a digit end
# that text, so they stay one piece: GPT-2's (?!\S) becomes "not before a non-digit non-space".
DIGITS_GPT2_PATTERN = (r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++"
                       r"|\s+(?![^\s\p{N}])|\s")
SENTENCEPIECE_REFUSAL = ("is not served: Llama 2, TinyLlama and Mistral 7B use it; nanoserve "
                         "serves byte-level BPE (GPT-2, Llama 3, Qwen2/2.5/3, SmolLM2)")


def gpt2_byte_chars() -> list[tuple[int, str]]:
    """GPT-2's 256 one-byte tokens in id order, as (byte, the character vocab.json writes)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return [(b, chr(b)) for b in printable] + [(b, chr(256 + n)) for n, b in enumerate(others)]


BYTE_OF_CHAR = {ch: b for b, ch in gpt2_byte_chars()}  # a byte-level file's character -> byte


def byte_level_bytes(token: str) -> bytes:
    """A token as byte-level files write it (vocab.json, merges, tokenizer.json: a character
    per byte, gpt2_byte_chars's) -> its bytes; KeyError for a character that is no byte's."""
    return bytes(BYTE_OF_CHAR[ch] for ch in token)


class Tokenizer:
    """Text <-> token ids, for the engine. tiktoken does the byte-level BPE (in Rust); around it
    is what a Hugging Face tokenizer.json adds: added tokens, each its id wherever a text writes
    it (those marked special are left out of decoded text, as vLLM's skip_special_tokens; the
    others, as Qwen's <tool_call>, are text), an NFC normalizer (Qwen2/3's) and a BOS that the
    post-processor puts before a text (Llama 3's <|begin_of_text|>). The byte-level tokenizer,
    GPT-2's files and tokenizer.json all give one."""

    def __init__(self, name: str, pat_str: str, mergeable_ranks: dict[bytes, int],
                 added_tokens: dict[str, int], special_token_ids: set[int],
                 bos_token: str | None = None, nfc: bool = False):
        # a rank is the token's id: tiktoken first merges the adjacent pair whose joined bytes
        # have the lowest; added tokens are tiktoken's special tokens (decoded as their text)
        self.encoding = tiktoken.Encoding(name=name, pat_str=pat_str,
                                          mergeable_ranks=mergeable_ranks,
                                          special_tokens=added_tokens)
        self.added_tokens = added_tokens                       # text -> id
        self.special_token_ids = frozenset(special_token_ids)  # no text in decoded output
        self.bos_token = bos_token
        self.bos_token_id = None if bos_token is None else added_tokens[bos_token]
        self.nfc = nfc
        self.n_vocab = self.encoding.n_vocab  # ids 0..n_vocab-1; an embedding may have more rows
        self.added_pattern = None  # added tokens, longest first: of two at one place, the longer
        if added_tokens:
            longest_first = sorted(added_tokens, key=len, reverse=True)
            self.added_pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def encode(self, text: str) -> list[int]:
        """A text's token ids, as Hugging Face's tokenizer gives them: an added token the text
        writes is its id; the text between them is normalized (NFC, if declared), split by
        the regex and merged; the BOS comes first if the post-processor adds one, unless the
        text starts with it already (a chat template writes it): never two."""
        pieces = [text] if self.added_pattern is None else self.added_pattern.split(text)
        ids = []
        for i, piece in enumerate(pieces):
            if i % 2 == 1:  # split() puts the added tokens it found at the odd places
                ids.append(self.added_tokens[piece])
            elif piece:
                if self.nfc:
                    piece = unicodedata.normalize("NFC", piece)
                ids += self.encoding.encode_ordinary(piece)
        if self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text, without the special tokens unless not skip_special_tokens (vLLM's
        /detokenize keeps them); bytes that are no UTF-8 character become U+FFFD."""
        data = b"".join([self.token_bytes(t, skip_special_tokens) for t in token_ids])
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """One token's bytes (a piece of a UTF-8 character, maybe); b"" for a special token
        (unless not skip_special_tokens) and for an id that is no token: Qwen's embedding has
        rows past its tokenizer's n_vocab."""
        if skip_special_tokens and token_id in self.special_token_ids:
            return b""
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):  # no such id (OverflowError: negative or >= 2**32)
            return b""

    def token_id(self, token: str | bytes) -> int:
        """The id of one token: an added token's text (<|im_end|>) or a vocabulary token's
        bytes; KeyError if it is no one token."""
        return self.encoding.encode_single_token(token)


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens (GPT-2's first 256 ids) plus <|endoftext|> = 256: GPT-2 without merges."""
    ranks = {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}
    return Tokenizer("bytes", GPT2_PATTERN, ranks, {EOT: 256}, {256})


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of checkpoint directory `path`: its tokenizer.json (Llama 3, Qwen2/2.5/3,
    SmolLM2) if it has one, else GPT-2's BPE files."""
    hf_file = os.path.join(path, "tokenizer.json")
    if os.path.exists(hf_file):
        return load_hf_tokenizer(hf_file)
    return load_gpt2_tokenizer(path)


def tokenizer_files(path: str) -> tuple[str, str]:
    """The vocabulary and merges files in directory `path`: Hugging Face's names, else OpenAI's."""
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        vocab_file = os.path.join(path, vocab_name)
        merges_file = os.path.join(path, merges_name)
        if os.path.exists(vocab_file) and os.path.exists(merges_file):
            return vocab_file, merges_file
    if os.path.exists(os.path.join(path, "tokenizer.model")):
        raise ValueError(f"{path} has only a SentencePiece model (tokenizer.model, no "
                         f"tokenizer.json), which {SENTENCEPIECE_REFUSAL}")
    raise ValueError(f"{path} has no tokenizer: expected tokenizer.json, vocab.json + merges.txt "
                     "or encoder.json + vocab.bpe")


def load_gpt2_tokenizer(path: str) -> Tokenizer:
    """GPT-2 BPE: Hugging Face's vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe.
    The ranks the merges give must be the ids the vocabulary gives."""
    vocab_file, merges_file = tokenizer_files(path)
    ranks = {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}
    with open(merges_file, encoding="utf-8") as f:
        merges = [line.split() for line in f.read().split("\n")[1:] if line]  # line 0: #version
    ranks |= {byte_level_bytes(a) + byte_level_bytes(b): rank
              for rank, (a, b) in enumerate(merges, start=256)}
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if EOT not in vocab:
        raise ValueError(f"{vocab_file} has no {EOT} token")
    eot_id = vocab.pop(EOT)
    if {byte_level_bytes(t): i for t, i in vocab.items()} != ranks:
        raise ValueError(f"{vocab_file} and {merges_file} disagree on the token ranks")
    return Tokenizer(os.path.basename(os.path.normpath(path)), GPT2_PATTERN, ranks,
                     {EOT: eot_id}, {eot_id})


def load_hf_tokenizer(file: str) -> Tokenizer:
    """A Hugging Face tokenizer.json, if it is byte-level BPE as GPT-2's, Llama 3's, Qwen2/2.5/
    3's and SmolLM2's are; anything else is refused, naming what is not served. Its vocabulary
    becomes tiktoken's ranks, its pre-tokenizer one tiktoken regex, its added tokens tiktoken's
    special tokens, its post-processor's leading special token the BOS. tiktoken looks each
    piece up whole before merging (ignore_merges, which Llama 3 sets); a trained BPE reaches
    the same tokens without it (the fixtures in .ci/fixtures/tokenizers check both)."""
    spec = read_json(file)
    check_not_sentencepiece(spec, file)
    bpe = spec.get("model") or {}
    check_bpe_model(bpe, file)
    check_decoder(spec.get("decoder"), file)
    added_tokens, special_token_ids = read_added_tokens(spec.get("added_tokens") or [], file)
    return Tokenizer(os.path.basename(os.path.dirname(os.path.abspath(file))),
                     pre_tokenizer_pattern(spec.get("pre_tokenizer"), file),
                     bpe_ranks(bpe, set(added_tokens.values()), file),
                     added_tokens, special_token_ids,
                     bos_token=post_processor_bos(spec.get("post_processor"), added_tokens, file),
                     nfc=declares_nfc(spec.get("normalizer"), file))


def components(component: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer, pre-tokenizer, post-processor or decoder as a list of
    parts: a Sequence's (listed under `key`), flattened; one part alone; none for null."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [part for sub in component.get(key) or [] for part in components(sub, key)]
    return [component]


def check_not_sentencepiece(spec: dict, file: str) -> None:
    """SentencePiece-style BPE (a space is ▁, a character outside the vocabulary its <0x..>
    byte tokens) is refused first, by its signs: of what is not served, it is the common case."""
    signs = []
    for where, key in (("normalizer", "normalizers"), ("pre_tokenizer", "pretokenizers"),
                       ("decoder", "decoders")):
        for part in components(spec.get(where), key):
            if part.get("type") in ("Metaspace", "Prepend", "ByteFallback"):
                signs.append(f"{part['type']} {where}")
    if (spec.get("model") or {}).get("byte_fallback"):
        signs.append("byte_fallback")
    if signs:
        raise ValueError(f"{file}: a SentencePiece-style tokenizer ({', '.join(signs)}), which "
                         f"{SENTENCEPIECE_REFUSAL}")


def check_bpe_model(bpe: dict, file: str) -> None:
    """The model is plain BPE: no dropout, no subword prefix or word suffix."""
    kind = bpe.get("type", "BPE" if "merges" in bpe else None)  # old files may omit it
    if kind != "BPE":
        raise ValueError(f"{file}: a {kind} model is not served: byte-level BPE only")
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if bpe.get(option):
            raise ValueError(f"{file}: BPE's {option} {bpe[option]!r} is not served")


def check_decoder(decoder: dict | None, file: str) -> None:
    """Decoding is byte-level: ids -> bytes -> UTF-8, what ByteLevel's decoder does."""
    types = [part.get("type") for part in components(decoder, "decoders")]
    if types not in ([], ["ByteLevel"]):
        raise ValueError(f"{file}: decoder {' + '.join(map(str, types))} is not served: "
                         "ByteLevel only")


def read_added_tokens(entries: list, file: str) -> tuple[dict[str, int], set[int]]:
    """Every added token, text -> id (each is its id wherever a text writes it, special or not),
    and the ids of those marked special, which decoded text leaves out."""
    added = {}
    special = set()
    for entry in entries:
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
            raise ValueError(f"{file}: added token {entry['content']!r} takes the spaces beside "
                             "it or matches whole words only (lstrip, rstrip, single_word), "
                             "which is not served")
        added[entry["content"]] = entry["id"]
        if entry.get("special"):
            special.add(entry["id"])
    return added, special


def pre_tokenizer_pattern(pre_tokenizer: dict | None, file: str) -> str:
    """The one tiktoken regex that splits a text as the pre-tokenizer does: ByteLevel's own
    (GPT-2's regex; use_regex), a Split regex before a ByteLevel that splits no more (Llama 3,
    Qwen2/3), or Digits(individual_digits) before ByteLevel's (SmolLM2)."""
    parts = components(pre_tokenizer, "pretokenizers")
    types = [part.get("type") for part in parts]
    described = " + ".join(map(str, types)) or "none"
    if types[-1:] != ["ByteLevel"]:
        raise ValueError(f"{file}: pre-tokenizer {described} is not served: byte-level BPE "
                         "ends with ByteLevel")
    byte_level = parts[-1]
    if byte_level.get("add_prefix_space"):
        raise ValueError(f"{file}: ByteLevel's add_prefix_space is not served")
    splits = byte_level.get("use_regex", True)  # GPT-2's regex, after the parts before it
    if types == ["ByteLevel"] and splits:
        return GPT2_PATTERN
    if types == ["Split", "ByteLevel"] and not splits:
        return split_pattern(parts[0], file)
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and splits:
        return DIGITS_GPT2_PATTERN
    raise ValueError(f"{file}: pre-tokenizer {described} (ByteLevel use_regex {splits}) is not "
                     "served: ByteLevel (GPT-2), Split + ByteLevel (Llama 3, Qwen2/3) or "
                     "Digits(individual_digits) + ByteLevel (SmolLM2) only")


def split_pattern(split: dict, file: str) -> str:
    """A Split pre-tokenizer's regex for tiktoken. Split (Isolated) makes each match a piece and
    each stretch between matches another; tiktoken drops what no match covers, so a stretch is
    one more alternative (Llama 3's and Qwen2's regexes leave none: it never matches)."""
    regex = (split.get("pattern") or {}).get("Regex")
    if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise ValueError(f"{file}: a Split pre-tokenizer is served as Llama 3's and Qwen2's "
                         "only: a Regex pattern, behavior Isolated, not inverted")
    return f"{regex}|(?:(?!{regex})[\\s\\S])+"


def declares_nfc(normalizer: dict | None, file: str) -> bool:
    """Whether a text is NFC-normalized before it is split (Qwen2/3's normalizer); none other
    is served."""
    types = [part.get("type") for part in components(normalizer, "normalizers")]
    if types not in ([], ["NFC"]):
        raise ValueError(f"{file}: normalizer {' + '.join(map(str, types))} is not served: "
                         "none, or NFC")
    return types == ["NFC"]


def bpe_ranks(bpe: dict, added_ids: set[int], file: str) -> dict[bytes, int]:
    """tiktoken's mergeable ranks: each vocabulary token's bytes (ByteLevel writes a byte as one
    of GPT-2's 256 characters) -> its id, less the added tokens (GPT-2 and SmolLM2 list theirs
    in the vocabulary too). Every byte must be a token; the merges must be in id order."""
    vocab = bpe.get("vocab") or {}
    ranks = {}
    for token, token_id in vocab.items():
        if token_id in added_ids:
            continue
        if not all(ch in BYTE_OF_CHAR for ch in token):
            raise ValueError(f"{file}: vocabulary token {token!r} is not byte-level: byte-level "
                             "BPE only")
        ranks[byte_level_bytes(token)] = token_id
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{file}: {len(missing)} of the 256 bytes are no token (byte "
                         f"{missing[0]:#04x} first); byte-level BPE needs them all")
    check_merge_order(bpe.get("merges") or [], vocab, file)
    return ranks


def check_merge_order(merges: list, vocab: dict[str, int], file: str) -> None:
    """tiktoken merges the adjacent pair whose joined bytes have the lowest rank (id); Hugging
    Face's BPE the pair listed first in merges. They can agree only if the merges list their
    tokens in id order (one token may have several: Llama 3 lists every split of each)."""
    last = -1
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge  # "a b": before 0.20
        token_id = vocab.get("".join(pair)) if len(pair) == 2 else None
        if token_id is None:
            raise ValueError(f"{file}: merge {merge!r} makes no token of the vocabulary")
        if token_id < last:
            raise ValueError(f"{file}: the merges are not in the order of their tokens' ids "
                             f"({merge!r} makes id {token_id}, after id {last}), which "
                             "tiktoken's ranks need")
        last = token_id


def post_processor_bos(post_processor: dict | None, added_tokens: dict[str, int], file: str
                       ) -> str | None:
    """The token the post-processor puts before a text (Llama 3's TemplateProcessing
    "<|begin_of_text|> $A"), or None (ByteLevel's adds nothing). A template that adds anything
    else (an EOS after the text) is not served."""
    bos = None
    for part in components(post_processor, "processors"):
        if part.get("type") == "ByteLevel":
            continue
        if part.get("type") != "TemplateProcessing":
            raise ValueError(f"{file}: post-processor {part.get('type')} is not served: "
                             "ByteLevel or TemplateProcessing only")
        template = part.get("single") or []
        words = [item["SpecialToken"]["id"] if "SpecialToken" in item
                 else "$" + item["Sequence"]["id"] for item in template]
        if words == ["$A"]:
            continue
        if len(words) != 2 or words[1] != "$A" or "SpecialToken" not in template[0] or bos:
            raise ValueError(f"{file}: post-processor template {' '.join(words)!r} is not "
                             "served: one token before the text, or none")
        bos = words[0]
    if bos is not None and bos not in added_tokens:
        raise ValueError(f"{file}: the post-processor's BOS {bos!r} is no added token")
    return bos


class Detokenizer:
    """A request's text, decoded a token at a time: a step costs what its new tokens cost. An
    unfinished UTF-8 character waits in the decoder; stop strings are looked for in the new
    text and the longest one's overlap; text that could start one is held back until it
    cannot, so what was streamed is never taken back."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.max_stop_len = max(map(len, stop), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.num_sent_chars = 0  # text returned by new_text so far

    def append(self, token: int, check_stop: bool = True) -> str | None:
        """Add a token's text (none for a special token, or an id past the tokenizer); return
        the stop string it completed (unless not check_stop: before min_tokens), the text cut
        before it (or after it, if include_stop)."""
        search_from = max(0, len(self.text) - self.max_stop_len + 1)  # a stop string's overlap
        self.text += self.decoder.decode(self.tokenizer.token_bytes(token))
        if not check_stop:
            return None
        # One token can complete several stop strings: the earliest in the text wins, whatever
        # the list's order; of those found at the same place ("ab" and "abc"), the longest.
        found = None
        found_at = -1
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at < 0:
                continue
            if found is None or at < found_at or (at == found_at and len(stop) > len(found)):
                found = stop
                found_at = at
        if found is None:
            return None
        end = found_at
        if self.include_stop:
            end = found_at + len(found)
        self.text = self.text[:end]
        return found

    def flush(self) -> None:
        """The text ended: the bytes of an unfinished character become U+FFFD."""
        self.text += self.decoder.decode(b"", final=True)

    def new_text(self, finished: bool) -> str:
        """Text not returned yet, less (unless finished) what could still become a stop string."""
        end = len(self.text)
        for n in range(0 if finished else min(self.max_stop_len - 1, end), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                end -= n
                break
        new = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return new


# ----------------------------------------------------------------------------- configs
SERVED_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "mistral": "MistralForCausalLM"}
# config.json keys that change nothing a forward pass computes: metadata, training settings
# (dropout, init), generation defaults. max_window_layers counts sliding-window layers, and
# those are refused; pretraining_tp only split the matmuls while training.
NEUTRAL_KEYS = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
                "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
                "initializer_range", "attention_dropout", "attn_pdrop", "embd_pdrop",
                "resid_pdrop", "summary_activation", "summary_first_dropout",
                "summary_proj_to_labels", "summary_type", "summary_use_proj",
                "task_specific_params", "reorder_and_upcast_attn", "max_window_layers",
                "pretraining_tp", "is_llama_config", "rope_interleaved", "transformers.js_config"}
# The keys config_from_hf reads, each into a GPTConfig field or a check.
GPT2_KEYS = {"vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
             "layer_norm_epsilon", "activation_function", "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx", "tie_word_embeddings"}
LLAMA_KEYS = {"vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings",
              "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
              "use_sliding_window", "layer_types", "use_mrope"}
LLAMA3_SCALING_KEYS = {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"}


def config_from_hf(hf: dict, path: str) -> GPTConfig:
    """A Hugging Face config.json -> GPTConfig. An allow-list: a key this function does not
    know is refused by name, since serving a model while ignoring what a key changes (another
    RoPE scaling, a sliding window, experts) would give wrong text without a word."""
    model_type = hf.get("model_type")
    if model_type not in SERVED_ARCHITECTURES:
        raise ValueError(f"{path}: model_type {model_type!r} is not served; nanoserve serves "
                         f"{', '.join(SERVED_ARCHITECTURES)}")
    architecture = SERVED_ARCHITECTURES[model_type]
    if hf.get("architectures", [architecture]) != [architecture]:
        raise ValueError(f"{path}: architectures {hf['architectures']} is not served; a "
                         f"{model_type} checkpoint is served as {architecture}")
    known = GPT2_KEYS if model_type == "gpt2" else LLAMA_KEYS
    if unknown := sorted(set(hf) - known - NEUTRAL_KEYS):
        raise ValueError(f"{path}: config.json key {unknown[0]!r} is not served: it may change "
                         "what the model computes, and nanoserve would ignore it")
    try:
        if model_type == "gpt2":
            return gpt2_config(hf, path)
        return llama_config(hf, path)
    except KeyError as e:  # a size every config of the family has
        raise ValueError(f"{path}: config.json lacks {e.args[0]!r}") from None


def require(hf: dict, key: str, allowed: tuple, path: str) -> None:
    """Refuse a config whose `key` is present with a value not in `allowed`."""
    if key in hf and hf[key] not in allowed:
        raise ValueError(f"{path}: {key} {hf[key]!r} is not served (only {allowed})")


def gpt2_config(hf: dict, path: str) -> GPTConfig:
    require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), path)
    require(hf, "scale_attn_weights", (True,), path)
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), path)
    require(hf, "tie_word_embeddings", (True,), path)
    require(hf, "n_ctx", (hf["n_positions"],), path)
    return GPTConfig(vocab_size=hf["vocab_size"], n_positions=hf["n_positions"],
                     n_embd=hf["n_embd"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                     intermediate_size=hf.get("n_inner"),
                     norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def llama_config(hf: dict, path: str) -> GPTConfig:
    """Llama, Qwen2, Qwen3 and Mistral: one layout; they differ in biases, q/k norm and RoPE."""
    model_type = hf["model_type"]
    require(hf, "hidden_act", ("silu",), path)
    require(hf, "use_mrope", (False,), path)  # Qwen2-VL's multimodal RoPE
    check_full_attention(hf, path)
    rope_theta, rope_scaling = rope_settings(hf, path)
    attention_bias = hf.get("attention_bias", False)
    # Biases as transformers builds each family: Qwen2 has them on q, k, v always; Mistral and
    # Qwen2 have no attention_bias key (transformers ignores one), Llama and Qwen3 do.
    qkv_bias = {"llama": attention_bias, "qwen2": True, "qwen3": attention_bias}
    o_bias = {"llama": attention_bias, "qwen3": attention_bias}
    return GPTConfig(vocab_size=hf["vocab_size"], n_positions=hf["max_position_embeddings"],
                     n_embd=hf["hidden_size"], n_layer=hf["num_hidden_layers"],
                     n_head=hf["num_attention_heads"],
                     n_kv_head=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                     intermediate_size=hf["intermediate_size"], norm="rmsnorm",
                     norm_eps=hf.get("rms_norm_eps", 1e-6), position_encoding="rope",
                     mlp="swiglu", qkv_bias=qkv_bias.get(model_type, False),
                     o_bias=o_bias.get(model_type, False),
                     mlp_bias=model_type == "llama" and hf.get("mlp_bias", False),
                     qk_norm=model_type == "qwen3",
                     tie_word_embeddings=hf.get("tie_word_embeddings", False),
                     rope_theta=rope_theta, rope_scaling=rope_scaling)


def check_full_attention(hf: dict, path: str) -> None:
    """Refuse sliding-window attention where it would apply: a window shorter than the context
    (Mistral's whenever set; Qwen's only with use_sliding_window), or sliding layer_types."""
    window = hf.get("sliding_window")
    applies = hf.get("use_sliding_window", hf["model_type"] == "mistral")
    if applies and window is not None and window < hf["max_position_embeddings"]:
        raise ValueError(f"{path}: sliding_window {window} is shorter than the context "
                         f"{hf['max_position_embeddings']}: sliding-window attention is not "
                         "served")
    sliding = [kind for kind in hf.get("layer_types") or [] if kind != "full_attention"]
    if sliding:
        raise ValueError(f"{path}: layer_types has {sliding[0]!r} layers: only "
                         "full_attention is served")


def rope_settings(hf: dict, path: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from published configs' rope_theta and rope_scaling keys, or
    transformers 5's rope_parameters; a scaling other than Llama 3's is refused by name."""
    parameters = hf.get("rope_parameters")
    if parameters is None:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
    else:
        theta = parameters.get("rope_theta", 10000.0)
        scaling = parameters
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{path}: rope_scaling type {rope_type!r} is not served (only llama3)")
    if missing := sorted(LLAMA3_SCALING_KEYS - set(scaling)):
        raise ValueError(f"{path}: llama3 rope_scaling lacks {missing[0]!r}")
    if unknown := sorted(set(scaling) - LLAMA3_SCALING_KEYS - {"rope_type", "type", "rope_theta"}):
        raise ValueError(f"{path}: rope_scaling key {unknown[0]!r} is not served")
    return theta, {key: scaling[key] for key in sorted(LLAMA3_SCALING_KEYS)}


# ----------------------------------------------------------------------------- checkpoints
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "U8": torch.uint8}
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints",
                             "shakespeare")  # trained by train() below, shipped with the repo


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A .safetensors file: 8-byte little-endian header length, a JSON header, raw tensors."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else len(data)
    if len(data) < 8 or 8 + n > len(data):
        raise ValueError(f"{path}: corrupt safetensors header (length {n}, file {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        start, end = info["data_offsets"]
        numel = math.prod(info["shape"])
        if dtype is None or end - start != numel * dtype.itemsize or 8 + n + end > len(data):
            raise ValueError(f"{path}: corrupt safetensors entry for {name}: {info}")
        tensors[name] = torch.frombuffer(data, dtype=dtype, count=numel,
                                         offset=8 + n + start).reshape(info["shape"])
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header = {}
    offset = 0  # of the tensor's bytes, after the header
    for name, t in tensors.items():
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())


def load_checkpoint(path: str) -> GPT:
    """A Hugging Face checkpoint directory of a served architecture (config_from_hf):
    config.json + model.safetensors or pytorch_model.bin."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} is not a checkpoint directory: no config.json")
    hf = read_json(config_file)
    model = GPT(config_from_hf(hf, path))
    tensors = read_weights(path)
    if hf["model_type"] == "gpt2":
        tensors = from_gpt2_state(checked_state(gpt2_tensors(tensors),
                                                to_gpt2_state(model.state_dict()), path))
    else:
        tensors = checked_llama_state(tensors, model, path)
    if model.config.tie_word_embeddings:  # one tensor under two names
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors)
    return model


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors, else of the shards model.safetensors.index.json
    lists, else of pytorch_model.bin, in `path`."""
    safetensors_file = os.path.join(path, "model.safetensors")
    index_file = os.path.join(path, "model.safetensors.index.json")
    pickle_file = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(safetensors_file):
        return read_safetensors(safetensors_file)
    if os.path.exists(index_file):
        return read_shards(index_file)
    if os.path.exists(pickle_file):
        return torch.load(pickle_file, map_location="cpu", weights_only=True)
    raise ValueError(f"{path} has no model.safetensors, model.safetensors.index.json or "
                     "pytorch_model.bin")


def read_shards(index_file: str) -> dict[str, torch.Tensor]:
    """A sharded checkpoint: each shard its index's weight_map names, read once; a tensor the
    index places in a shard that lacks it is an error, not a silent gap."""
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_file} has no weight_map")
    directory = os.path.dirname(index_file)
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        shard_file = os.path.join(directory, shard)
        if not os.path.exists(shard_file):
            raise ValueError(f"{index_file} lists shard {shard}, which is missing")
        tensors |= read_safetensors(shard_file)
    if missing := sorted(set(weight_map) - set(tensors)):
        raise ValueError(f"{index_file}: tensor {missing[0]} is not in its shard "
                         f"{weight_map[missing[0]]}")
    return tensors


def checked_state(state: dict, expected: dict, path: str) -> dict:
    """state, once every tensor of `expected` is in it with its shape and nothing else is."""
    for key, want in expected.items():
        if key not in state:
            raise ValueError(f"{path}: checkpoint is missing tensor {key}")
        if state[key].shape != want.shape:
            raise ValueError(f"{path}: tensor {key} has shape {tuple(state[key].shape)}; "
                             f"config.json implies {tuple(want.shape)}")
    if unexpected := sorted(set(state) - set(expected)):
        raise ValueError(f"{path}: unexpected tensors {unexpected[:5]}")
    return state


def checked_llama_state(tensors: dict, model: GPT, path: str) -> dict:
    """A Llama-family checkpoint's tensors, named as ours already, checked: old checkpoints'
    saved RoPE buffers dropped, and a tied head's copy (some checkpoints store one) too."""
    tied = model.config.tie_word_embeddings
    state = {key: t for key, t in tensors.items()
             if not key.endswith("rotary_emb.inv_freq") and not (tied and key == "lm_head.weight")}
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    return checked_state(state, expected, path)


# GPT-2's names for our parameters (ours are Llama's): top level, then within layer i ("h.i.").
# q, k and v are one fused c_attn in GPT-2; its Conv1D weights are stored (in, out).
GPT2_NAMES = {"model.embed_tokens": "wte", "model.embed_positions": "wpe", "model.norm": "ln_f"}
GPT2_LAYER_NAMES = {"input_layernorm": "ln_1", "self_attn.o_proj": "attn.c_proj",
                    "post_attention_layernorm": "ln_2", "mlp.up_proj": "mlp.c_fc",
                    "mlp.down_proj": "mlp.c_proj"}
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # HF's Conv1D stores (in, out); nn.Linear wants (out, in)


def gpt2_tensors(tensors: dict) -> dict:
    """A GPT-2 checkpoint's parameters, by GPT-2's names without the "transformer." prefix
    (safetensors files drop it, pytorch_model.bin keeps it); no causal-mask buffers, no LM head
    (GPT-2's is tied to wte)."""
    state = {}
    for key, t in tensors.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue
        state[key] = t
    return state


def to_gpt2_state(state: dict) -> dict:
    """Our parameters -> GPT-2's: renamed, q, k, v fused into c_attn, Conv1D weights (in, out)."""
    gpt2 = {}
    for key, t in state.items():
        if key == "lm_head.weight" or ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue  # the head is wte; k and v go into c_attn with q
        if ".self_attn.q_proj." in key:
            k = state[key.replace(".q_proj.", ".k_proj.")]
            v = state[key.replace(".q_proj.", ".v_proj.")]
            t = torch.cat((t, k, v))
            key = key.replace(".self_attn.q_proj.", ".self_attn.c_attn.")
        gpt2_key = gpt2_name(key)
        if gpt2_key.endswith(CONV1D_WEIGHTS):
            t = t.t()
        gpt2[gpt2_key] = t
    return gpt2


def gpt2_name(key: str) -> str:
    """Ours -> GPT-2's: "model.layers.3.mlp.up_proj.bias" -> "h.3.mlp.c_fc.bias"."""
    module, param = key.rsplit(".", 1)
    if module in GPT2_NAMES:
        return f"{GPT2_NAMES[module]}.{param}"
    layer, inner = module.removeprefix("model.layers.").split(".", 1)
    if inner == "self_attn.c_attn":
        return f"h.{layer}.attn.c_attn.{param}"
    return f"h.{layer}.{GPT2_LAYER_NAMES[inner]}.{param}"


def from_gpt2_state(gpt2: dict) -> dict:
    """GPT-2's parameters (gpt2_tensors) -> ours: to_gpt2_state undone."""
    ours = {}
    top_names = {theirs: mine for mine, theirs in GPT2_NAMES.items()}
    layer_names = {theirs: mine for mine, theirs in GPT2_LAYER_NAMES.items()}
    for key, t in gpt2.items():
        if key.endswith(CONV1D_WEIGHTS):
            t = t.t()
        module, param = key.rsplit(".", 1)
        if module in top_names:
            ours[f"{top_names[module]}.{param}"] = t
            continue
        _, layer, inner = module.split(".", 2)  # "h", "3", "mlp.c_fc"
        prefix = f"model.layers.{layer}."
        if inner == "attn.c_attn":
            q, k, v = t.chunk(3)
            ours |= {prefix + f"self_attn.{name}_proj.{param}": part
                     for name, part in zip("qkv", (q, k, v))}
            continue
        ours[prefix + f"{layer_names[inner]}.{param}"] = t
    return ours


@dataclass
class Checkpoint:
    """What load_model gives the engine: the model, its tokenizer, and what else a checkpoint
    directory says about serving it."""
    model: GPT
    tokenizer: Tokenizer
    eos_token_ids: list[int]          # every id that ends a request (unless it ignores EOS)
    dtype: torch.dtype | None = None  # config.json's torch_dtype: --dtype auto's on CUDA
    generation_config: dict = field(default_factory=dict)  # generation_config.json, or {}
    path: str | None = None           # the checkpoint's directory; None for a preset


def load_model(model: str | None = None, preset: str | None = None, seed: int = 0
               ) -> Checkpoint:
    """A preset (seeded random weights), a checkpoint directory, a name in the local Hugging
    Face cache (Qwen/Qwen3-0.6B; GPT-2's are downloaded there if missing) or the shipped model."""
    if preset is not None:
        torch.manual_seed(seed)
        tokenizer = byte_tokenizer()
        return Checkpoint(GPT(PRESETS[preset]), tokenizer, eos_token_ids(tokenizer, {}, {}))
    path = checkpoint_path(model or DEFAULT_MODEL)
    gpt = load_checkpoint(path)  # first: a directory that is no checkpoint says so
    hf = read_json(os.path.join(path, "config.json"))
    generation_config = read_json(os.path.join(path, "generation_config.json"))
    tokenizer = load_tokenizer(path)
    return Checkpoint(gpt, tokenizer, eos_token_ids(tokenizer, hf, generation_config),
                      dtype=CONFIG_DTYPES.get(hf.get("torch_dtype", hf.get("dtype"))),
                      generation_config=generation_config, path=path)


CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_json(path: str) -> dict:
    """A JSON object from a file; {} if there is no such file."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value


def eos_token_ids(tokenizer: Tokenizer, hf: dict, generation_config: dict) -> list[int]:
    """Every id that ends a request: generation_config.json's eos_token_id, then config.json's
    (each an int or a list: Llama 3 Instruct ends at <|end_of_text|>, <|eom_id|> and
    <|eot_id|>); with neither, the tokenizer's <|endoftext|>, if it has one."""
    ids = []
    for source in (generation_config, hf):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if type(token_id) is not int or token_id < 0:
                raise ValueError(f"eos_token_id {value!r} is not a token id or a list of them")
            if token_id not in ids:
                ids.append(token_id)
    if not ids and EOT in tokenizer.added_tokens:
        ids.append(tokenizer.added_tokens[EOT])
    return ids


def checkpoint_path(model: str) -> str:
    """The directory of `model`: a directory as given, else a name in the local Hugging Face
    cache (GPT-2's downloaded into it if missing)."""
    if os.path.isdir(model):
        return model
    if model in HUB_MODELS:
        return hub_checkpoint(model)
    cached = find_in_hub_cache(model, hub_cache_dir(), ("config.json",))
    if cached is not None:
        return cached
    raise ValueError(f"model {model!r} is neither a checkpoint directory, nor in the Hugging "
                     f"Face cache ({hub_cache_dir()}), nor one of {', '.join(HUB_MODELS)}; "
                     f"download it first (huggingface-cli download {model})")


HUB_FILES = ("config.json", "vocab.json", "merges.txt", "model.safetensors")


def hub_cache_dir() -> str:
    """Where Hugging Face keeps downloaded models: $HF_HUB_CACHE, $HF_HOME/hub or the default."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")


def hub_checkpoint(name: str) -> str:
    """A GPT-2 checkpoint from the local Hugging Face cache, else downloaded into it."""
    hub = hub_cache_dir()
    cached = find_in_hub_cache(name, hub, HUB_FILES)
    if cached is not None:
        return cached
    advice = (f"{name} is not in the Hugging Face cache ({hub}) and cannot be downloaded ({{}});"
              " pass --model DIR with a GPT-2 checkpoint directory, or no --model for the "
              "built-in Shakespeare model")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise ValueError(advice.format("HF_HUB_OFFLINE is set"))
    target = os.path.join(hub, f"models--openai-community--{name}", "snapshots", "main")
    for file_name in HUB_FILES:
        try:
            _download(f"https://huggingface.co/openai-community/{name}/resolve/main/{file_name}",
                      os.path.join(target, file_name))
        except OSError as e:
            raise ValueError(advice.format(e)) from None
    return target


def find_in_hub_cache(name: str, hub: str, files: tuple) -> str | None:
    """The first snapshot of `name` (or openai-community/`name`) in the hub cache that holds
    every one of `files`, or None."""
    for repo in (name, f"openai-community/{name}"):
        snapshots = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots")
        if not os.path.isdir(snapshots):
            continue
        for snapshot in sorted(os.listdir(snapshots)):
            path = os.path.join(snapshots, snapshot)
            if all(os.path.exists(os.path.join(path, file_name)) for file_name in files):
                return path
    return None


def _download(url: str, path: str) -> None:
    """url -> path, with a progress line; a partial file never takes the final name."""
    with urllib.request.urlopen(url, timeout=10) as r:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # only once the hub has answered
        total = int(r.headers.get("Content-Length") or 0)
        done = 0
        with open(path + ".part", "wb") as f:
            while chunk := r.read(1 << 20):
                done += f.write(chunk)
                print(f"\rdownloading {os.path.basename(path)}: {done / 1e6:.0f}/"
                      f"{total / 1e6:.0f} MB", end="", file=sys.stderr)
    print(file=sys.stderr)
    os.replace(path + ".part", path)


def save_checkpoint(model: GPT, path: str, dtype=torch.float16) -> None:
    """Write a GPT-2-shaped `model` (the trainer's) as a Hugging Face GPT-2 directory, with the
    byte-level tokenizer files."""
    c = model.config
    if c != GPTConfig(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
                      n_layer=c.n_layer, n_head=c.n_head, norm_eps=c.norm_eps):
        raise ValueError("save_checkpoint writes GPT-2's layout only")
    os.makedirs(path, exist_ok=True)
    state = {key: t.to(dtype).contiguous() for key, t in to_gpt2_state(model.state_dict()).items()}
    write_safetensors(state, os.path.join(path, "model.safetensors"))
    hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_ctx=c.n_positions,
              bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1,
              vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
              n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.norm_eps)
    vocab = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: 256}
    for name, text in [("config.json", json.dumps(hf, indent=2)), ("vocab.json", json.dumps(vocab)),
                       ("merges.txt", "#version: 0.2\n")]:  # bytes only: no merges
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)


# ----------------------------------------------------------------------------- training

def train(args) -> None:
    """Train a byte-level GPT-2 on a text file (its last 10% held out for validation) and save
    it as a Hugging Face GPT-2 directory in fp16, ready for `nanoserve.py --model DIR`.

    The recipe of the shipped checkpoint (checkpoints/shakespeare/) is these defaults, run on
    tinyshakespeare.txt (in ../shared/data/) with --out checkpoints/shakespeare: 6 layers,
    6 heads, n_embd 192 (2,915,520 parameters), context 1024 bytes; 1300 AdamW steps of 8,192
    bytes each (lr 2e-3, 100 warmup steps, cosine to 2e-4, weight decay 0.1 on matrices,
    gradients clipped at 1, seed 1337).

    A context curriculum: the first --short-steps (900) steps see 32 windows of 256 bytes,
    the last 400 see 8 windows of 1024 (as many bytes a step), and at the switch the position
    embeddings 256..1023, never trained until then, start as a copy of position 255's. Why:
    two runs at 1024 bytes from the start (1100 x 8 and 2200 x 4 windows, about 29 minutes
    each) sat near 2.45 nats/byte, about what byte frequencies give, for half the run, and
    ended at 1.954 and 1.935; short windows first learn the short-range statistics at 4x the
    windows a step, and the long phase only has to extend them.

    Validation loss (the held-out 111,540 bytes, 1024-byte windows): 5.59 at step 0, 1.76 at
    1000, 1.59 at 1200, and 1.573 nats/byte at the end with the fp16 weights as shipped (the
    steps before 1000 score worse: they count positions the short windows never trained).
    About 32 minutes on 2 idle CPU cores."""
    torch.manual_seed(args.seed)
    train_data, val_data = read_split(args.train)
    model = GPT(GPTConfig(n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                          n_head=args.n_head))
    opt = adamw(model, args.lr)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, {len(train_data):,} train bytes, "
          f"{len(val_data):,} validation bytes")
    t0 = time.time()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val {evaluate(model, val_data, args.seq_len):.4f} nats/byte  "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        seq_len = args.short_seq_len if step < args.short_steps else args.seq_len
        if step == args.short_steps and step > 0:
            # the first full-length step: positions never trained start as the last trained one
            wpe = model.model.embed_positions.weight.data
            wpe[args.short_seq_len:] = wpe[args.short_seq_len - 1]
        x, y = random_windows(train_data, args.batch_size * args.seq_len // seq_len, seq_len)
        loss = F.cross_entropy(model.forward_dense(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    save_checkpoint(model, args.out)
    shipped = load_checkpoint(args.out)  # fp16 weights, as served
    print(f"saved {args.out}: {num_params:,} parameters, context {args.seq_len}, "
          f"{(time.time() - t0) / 60:.1f} min, "
          f"val {evaluate(shipped, val_data, args.seq_len):.4f} nats/byte (fp16 weights)")


def read_split(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A UTF-8 text file as byte tokens: its first 90% to train on, its last 10% held out."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    split = int(len(text) * 0.9)
    train_data = byte_tensor(text[:split])
    val_data = byte_tensor(text[split:])
    return train_data, val_data


def byte_tensor(text: str) -> torch.Tensor:
    """Text -> its byte tokens (n,), int64."""
    return torch.tensor(byte_tokenizer().encoding.encode_ordinary(text), dtype=torch.long)


def adamw(model: GPT, lr: float) -> torch.optim.AdamW:
    """AdamW, with weight decay on the matrices only (not on biases and LayerNorm gains)."""
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                              {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99))


def random_windows(data: torch.Tensor, batch_size: int,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size windows of `data` at random starts: inputs x (B, T) and targets y (B, T), the
    byte after each of x's."""
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,))
    windows = torch.stack([data[i:i + seq_len + 1] for i in starts])  # (B, T + 1)
    x = windows[:, :-1]
    y = windows[:, 1:]
    return x, y


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, seq_len: int) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of `data`."""
    n = (len(data) - 1) // seq_len
    x = data[:n * seq_len].view(n, seq_len)
    y = data[1:n * seq_len + 1].view(n, seq_len)  # the next bytes
    losses = [F.cross_entropy(model.forward_dense(xb).flatten(0, 1), yb.flatten(), reduction="sum")
              for xb, yb in zip(x.split(64), y.split(64))]
    return sum(loss.item() for loss in losses) / y.numel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=inspect.cleandoc(train.__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="UTF-8 text file; its last 10%% is held out")
    p.add_argument("--out", default=os.path.join("checkpoints", "trained"),
                   help="checkpoint directory to write; serve it with --model DIR "
                   "(default: %(default)s)")
    for flag, default in [("--steps", 1300), ("--batch-size", 8), ("--seq-len", 1024),
                          ("--short-steps", 900), ("--short-seq-len", 256), ("--n-layer", 6),
                          ("--n-head", 6), ("--n-embd", 192), ("--lr", 2e-3), ("--warmup", 100),
                          ("--eval-every", 200), ("--seed", 1337)]:
        p.add_argument(flag, type=type(default), default=default, help="(default: %(default)s)")
    train(p.parse_args())

"""model.py: a decoder-only transformer shaped for serving: GPT-2, Llama, Qwen2, Qwen3, Mistral.

GPTConfig holds the few fields in which those families differ, and PRESETS a few shapes with
random weights; then RMSNorm, RotaryEmbedding (RoPE, Llama 3's rescaling included), Attention
(grouped-query: fewer K/V heads than query heads), MLP (GELU or SwiGLU), Block, GPT. Two
forward paths run the same layers. `GPT.forward` is the engine's: one flat batch of tokens
(N, C), every op but attention on all scheduled tokens at once (Orca's "selective batching"),
positions rotating q and k per token, attention reading and writing the paged KV cache
through kernels.py, told where everything is by an AttentionMetadata. `GPT.forward_dense` is
the plain model on (B, T): the training path (train.py) and the paged path's reference;
`GPT.dense_hidden_states` is its body, which can also keep K/V in a DenseKVCache, contiguous
per sequence as Hugging Face keeps them (bench.py's naive baseline).

A layer launches few kernels: q, k, v are one GEMM (qkv_proj) and the MLP's gate and up another
(gate_up_proj), stacked as the weights load (linear.py's MergedLinear, the projections' home,
where adapters add their LoRA terms; the state dict keeps Hugging Face's names); each residual
add is done by the norm after it (vLLM's fused_add_rms_norm); and on CUDA the RMSNorm, RoPE and
SwiGLU functions are compiled into one kernel each (fused_on_cuda), while a CPU runs them as
written, computing what it always did, bit for bit.

checkpoint.py builds a GPT from a checkpoint's config.json and weights; the engine
(nanoserve.py) runs it.

Left out: dropout, sliding-window attention, mixture-of-experts, RoPE scalings but Llama 3's.
Tensor parallelism cuts this model in tensor_parallel.py; quantized projections are
linear.py's, an FP8 KV cache kernels.py's (with Attention's k_scale and v_scale).
Shape legend: N tokens in the flat batch, B batch, T time, C n_embd, H query heads, Hkv K/V
heads, D head dim.
"""
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import cuda_runtime
from kernels import AttentionMetadata, paged_attention_ref, store_kv
from linear import Linear, MergedLinear, merge_split, split_merged


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


def fused_on_cuda(fn):
    """fn run as written on a CPU (eager PyTorch: the reference, bit for bit what the model
    always computed; torch.compile there needs a C++ compiler and seconds to start, and a
    CPU's ATen calls are cheap); on CUDA, fn compiled by torch.compile (Inductor: one Triton
    kernel where eager launches one per op; emulate_precision_casts: rounded to x's dtype
    wherever fn rounds, not kept in fp32 between ops). Compiled on its first CUDA call, which
    takes seconds (run one before capturing a CUDA graph), with dynamic sizes, so that no
    token count, model or head count compiles it again; a new rank or dtype does, and past
    torch's recompile limit fn runs eagerly. fn.__wrapped__ is fn itself."""
    compiled = None

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args):
        nonlocal compiled
        if not cuda_runtime.is_cuda(x.device):
            return fn(x, *args)
        if compiled is None:
            compiled = cuda_runtime.compile_fused(fn)
        return compiled(x, *args)
    return run


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over x's last dim, as Llama's: the mean square taken in fp32, the
    product in x's dtype. On CUDA one kernel (eager: 8)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@fused_on_cuda
def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm: x, residual (..., C) -> rms_norm(x + residual), x + residual,
    the sum being the next residual: the residual add and the norm after it in one kernel on
    CUDA. The sum is x + residual as the unfused layer added it (a sum of two is the same in
    either order), so a CPU computes the same bits."""
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    """rms_norm with a learned weight; given a residual, rms_norm_residual."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x (..., dim) -> normed x; with a residual, (normed x + residual, x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_residual(x, residual, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """GPT-2's nn.LayerNorm, taking a residual as RMSNorm does (eagerly on every device: the
    kernel count is the Llama family's concern)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x (..., dim) -> normed x; with a residual, (normed x + residual, x + residual)."""
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


def make_norm(config: GPTConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return LayerNorm(dim, eps=config.norm_eps)


def add_and_norm(norm: nn.Module, x: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): a layer's residual add, done by the norm after it
    (vLLM's pattern); residual None, at the first layer's input: (norm(x), x)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoPE): a position enters attention as a rotation of q and k,
    head-dim pair (i, i + D/2) turned by position x inv_freq[i], so q.k depends on how far apart
    two tokens are, not where they are. Computed from the flat batch's positions, so a token's
    rotation is the same whatever its step, chunk or batch."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,) fp32

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) casts every floating buffer with the weights; inv_freq stays fp32,
        as transformers and vLLM keep it, and only follows the model's device. Rounded to bf16,
        a Llama 3.1 angle is 0.18 rad off at position 100 and 1.8 at 1,000."""
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (...,) -> cos, sin (..., 1, D) in dtype, the 1 broadcasting over heads:
        each angle once per pair's half. Once a step, for every layer."""
        angles = positions.float()[..., None, None] * self.inv_freq.float()  # (..., 1, D/2)
        angles = torch.cat((angles, angles), dim=-1)                           # (..., 1, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Each pair's turn per position (D/2,) fp32, computed as Hugging Face computes it (in fp32,
    so the angles are bit-equal), then Llama 3's rescaling if asked for."""
    # on the CPU, whatever the default device: a model built on "meta" gets real values too
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
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


@fused_on_cuda
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., heads, D) by cos, sin (..., 1, D): pair (i, i + D/2) as the complex number
    x_i + i x_{i+D/2} times e^{i angle} (Hugging Face's "rotate_half" layout, not interleaved).
    On CUDA one kernel (eager: 5), for q's and k's heads at once."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


@fused_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (vLLM's SiluAndMul): x (..., 2 I), gate_up_proj's output, -> silu(gate)
    * up (..., I), gate and up its halves. On CUDA one kernel (eager: 3, a copy included)."""
    gate, up = x.chunk(2, dim=-1)
    # contiguous: a CPU's F.silu computes a strided row's last elements on another path, off
    # by an ulp from gate_proj's own output's; on CUDA it is a layout, fused away
    return F.silu(gate.contiguous()) * up


class Attention(nn.Module):
    """Causal self-attention with n_head query heads and n_kv_head K/V heads: query head h reads
    K/V head h // G (G = n_head // n_kv_head, the group size), so the cache holds n_kv_head
    heads a token (GPT-2: as many as the queries; Llama-3.2-1B: 8 for 32)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.q_size = config.n_head * config.head_dim
        self.kv_size = config.n_kv_head * config.head_dim
        self.qkv_proj = MergedLinear(config.n_embd, dict(q_proj=self.q_size, k_proj=self.kv_size,
                                                         v_proj=self.kv_size),
                                     bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.n_embd, bias=config.o_bias)
        self.q_norm = None
        self.k_norm = None
        # an FP8 KV cache stores K / k_scale and V / v_scale (vLLM's _k_scale, _v_scale: 1.0
        # unless a checkpoint gives them: compressed-tensors' kv_cache_scheme, checkpoint.py)
        self.k_scale = 1.0
        self.v_scale = 1.0
        # values clipped to +-448 as they were stored (an FP8 cache; made on the CPU, whatever
        # the default device, moved with the model)
        self.register_buffer("num_kv_clipped", torch.zeros((), dtype=torch.int64, device="cpu"),
                             persistent=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """x (..., C) -> q (..., H, D), k and v (..., Hkv, D): one GEMM, its output split into
        views; q and k normed per head (Qwen3), then rotated together by rope = (cos, sin)
        (..., 1, D) unless it is None (GPT-2). q and k sit side by side in the GEMM's output, so
        RoPE turns their H + Hkv heads in one call."""
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.unflatten(-1, (self.n_head + self.n_kv_head, self.head_dim))  # (..., H + Hkv, D)
        v = v.unflatten(-1, (self.n_kv_head, self.head_dim))
        if self.q_norm is not None:
            q, k = qk.split([self.n_head, self.n_kv_head], dim=-2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-2)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=-2)
        return q, k, v

    def forward(self, x, rope, meta, k_cache, v_cache, attention):
        """Paged: x is the flat batch (N, C); each token's K/V are stored at its slot in the
        layer's k_cache, v_cache (NB, BS, Hkv, D), then `attention` (kernels.py) reads each
        sequence's context back through its block table."""
        q, k, v = self.qkv(x, rope)  # (N, H, D), (N, Hkv, D), (N, Hkv, D)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale,
                 self.num_kv_clipped)
        y = attention(q, k_cache, v_cache, meta, 1.0 / math.sqrt(self.head_dim),
                      k_scale=self.k_scale, v_scale=self.v_scale)
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
    """GPT-2's: down(gelu(up(x))). Llama's SwiGLU: down(silu(gate(x)) * up(x)), gate and up one
    GEMM (gate_up_proj)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.intermediate_size
        self.gated = config.mlp == "swiglu"
        if self.gated:
            self.gate_up_proj = MergedLinear(config.n_embd, dict(gate_proj=hidden, up_proj=hidden),
                                             bias=config.mlp_bias)
        else:
            self.up_proj = Linear(config.n_embd, hidden, bias=config.mlp_bias)
        self.down_proj = Linear(hidden, config.n_embd, bias=config.mlp_bias)

    def forward(self, x):
        if self.gated:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """A transformer layer, pre-norm as in GPT-2 and Llama: x + attention, then x + MLP. Each
    add is left to the norm after it (add_and_norm), so a layer takes and returns (x, residual)
    (vLLM's pattern): x the last layer's output, residual the sum it is added to."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = make_norm(config, config.n_embd)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, residual, rope, meta, k_cache, v_cache, attention):
        """Paged: x, residual (N, C) (residual None in the first layer) -> (x, residual); the
        arguments after them are Attention.forward's."""
        x, residual = add_and_norm(self.input_layernorm, x, residual)
        x = self.self_attn(x, rope, meta, k_cache, v_cache, attention)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_dense(self, x, residual, rope, cache: DenseKVCache | None = None, layer: int = 0,
                      mask=None):
        """Dense: x, residual (B, T, C) -> (x, residual); the arguments after them are
        Attention.forward_dense's."""
        x, residual = add_and_norm(self.input_layernorm, x, residual)
        x = self.self_attn.forward_dense(x, rope, cache, layer, mask)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LMHead(nn.Linear):
    """The logits, computed in fp32 whatever the model's dtype: rounded to bf16 first, GPT-2's
    logits (tens in size) would lose up to a few tenths, moving log-probabilities and deciding
    near-ties in greedy by rounding. Never by converting the weight each step, a copy of the
    largest matrix (0.27 GB a step at a 152k vocabulary in bf16): on CUDA a bf16 (or fp16)
    matmul that accumulates in fp32 and returns fp32; on a CPU, where torch has none, an fp32
    copy of the weight made once (the same products and sums: a bf16 value is exact in fp32)."""
    fp32_weight = None  # the CPU's fp32 copy of the weight
    fp32_made_from = None  # what it was made from: (data_ptr, dtype, version) of the weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, C) -> (n, vocab) fp32
        weight = self.weight
        if weight.dtype == torch.float32:
            return F.linear(hidden.float(), weight)
        if cuda_runtime.is_cuda(weight.device):  # no CPU kernel: torch.mm(out_dtype)
            return torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
        return F.linear(hidden.float(), self.fp32_copy())

    def fp32_copy(self) -> torch.Tensor:
        """The weight in fp32, made on the first call and again only if the weight changed:
        new data (a load, a .to()) moves its data_ptr or dtype, and a write in place bumps
        its version counter (torch's own, which autograd reads). A tensor made under
        inference_mode keeps no counter, and cannot be written outside it."""
        weight = self.weight
        version = None
        if not weight.is_inference():
            version = weight._version
        source = (weight.data_ptr(), weight.dtype, version)
        if self.fp32_made_from != source:
            self.fp32_weight = weight.float()
            self.fp32_made_from = source
        return self.fp32_weight


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding, but on the meta device (a checkpoint's model, its weights to come from the
    file) one that draws no weights: nn.Embedding's normal_ costs 2 s there the first time, as
    torch imports its compiler for it. Elsewhere its draw stays, so a preset's seeded weights
    are the same as ever."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding.from_pretrained(torch.empty(num_embeddings, embedding_dim),
                                            freeze=False)
    return nn.Embedding(num_embeddings, embedding_dim)


class GPT(nn.Module):
    """The decoder, its state dict named and shaped as Hugging Face's Llama (model.layers.0.
    self_attn.q_proj.weight, ...), so a Llama-family checkpoint loads by name; a GPT-2
    checkpoint is renamed on load (from_gpt2_state). Inside, q, k, v are one qkv_proj and gate,
    up one gate_up_proj (vLLM's names): split_merged and merge_split translate at the edge."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=embedding(config.vocab_size, config.n_embd),
            layers=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            norm=make_norm(config, config.n_embd)))
        self.rotary = None
        if config.position_encoding == "learned":
            self.model["embed_positions"] = embedding(config.n_positions, config.n_embd)
        else:
            self.rotary = RotaryEmbedding(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        self.register_state_dict_post_hook(split_merged)
        self.register_load_state_dict_pre_hook(merge_split)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.is_meta:  # a checkpoint's weights come next: nothing to draw
            return
        for module in self.modules():  # GPT-2's init (norms keep their ones and zeros)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token ids and their positions (...,) -> x (..., C) and rope: GPT-2 adds a learned
        position embedding to x (rope None); RoPE models leave x alone and return the (cos,
        sin) (..., 1, D) that every layer rotates its q and k by."""
        x = self.model.embed_tokens(input_ids)
        if self.rotary is None:
            return x + self.model.embed_positions(positions), None
        return x, self.rotary(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: torch.Tensor, v_caches: torch.Tensor, attention=paged_attention_ref):
        """Paged forward of the flat batch: input_ids, positions (N,) -> hidden states (N, C).
        Caches K/V in k_caches, v_caches (n_layer, NB, BS, Hkv, D); `attention` is from
        kernels.py."""
        x, rope = self.embed(input_ids, positions)  # (N, C); cos, sin (N, 1, D) or None
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, meta, k_caches[i], v_caches[i], attention)
        return self.model.norm(x, residual)[0]

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
        x, rope = self.embed(idx, positions)  # (B, T, C); cos, sin (B, T, 1, D) or None
        residual = None
        for layer, block in enumerate(self.model.layers):
            x, residual = block.forward_dense(x, residual, rope, cache, layer, mask)
        if cache is not None:  # every layer wrote its K/V at length..length + T
            cache.length += idx.shape[1]
        return self.model.norm(x, residual)[0]

"""linear.py: the model's projections, in one home (nano-vllm's layers/linear.py, vLLM's
linear layers): what a projection computes, and where what composes with it is added.

Linear is the base projection, y = x W^T + b, and the hook where each token's LoRA term is
added to y (lora.py loads the adapters; kernels.py computes the term: the shrink x A^T to the
adapter's rank, the expand of that by B^T into y). MergedLinear is Hugging Face's projections
of one input stacked along the output as one GEMM: q, k and v (vLLM's QKVParallelLinear), gate
and up (MergedColumnParallelLinear); each stacked projection is a part, whose adapter adds to
its slice of the output. split_merged and merge_split translate a MergedLinear's tensors to
Hugging Face's names and back at the state dict's edge, so checkpoints keep their layout.

Quantization (vLLM's quantization="int8" or "fp8") is a Linear's quant_method: its weight
stored in 8 bits with a scale per output channel (weight_scale, fp32), and Linear.base's GEMM
reading it (int8_linear, fp8_linear). The scale arithmetic, symmetric per output channel: a
row w of W (one output channel) is stored as q = round(w / s), s = max|w| / QMAX (127 for
int8; 448, float8_e4m3fn's largest value, for fp8), and read back as q * s. Worked example,
one channel of four weights, int8:

    w = [0.52, -1.27, 0.03, 0.90]       max|w| = 1.27, s = 1.27 / 127 = 0.01
    q = round(w / s) = [52, -127, 3, 90]                   (int8, 1 byte each)
    q * s = [0.52, -1.27, 0.03, 0.90]   error at most s / 2 = 0.005 a weight

and fp8 on the same row: s = 1.27 / 448 = 0.002835; w / s = [183.4, -448, 10.6, 317.5], which
float8_e4m3fn rounds to [176, -448, 11, 320] (3 mantissa bits: a step of 1 between 8 and 16,
16 between 128 and 256, 32 between 256 and 448), read back as [0.499, -1.27, 0.0312, 0.907]:
an error of at most 2^-4 = 6.25% of a weight, wherever in its range it lies, where int8's is
at most s / 2 whatever the weight (small weights lose more in int8, large ones in fp8).
Since y[o] = x . w[o] and w[o] = q[o] s[o], y[o] = s[o] (x . q[o]): the GEMM runs on q (upcast in
registers, or in 8 bits on GPUs with FP8 tensor cores) and each output column is multiplied
by its scale after. On CUDA at compute capability 8.9 and up, fp8 quantizes the activations
too, per token (each row of x by its own max|x| / 448, vLLM's dynamic per-token scheme), and
torch._scaled_mm multiplies in 8 bits, applying both scales to its fp32 sums. The bounds the
tests check: int8 weight errors within s / 2; fp8's within 2^-4 |w| + half the subnormal
step (2^-10 s); their products with x within the sums of those times |x|. checkpoint.py
quantizes a checkpoint's weights one tensor at a time as they load; the embedding and the LM
head are no Linear of these, and stay in the model's dtype: the embedding is a lookup (a row a
token, no GEMM to speed up), and the LM head's logits decide every sampled token, a
vocabulary-wide softmax whose near-ties a 2^-4 error would flip, where a projection's error is
averaged over the layers after it.

A tensor-parallel projection holds its rank's share of the output (its parts' rows, so each
LoRA slice shards with them) or of the input, and all-reduces: RowParallel below, the cut in
tensor_parallel.py (a quantized one is quantized after the cut, each rank its own scales).
Shape legend: N tokens, L adapter slots (max_loras), R the slots' rank (max_lora_rank), I
in_features, O a part's rows.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import cuda_runtime
from kernels import (FP8_DTYPE, FP8_MAX, PaddedSlots, add_lora_padded, lora_expand,
                     lora_expand_ref, lora_padded_slots, lora_segments, lora_shrink,
                     lora_shrink_ref, sgmv_expand, sgmv_shrink)

QUANTIZATION_METHODS = ("int8", "fp8")  # vLLM's quantization= names this module serves
INT8_MAX = 127                          # symmetric: -127..127, -128 unused
QUANTIZED_DTYPES = {"int8": torch.int8, "fp8": FP8_DTYPE}
FP8_MIN_CAPABILITY = (8, 9)             # Ada and Hopper: FP8 tensor cores, torch._scaled_mm


def quantize_weight(weight: torch.Tensor, quant_method: str, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (O, I) -> (q (O, I) int8 or float8_e4m3fn, weight_scale (O,) fp32), symmetric per
    output channel: s = max|row| / QMAX (a zero row: s = 1), q = row / s rounded (int8 to the
    nearest integer, fp8 to its nearest value). The docstring above works one channel. amax
    (O,): each row's max|w| when weight holds only some of its columns (a row-parallel rank's
    slice, tensor_parallel.py: the whole row's max, so q and s are those of one rank's)."""
    w = weight.float()
    qmax = INT8_MAX if quant_method == "int8" else FP8_MAX
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # (O,)
    q = (w / scale[:, None]).clamp(-qmax, qmax)
    if quant_method == "int8":
        return q.round().to(torch.int8), scale
    return q.to(FP8_DTYPE), scale


def dequantize_weight(q: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """quantize_weight undone: q (O, I) * weight_scale (O,) -> (O, I) fp32."""
    return q.float() * weight_scale[:, None]


def int8_linear(x: torch.Tensor, q: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) times an int8 weight q (O, I) with its scales (O,): (N, O) in x's dtype. On a
    CPU in bf16 or fp16, torch._weight_int8pack_mm (gpt-fast's: the int8 rows read as they
    are, 2.4x faster than bf16 F.linear at batch 1 on a 2-core EPYC); elsewhere q upcast to
    x's dtype for the GEMM (exact: |q| <= 127), each output column times its scale after (in
    fp32, torch's int8 kernel is 10x slower than that)."""
    if x.dtype == torch.float32 or cuda_runtime.is_cuda(x.device):
        return dequantized_linear(x, q, weight_scale, bias)
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, weight_scale.to(x.dtype))
    y = y.reshape(*x.shape[:-1], -1)
    if bias is not None:
        y = y + bias
    return y


def fp8_linear(x: torch.Tensor, q: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) times an fp8 weight q (O, I) with its scales (O,): (N, O) in x's dtype. On a
    GPU with FP8 tensor cores, x quantized per token and multiplied in 8 bits (fp8_scaled_mm);
    elsewhere q upcast to x's dtype (exact: every fp8 value is a bf16 value) and each output
    column times its scale after."""
    if uses_scaled_mm(x, q):
        return fp8_scaled_mm(x, q, weight_scale, bias)
    return dequantized_linear(x, q, weight_scale, bias)


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """The 8-bit GEMMs' portable form: q upcast to x's dtype for the GEMM (exact for int8 and
    for fp8, whose values are all bf16 values), each output column times its scale after."""
    y = F.linear(x, q.to(x.dtype)) * weight_scale.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y


def uses_scaled_mm(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether fp8_linear multiplies in FP8: on CUDA at compute capability 8.9 and up, in bf16
    (torch._scaled_mm's row-wise scales give bf16 only), I and O multiples of 16 (its tiles)."""
    if not cuda_runtime.is_cuda(x.device) or x.dtype != torch.bfloat16:
        return False
    if q.shape[0] % 16 or q.shape[1] % 16:
        return False
    return cuda_runtime.device_capability(x.device) >= FP8_MIN_CAPABILITY


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, I) -> (x_q (N, I) float8_e4m3fn, x_scale (N, 1) fp32), each token's row by its own
    scale max|row| / 448 (vLLM's dynamic per-token activations; a zero row: scale 1)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    x_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # (N, 1)
    x_q = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, x_scale


def fp8_scaled_mm(x: torch.Tensor, q: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., I) quantized per token, times q (O, I) in FP8 with fp32 sums, both scales and the
    bias applied by the GEMM's epilogue: (..., O) in x's dtype. q.t() is column-major, as
    _scaled_mm wants its second operand."""
    x_q, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))  # (N, I), (N, 1)
    y = cuda_runtime.scaled_mm(x_q, q.t(), x_scale, weight_scale[None, :], bias, x.dtype)
    return y.reshape(*x.shape[:-1], -1)


QUANTIZED_LINEAR = {"int8": int8_linear, "fp8": fp8_linear}


@dataclass
class LoRAMapping:
    """Which adapter slot each token of the step runs with, shared by every Linear that holds
    adapters (vLLM's punica wrapper's metadata): set by the model runner before a forward."""
    token_slots: torch.Tensor | None = None  # (N,) int64, -1: the base model; None: no token
                                             # of the step has an adapter (no LoRA term at all)
    # the CPU's layout of the same slots (kernels.py), made once a step on the host: the tokens
    # of each slot padded to one length (lora_padded_slots), or where that would double the
    # work, runs of one adapter's tokens (lora_segments); the other None, both None: not made
    segments: list[tuple[int, int, int]] | None = None
    padded: PaddedSlots | None = None

    def set(self, token_slots: torch.Tensor | None, host_slots: list[int] | None = None) -> None:
        """The step's slots; on a CPU, given host_slots (the list they were uploaded from),
        the CPU's layout of them too (on CUDA the Triton kernels read token_slots)."""
        self.token_slots = token_slots
        self.segments = None
        self.padded = None
        if host_slots is None or cuda_runtime.is_cuda(token_slots.device):
            return
        self.padded = lora_padded_slots(host_slots)
        if self.padded is None:
            self.segments = lora_segments(host_slots)


class Linear(nn.Linear):
    """y = x W^T + b (nn.Linear's, bit for bit), then, when the step has adapters, each token's
    LoRA term added (add_lora). output_sizes: the rows of each part, one part unless merged."""
    lora_a: list[torch.Tensor] | None = None  # per part (L, R, I): each slot's A, zero-padded
    lora_a_merged: torch.Tensor | None = None  # (L, parts * R, I): lora_a's storage, the parts
                                               # stacked along the rank: one shrink for them all
    lora_b: list[torch.Tensor] | None = None  # per part (L, O, R): each slot's B x scaling
    lora_mapping: LoRAMapping | None = None
    quant_method: str | None = None  # "int8" or "fp8": weight is q, weight_scale its scales
    params_dtype: torch.dtype | None = None  # the model's dtype, which a quantized weight is not
    lora_shard = None  # tensor parallelism: (part, a, b) -> this rank's slices of a and b

    @property
    def output_sizes(self) -> list[int]:
        return [self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.lora_mapping is None or self.lora_mapping.token_slots is None:
            return y
        return self.add_lora(x, y)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The base projection: F.linear, or the quant_method's GEMM on the quantized weight."""
        if self.quant_method is None:
            return F.linear(x, self.weight, self.bias)
        return QUANTIZED_LINEAR[self.quant_method](x, self.weight, self.weight_scale, self.bias)

    def create_quantized_weights(self, quant_method: str) -> None:
        """Make this projection quant_method's, as vLLM's quantized layers make theirs: its
        weight an (O, I) int8 or fp8 tensor and weight_scale (O,) fp32, empty on the weight's
        device (the meta device, before a checkpoint's tensors are assigned), the model's
        dtype kept for the activations and adapters."""
        weight = self.weight
        self.params_dtype = weight.dtype
        self.quant_method = quant_method
        self.weight = nn.Parameter(torch.empty(weight.shape, dtype=QUANTIZED_DTYPES[quant_method],
                                               device=weight.device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(weight.shape[0], device=weight.device),
                                         requires_grad=False)

    def quantize_(self, quant_method: str, amax: torch.Tensor | None = None) -> None:
        """This projection's float weight quantized in place (a preset's random weights, a
        tensor-parallel rank's slices; a checkpoint's are quantized as they load,
        checkpoint.py); amax: as quantize_weight's."""
        q, scale = quantize_weight(self.weight.detach(), quant_method, amax)
        self.create_quantized_weights(quant_method)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (N, sum O) += each part's x A[slot]^T B[slot]^T, slot the token's (none: -1), for
        all adapters of the step at once: a shrink to rank R, an expand into the part's slice."""
        mapping = self.lora_mapping
        if mapping.padded is not None:  # the CPU, many short runs: batched over the slots
            add_lora_padded(y, x, self.lora_a_merged, self.lora_b, mapping.padded)
            return y
        shrink, expand, tokens = lora_shrink_ref, lora_expand_ref, mapping.token_slots
        if cuda_runtime.is_cuda(x.device):  # a program a token (BGMV): graph-safe
            shrink, expand = lora_shrink, lora_expand
        elif mapping.segments is not None:  # the CPU, long runs: a GEMM pair a run (SGMV)
            shrink, expand, tokens = sgmv_shrink, sgmv_expand, mapping.segments
        start = 0
        for lora_a, lora_b in zip(self.lora_a, self.lora_b):
            end = start + lora_b.shape[1]
            expand(shrink(x, lora_a, tokens), lora_b, tokens, y[:, start:end])  # (N, R) -> slice
            start = end
        return y

    def create_lora_weights(self, max_loras: int, max_rank: int, mapping: LoRAMapping) -> None:
        """Zeroed adapter slots for every part (vLLM's create_lora_weights), in the weight's
        dtype (the model's, over a quantized weight) and device; mapping says which slot each
        token reads. Each part's A is a view of lora_a_merged. B is held as the device's
        kernels read it: (L, O, R) dense on CUDA (a program reads a token's rows of B), and
        on a CPU as views of a dense B^T (L, R, O), which add_lora_padded's batched GEMM
        streams row by row (a 16-adapter decode step's expands, their weights cold in
        memory, took a fifth less time so than reading B (L, O, R) transposed)."""
        kind = dict(dtype=self.params_dtype or self.weight.dtype, device=self.weight.device)
        num_parts = len(self.output_sizes)
        self.lora_a_merged = torch.zeros(max_loras, num_parts * max_rank, self.in_features, **kind)
        self.lora_a = list(self.lora_a_merged.split(max_rank, dim=1))
        if cuda_runtime.is_cuda(self.weight.device):
            self.lora_b = [torch.zeros(max_loras, rows, max_rank, **kind)
                           for rows in self.output_sizes]
        else:
            self.lora_b = [torch.zeros(max_loras, max_rank, rows, **kind).mT
                           for rows in self.output_sizes]
        self.lora_mapping = mapping

    def set_lora(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` of part `part` holds a (r, I) and b (O, r), r <= R, zero past r."""
        if self.lora_shard is not None:  # tensor parallelism: its rows of b, or columns of a
            a, b = self.lora_shard(part, a, b)
        r = a.shape[0]
        self.lora_a[part][slot].zero_()
        self.lora_b[part][slot].zero_()
        self.lora_a[part][slot, :r].copy_(a)
        self.lora_b[part][slot, :, :r].copy_(b)

    def reset_lora(self, slot: int) -> None:
        """Slot `slot` adds nothing to any part (an adapter that does not target this one)."""
        for lora_a, lora_b in zip(self.lora_a, self.lora_b):
            lora_a[slot].zero_()
            lora_b[slot].zero_()


class MergedLinear(Linear):
    """Hugging Face's projections of one input as one Linear, stacked along its output (vLLM's
    QKVParallelLinear, MergedColumnParallelLinear): one GEMM for q, k and v, or for gate and
    up, whose output the caller splits into views. `parts`: each projection's Hugging Face
    name and rows, in order. GPT's state dict hooks split it back into those names."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    @property
    def output_sizes(self) -> list[int]:
        return list(self.parts.values())


PARAMS = ("weight", "bias", "weight_scale")  # a projection's tensors, by Hugging Face's names


def split_merged(model: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """A state_dict post-hook: each MergedLinear's tensors split into Hugging Face's (views):
    "...self_attn.qkv_proj.weight" -> "...self_attn.q_proj.weight", k_proj's, v_proj's, in the
    order the unmerged model listed them, so checkpoints are read, checked and written by those
    names and layouts, as ever."""
    merged = {prefix + name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for key in [key for key in state if key.startswith(prefix)]:  # the model's, at the end
        if key not in state:  # a merged bias, split with its weight
            continue
        module = key.rpartition(".")[0]
        if module not in merged:
            state[key] = state.pop(key)  # moved to the end, in its turn
            continue
        parts = merged[module].parts
        splits = {param: state.pop(f"{module}.{param}").split(list(parts.values()))
                  for param in PARAMS if f"{module}.{param}" in state}
        parent = module.rpartition(".")[0]
        for i, name in enumerate(parts):  # q_proj.weight, q_proj.bias, k_proj.weight, ...
            for param, pieces in splits.items():
                state[f"{parent}.{name}.{param}"] = pieces[i]


def merge_split(model: nn.Module, state: dict, prefix: str, *_, release=None) -> None:
    """A load_state_dict pre-hook, split_merged undone: Hugging Face's q_proj, k_proj, v_proj
    (gate_proj, up_proj) tensors concatenated into the MergedLinear's, a copy made once as the
    weights load. A state dict in merged names loads as it is. release: called with each
    concatenated piece, which nothing reads again (the loader lets its file's pages go)."""
    for name, m in model.named_modules():
        if not isinstance(m, MergedLinear):
            continue
        parent = prefix + name.rpartition(".")[0]
        for param in PARAMS:
            keys = [f"{parent}.{part}.{param}" for part in m.parts]
            if not all(key in state for key in keys):
                continue
            pieces = [state.pop(key) for key in keys]
            state[f"{prefix}{name}.{param}"] = torch.cat(pieces)
            for piece in pieces:
                if release is not None:
                    release(piece)


def projections(model: nn.Module) -> dict[str, tuple[Linear, int]]:
    """Every projection by its Hugging Face module name -> (the Linear holding it, its part):
    "model.layers.0.self_attn.k_proj" -> (that layer's qkv_proj, 1); "...o_proj" -> (o_proj, 0).
    What an adapter's target modules are looked up in."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, MergedLinear):
            parent = name.rpartition(".")[0]
            found |= {f"{parent}.{part}": (m, i) for i, part in enumerate(m.parts)}
        elif isinstance(m, Linear):
            found[name] = (m, 0)
    return found


def quantize_model(model: nn.Module, quant_method: str) -> None:
    """Every projection of the model's layers quantized in place (quantize_): the embedding
    and the LM head are no Linear of ours, and stay in the model's dtype."""
    for linear in {id(m): m for m, _ in projections(model).values()}.values():
        linear.quantize_(quant_method)


class RowParallel:
    """The forward hook that makes a Linear row-parallel (Megatron's RowParallelLinear): the
    rank holds its columns of the weight, multiplies its slice of the input (the heads or MLP
    slice a column-parallel projection gave it), and the ranks' partial outputs (N, O) are
    summed by all_reduce. The bias is added by one rank (the others hold zeros), so once. An
    adapter's A is cut by the same columns (a partial LoRA term, summed with the rest)."""

    def __init__(self, all_reduce):
        self.all_reduce = all_reduce

    def __call__(self, _module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(output)


def row_parallel(linear: Linear, all_reduce) -> None:
    """Make linear row-parallel (see RowParallel); a column-parallel one needs nothing but its
    rows (tensor_parallel.Shard cuts each part's, and each LoRA slice shards with them)."""
    linear.register_forward_hook(RowParallel(all_reduce))

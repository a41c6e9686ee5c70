"""linear.py: the model's projections, in one home (nano-vllm's layers/linear.py, vLLM's
linear layers): what a projection computes, and where what composes with it is added.

Linear is the base projection, y = x W^T + b, and the hook where each token's LoRA term is
added to y (lora.py loads the adapters; kernels.py computes the term: the shrink x A^T to the
adapter's rank, the expand of that by B^T into y). MergedLinear is Hugging Face's projections
of one input stacked along the output as one GEMM: q, k and v (vLLM's QKVParallelLinear), gate
and up (MergedColumnParallelLinear); each stacked projection is a part, whose adapter adds to
its slice of the output. split_merged and merge_split translate a MergedLinear's tensors to
Hugging Face's names and back at the state dict's edge, so checkpoints keep their layout.

How a later layer composes here: a quantized projection replaces Linear.base's F.linear (its
weight stored packed, dequantized in the GEMM); a tensor-parallel one builds each rank's share
of the output (its parts' rows, so each LoRA slice shards with them) or of the input, and
all-reduces: RowParallel below, the cut in tensor_parallel.py. Quantization is not built.
Shape legend: N tokens, L adapter slots (max_loras), R the slots' rank (max_lora_rank), I
in_features, O a part's rows.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import cuda_runtime
from kernels import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref


@dataclass
class LoRAMapping:
    """Which adapter slot each token of the step runs with, shared by every Linear that holds
    adapters (vLLM's punica wrapper's metadata): set by the model runner before a forward."""
    token_slots: torch.Tensor | None = None  # (N,) int64, -1: the base model; None: no token
                                             # of the step has an adapter (no LoRA term at all)


class Linear(nn.Linear):
    """y = x W^T + b (nn.Linear's, bit for bit), then, when the step has adapters, each token's
    LoRA term added (add_lora). output_sizes: the rows of each part, one part unless merged."""
    lora_a: list[torch.Tensor] | None = None  # per part (L, R, I): each slot's A, zero-padded
    lora_b: list[torch.Tensor] | None = None  # per part (L, O, R): each slot's B x scaling
    lora_mapping: LoRAMapping | None = None
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
        """The base projection (where a quantized weight would be dequantized)."""
        return F.linear(x, self.weight, self.bias)

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (N, sum O) += each part's x A[slot]^T B[slot]^T, slot the token's (none: -1), for
        all adapters of the step at once: a shrink to rank R, an expand into the part's slice."""
        slots = self.lora_mapping.token_slots
        shrink, expand = lora_shrink_ref, lora_expand_ref
        if cuda_runtime.is_cuda(x.device):
            shrink, expand = lora_shrink, lora_expand
        start = 0
        for lora_a, lora_b in zip(self.lora_a, self.lora_b):
            end = start + lora_b.shape[1]
            expand(shrink(x, lora_a, slots), lora_b, slots, y[:, start:end])  # (N, R) -> slice
            start = end
        return y

    def create_lora_weights(self, max_loras: int, max_rank: int, mapping: LoRAMapping) -> None:
        """Zeroed adapter slots for every part (vLLM's create_lora_weights), in the weight's
        dtype and device; mapping says which slot each token reads."""
        weight = self.weight
        self.lora_a = [weight.new_zeros(max_loras, max_rank, self.in_features)
                       for _ in self.output_sizes]
        self.lora_b = [weight.new_zeros(max_loras, rows, max_rank) for rows in self.output_sizes]
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
                  for param in ("weight", "bias") if f"{module}.{param}" in state}
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
        for param in ("weight", "bias"):
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

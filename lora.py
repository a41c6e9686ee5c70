"""lora.py: many LoRA adapters over one base model, batched together in every step (Punica's
batched LoRA, S-LoRA's adapters paged between host and device, in vLLM's terms).

A LoRA adapter changes a projection W (O, I) to W + s B A, A (r, I) and B (O, r) of a small
rank r, s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Served unmerged, one base
model runs requests of many adapters in one step: y = x W^T + s (x A^T) B^T, the base GEMM
for every token, then the shrink x A^T (to rank r) and the expand by B^T, each token with its
own adapter's A and B (linear.py adds the term; kernels.py computes it).

In this file, in order: LoRARequest (vLLM's: which adapter a request runs with); loading a
PEFT adapter directory (adapter_config.json and adapter_model.safetensors or .bin) onto the
model's projections, scaling folded into B once, every refusal naming its field; LoRAModel
(an adapter in host memory); LoRAManager (the device slots and the host cache).

Worked example: max_loras 2, slots 0 and 1 holding adapters "sql" and "chat". One step runs
a decode of "sql" (token 0), a decode of the base model (token 1), a decode of "chat"
(token 2), then a 3-token prefill chunk of "sql" (tokens 3..5):

    token_slots   [0, -1, 1, 0, 0, 0]
    segments      slot 0: tokens 0, 3, 4, 5;  slot 1: token 2;  token 1 has none
    shrink        s[0,3,4,5] = x[0,3,4,5] A0^T   s[2] = x[2] A1^T     (rank R)
    expand        y[0,3,4,5] += s[0,3,4,5] B0^T  y[2] += s[2] B1^T

Every projection of every layer does the same, with its own stacked A and B. The torch
reference (kernels.py) runs one GEMM a slot, its tokens gathered. The model runner orders a
step's sequences by adapter (model_runner.adapter_order: decodes first, then by slot), so on
a CPU each adapter's tokens are runs (SGMV's segments, kernels.lora_segments): the step above
runs as slots [-1, 0, 1] for the decodes, then [0, 0, 0] for the chunk. A CPU runs a GEMM
pair a run (sgmv_shrink, sgmv_expand), or, where the slots' tokens pad to one length without
doubling the work (a decode batch spread over many adapters: 16 runs of 4 tokens would be 32
small GEMMs a part, each costing more to call than to compute), batched GEMMs over the
padded slots (add_lora_padded): one shrink for all the parts of a merged projection, then an
expand a part added in place. The Triton kernels run a program a token (BGMV), reading its
slot, so a CUDA graph replays them. The base model's tokens get nothing added: their
outputs are the base model's, bit for bit, whatever runs beside them. A and B of every slot
are padded with zeros to max_lora_rank, so one launch serves adapters of ranks 1 and 16 side
by side. Merged projections (q/k/v as qkv_proj, gate/up as gate_up_proj) take each adapter
as slices of their output: q_proj's B expands into qkv_proj's first q_size columns, k_proj's
into the next, and GPT-2's c_attn (one adapter over q, k and v at once) into all three, its
A shared.

What a step costs on a CPU: a decode step reads every slot's A and B it serves, whatever
its tokens: 16 adapters of rank 16 on SmolLM2-135M are 312 MB of fp32 a step, 58% of the
base model's weights, for about 4% of its FLOPs. A decode step's LoRA term is bound by
that memory traffic, not by arithmetic, and grows with the adapters a step serves (so
max_loras 8, half the bytes, can beat 16 on the same requests).

Paging: an adapter is read from disk into host memory when a request first names it (its
errors raised there), kept in the host cache (max_cpu_loras, least recently used evicted,
never one a live request names), and copied into a device slot (max_loras) when a running
sequence needs it, evicting the least recently used slot that no running sequence holds. The
scheduler admits a sequence whose adapter has no slot only while the running sequences hold
fewer than max_loras adapters, so a step never needs more slots than there are.

Left out: LoRA on the embeddings and the LM head (modules_to_save, extra vocabulary), DoRA,
per-module ranks (rank_pattern), biases on the adapters, adapters on the draft model.
"""
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from checkpoint import (GPT2_LAYER_NAMES, SERVED_ARCHITECTURES, read_pickle, read_safetensors,
                        write_safetensors)
from linear import Linear, LoRAMapping, projections

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's module names
# adapter_config.json keys that must hold their neutral value: key -> (served values, what
# another brings). Other keys (lora_dropout, init_lora_weights, task_type, ...) change nothing
# at inference.
NEUTRAL_ADAPTER_VALUES = {
    "peft_type": (("LORA", None), "another kind of adapter"),
    "use_dora": ((False, None), "DoRA (weight-decomposed LoRA)"),
    "modules_to_save": ((None, []), "whole modules saved beside the adapter"),
    "bias": (("none", None), "trained biases"),
    "rank_pattern": (({}, None), "a rank per module"),
    "alpha_pattern": (({}, None), "an alpha per module"),
    "lora_bias": ((False, None), "a bias on lora_B"),
}


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter a request runs with. lora_int_id identifies it (positive, unique
    per adapter); lora_name is what the server's `model` field calls it; lora_path its PEFT
    directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_salt(self) -> bytes:
        """What the prefix cache chains a sequence's first block to: K/V computed under one
        adapter are never another's (nor the base model's, whose salt is empty)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}".encode()


# ----------------------------------------------------------------------------- loading

def read_adapter_config(path: str) -> dict:
    """adapter_config.json of a PEFT directory, checked field by field."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path} is not a LoRA adapter directory: no adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except ValueError as e:
        raise ValueError(f"{config_file}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    for key, (served, what) in NEUTRAL_ADAPTER_VALUES.items():
        if config.get(key) not in served:
            raise ValueError(f"{path}: adapter_config.json {key} {config[key]!r} is not served "
                             f"({what})")
    r = config.get("r")
    if type(r) is not int or r < 1:
        raise ValueError(f"{path}: adapter_config.json r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ValueError(f"{path}: adapter_config.json lora_alpha must be a finite number, "
                         f"got {alpha!r}")
    for key in ("use_rslora", "fan_in_fan_out"):
        if type(config.get(key, False)) is not bool:
            raise ValueError(f"{path}: adapter_config.json {key} must be true or false, got "
                             f"{config[key]!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{path}: adapter_config.json target_modules {targets!r} is a regular "
                         "expression, which is not served: list the modules' names")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: adapter_config.json target_modules must be a list of module "
                         f"names, got {targets!r}")
    return config


def scaling(config: dict) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (use_rslora)."""
    if config.get("use_rslora", False):
        return config["lora_alpha"] / math.sqrt(config["r"])
    return config["lora_alpha"] / config["r"]


def check_targets(config: dict, model, path: str) -> None:
    """Every target module is one of the base model's projections: Llama's names on the
    Llama family, GPT-2's on GPT-2. A target of the other family means an adapter trained
    for another base model."""
    is_gpt2 = model.config.position_encoding == "learned"
    served, other = (GPT2_TARGETS, LLAMA_TARGETS) if is_gpt2 else (LLAMA_TARGETS, GPT2_TARGETS)
    family = "GPT-2" if is_gpt2 else "Llama-family"
    for target in config["target_modules"]:
        if target in served:
            continue
        if target in other:
            base = config.get("base_model_name_or_path")
            raise ValueError(f"{path}: adapter_config.json target_modules {target!r} is another "
                             f"architecture's (base_model_name_or_path {base!r}); the base "
                             f"model is {family}")
        raise ValueError(f"{path}: adapter_config.json target_modules {target!r} is not "
                         f"served; a {family} adapter may target {', '.join(served)}")
    check_base_model(config, is_gpt2, path)


def check_base_model(config: dict, is_gpt2: bool, path: str) -> None:
    """base_model_name_or_path, where it is a local checkpoint directory: its model_type is
    of the served model's family (a name elsewhere cannot be checked without a download)."""
    base = config.get("base_model_name_or_path")
    base_config = os.path.join(base, "config.json") if isinstance(base, str) else ""
    if not os.path.isfile(base_config):
        return
    with open(base_config) as f:
        model_type = json.load(f).get("model_type")
    if model_type in SERVED_ARCHITECTURES and (model_type == "gpt2") == is_gpt2:
        return
    raise ValueError(f"{path}: adapter_config.json base_model_name_or_path {base!r} is a "
                     f"{model_type} model; the base model is "
                     f"{'GPT-2' if is_gpt2 else 'Llama-family'}")


def read_adapter_weights(path: str) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors (memory-mapped, as checkpoints are), else adapter_model.bin."""
    safetensors_file = os.path.join(path, "adapter_model.safetensors")
    pickle_file = os.path.join(path, "adapter_model.bin")
    if os.path.exists(safetensors_file):
        return read_safetensors(safetensors_file)
    if os.path.exists(pickle_file):
        return read_pickle(pickle_file)
    raise ValueError(f"{path} has no adapter_model.safetensors or adapter_model.bin")


def our_names(module: str, is_gpt2: bool, sizes: list[int]) -> list[tuple[str, slice]]:
    """A PEFT module name (its prefix removed) -> the projections it adapts, each with the rows
    of the adapter's B that are its: Llama's name as it is, all rows; GPT-2's renamed, and
    c_attn (q, k and v in one) split into q_proj, k_proj and v_proj by their sizes."""
    if not is_gpt2:
        return [(module, slice(None))]
    _, layer, inner = module.removeprefix("transformer.").split(".", 2)  # "h", "3", "attn.c_fc"
    prefix = f"model.layers.{layer}."
    if inner != "attn.c_attn":
        ours = {theirs: mine for mine, theirs in GPT2_LAYER_NAMES.items()}.get(inner, inner)
        return [(prefix + ours, slice(None))]
    q, kv = sizes[0], sizes[1]
    return [(prefix + "self_attn.q_proj", slice(0, q)),
            (prefix + "self_attn.k_proj", slice(q, q + kv)),
            (prefix + "self_attn.v_proj", slice(q + kv, q + 2 * kv))]


@dataclass
class LoRAModel:
    """An adapter in host memory, on the model's projections: each projection's Hugging Face
    name -> (A (r, I), B (O, r) times the scaling), in the model's dtype."""
    request: LoRARequest
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_lora(request: LoRARequest, model, max_lora_rank: int) -> LoRAModel:
    """Read a PEFT adapter directory for `model`; ValueError naming the field or tensor that
    cannot be served: a rank above max_lora_rank, modules_to_save, DoRA, an unknown target, a
    shape unlike the base model's, a base model of another architecture."""
    path = request.lora_path
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a directory")
    config = read_adapter_config(path)
    if config["r"] > max_lora_rank:
        raise ValueError(f"{path}: adapter_config.json r {config['r']} is above max_lora_rank "
                         f"{max_lora_rank}")
    check_targets(config, model, path)
    scale = scaling(config)
    dtype = model.lm_head.weight.dtype
    is_gpt2 = model.config.position_encoding == "learned"
    found = projections(model)
    tensors = read_adapter_weights(path)
    weights = {}
    for key in tensors:
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{path}: tensor {key} is not served (only lora_A.weight and "
                             "lora_B.weight: no embeddings, biases or saved modules)")
        if kind == "B.weight":
            continue  # read with its A
        a = tensors[key]
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{path}: tensor {key} has no lora_B.weight beside it")
        if module.rpartition(".")[2] not in config["target_modules"]:
            raise ValueError(f"{path}: tensor {key} adapts a module outside target_modules")
        targets = our_names(module, is_gpt2, sizes_of(found, module, is_gpt2))
        check_shapes(key, a, b, config["r"], targets, found, path)
        for name, rows in targets:
            weights[name] = (a.to(dtype), (b[rows].float() * scale).to(dtype))
    if len(tensors) != 2 * len({key for key in tensors if ".lora_A." in key}):
        raise ValueError(f"{path}: a lora_B.weight has no lora_A.weight beside it")
    return LoRAModel(request, config["r"], weights)


def sizes_of(found: dict, module: str, is_gpt2: bool) -> list[int]:
    """The rows of each part of the Linear a GPT-2 c_attn adapts (q, k, v); [] otherwise."""
    if not (is_gpt2 and module.endswith("attn.c_attn")):
        return []
    layer = module.removeprefix("transformer.").split(".")[1]
    linear, _ = found[f"model.layers.{layer}.self_attn.q_proj"]
    return linear.output_sizes


def check_shapes(key: str, a: torch.Tensor, b: torch.Tensor, r: int,
                 targets: list[tuple[str, slice]], found: dict, path: str) -> None:
    """A (r, I) and B (O, r), I and O the adapted projection's (O: all its targets' rows)."""
    if targets[0][0] not in found:
        raise ValueError(f"{path}: tensor {key} adapts no projection of the base model")
    linear, _ = found[targets[0][0]]
    rows = sum(linear.output_sizes[found[name][1]] for name, _ in targets)
    if a.dim() != 2 or tuple(a.shape) != (r, linear.in_features):
        raise ValueError(f"{path}: tensor {key} has shape {tuple(a.shape)}; the base model's "
                         f"projection wants ({r}, {linear.in_features}) (r, in_features)")
    b_key = key.replace(".lora_A.", ".lora_B.")
    if b.dim() != 2 or tuple(b.shape) != (rows, r):
        raise ValueError(f"{path}: tensor {b_key} has shape {tuple(b.shape)}; the base "
                         f"model's projection wants ({rows}, {r}) (out_features, r)")


# ----------------------------------------------------------------------------- paging

class LoRAManager:
    """The adapters' two tiers: max_loras device slots (every projection's A and B stacked,
    padded to max_lora_rank; linear.py reads them) and a host cache of max_cpu_loras adapters.
    The engine calls acquire() when a request names an adapter and release() when a sequence
    of it leaves; activate() before each step puts the running sequences' adapters in slots;
    token_slots() gives each token of a step its slot."""
    mirror = None  # tensor parallelism: told (slot, adapter) after each slot load, so the
                   # workers load it too (tensor_parallel.TensorParallel.mirror_lora)

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: str):
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.mapping = LoRAMapping()
        self.linears = [m for m in model.modules() if isinstance(m, Linear)]
        self.projections = projections(model)
        for linear in self.linears:
            linear.create_lora_weights(max_loras, max_lora_rank, self.mapping)
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.free_slots = list(range(max_loras))
        self.host: OrderedDict[int, LoRAModel] = OrderedDict()  # adapter id -> it, LRU first
        self.num_live: dict[int, int] = {}  # adapter id -> its live (unfinished) sequences
        self.num_disk_loads = 0  # adapters read from disk (bench.py, the tests)
        self.num_slot_loads = 0  # adapters copied into a device slot

    def acquire(self, request: LoRARequest, num_seqs: int) -> None:
        """num_seqs new sequences run with `request`'s adapter: read it from disk unless the
        host holds it (ValueError: it cannot be served); it stays there while they live."""
        held = self.host.get(request.lora_int_id)
        if held is not None and held.request != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter "
                             f"{held.request.lora_name!r} ({held.request.lora_path}); "
                             f"{request.lora_name!r} needs an id of its own")
        if held is None:
            held = load_lora(request, self.model, self.max_lora_rank)
            self.num_disk_loads += 1
        self.host[request.lora_int_id] = held
        self.host.move_to_end(request.lora_int_id)
        self.num_live[request.lora_int_id] = self.num_live.get(request.lora_int_id, 0) + num_seqs
        self._trim_host()

    def release(self, request: LoRARequest) -> None:
        """A sequence of `request`'s adapter left the engine."""
        lora_id = request.lora_int_id
        self.num_live[lora_id] -= 1
        if self.num_live[lora_id] == 0:
            del self.num_live[lora_id]
        self._trim_host()

    def _trim_host(self) -> None:
        """Evict the least recently used adapters no live sequence names while the host holds
        more than max_cpu_loras (those live ones are kept, past it if need be)."""
        idle = [lora_id for lora_id in self.host if lora_id not in self.num_live]
        for lora_id in idle[:max(0, len(self.host) - self.max_cpu_loras)]:
            del self.host[lora_id]

    def activate(self, running) -> None:
        """Put every running sequence's adapter in a device slot (the scheduler keeps them
        within max_loras), evicting the least recently used slots that none of them holds."""
        needed = {seq.lora_request.lora_int_id for seq in running if seq.lora_request}
        for lora_id in needed:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            self._load_slot(lora_id, self._free_slot(needed))

    def _free_slot(self, needed: set[int]) -> int:
        """A free slot, else the least recently used one whose adapter is not `needed`."""
        if self.free_slots:
            return self.free_slots.pop()
        idle = [lora_id for lora_id in self.slots if lora_id not in needed]
        assert idle, f"the running sequences hold more than max_loras {self.max_loras} adapters"
        return self.slots.pop(idle[0])

    def _load_slot(self, lora_id: int, slot: int) -> None:
        """Copy a host adapter into `slot` of every projection (zero where it has none)."""
        lora = self.host[lora_id]
        for linear in self.linears:
            linear.reset_lora(slot)
        for name, (a, b) in lora.weights.items():
            linear, part = self.projections[name]
            linear.set_lora(slot, part, a.to(self.device), b.to(self.device))
        self.slots[lora_id] = slot
        self.num_slot_loads += 1
        if self.mirror is not None:
            self.mirror(slot, lora)

    def slot_of(self, seq) -> int:
        """seq's adapter's device slot; -1 for the base model."""
        if seq.lora_request is None:
            return -1
        return self.slots[seq.lora_request.lora_int_id]

    def token_slots(self, scheduled: list[tuple]) -> list[int] | None:
        """Each scheduled token's slot, in the flat batch's order (scheduled: (sequence, its
        new tokens) in that order), -1 for the base model; None if no sequence has an
        adapter (the step adds no LoRA term at all)."""
        if not any(seq.lora_request for seq, _ in scheduled):
            return None
        slots = []
        for seq, num_new in scheduled:
            slots += [self.slot_of(seq)] * num_new
        return slots


# ----------------------------------------------------------------------------- random adapters

def peft_modules(model, targets: list[str]) -> dict[str, tuple[int, int]]:
    """The PEFT module names a set of targets adapts on `model`, each with its adapter's
    (in_features, out_features): Llama's names as ours; GPT-2's renamed (c_attn: q, k, v)."""
    is_gpt2 = model.config.position_encoding == "learned"
    modules = {}
    for name, (linear, part) in projections(model).items():
        short = name.rpartition(".")[2]
        if not is_gpt2:
            if short in targets:
                modules[name] = (linear.in_features, linear.output_sizes[part])
            continue
        layer = name.split(".")[2]
        theirs = GPT2_LAYER_NAMES.get(name.split(".", 3)[3], "attn.c_attn")
        if theirs.rpartition(".")[2] in targets and (part == 0 or theirs != "attn.c_attn"):
            modules[f"transformer.h.{layer}.{theirs}"] = (linear.in_features,
                                                        linear.out_features)
    return modules


def save_random_lora(path: str, model, targets: list[str], r: int, lora_alpha: float = 16.0,
                     seed: int = 0, use_rslora: bool = False, **config) -> None:
    """A PEFT adapter directory for `model` with random A and B (PEFT's own starts B at zero,
    which would change nothing): the tests' and bench.py's adapters. config: more
    adapter_config.json fields."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in peft_modules(model, targets).items():
        key = PEFT_PREFIX + module
        tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_features, generator=generator) \
            / math.sqrt(in_features)
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, r, generator=generator) * 0.05
    is_gpt2 = model.config.position_encoding == "learned"
    adapter_config = dict(peft_type="LORA", r=r, lora_alpha=lora_alpha, target_modules=targets,
                          use_rslora=use_rslora, fan_in_fan_out=is_gpt2, lora_dropout=0.0,
                          bias="none", modules_to_save=None, task_type="CAUSAL_LM",
                          base_model_name_or_path=None) | config
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    write_safetensors(tensors, os.path.join(path, "adapter_model.safetensors"))

"""Checkpoints: a Hugging Face directory, a name in its cache or a preset, made ready to serve.

config_from_hf maps config.json onto a GPTConfig through an allow-list (a key that would change
the computation and is not served is refused by name); read_safetensors reads the weights,
sharded or not (Llama-family parameters keep Hugging Face's names; GPT-2's are renamed and its
Conv1D weights transposed); load_model puts it all together as a Checkpoint: the model, its
tokenizer and chat template, its EOS ids, dtype and generation_config.json. A name is looked
up in the local Hugging Face cache (GPT-2's are downloaded there if missing). save_checkpoint
writes GPT-2's layout (train.py saves with it).

The engine (nanoserve.py) calls load_model once, as it starts.
"""
import ctypes
import ctypes.util
import json
import math
import mmap
import os
import re
import sys
import urllib.request
import zipfile
from dataclasses import dataclass, field
from functools import partial

import torch

from kernels import FP8_DTYPE, FP8_MAX
from linear import QUANTIZATION_METHODS, merge_split, projections, quantize_model, quantize_weight
from model import GPT, PRESETS, GPTConfig
from tokenizer import (EOT, ChatTemplate, Tokenizer, byte_tokenizer, gpt2_byte_chars,
                       load_chat_template, load_tokenizer, read_json)

SERVED_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "mistral": "MistralForCausalLM"}
# Generation defaults that transformers 4 wrote into config.json: nanoserve reads them from
# generation_config.json, and transformers 5 drops them from config.json as well.
GENERATION_KEYS = {"max_length", "min_length", "do_sample", "early_stopping", "num_beams",
                   "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
                   "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                   "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
                   "output_scores", "return_dict_in_generate", "forced_bos_token_id",
                   "forced_eos_token_id", "remove_invalid_values",
                   "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"}
# config.json keys that change nothing a forward pass computes, whatever their value: metadata
# (architectures is checked against the model_type), token ids, what a forward pass returns,
# classification metadata, training-only settings, generation defaults, and what only other
# heads, frameworks or layouts read. A key that starts with "_" is metadata too
# (_name_or_path, which transformers writes into a converted checkpoint; _commit_hash).
# torchscript only clones the tied head; chunk_size_feed_forward splits the MLP over positions,
# which is exact, and these families never do; every served family decodes, is_decoder or not;
# max_window_layers counts sliding-window layers, which are refused; pretraining_tp split the
# matmuls while training; rope_interleaved is nanotron's layout, which transformers ignores.
NEUTRAL_KEYS = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
                "name_or_path", "attn_implementation", "tokenizer_class", "prefix",
                "finetuning_task", "task_specific_params", "transformers.js_config",
                "is_llama_config",
                "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id",
                "decoder_start_token_id",
                "use_cache", "output_past", "output_attentions", "output_hidden_states",
                "return_dict", "torchscript", "is_decoder", "chunk_size_feed_forward",
                "id2label", "label2id", "num_labels", "problem_type",
                "initializer_range", "attention_dropout", "attn_pdrop", "embd_pdrop",
                "resid_pdrop", "gradient_checkpointing", "use_bfloat16", "tf_legacy_loss",
                "pretraining_tp", "max_window_layers", "rope_interleaved",
                "summary_activation", "summary_first_dropout", "summary_proj_to_labels",
                "summary_type", "summary_use_proj", "reorder_and_upcast_attn"} | GENERATION_KEYS
# Keys served at their neutral value only (transformers' default, which transformers 5 writes
# into every config it saves): key -> (the values served, what another value would bring).
# Another value is refused by name.
NEUTRAL_VALUES = {"add_cross_attention": ((False,), "cross-attention"),
                  "cross_attention_hidden_size": ((None,), "cross-attention"),
                  "is_encoder_decoder": ((False,), "an encoder-decoder model"),
                  "tie_encoder_decoder": ((False,), "an encoder-decoder model"),
                  "pruned_heads": (({},), "attention heads pruned away")}
GPT2_VALUES = {"activation_function": (("gelu_new", "gelu_pytorch_tanh"), "another activation"),
               "scale_attn_weights": ((True,), "unscaled attention scores"),
               "scale_attn_by_inverse_layer_idx": ((False,), "scores scaled by layer"),
               "tie_word_embeddings": ((True,), "an LM head of its own")}
LLAMA_VALUES = {"hidden_act": (("silu",), "another activation"),
                "use_mrope": ((False,), "Qwen2-VL's multimodal RoPE")}
# The keys config_from_hf reads, each into a GPTConfig field or a check.
GPT2_KEYS = {"vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
             "layer_norm_epsilon"} | set(GPT2_VALUES)
LLAMA_KEYS = {"vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "attention_bias", "mlp_bias", "tie_word_embeddings",
              "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
              "use_sliding_window", "layer_types"} | set(LLAMA_VALUES)
LLAMA3_SCALING_KEYS = {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"}
# What the keys read here must hold, checked before any is used (null: the key's default): a
# string for a bool, a NaN or a negative epsilon would build a model that prints garbage.
POSITIVE_INTS = {"vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
                 "max_position_embeddings", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "sliding_window", "original_max_position_embeddings"}
POSITIVE_NUMBERS = {"layer_norm_epsilon", "rms_norm_eps", "rope_theta", "factor",
                    "low_freq_factor", "high_freq_factor"}
BOOLS = {"attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window"}
MAPS = {"rope_scaling", "rope_parameters"}


def config_from_hf(hf: dict, path: str) -> GPTConfig:
    """A Hugging Face config.json -> GPTConfig. An allow-list: a key this function does not
    know is refused by name, since serving a model while ignoring what a key changes (another
    RoPE scaling, a sliding window, experts) would give wrong text without a word."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in SERVED_ARCHITECTURES:
        raise ValueError(f"{path}: model_type {model_type!r} is not served; nanoserve serves "
                         f"{', '.join(SERVED_ARCHITECTURES)}")
    architecture = SERVED_ARCHITECTURES[model_type]
    architectures = hf.get("architectures") or [architecture]  # null where no model saved it
    if architectures != [architecture]:
        raise ValueError(f"{path}: architectures {architectures} is not served; a "
                         f"{model_type} checkpoint is served as {architecture}")
    family = GPT2_KEYS if model_type == "gpt2" else LLAMA_KEYS
    known = family | NEUTRAL_KEYS | set(NEUTRAL_VALUES)
    if unknown := sorted(key for key in set(hf) - known if not key.startswith("_")):
        raise ValueError(f"{path}: config.json key {unknown[0]!r} is not served: it may change "
                         "what the model computes, and nanoserve would ignore it")
    require(hf, NEUTRAL_VALUES, path)
    check_kinds(hf, "config.json", path)
    try:
        if model_type == "gpt2":
            return gpt2_config(hf, path)
        return llama_config(hf, path)
    except KeyError as e:  # a size every config of the family has
        raise ValueError(f"{path}: config.json lacks {e.args[0]!r}") from None


def setting(values: dict, key: str, default):
    """values[key], or default where the key is absent or null (transformers' reading)."""
    value = values.get(key)
    if value is None:
        return default
    return value


def check_kinds(values: dict, where: str, path: str) -> None:
    """ValueError naming the first key of `values` that holds the wrong kind of value for
    what it is read as (POSITIVE_INTS, POSITIVE_NUMBERS, BOOLS, MAPS); null passes."""
    for key, value in values.items():
        if value is None:
            continue
        if key in POSITIVE_INTS and not (type(value) is int and value >= 1):
            wanted = "a positive integer"
        elif key in POSITIVE_NUMBERS and not (type(value) in (int, float)
                                              and math.isfinite(value) and value > 0):
            wanted = "a positive finite number"
        elif key in BOOLS and type(value) is not bool:
            wanted = "true or false"
        elif key in MAPS and not isinstance(value, dict):
            wanted = "an object"
        else:
            continue
        raise ValueError(f"{path}: {where} {key} must be {wanted}, got {value!r}")


def require(hf: dict, values: dict, path: str) -> None:
    """Refuse, by name, a key of `values` present in the config with a value it does not
    serve: values maps a key to (the values served, what another value would bring)."""
    for key, (served, what) in values.items():
        if key in hf and hf[key] not in served:
            raise ValueError(f"{path}: config.json {key} {hf[key]!r} is not served ({what}; "
                             f"only {' or '.join(map(repr, served))})")


def gpt2_config(hf: dict, path: str) -> GPTConfig:
    require(hf, GPT2_VALUES | {"n_ctx": ((hf["n_positions"],), "a context unlike n_positions")},
            path)
    return GPTConfig(vocab_size=hf["vocab_size"], n_positions=hf["n_positions"],
                     n_embd=hf["n_embd"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                     intermediate_size=hf.get("n_inner"),
                     norm_eps=setting(hf, "layer_norm_epsilon", 1e-5))


def llama_config(hf: dict, path: str) -> GPTConfig:
    """Llama, Qwen2, Qwen3 and Mistral: one layout; they differ in biases, q/k norm and RoPE."""
    model_type = hf["model_type"]
    require(hf, LLAMA_VALUES, path)
    check_full_attention(hf, path)
    rope_theta, rope_scaling = rope_settings(hf, path)
    attention_bias = setting(hf, "attention_bias", False)
    # Biases as transformers builds each family: Qwen2 has them on q, k, v always; Mistral and
    # Qwen2 have no attention_bias key (transformers ignores one), Llama and Qwen3 do.
    qkv_bias = {"llama": attention_bias, "qwen2": True, "qwen3": attention_bias}
    o_bias = {"llama": attention_bias, "qwen3": attention_bias}
    return GPTConfig(vocab_size=hf["vocab_size"], n_positions=hf["max_position_embeddings"],
                     n_embd=hf["hidden_size"], n_layer=hf["num_hidden_layers"],
                     n_head=hf["num_attention_heads"],
                     n_kv_head=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                     intermediate_size=hf["intermediate_size"], norm="rmsnorm",
                     norm_eps=setting(hf, "rms_norm_eps", 1e-6), position_encoding="rope",
                     mlp="swiglu", qkv_bias=qkv_bias.get(model_type, False),
                     o_bias=o_bias.get(model_type, False),
                     mlp_bias=model_type == "llama" and setting(hf, "mlp_bias", False),
                     qk_norm=model_type == "qwen3",
                     tie_word_embeddings=setting(hf, "tie_word_embeddings", False),
                     rope_theta=rope_theta, rope_scaling=rope_scaling)


def check_full_attention(hf: dict, path: str) -> None:
    """Refuse sliding-window attention where it would apply: a window shorter than the context
    (Mistral's whenever set; Qwen's only with use_sliding_window), or sliding layer_types."""
    window = hf.get("sliding_window")
    applies = setting(hf, "use_sliding_window", hf["model_type"] == "mistral")
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
    theta = setting(hf, "rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    if parameters is not None:  # transformers 5: the top-level rope_theta, if any, under it
        check_kinds(parameters, "rope_parameters", path)
        without_theta = {key: value for key, value in parameters.items() if key != "rope_theta"}
        if scaling is not None and scaling != without_theta:
            raise ValueError(f"{path}: config.json's rope_scaling and rope_parameters differ: "
                             "which one holds is ambiguous")
        theta = setting(parameters, "rope_theta", theta)
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
    check_kinds(scaling, "rope_scaling", path)
    if not scaling["low_freq_factor"] < scaling["high_freq_factor"]:  # their gap divides
        raise ValueError(f"{path}: rope_scaling's low_freq_factor must be below its "
                         "high_freq_factor")
    return theta, {key: scaling[key] for key in sorted(LLAMA3_SCALING_KEYS)}


# quantization_config methods refused by name (their weights are not in a layout served)
REFUSED_QUANT_METHODS = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes",
                         "fp8": "FP8 in vLLM's own format", "marlin": "Marlin",
                         "gguf": "GGUF", "aqlm": "AQLM", "hqq": "HQQ", "eetq": "EETQ",
                         "quark": "Quark", "mxfp4": "MXFP4", "modelopt": "ModelOpt"}
# compressed-tensors FP8 as published (llm-compressor's FP8_DYNAMIC scheme): field -> values
FP8_WEIGHTS = {"type": ("float",), "num_bits": (8,), "strategy": ("channel", "tensor"),
               "symmetric": (True, None), "dynamic": (False, None), "group_size": (None,),
               "block_structure": (None,), "actorder": (None,)}
FP8_INPUT_ACTIVATIONS = {"type": ("float",), "num_bits": (8,), "strategy": ("token",),
                         "symmetric": (True, None), "dynamic": (True,), "group_size": (None,),
                         "block_structure": (None,), "actorder": (None,)}
# its FP8 KV cache scheme (kv_cache_scheme): static, a scale a layer for K and one for V,
# stored as model.layers.N.self_attn.k_scale and v_scale (vLLM's names)
FP8_KV_CACHE = {"type": ("float",), "num_bits": (8,), "strategy": ("tensor",),
                "symmetric": (True, None), "dynamic": (False,), "group_size": (None,),
                "block_structure": (None,), "actorder": (None,)}


def checkpoint_quantization(qc, path: str) -> dict | None:
    """config.json's quantization_config -> None (none) or {"ignore": [module names or re:
    patterns], "kv_cache_scales": whether it gives them} for a compressed-tensors FP8
    checkpoint (format float-quantized, weights F8_E4M3 with a scale per channel or per tensor,
    activations dynamic per token or none, and optionally an FP8 KV cache's static per-layer
    scales): the only quantized format served. Any other (GPTQ, AWQ, bitsandbytes, block-wise
    FP8, static activation scales) is refused by name, never served as full precision."""
    if qc is None:
        return None
    where = f"{path}: config.json quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {qc!r:.100}")
    method = qc.get("quant_method")
    if qc.get("weight_block_size") is not None:
        raise ValueError(f"{where}: block-wise FP8 (weight_block_size "
                         f"{qc['weight_block_size']}) is not served; only compressed-tensors "
                         "FP8 with a scale per channel or per tensor")
    if method != "compressed-tensors":
        name = REFUSED_QUANT_METHODS.get(method, repr(method))
        raise ValueError(f"{where}: quant_method {method!r} ({name}) is not served; only "
                         "compressed-tensors FP8 (format float-quantized)")
    if qc.get("format") != "float-quantized":
        raise ValueError(f"{where}: compressed-tensors format {qc.get('format')!r} is not "
                         "served; only float-quantized (FP8 weights)")
    kv_cache_scheme = qc.get("kv_cache_scheme")
    if kv_cache_scheme is not None:
        check_scheme("kv_cache_scheme", kv_cache_scheme, FP8_KV_CACHE, where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where} has no config_groups")
    for name, group in groups.items():
        check_fp8_group(group, f"{where} group {name}")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise ValueError(f"{where}: ignore must be a list of module names")
    return {"ignore": ignore, "kv_cache_scales": kv_cache_scheme is not None}


def check_fp8_group(group, where: str) -> None:
    """A config group of compressed-tensors FP8: Linear targets, FP8_WEIGHTS, and no activation
    scheme or FP8_INPUT_ACTIVATIONS; ValueError naming the first field that differs."""
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ValueError(f"{where} has no weights scheme")
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"{where}: targets {group.get('targets')!r} are not served (Linear)")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}: output_activations are not served")
    schemes = [("weights", group["weights"], FP8_WEIGHTS)]
    if group.get("input_activations") is not None:
        schemes.append(("input_activations", group["input_activations"],
                        FP8_INPUT_ACTIVATIONS))
    for part, scheme, served in schemes:
        check_scheme(part, scheme, served, where)


def check_scheme(part: str, scheme, served: dict, where: str) -> None:
    """A compressed-tensors quantization scheme (weights, input activations, the KV cache's)
    against the values served for each field; ValueError naming the first that differs."""
    if not isinstance(scheme, dict):
        raise ValueError(f"{where}: {part} must be an object")
    for field_name, values in served.items():
        value = scheme.get(field_name)
        if value not in values:
            what = "block-wise FP8" if value == "block" or field_name == "block_structure" \
                else "another scheme"
            raise ValueError(f"{where}: {part} {field_name} {value!r} is not served ({what};"
                             f" only {' or '.join(map(repr, values))})")


def served_quantization(asked: str | None, stored: dict | None, path: str) -> str | None:
    """The scheme a checkpoint is served with: asked for (online at load), or a compressed-
    tensors FP8 checkpoint's own fp8 (asked for none or fp8; int8 over it is refused)."""
    if asked is not None and asked not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {asked!r}; choose one of "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if stored is None:
        return asked
    if asked not in (None, "fp8"):
        raise ValueError(f"{path} holds compressed-tensors FP8 weights: quantization {asked!r} "
                         "would quantize them again; leave it unset or fp8")
    return "fp8"


def is_ignored(name: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' ignore list names module `name`: as it is, or as a "re:"
    pattern matching it whole."""
    for entry in ignore:
        if entry == name or (entry.startswith("re:") and re.fullmatch(entry[3:], name)):
            return True
    return False


def quantized_linears(model: GPT, stored: dict | None, path: str) -> list:
    """The model's projections to quantize, each once: all of them, or a compressed-tensors
    checkpoint's not ignored. A merged projection's parts must agree (q quantized, k not,
    would be two schemes in one GEMM)."""
    by_linear = {}
    for name, (linear, _) in projections(model).items():
        ignored = stored is not None and is_ignored(name, stored["ignore"])
        by_linear.setdefault(linear, set()).add(ignored)
    for linear, kinds in by_linear.items():
        if len(kinds) > 1:
            raise ValueError(f"{path}: quantization_config ignores some of {linear.parts} but "
                             "not all: they are one GEMM here")
    return [linear for linear, kinds in by_linear.items() if kinds == {False}]


def pop_kv_cache_scales(tensors: dict, num_layers: int, path: str) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) of a compressed-tensors FP8 KV cache scheme, taken out
    of tensors (they are no parameter: Attention's floats): one positive finite number each,
    per tensor, as llm-compressor calibrates them (max |K| / 448 over its calibration data)."""
    scales = []
    for layer in range(num_layers):
        pair = []
        for name in ("k_scale", "v_scale"):
            key = f"model.layers.{layer}.self_attn.{name}"
            if key not in tensors:
                raise ValueError(f"{path}: checkpoint is missing tensor {key} (quantization_config"
                                 " has a kv_cache_scheme)")
            scale = tensors.pop(key)
            value = float(scale.float().reshape(-1)[0]) if scale.numel() == 1 else None
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{path}: tensor {key} must be one positive finite scale, got "
                                 f"shape {tuple(scale.shape)}")
            pair.append(value)
        scales.append(tuple(pair))
    return scales


def compressed_tensors_state(tensors: dict, model: GPT, stored: dict, path: str) -> dict:
    """A compressed-tensors FP8 checkpoint's tensors, checked as checked_llama_state checks a
    float one: each quantized projection's weight F8_E4M3 (O, I) and its weight_scale, per
    channel (O, 1) or per tensor ([] or [1]), made (O,) fp32 here; no static activation
    scales."""
    if static := sorted(key for key in tensors if key.endswith(".input_scale")):
        raise ValueError(f"{path}: tensor {static[0]} is a static activation scale: not "
                         "served (only dynamic per-token activations)")
    quantized = {name for name in projections(model)
                 if not is_ignored(name, stored["ignore"])}
    for name in quantized:
        weight, scale = tensors.get(f"{name}.weight"), tensors.get(f"{name}.weight_scale")
        if weight is None or scale is None:
            raise ValueError(f"{path}: checkpoint is missing tensor {name}.weight"
                             f"{'_scale' if weight is not None else ''}")
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{path}: tensor {name}.weight holds {weight.dtype}, not F8_E4M3: "
                             "quantization_config says it is quantized")
        rows = weight.shape[0]
        if scale.numel() == 1:  # per tensor: every channel its scale
            scale = scale.reshape(1).expand(rows)
        elif tuple(scale.shape) in ((rows, 1), (rows,)):
            scale = scale.reshape(rows)
        else:
            raise ValueError(f"{path}: tensor {name}.weight_scale has shape "
                             f"{tuple(scale.shape)}; per channel ({rows}, 1) or per tensor")
        tensors[f"{name}.weight_scale"] = scale
    state = checked_llama_state({key: t for key, t in tensors.items()
                                 if not key.endswith(".weight_scale")}, model, path,
                                fp8=quantized)
    return state | {key: t for key, t in tensors.items() if key.endswith(".weight_scale")}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "U8": torch.uint8,
                      "I8": torch.int8, "F8_E4M3": FP8_DTYPE}
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints",
                             "shakespeare")  # trained by train.py, shipped with the repo


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A .safetensors file (8-byte little-endian header length, a JSON header, raw tensors),
    memory-mapped: each tensor is a view of the file's pages, read from disk when first used
    and never copied here. The mapping is private (copy-on-write), so nothing written to a
    tensor reaches the file; the file must not be rewritten while a tensor of it is in use."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: corrupt safetensors header (file {size} bytes)")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise ValueError(f"{path}: corrupt safetensors header (length {n}, file {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n], object_pairs_hook=without_repeated_keys)
    except ValueError as e:
        raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    tensors = {}
    spans = []  # (start, end, name) of each tensor's bytes, after the header
    for name, info in header.items():
        layout = entry_layout(info)
        if layout is None:
            raise ValueError(f"{path}: corrupt safetensors entry for {name}: {info!r:.200}")
        dtype, start, end, shape = layout
        if 8 + n + end > len(data):
            raise ValueError(f"{path}: safetensors entry {name} ends past the file")
        spans.append((start, end, name))
        tensors[name] = torch.frombuffer(data, dtype=dtype, count=math.prod(shape),
                                         offset=8 + n + start).reshape(shape)
    spans.sort()
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:  # two tensors reading the same bytes: the file is damaged
            raise ValueError(f"{path}: tensors {name} and {next_name} overlap")
    return tensors


def without_repeated_keys(pairs: list) -> dict:
    """json's object hook: a dict of the pairs; ValueError if a key comes twice (which tensor
    a name means would be a guess)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError("a key comes twice")
    return dict(pairs)


def entry_layout(info) -> tuple[torch.dtype, int, int, list[int]] | None:
    """A safetensors header entry's (dtype, start, end, shape), or None unless it is well
    formed: a known dtype, offsets 0 <= start <= end, and a shape of non-negative integers
    whose elements fill start..end exactly."""
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return None
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    offsets = info.get("data_offsets")
    shape = info.get("shape")
    if dtype is None or not (isinstance(offsets, list) and len(offsets) == 2
                             and all(type(offset) is int for offset in offsets)):
        return None
    if not (isinstance(shape, list) and all(type(size) is int and size >= 0 for size in shape)):
        return None
    start, end = offsets
    if not 0 <= start <= end or end - start != math.prod(shape) * dtype.itemsize:
        return None
    return dtype, start, end, shape


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


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    quantization: str | None = None, shard=None) -> GPT:
    """A Hugging Face checkpoint directory of a served architecture (config_from_hf):
    config.json + model.safetensors (or its shards, or pytorch_model.bin), loaded as the best
    loaders load one. The model is built on the meta device (no memory, no random weights to
    overwrite); each tensor, a view of its memory-mapped file, goes to `device` in `dtype` in
    one copy (none on a CPU in the file's own dtype: the model then reads the mapped pages),
    and the model takes those tensors as its parameters. Host memory: the file's pages, where
    building, initialising and converting a whole model first took four times the file.
    quantization ("int8", "fp8"): each projection's weight quantized as it is placed, its
    file's pages let go, so no more than one full-precision tensor is held beyond the
    quantized model; a compressed-tensors FP8 checkpoint's are placed as stored. shard: a
    tensor-parallel rank's (tensor_parallel.Shard), which copies its slices only (quantized
    after: one rank's full-precision slices, 1/N of the model, held for a moment)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} is not a checkpoint directory: no config.json")
    hf = read_json(config_file)
    stored = checkpoint_quantization(hf.pop("quantization_config", None), path)
    quantization = served_quantization(quantization, stored, path)
    config = config_from_hf(hf, path)
    tensors = read_weights(path)
    check_sizes(config, tensors, path)
    with torch.device("meta"):
        model = GPT(config)
    if hf["model_type"] == "gpt2" and stored is not None:
        raise ValueError(f"{path}: compressed-tensors FP8 is served for the Llama family only "
                         "(GPT-2's fused c_attn would need its own scales)")
    kv_cache_scales = []  # each layer's (k_scale, v_scale), if the checkpoint gives them
    if hf["model_type"] == "gpt2":
        tensors = from_gpt2_state(checked_state(gpt2_tensors(tensors),
                                                to_gpt2_state(model.state_dict()), path))
    elif stored is not None:  # its projections' tensors are q and weight_scale already
        if stored["kv_cache_scales"]:
            kv_cache_scales = pop_kv_cache_scales(tensors, config.n_layer, path)
        tensors = compressed_tensors_state(tensors, model, stored, path)
    else:
        tensors = checked_llama_state(tensors, model, path)
    to_quantize = set()
    if quantization is not None and stored is None:
        to_quantize = {f"{name}.weight" for name in projections(model)}
    if shard is not None:  # tensor parallelism: the views narrowed to the rank's slices
        if stored is not None:
            raise ValueError(f"{path}: a compressed-tensors checkpoint is not cut for "
                             "tensor_parallel_size > 1 (its scales would need cutting too)")
        sharded = shard.build(config, tensors, device, dtype)
        if quantization is not None:
            shard.quantize(sharded, quantization)
        return sharded
    # safetensors' views, never overlapping (read_safetensors checks): their pages may go
    is_safetensors = os.path.exists(os.path.join(path, "model.safetensors")) or \
        os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    placed = {}
    file_views = set()  # the data pointers of placed tensors that are the mapped file's pages
    for name in list(tensors):  # one at a time: each view is let go once placed
        view = tensors.pop(name)
        if view.dtype == FP8_DTYPE:  # stored quantized (compressed_tensors_state checked)
            placed[name] = view.to(device)
            continue
        if name.endswith(".weight_scale"):
            placed[name] = view.to(device, torch.float32)
            continue
        # contiguous: GPT-2's Conv1D weights arrive transposed, as views
        placed[name] = view.to(device, dtype).contiguous()
        if is_safetensors and placed[name].data_ptr() == view.data_ptr():
            file_views.add(view.data_ptr())
        if name in to_quantize:  # quantized now, its full-precision copy and pages let go
            weight = placed.pop(name)
            placed[name], placed[name + "_scale"] = quantize_weight(weight, quantization)
            release_file_pages(file_views, weight)
    if model.config.tie_word_embeddings:  # one tensor under two names
        placed["lm_head.weight"] = placed["model.embed_tokens.weight"]
    if quantization is not None:  # the meta model's projections take q and its scales
        for linear in quantized_linears(model, stored, path):
            linear.create_quantized_weights(quantization)
    # q/k/v and gate/up concatenated (qkv_proj, gate_up_proj) here, each piece's pages let go
    # as it is copied: read pages count in the process's memory, and the pieces' would add
    # 60% of a Llama file's size to the load's peak
    merge_split(model, placed, "", release=partial(release_file_pages, file_views))
    model.load_state_dict(placed, assign=True)
    if model.config.tie_word_embeddings:  # one parameter, as GPT() ties them
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer, (k_scale, v_scale) in zip(model.model.layers, kv_cache_scales):
        layer.self_attn.k_scale = k_scale  # an FP8 cache stores K / k_scale, V / v_scale
        layer.self_attn.v_scale = v_scale
    return model.to(device)  # the buffers: RoPE's frequencies, on the CPU until now


LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # Llama's and GPT-2's layer names


def check_sizes(config: GPTConfig, tensors: dict, path: str) -> None:
    """Before the model is built, config.json's layer count and query width against the
    weights': a wrong number then fails at once, not after building a model of its size (a
    million layers take minutes; a head_dim of 2e9, gigabytes of RoPE tables)."""
    layers = {int(match.group(1)) for name in tensors if (match := LAYER_INDEX.search(name))}
    if len(layers) != config.n_layer:
        raise ValueError(f"{path}: config.json has {config.n_layer} layers; the weights hold "
                         f"{len(layers)}")
    query = tensors.get("model.layers.0.self_attn.q_proj.weight")
    query_width = config.n_head * config.head_dim
    if query is not None and query.shape[0] != query_width:
        raise ValueError(f"{path}: config.json's heads make queries {query_width} wide; the "
                         f"weights' are {query.shape[0]}")


MADV_DONTNEED = 4  # madvise(2): these pages may go; a file's are read again if touched
PAGE_SIZE = mmap.PAGESIZE
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def release_file_pages(file_views: set[int], tensor: torch.Tensor) -> None:
    """Let the whole pages inside a tensor that is a view of a memory-mapped checkpoint go
    from the process's memory (file_views: the data pointers of such views). The mapping is
    private and never written, so a page let go holds the file's bytes again if read; only
    the pages wholly inside the tensor's bytes go (tensors of a file never overlap). A tensor
    not in file_views (a copy: converted, or read whole) is left alone."""
    start = tensor.data_ptr()
    if start not in file_views:
        return
    end = start + tensor.numel() * tensor.element_size()
    first_page = (start + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE  # rounded up
    last_page = end // PAGE_SIZE * PAGE_SIZE                       # rounded down
    if last_page <= first_page:
        return
    LIBC.madvise(ctypes.c_void_p(first_page), ctypes.c_size_t(last_page - first_page),
                 MADV_DONTNEED)


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
        return read_pickle(pickle_file)
    raise ValueError(f"{path} has no model.safetensors, model.safetensors.index.json or "
                     "pytorch_model.bin")


def read_pickle(path: str) -> dict[str, torch.Tensor]:
    """pytorch_model.bin, memory-mapped as a safetensors file is (its tensors views of the
    file's pages, not a copy of a whole file read first), weights only: no code of the file's
    runs. ValueError unless it holds a state dict of tensors."""
    # torch maps only its zip format; the legacy one (torch.save before 1.6, or with
    # _use_new_zipfile_serialization=False) makes mmap=True raise: read such a file whole
    mappable = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mappable)
    except Exception as e:  # noqa: BLE001 (torch raises whatever its unpickler meets)
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{path} is not a PyTorch state dict: {type(e).__name__}: "
                         f"{first_line[:200]}") from None
    if not isinstance(state, dict) or not all(isinstance(name, str) and torch.is_tensor(t)
                                              for name, t in state.items()):
        raise ValueError(f"{path} is not a state dict of tensors")
    return state


def read_shards(index_file: str) -> dict[str, torch.Tensor]:
    """A sharded checkpoint: each shard its index's weight_map names, read once; a tensor the
    index places in a shard that lacks it is an error, not a silent gap."""
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_file} has no weight_map")
    for shard in weight_map.values():  # a file beside the index, nowhere else
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
            raise ValueError(f"{index_file}: weight_map names {shard!r}, not a file beside it")
    directory = os.path.dirname(index_file)
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        shard_file = os.path.join(directory, shard)
        if not os.path.isfile(shard_file):
            raise ValueError(f"{index_file} lists shard {shard}, which is missing")
        for name, tensor in read_safetensors(shard_file).items():
            placed = weight_map.get(name)  # None: one the index omits (a RoPE buffer, say)
            if placed is not None and placed != shard:  # a second copy would win unseen
                raise ValueError(f"{shard_file} holds {name}, which {index_file} places in "
                                 f"{placed}")
            tensors[name] = tensor
    if missing := sorted(set(weight_map) - set(tensors)):
        raise ValueError(f"{index_file}: tensor {missing[0]} is not in its shard "
                         f"{weight_map[missing[0]]}")
    return tensors


def checked_state(state: dict, expected: dict, path: str, fp8: set = frozenset()) -> dict:
    """state, once every tensor of `expected` is in it with its shape and nothing else is, in
    a floating dtype: F8_E4M3 only for the keys in fp8 (compressed-tensors' weights)."""
    for key, want in expected.items():
        if key not in state:
            raise ValueError(f"{path}: checkpoint is missing tensor {key}")
        if state[key].shape != want.shape:
            raise ValueError(f"{path}: tensor {key} has shape {tuple(state[key].shape)}; "
                             f"config.json implies {tuple(want.shape)}")
        if not state[key].is_floating_point():
            raise ValueError(f"{path}: tensor {key} holds {state[key].dtype}, not weights")
        if state[key].dtype == FP8_DTYPE and key not in fp8:
            raise ValueError(f"{path}: tensor {key} holds F8_E4M3 where config.json's "
                             "quantization_config (if any) says full precision")
    if unexpected := sorted(set(state) - set(expected)):
        raise ValueError(f"{path}: unexpected tensors {unexpected[:5]}")
    return state


def checked_llama_state(tensors: dict, model: GPT, path: str, fp8: set = frozenset()) -> dict:
    """A Llama-family checkpoint's tensors, named as ours already, checked: old checkpoints'
    saved RoPE buffers dropped, and a tied head's copy (some checkpoints store one) too. fp8:
    the projections stored in FP8 (compressed_tensors_state), whose weights alone may be, and
    must be, F8_E4M3."""
    tied = model.config.tie_word_embeddings
    state = {key: t for key, t in tensors.items()
             if not key.endswith("rotary_emb.inv_freq") and not (tied and key == "lm_head.weight")}
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    return checked_state(state, expected, path, {f"{name}.weight" for name in fp8})


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
    dtype: torch.dtype                # what the model runs in (run_dtype)
    generation_config: dict = field(default_factory=dict)  # generation_config.json, or {}
    path: str | None = None           # the checkpoint's directory; None for a preset
    chat_template: ChatTemplate | None = None  # None: a preset, or a checkpoint without one


def load_model(model: str | None = None, preset: str | None = None, seed: int = 0,
               device: str = "cpu", dtype: torch.dtype | None = None,
               quantization: str | None = None, shard=None) -> Checkpoint:
    """A preset (seeded random weights), a checkpoint directory, a name in the local Hugging
    Face cache (Qwen/Qwen3-0.6B; GPT-2's are downloaded there if missing) or the shipped model,
    on `device` in `dtype` (None: run_dtype's choice), its projections quantized if asked
    (quantization: "int8", "fp8"; a compressed-tensors FP8 checkpoint's are already); shard: a
    tensor-parallel rank's slices only (tensor_parallel.Shard)."""
    if preset is not None:
        dtype = run_dtype(dtype, None)
        torch.manual_seed(seed)  # the weights are drawn on the CPU: the same on any device
        gpt = GPT(PRESETS[preset])
        if shard is not None:  # the rank's slices of the drawn weights
            gpt = shard.build(gpt.config, gpt.state_dict(), device, dtype)
        gpt = gpt.to(device, dtype)
        quantized = served_quantization(quantization, None, preset) is not None
        if quantized and shard is not None:
            shard.quantize(gpt, quantization)
        elif quantized:
            quantize_model(gpt, quantization)
        tokenizer = byte_tokenizer()
        eos_ids = eos_token_ids(tokenizer, {}, {}, gpt.config.vocab_size, preset)
        return Checkpoint(gpt, tokenizer, eos_ids, dtype)
    path = checkpoint_path(model or DEFAULT_MODEL)
    hf = read_json(os.path.join(path, "config.json"))
    dtype = run_dtype(dtype, DTYPES.get(hf.get("torch_dtype", hf.get("dtype"))))
    # first: a directory that is no checkpoint says so
    gpt = load_checkpoint(path, dtype, device, quantization, shard)
    generation_config = read_json(os.path.join(path, "generation_config.json"))
    tokenizer = load_tokenizer(path)
    eos_ids = eos_token_ids(tokenizer, hf, generation_config, gpt.config.vocab_size, path)
    return Checkpoint(gpt, tokenizer, eos_ids, dtype,
                      generation_config=generation_config, path=path,
                      chat_template=load_chat_template(path))


def run_dtype(asked: torch.dtype | None, stored: torch.dtype | None) -> torch.dtype:
    """The dtype a model runs in: the one asked for (--dtype), else the checkpoint's
    torch_dtype, else bfloat16. (--dtype auto asks for none on CUDA; EngineConfig makes it
    float32 on a CPU, where fp32 is exact and as fast.)"""
    return asked or stored or torch.bfloat16


# the dtypes a model runs in, by the names config.json's torch_dtype and --dtype give them
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def eos_token_ids(tokenizer: Tokenizer, hf: dict, generation_config: dict, vocab_size: int,
                  path: str) -> list[int]:
    """Every id that ends a request: generation_config.json's eos_token_id, then config.json's
    (each an int or a list: Llama 3 Instruct ends at <|end_of_text|>, <|eom_id|> and
    <|eot_id|>); with neither, the tokenizer's <|endoftext|>, if it has one. ValueError
    naming the file for an id the model does not embed."""
    ids = []
    for file, source in (("generation_config.json", generation_config), ("config.json", hf)):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if type(token_id) is not int or not 0 <= token_id < vocab_size:
                raise ValueError(f"{path}: {file} eos_token_id {value!r} is not a token id of "
                                 f"the model (0 to {vocab_size - 1}) or a list of them")
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
    byte-level tokenizer files: the model embeds their 257 ids, <|endoftext|> (256) its EOS."""
    c = model.config
    if c != GPTConfig(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
                      n_layer=c.n_layer, n_head=c.n_head, norm_eps=c.norm_eps):
        raise ValueError("save_checkpoint writes GPT-2's layout only")
    eot_id = byte_tokenizer().added_tokens[EOT]
    if c.vocab_size <= eot_id:
        raise ValueError(f"save_checkpoint writes the byte-level tokenizer's {eot_id + 1} ids; "
                         f"the model embeds {c.vocab_size}")
    os.makedirs(path, exist_ok=True)
    state = {key: t.to(dtype).contiguous() for key, t in to_gpt2_state(model.state_dict()).items()}
    write_safetensors(state, os.path.join(path, "model.safetensors"))
    hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_ctx=c.n_positions,
              bos_token_id=eot_id, eos_token_id=eot_id,
              vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
              n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.norm_eps)
    vocab = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: eot_id}
    for name, text in [("config.json", json.dumps(hf, indent=2)), ("vocab.json", json.dumps(vocab)),
                       ("merges.txt", "#version: 0.2\n")]:  # bytes only: no merges
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)


def save_compressed_tensors_fp8(source: str, path: str, strategy: str = "channel",
                                ignore: tuple = ("lm_head",),
                                kv_cache_scales: list[tuple[float, float]] | None = None) -> None:
    """The Llama-family checkpoint directory `source` written to `path` as llm-compressor
    writes a model in its FP8 dynamic scheme (compressed-tensors, format float-quantized): each
    projection of the layers F8_E4M3 with its weight_scale, fp32, per output channel (O, 1) as
    quantize_weight makes it, or per tensor (1,) (strategy "tensor": one max|W| / 448 for the
    whole matrix); input activations dynamic per token; every other tensor as it was, and
    `ignore` in config.json (what llm-compressor leaves out: the LM head); kv_cache_scales,
    each layer's (k_scale, v_scale), written with an FP8 kv_cache_scheme. The tests' FP8
    fixture is made by .ci/fixtures/make_fp8_fixture.py with it."""
    hf = read_json(os.path.join(source, "config.json"))
    with torch.device("meta"):
        names = set(projections(GPT(config_from_hf(hf, source))))
    tensors = {}
    for key, t in read_weights(source).items():
        module = key.removesuffix(".weight")
        if module not in names or is_ignored(module, list(ignore)):
            tensors[key] = t.contiguous()
            continue
        if strategy == "channel":
            q, scale = quantize_weight(t, "fp8")
            scale = scale[:, None]  # (O, 1)
        else:
            scale = (t.float().abs().max() / FP8_MAX).reshape(1)
            q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        tensors[key] = q
        tensors[f"{module}.weight_scale"] = scale
    scheme = dict(num_bits=8, type="float", symmetric=True, group_size=None, actorder=None,
                  block_structure=None, observer_kwargs={})
    kv_cache_scheme = None
    if kv_cache_scales is not None:
        kv_cache_scheme = scheme | dict(strategy="tensor", dynamic=False, observer="minmax")
        for layer, (k_scale, v_scale) in enumerate(kv_cache_scales):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    hf["quantization_config"] = dict(
        quant_method="compressed-tensors", format="float-quantized",
        quantization_status="compressed", kv_cache_scheme=kv_cache_scheme, ignore=list(ignore),
        config_groups=dict(group_0=dict(
            targets=["Linear"], output_activations=None,
            weights=scheme | dict(strategy=strategy, dynamic=False, observer="minmax"),
            input_activations=scheme | dict(strategy="token", dynamic=True, observer=None))))
    os.makedirs(path, exist_ok=True)
    write_safetensors(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)

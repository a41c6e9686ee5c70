"""Quantization's guarantees: each quantized projection within its scheme's bound of the float
one (linear.py); quantized models' logits within a measured tolerance of the float model's;
greedy outputs alone equal to batched with each scheme on; compressed-tensors FP8 checkpoints
served as online FP8 of the same weights, every other quantization_config refused by name; an
FP8 KV cache read by every attention path as the reference reads it (kernels.py), twice the
tokens of a 16-bit cache in the same memory.
"""
import json
import math
import os
import shutil

import pytest
import torch

import checkpoint
from conftest import (MODEL_FIXTURES, PROMPTS, assert_no_leaks, fixture_llm, http,
                      nanoserve_main, run_to_end, server_in_process, tiny, token_ids,
                      write_byte_tokenizer)
from kernels import (FP8_DTYPE, dequantize_kv, paged_attention, paged_attention_cpu,
                     paged_attention_ref, quantize_kv, store_kv)
from linear import (FP8_MAX, INT8_MAX, Linear, LoRAMapping, MergedLinear, dequantize_weight,
                    projections, quantize_per_token)
from nanoserve import LLM, EngineConfig
from paged_cache import cdiv, kv_bytes_per_token
from sampling import SamplingParams
from test_kernels import make_batch

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def quantized_copy(linear: Linear, quant_method: str) -> Linear:
    """A copy of linear with its weight quantized (the float one left as it was)."""
    copy = MergedLinear(linear.in_features, dict(linear.parts), bias=linear.bias is not None)
    copy.load_state_dict(linear.state_dict(keep_vars=False))
    copy.quantize_(quant_method)
    return copy


def float_linear(seed: int = 0, in_features: int = 96, bias: bool = True) -> MergedLinear:
    """A merged projection (parts of 32, 48 and 16 rows) with weights of varied row sizes: the
    per-channel scales differ row by row, and one row is all zeros."""
    torch.manual_seed(seed)
    linear = MergedLinear(in_features, dict(q_proj=32, k_proj=48, v_proj=16), bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, 96)[:, None])
        linear.weight[5] = 0
    return linear


# ----------------------------------------------------------------------------- the projections

def test_int8_projection_is_within_half_a_step_a_weight():
    """Each weight moves by at most half its channel's step s = max|w| / 127 (round to
    nearest), each row's largest weight to +-127; so |x . w - x . q s| <= sum|x| s / 2."""
    linear = float_linear()
    quantized = quantized_copy(linear, "int8")
    scale = linear.weight.abs().amax(dim=1) / INT8_MAX
    weight_error = (dequantize_weight(quantized.weight, quantized.weight_scale) - linear.weight)
    assert (weight_error.abs() <= scale[:, None] / 2 + 1e-7).all()
    assert quantized.weight.abs().amax(dim=1)[:5].eq(INT8_MAX).all()  # each row's max -> 127
    x = torch.randn(7, 96)
    bound = x.abs().sum(dim=1, keepdim=True) * scale / 2 + 1e-5
    with torch.no_grad():
        error = (quantized(x) - linear(x)).abs()
    assert quantized.weight.dtype == torch.int8 and (error <= bound).all()


def test_fp8_projection_is_within_its_relative_bound():
    """float8_e4m3fn keeps 3 mantissa bits: each weight moves by at most 2^-4 of itself (or
    half the subnormal step, 2^-10 s, near zero, s its channel's max|w| / 448, which maps the
    row's largest weight to +-448); so |x . w - x . q s| <= sum|x| (|w| 2^-4 + s 2^-10)."""
    linear = float_linear()
    quantized = quantized_copy(linear, "fp8")
    scale = linear.weight.abs().amax(dim=1) / FP8_MAX
    weight_bound = linear.weight.abs() * 2**-4 + scale[:, None] * 2**-10
    weight_error = (dequantize_weight(quantized.weight, quantized.weight_scale) - linear.weight)
    assert (weight_error.abs() <= weight_bound + 1e-9).all()
    assert quantized.weight.float().abs().amax(dim=1)[:5].eq(FP8_MAX).all()
    x = torch.randn(7, 96)
    with torch.no_grad():
        error = (quantized(x) - linear(x)).abs()
    assert quantized.weight.dtype == FP8_DTYPE
    assert (error <= x.abs() @ weight_bound.t().detach() + 1e-5).all()


def test_int8pack_mm_in_bf16_equals_the_dequantized_weight():
    """On a CPU in bf16 the int8 GEMM is torch._weight_int8pack_mm: the weight it multiplies is
    q s, as the dequantized path's, up to bf16's rounding of the result."""
    linear = float_linear(bias=False)
    quantized = quantized_copy(linear, "int8").to(torch.bfloat16)
    quantized.weight_scale.data = quantized.weight_scale.float()  # kept fp32 as loaded
    x = torch.randn(5, 96).to(torch.bfloat16)
    expected = x.float() @ dequantize_weight(quantized.weight, quantized.weight_scale).t()
    with torch.no_grad():
        torch.testing.assert_close(quantized(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_fp8_on_an_fp8_gpu_quantizes_activations_per_token_for_scaled_mm(fake_cuda):
    """At compute capability 8.9 and up (the runtime's answer), a bf16 projection runs
    _scaled_mm on x quantized per token: each row's own scale, so a row 1000 times larger
    than another keeps its relative precision; on an older GPU the dequantized path runs."""
    linear = float_linear().to(torch.bfloat16)
    quantized = quantized_copy(linear, "fp8")
    x = torch.randn(4, 96)
    x[1] *= 1e4  # per tensor, the other rows would fall among fp8's subnormals
    x = x.to(torch.bfloat16)
    x_q, _ = quantize_per_token(x)
    assert x_q.float().abs().amax(dim=1).eq(FP8_MAX).all()  # each row's max -> 448
    with torch.no_grad():
        expected = x.float() @ linear.weight.float().t() + linear.bias.float()
        got = quantized(x).float()
    assert fake_cuda.calls_to("scaled_mm") == [((4, 96), (96, 96))]
    relative = (got - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)
    assert (relative < 0.1).all()  # weights and activations each within 2^-4
    fake_cuda.CAPABILITY = (8, 0)  # an A100: no FP8 tensor cores
    with torch.no_grad():
        quantized(x)
    assert len(fake_cuda.calls_to("scaled_mm")) == 1


def test_a_lora_adapter_adds_the_same_term_over_a_quantized_base():
    """The LoRA term is added in the model's dtype whatever the base weight's: over an int8
    base, y - base(x) is the float model's term, exactly."""
    linear = float_linear()
    quantized = quantized_copy(linear, "int8")
    slots = LoRAMapping(token_slots=torch.tensor([0, -1, 0]))
    torch.manual_seed(1)
    a, b = torch.randn(4, 96), torch.randn(32, 4)
    for layer in (linear, quantized):
        layer.create_lora_weights(max_loras=1, max_rank=8, mapping=slots)
        layer.set_lora(0, 0, a, b)
    x = torch.randn(3, 96)
    with torch.no_grad():
        float_term = linear(x) - linear.base(x)
        quantized_term = quantized(x) - quantized.base(x)
    assert quantized.lora_a[0].dtype == torch.float32
    torch.testing.assert_close(quantized_term, float_term, rtol=1e-5, atol=1e-5)


def test_only_the_layers_projections_are_quantized():
    """Every projection of every layer is 8-bit; the embedding and the LM head (tied) keep the
    model's dtype."""
    model = tiny(quantization="fp8").engine.model
    linears = {m for m, _ in projections(model).values()}
    assert len(linears) == 4 * model.config.n_layer
    assert all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32


# ----------------------------------------------------------------------------- whole models

SHIPPED_TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east."
# max |logit - float logit| over the text's positions: measured 0.12 (int8) and 0.42 (fp8) on
# the shipped model (logits up to 13.6); 0.40 and 1.43 on llama3-tied's random weights (up to
# 6.8, and far more sensitive). The tolerances are about twice that.
LOGIT_TOLERANCE = {("shipped", "int8"): 0.25, ("shipped", "fp8"): 0.85,
                   ("llama3-tied", "int8"): 0.8, ("llama3-tied", "fp8"): 2.9}


def logits_of(model_name: str, tmp_path, quantization=None) -> torch.Tensor:
    if model_name == "shipped":
        llm = LLM(device="cpu", dtype="float32", kv_cache_tokens=1024,
                  quantization=quantization)
        ids = llm.engine.tokenizer.encode(SHIPPED_TEXT)
    else:
        llm = fixture_llm(model_name, tmp_path / str(quantization), quantization=quantization)
        ids = [7 * i % 257 for i in range(40)]
    with torch.no_grad():
        return llm.engine.model.forward_dense(torch.tensor([ids]))[0]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("model_name", ["shipped", "llama3-tied"])
def test_quantized_logits_are_within_the_measured_tolerance(model_name, quantization, tmp_path):
    if model_name == "shipped" and not os.path.exists(checkpoint.DEFAULT_MODEL):
        pytest.skip("no shipped model")
    expected = logits_of(model_name, tmp_path)
    got = logits_of(model_name, tmp_path, quantization)
    error = (got - expected).abs().max().item()
    assert 0 < error < LOGIT_TOLERANCE[model_name, quantization]


SCHEMES = [pytest.param(dict(quantization="int8"), id="int8"),
           pytest.param(dict(quantization="fp8"), id="fp8"),
           pytest.param(dict(kv_cache_dtype="fp8"), id="fp8-kv"),
           pytest.param(dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"), id="fp8-both")]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_alone_equals_batched_and_chunked_with_each_scheme(scheme):
    """Batch composition and chunked prefill change no token of a quantized model: each
    token's row is computed alone in every GEMM, whatever its neighbours."""
    prompts = PROMPTS[1:4]  # 11, 138 and 37 bytes
    single = tiny(**scheme)
    alone = [token_ids(single.generate([p], GREEDY))[0] for p in prompts]
    llm = tiny(max_num_batched_tokens=32, block_size=8, **scheme)
    assert token_ids(llm.generate(prompts, GREEDY)) == alone
    assert_no_leaks(llm.engine)


def test_fp8_kv_cache_swaps_and_prefix_caches_as_any_cache():
    """Sequences swapped out of a small FP8 cache and back, and a prompt that then finds its
    prefix cached, give the tokens they give alone; nothing leaks."""
    scheme = dict(kv_cache_dtype="fp8")
    prompts = [PROMPTS[4], PROMPTS[3], PROMPTS[5], PROMPTS[4] + " again"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    single = tiny(**scheme)
    alone = [token_ids(single.generate([p], params))[0] for p in prompts]
    llm = tiny(kv_cache_tokens=160, block_size=8, preemption_mode="swap", swap_space=0.01,
               **scheme)
    engine = llm.engine
    engine.step_records = []
    for i, p in enumerate(prompts[:3]):
        engine.add_request(p, params, request_id=str(i))
    deltas = run_to_end(engine)
    got = [sum((d.outputs[0].token_ids for d in deltas[str(i)]), []) for i in range(3)]
    assert got == alone[:3]
    assert any(record.swapped_out for record in engine.step_records)
    assert token_ids(llm.generate([prompts[3]], params)) == alone[3:]
    assert engine.stats.num_cached_tokens > 0  # blocks of the shared 60 bytes, found cached
    assert engine.model_runner.k_caches.dtype == FP8_DTYPE
    assert_no_leaks(engine)


def test_fp8_kv_cache_holds_twice_the_tokens_of_a_16_bit_one(fake_cuda):
    """A byte a value: the cache's bytes a token are half a 16-bit cache's (a quarter of
    fp32's), so the memory the profile leaves holds that many times the tokens."""
    engines = {kv: tiny(preset="llama-tiny", kv_cache_tokens=None, gpu_memory_utilization=0.5,
                        enforce_eager=True, kv_cache_dtype=kv).engine for kv in ("auto", "fp8")}
    auto, fp8 = engines["auto"].model_runner, engines["fp8"].model_runner
    assert auto.kv_bytes_per_token == 4 * fp8.kv_bytes_per_token
    assert auto.kv_bytes_per_token == 2 * kv_bytes_per_token(4, 2, 32, torch.bfloat16)
    block_size = auto.config.block_size
    assert abs(engines["fp8"].kv_cache_tokens - 4 * engines["auto"].kv_cache_tokens) \
        < 4 * block_size
    assert abs(fp8.k_caches.nbytes - auto.k_caches.nbytes) < 4 * block_size * 2 * 32 * 4 * 4


# ----------------------------------------------------------------------------- compressed-tensors

def test_compressed_tensors_fp8_checkpoint_serves_as_online_fp8(tmp_path):
    """The fixture (llama3-tied as llm-compressor writes FP8_DYNAMIC) loads its F8_E4M3 weights
    as stored, without quantizing again, and computes what quantization="fp8" of the float
    checkpoint computes, bit for bit."""
    stored = fixture_llm("llama3-tied-fp8", tmp_path / "stored")
    online = fixture_llm("llama3-tied", tmp_path / "online", quantization="fp8")
    ids = torch.tensor([[7 * i % 257 for i in range(40)]])
    with torch.no_grad():
        assert torch.equal(stored.engine.model.forward_dense(ids),
                           online.engine.model.forward_dense(ids))
    assert token_ids(stored.generate(["abc"], GREEDY)) == token_ids(
        online.generate(["abc"], GREEDY))


def test_per_tensor_scales_load_as_each_parts_scale(tmp_path):
    """A per-tensor weight_scale serves every row of its projection: q, k and v, merged,
    keep their own."""
    path = tmp_path / "per-tensor"
    checkpoint.save_compressed_tensors_fp8(os.path.join(MODEL_FIXTURES, "llama3-tied"),
                                           str(path), strategy="tensor")
    write_byte_tokenizer(path)
    model = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_tokens=256).engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    q, k, v = qkv.weight_scale.split(list(qkv.parts.values()))
    assert all(part.unique().numel() == 1 for part in (q, k, v))
    assert len({q[0].item(), k[0].item(), v[0].item()}) == 3


def test_a_checkpoints_kv_cache_scales_are_those_an_fp8_cache_stores_with(tmp_path):
    """compressed-tensors' kv_cache_scheme: each layer's k_scale and v_scale, as stored, divide
    what the FP8 cache stores: the same tokens and log-probabilities as the same scales set by
    hand, and values clipped that scale 1.0 keeps."""
    path = tmp_path / "kv-scales"
    scales = [(2 ** -9, 2 ** -10), (2 ** -8, 3 * 2 ** -10)]  # fp32-exact; |K| > 448 * scale clips
    checkpoint.save_compressed_tensors_fp8(os.path.join(MODEL_FIXTURES, "llama3-tied"),
                                           str(path), kv_cache_scales=scales)
    write_byte_tokenizer(path)
    stored = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_tokens=256,
                 kv_cache_dtype="fp8")
    layers = stored.engine.model.model.layers
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in layers] == scales
    by_hand = fixture_llm("llama3-tied-fp8", tmp_path / "by-hand", kv_cache_dtype="fp8")
    unscaled = fixture_llm("llama3-tied-fp8", tmp_path / "unscaled", kv_cache_dtype="fp8")
    for layer, (k_scale, v_scale) in zip(by_hand.engine.model.model.layers, scales):
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
    got = stored.generate(["abc"], GREEDY)
    expected = by_hand.generate(["abc"], GREEDY)
    assert token_ids(got) == token_ids(expected)
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs
    unscaled.generate(["abc"], GREEDY)
    assert stored.engine.num_kv_clipped > 0 == unscaled.engine.num_kv_clipped


@pytest.mark.parametrize("scale, message", [
    (None, "missing tensor model.layers.1.self_attn.v_scale"),
    (-1.0, "v_scale must be one positive finite scale"),
    (math.nan, "v_scale must be one positive finite scale")])
def test_a_kv_cache_scale_missing_or_not_positive_is_refused_naming_it(tmp_path, scale, message):
    path = tmp_path / "kv-scales"
    checkpoint.save_compressed_tensors_fp8(os.path.join(MODEL_FIXTURES, "llama3-tied"),
                                           str(path), kv_cache_scales=[(1.0, 1.0), (1.0, 1.0)])
    tensors = checkpoint.read_safetensors(str(path / "model.safetensors"))
    tensors = {key: t.clone() for key, t in tensors.items()}
    del tensors["model.layers.1.self_attn.v_scale"]
    if scale is not None:
        tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(scale)
    checkpoint.write_safetensors(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(path))


def fp8_config(**changes) -> dict:
    """The fixture's quantization_config, with changes (a key set to None is removed)."""
    with open(os.path.join(MODEL_FIXTURES, "llama3-tied-fp8", "config.json")) as f:
        config = json.load(f)["quantization_config"]
    return {key: value for key, value in (config | changes).items() if value is not None}


def group(weights: dict | None = None, inputs: dict | None = None) -> dict:
    base = fp8_config()["config_groups"]["group_0"]
    return dict(group_0=base | dict(weights=base["weights"] | (weights or {}),
                                    input_activations=base["input_activations"] | (inputs or {})))


REFUSED = [
    pytest.param(dict(quant_method="gptq", bits=4, group_size=128), "'gptq' (GPTQ)", id="gptq"),
    pytest.param(dict(quant_method="awq", bits=4), "'awq' (AWQ)", id="awq"),
    pytest.param(dict(quant_method="bitsandbytes", load_in_4bit=True), "bitsandbytes",
                 id="bitsandbytes"),
    pytest.param(dict(quant_method="fp8", weight_block_size=[128, 128],
                      activation_scheme="dynamic"), "block-wise FP8", id="fp8-block"),
    pytest.param(dict(quant_method="fp8", activation_scheme="static"), "'fp8'", id="fp8-vllm"),
    pytest.param(fp8_config(config_groups=group(dict(strategy="block",
                                                     block_structure=[128, 128]))),
                 "block-wise FP8", id="compressed-tensors-block"),
    pytest.param(fp8_config(config_groups=group(inputs=dict(dynamic=False, strategy="tensor"))),
                 "input_activations", id="static-activations"),
    pytest.param(fp8_config(format="pack-quantized"), "format 'pack-quantized'", id="int4"),
    pytest.param(fp8_config(kv_cache_scheme=dict(num_bits=8, type="float", strategy="head",
                                                 dynamic=False)),
                 "kv_cache_scheme strategy 'head'", id="kv-cache-per-head"),
    pytest.param(fp8_config(kv_cache_scheme=dict(num_bits=8, type="float", strategy="tensor",
                                                 dynamic=True)),
                 "kv_cache_scheme dynamic True", id="kv-cache-dynamic"),
]


@pytest.mark.parametrize("quantization_config, message", REFUSED)
def test_other_quantization_configs_are_refused_by_name(quantization_config, message,
                                                        tmp_path):
    """Never served as full precision: each other method, and compressed-tensors schemes other
    than FP8 per channel or tensor with dynamic per-token activations, stop the load."""
    path = tmp_path / "model"
    shutil.copytree(os.path.join(MODEL_FIXTURES, "llama3-tied"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config") as error:
        checkpoint.load_checkpoint(str(path))
    assert message in str(error.value)


def test_int8_over_an_fp8_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compressed-tensors FP8 weights: quantization 'int8'"):
        checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, "llama3-tied-fp8"),
                                   quantization="int8")


@pytest.mark.parametrize("field, value", [("quantization", "int4"), ("quantization", 8),
                                          ("quantization", True), ("kv_cache_dtype", "fp16"),
                                          ("kv_cache_dtype", None)])
def test_quantization_options_are_refused_naming_the_choices(field, value):
    with pytest.raises(ValueError, match=f"unknown {field} {value!r}; choose one of"):
        EngineConfig(preset="tiny", device="cpu", **{field: value})


# ----------------------------------------------------------------------------- FP8 KV cache

def test_store_kv_writes_k_over_its_scale_clipped_to_448_and_counts_the_clipped():
    k = torch.tensor([[[1.0, -3.0, 1000.0, -1000.0]]])  # (N=1, Hkv=1, D=4)
    k_cache = torch.zeros(2, 2, 1, 4, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    num_clipped = torch.tensor(5)
    store_kv(k, k, k_cache, v_cache, torch.tensor([3]), 0.5, 4.0, num_clipped)
    assert num_clipped == 5 + 2  # +-1000 / 0.5 past 448; / 4.0 within
    assert k_cache[1, 1, 0].float().tolist() == [2.0, -6.0, 448.0, -448.0]
    assert v_cache[1, 1, 0].float().tolist() == [0.25, -0.75, 256.0, -256.0]  # 250: E4M3 rounds
    assert k_cache[0].float().abs().sum() == 0  # no other slot written


FP8_BATCH = [(37, 1), (1, 1), (20, 20), (26, 9)]  # decodes first, beside prefill chunks


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_fp8_kv_kernels_match_the_reference(block_size, num_heads, num_kv_heads):
    """The Triton kernels (prefill and split decode, interpreted) and the CPU path read an FP8
    cache as the reference does: K * k_scale, V * v_scale, in q's dtype; and the reference over
    it equals the reference over its values dequantized into a float cache."""
    q, k_cache, v_cache, meta = make_batch(FP8_BATCH, block_size, 32, device="cpu",
                                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                                           num_decodes=2, width=cdiv(64, block_size))
    k8, v8 = quantize_kv(k_cache, 0.25), quantize_kv(v_cache, 2.0)
    scales = dict(k_scale=0.25, v_scale=2.0)
    expected = paged_attention_ref(q, dequantize_kv(k8, 0.25, q.dtype),
                                   dequantize_kv(v8, 2.0, q.dtype), meta, 0.2)
    torch.testing.assert_close(paged_attention_ref(q, k8, v8, meta, 0.2, **scales), expected)
    for attention in (paged_attention, paged_attention_cpu):
        meta.step_plan = None
        torch.testing.assert_close(attention(q, k8, v8, meta, 0.2, **scales), expected,
                                   atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- reported bytes

@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_projections_take_at_most_055_of_their_bf16_bytes(quantization):
    """8 bits a weight and 4 bytes a channel's scale: the layers' projections at most 0.55x
    the bytes they take in bf16 (the issue's goal), the model's other weights unchanged."""
    model = tiny(quantization=quantization).engine.model
    linears = {m for m, _ in projections(model).values()}
    quantized_bytes = sum(m.weight.nbytes + m.weight_scale.nbytes for m in linears)
    bf16_bytes = sum(m.weight.numel() * 2 for m in linears)
    assert quantized_bytes <= 0.55 * bf16_bytes


def test_metrics_and_the_start_up_line_report_weight_and_kv_cache_bytes(capsys):
    """/metrics' model_weights_bytes and kv_cache_bytes gauges, and the server's serving line,
    say what quantization saved."""
    plain = tiny().engine
    engine = tiny(quantization="int8", kv_cache_dtype="fp8").engine
    with server_in_process(engine) as url:
        metrics = http(url, "/metrics")[1]
    assert f"nanoserve:model_weights_bytes {engine.model_weights_bytes}\n" in metrics
    assert f"nanoserve:kv_cache_bytes {engine.kv_cache_bytes}\n" in metrics
    assert "nanoserve:kv_cache_clipped_total 0\n" in metrics
    assert engine.kv_cache_bytes * 4 == plain.kv_cache_bytes  # fp32's 4 bytes -> 1
    assert engine.model_weights_bytes < plain.model_weights_bytes
    serving = capsys.readouterr().err
    assert f"(weights {engine.model_weights_bytes / 2**20:.1f} MiB (int8), KV cache " \
           f"{engine.kv_cache_bytes / 2**20:.1f} MiB (float8_e4m3fn, 4096 tokens)) on " in serving


def test_the_command_line_refuses_an_unknown_quantization(capsys):
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--quantization", "int4", "hi")
    assert status == 2
    assert "--quantization: invalid choice: 'int4' (choose from 'int8', 'fp8')" in err

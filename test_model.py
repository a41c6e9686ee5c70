"""model.py's guarantees: each served architecture (GPT-2, Llama, Qwen2, Qwen3, Mistral) gives
transformers' logits.
"""
import dataclasses
import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import cli
import model as M
from conftest import (DEVICE, GREEDY, MODEL_FIXTURES, PROMPTS, OpLog, assert_no_leaks,
                      assert_paged_equals_dense_at_every_position, fixture_llm, tiny, token_ids)
from nanoserve import LLM
from sampling import SamplingParams


# ----------------------------------------------------------------------------- architectures

ARCHITECTURES = ["llama3-tied", "llama-untied", "qwen2", "qwen3", "mistral"]


PARITY_TOL = 1e-4  # max |logit - transformers' logit|, our fp32 against its fp64 (measured: 1.7e-5)


def reference_logits(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's input ids (2, 40) and transformers' logits for them (2, 40, vocab)."""
    reference = os.path.join(MODEL_FIXTURES, name, "reference.safetensors")
    tensors = checkpoint.read_safetensors(reference)
    return tensors["input_ids"], tensors["logits"]


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_logits_equal_transformers(name):
    model = checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, name))
    input_ids, want = reference_logits(name)
    assert (model.forward_dense(input_ids) - want).abs().max() < PARITY_TOL


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_greedy_tokens_equal_transformers_where_decided(name):
    """Wherever transformers' top two logits are further apart than twice the tolerance (tiny
    random weights give near-ties elsewhere), the greedy token is its token."""
    model = checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, name))
    input_ids, want = reference_logits(name)
    top_two = want.topk(2, dim=-1).values
    decided = top_two[..., 0] - top_two[..., 1] > 2 * PARITY_TOL
    assert decided.sum() >= 75  # of 80 positions: the comparison says something
    got = model.forward_dense(input_ids).argmax(-1)
    assert torch.equal(got[decided], want.argmax(-1)[decided])


@pytest.mark.parametrize("name", ARCHITECTURES)
@torch.inference_mode()
def test_architecture_paged_logits_equal_dense_at_every_position(name, tmp_path):
    """The engine's paged forward (rotations from the flat batch's positions, K/V of grouped
    heads through the cache) gives the dense forward's logits at every position."""
    engine = fixture_llm(name, tmp_path, block_size=8).engine
    tokens = reference_logits(name)[0][0, :30]
    assert_paged_equals_dense_at_every_position(engine, tokens)


def test_the_lm_head_gives_fp32_logits_without_converting_its_weight_each_step():
    """In bf16 the logits are still fp32, bit for bit those of the weight and hidden states
    upcast; after the first step no step converts the weight (the CPU keeps one fp32 copy;
    CUDA multiplies bf16 into fp32)."""
    model = M.GPT(M.PRESETS["llama-tiny"]).to(torch.bfloat16)
    hidden = torch.randn(4, model.config.n_embd).to(torch.bfloat16)
    weight = model.lm_head.weight
    want = torch.nn.functional.linear(hidden.float(), weight.float())
    assert torch.equal(model.compute_logits(hidden), want)
    with OpLog() as log:
        again = model.compute_logits(hidden)
    assert torch.equal(again, want)
    assert not [op for op in log.ops if op[0].startswith("_to_copy") and op[2] == weight.numel()]


def test_rmsnorm_takes_its_mean_square_in_fp32_under_bf16():
    """RMSNorm in bf16 squares and averages in fp32, as transformers' Llama does: a bf16
    mean square over 512 values rounds the sum at every step (an error that reached 0.35 in
    a checkpoint's logits, against 0.04). The output is the fp32 statistics' bit for bit, and
    bf16 statistics would differ (the test checks the difference is there to be made)."""
    norm = M.RMSNorm(512, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 512))
    x = (torch.randn(8, 512, generator=torch.Generator().manual_seed(0)) * 30).to(torch.bfloat16)
    x32 = x.float()
    fp32_stats = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    bf16_stats = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = norm(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, norm.weight * fp32_stats)
    assert not torch.equal(got, norm.weight * bf16_stats)


def unmerged_hidden_states(model: M.GPT, idx: torch.Tensor) -> torch.Tensor:
    """model's dense hidden states for idx (B, T) as its layers computed them before q, k, v
    and gate, up were stacked and the residual adds fused: each projection its own GEMM (the
    state dict's tensors), x + attention then x + MLP, RoPE on q and on k."""
    c = model.config
    state = model.state_dict()

    def linear(x, name):
        return F.linear(x, state[name + ".weight"], state.get(name + ".bias"))
    x, (cos, sin) = model.embed(idx, torch.arange(idx.shape[1]).expand(idx.shape))
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        h = block.input_layernorm(x)
        q, k, v = (linear(h, p + f"self_attn.{name}_proj").unflatten(-1, (heads, c.head_dim))
                   for name, heads in zip("qkv", (c.n_head, c.n_kv_head, c.n_kv_head)))
        if c.qk_norm:
            q, k = block.self_attn.q_norm(q), block.self_attn.k_norm(k)
        q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=c.n_kv_head != c.n_head)
        x = x + linear(y.transpose(1, 2).flatten(2), p + "self_attn.o_proj")
        h = block.post_attention_layernorm(x)
        gated = F.silu(linear(h, p + "mlp.gate_proj")) * linear(h, p + "mlp.up_proj")
        x = x + linear(gated, p + "mlp.down_proj")
    return model.model.norm(x)


@pytest.mark.parametrize("name, dtype", [("llama-tiny", torch.float32),
                                         ("qwen2", torch.float32), ("qwen3", torch.bfloat16)])
@torch.inference_mode()
def test_a_cpu_computes_the_unmerged_unfused_layers_bits(name, dtype):
    """On a CPU the stacked GEMMs, the residual adds done by the next norm and RoPE on q's
    and k's heads at once give bit for bit what the layers computed before (llama-tiny;
    Qwen2's q, k, v biases; Qwen3's q/k norms, in bf16)."""
    if name in M.PRESETS:
        model = checkpoint.load_model(preset=name, dtype=dtype).model
    else:
        model = checkpoint.load_checkpoint(os.path.join(MODEL_FIXTURES, name), dtype)
    idx = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.dense_hidden_states(idx), unmerged_hidden_states(model, idx))


def test_the_state_dict_keeps_hugging_faces_names_and_order_and_loads_back():
    """The model holds q, k, v as one qkv_proj and gate, up as one gate_up_proj (biases
    too), yet its state dict is Hugging Face's: q_proj, k_proj, v_proj, gate_proj, up_proj,
    each weight beside its bias, in a checkpoint's order; and loading such a state dict stacks
    them back."""
    config = dataclasses.replace(M.PRESETS["llama-tiny"], n_layer=1, qkv_bias=True, o_bias=True,
                                 mlp_bias=True)
    model = M.GPT(config)
    assert [name for name, _ in model.named_parameters() if "proj" in name] == [
        f"model.layers.0.{name}" for name in (
            "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
            "self_attn.o_proj.bias", "mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias",
            "mlp.down_proj.weight", "mlp.down_proj.bias")]
    layer = [f"model.layers.0.{module}.{param}"
             for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
             for param in ("weight", "bias")]
    state = model.state_dict()
    assert [name for name in state if "proj" in name] == layer
    assert state["model.layers.0.self_attn.k_proj.bias"].shape == (2 * 32,)
    assert state["model.layers.0.mlp.up_proj.weight"].shape == (688, 256)
    loaded = M.GPT(config)
    loaded.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), model.parameters()))


def test_a_cpu_runs_the_fused_functions_as_written_never_compiled(monkeypatch):
    """torch.compile is CUDA's: on a CPU (no C++ toolchain needed, nothing to wait for) the
    norms, RoPE and SwiGLU run as the eager functions they are."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile on a CPU")
    monkeypatch.setattr(torch, "compile", refuse)
    model = M.GPT(M.PRESETS["llama-tiny"])
    with torch.no_grad():
        model.forward_dense(torch.tensor([[1, 2, 3]]))


FUSED_INPUTS = {  # each function fused_on_cuda compiles, and arguments shaped as a layer's
    "rms_norm": lambda: (torch.randn(5, 64), torch.rand(64), 1e-6),
    "rms_norm_residual": lambda: (torch.randn(5, 64), torch.randn(5, 64), torch.rand(64), 1e-6),
    "apply_rope": lambda: (torch.randn(5, 12, 16)[:, :10], torch.rand(5, 1, 16),
                           torch.rand(5, 1, 16)),
    "silu_and_mul": lambda: (torch.randn(5, 2 * 48),)}


@pytest.mark.parametrize("name", list(FUSED_INPUTS))
def test_each_function_compiled_on_cuda_traces_as_one_graph(name):
    """On CUDA each is one kernel only if torch.compile takes it whole: a graph break (a
    .item(), a print, a branch on a value) would split it, silently. Traced here as CUDA's
    compile traces it, by Dynamo alone (no compiler), giving the function's own result."""
    fn = getattr(M, name).__wrapped__
    args = FUSED_INPUTS[name]()
    traced = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    got, want = traced(*args), fn(*args)
    if not isinstance(want, tuple):
        got, want = (got,), (want,)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_fused_function_on_cuda_is_compiled_on_its_first_call_alone(fake_cuda):
    """fused_on_cuda on a CUDA tensor (fake_cuda's: compiled means the function itself): the
    first call compiles, the next reuse it, and the result is the function's."""
    fn = M.rms_norm.__wrapped__
    fused = M.fused_on_cuda(fn)
    args = FUSED_INPUTS["rms_norm"]()
    assert torch.equal(fused(*args), fn(*args))
    fused(*args)
    assert fake_cuda.calls_to("compile_fused") == [("rms_norm",)]


def test_the_lm_heads_fp32_copy_follows_its_weight():
    """The CPU's fp32 copy of the head is made again when the weight changes: written in
    place, or given new data (the model cast to fp16): the logits are always the current
    weight's."""
    model = M.GPT(M.PRESETS["llama-tiny"]).to(torch.bfloat16)
    hidden = torch.randn(4, model.config.n_embd).to(torch.bfloat16)
    model.compute_logits(hidden)  # the copy made
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    want = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    assert torch.equal(model.compute_logits(hidden), want)
    model.to(torch.float16)
    hidden = hidden.to(torch.float16)
    want = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    assert torch.equal(model.compute_logits(hidden), want)


def test_grouped_query_kv_cache_holds_n_kv_head_heads():
    """llama-tiny: 8 query heads share 2 K/V heads, so a token's K/V take a quarter of what
    they would with a K/V head per query head, and 1 GiB holds 4 times the tokens."""
    engine = tiny(preset="llama-tiny").engine
    c = engine.model.config
    assert (c.n_head, c.n_kv_head) == (8, 2)
    assert engine.model_runner.k_caches.shape[-2:] == (2, 32)
    assert engine.model_runner.kv_bytes_per_token == 2 * c.n_layer * 2 * 32 * 4
    full = dataclasses.replace(c, n_kv_head=c.n_head)
    assert M.GPT(full).config.n_kv_head == 8
    assert cli.kv_cache_description(engine) == "524288 a GiB (2 K/V heads for 8)"


def llama_tiny(**kwargs) -> LLM:
    return tiny(preset="llama-tiny", **kwargs)


@pytest.fixture(scope="module")
def llama_alone() -> list[list[int]]:
    """llama-tiny's greedy outputs of each prompt on its own."""
    return [token_ids(llama_tiny().generate([p], GREEDY))[0] for p in PROMPTS]


GQA_SERVING = {  # engine settings, each exercising one way a step's batch can differ
    "batching": dict(max_num_seqs=4, enable_chunked_prefill=False, max_num_batched_tokens=256),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(kv_cache_tokens=192, max_num_batched_tokens=64)}


@pytest.mark.parametrize("how", list(GQA_SERVING))
def test_grouped_query_greedy_output_is_unchanged_by(llama_alone, how):
    llm = llama_tiny(**GQA_SERVING[how])
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == llama_alone
    if how == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_grouped_query_greedy_output_is_unchanged_by_prefix_caching(llama_alone):
    llm = llama_tiny()
    llm.generate(PROMPTS, GREEDY)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == llama_alone
    assert llm.engine.stats.num_cached_tokens > 100
    assert_no_leaks(llm.engine)


def test_grouped_query_greedy_output_is_the_same_with_triton_attention(llama_alone):
    llm = llama_tiny(attention="triton", max_num_batched_tokens=24, block_size=8, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:3], params)) == [a[:8] for a in llama_alone[:3]]
    assert_no_leaks(llm.engine)


def write_fixture_config(path, name: str, **changes) -> None:
    """A fixture model's config.json, with `changes` (None: the key removed), at path."""
    with open(os.path.join(MODEL_FIXTURES, name, "config.json")) as f:
        hf = json.load(f)
    for key, value in changes.items():
        hf.pop(key, None)
        if value is not None:
            hf[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


@pytest.mark.parametrize("name, changes, message", [
    ("mistral", dict(num_local_experts=8), "key 'num_local_experts' is not served"),
    ("llama3-tied", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling type 'yarn' is not served"),
    ("llama3-tied", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "lacks 'high_freq_factor'"),
    ("mistral", dict(sliding_window=64), "sliding_window 64 is shorter than the context 256"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64), "sliding_window 64"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    ("llama-untied", dict(hidden_act="gelu"), "hidden_act 'gelu' is not served"),
    ("qwen2", dict(architectures=["Qwen2ForSequenceClassification"]), "architectures"),
    ("qwen2", dict(model_type="gemma"), "model_type 'gemma' is not served"),
], ids=["moe", "yarn", "llama3-incomplete", "mistral-window", "qwen-window", "layer-types",
        "activation", "head", "model-type"])
def test_config_that_changes_the_computation_is_refused_by_name(tmp_path, name, changes, message):
    write_fixture_config(tmp_path, name, **changes)
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size="64"), "config.json hidden_size must be a positive integer, got '64'"),
    (dict(num_hidden_layers=True),
     "config.json num_hidden_layers must be a positive integer, got True"),
    (dict(num_key_value_heads=3), "n_head 4 is not a multiple of n_kv_head 3"),
    (dict(head_dim=33), "head_dim 33 is odd"),
    (dict(hidden_size=None), "config.json lacks 'hidden_size'"),
    (dict(rope_theta=float("nan")), "config.json rope_theta must be a positive finite number"),
    (dict(rms_norm_eps=-1), "config.json rms_norm_eps must be a positive finite number"),
    (dict(tie_word_embeddings="false"), "config.json tie_word_embeddings must be true or false"),
    (dict(rope_scaling="llama3"), "config.json rope_scaling must be an object"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0,
                            high_freq_factor=4.0, original_max_position_embeddings=64)),
     "low_freq_factor must be below its high_freq_factor"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=64)),
     "rope_scaling factor must be a positive finite number, got 0"),
    (dict(rope_scaling=dict(rope_type="default"),
          rope_parameters=dict(rope_type="llama3", factor=8.0)),
     "rope_scaling and rope_parameters differ"),
], ids=["string-size", "bool-size", "heads-not-grouped", "odd-head-dim", "missing-size",
        "nan-theta", "negative-eps", "string-bool", "string-scaling", "equal-freq-factors",
        "zero-factor", "two-rope-keys"])
def test_malformed_config_is_a_clear_error(tmp_path, changes, message):
    write_fixture_config(tmp_path, "qwen3", **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint.load_checkpoint(str(tmp_path))


def test_a_null_value_reads_as_its_keys_default(tmp_path):
    """As transformers reads one: "rms_norm_eps": null is the default epsilon, not None (which
    loaded, then failed every request)."""
    with open(os.path.join(MODEL_FIXTURES, "qwen3", "config.json")) as f:
        hf = json.load(f)
    hf |= dict(rms_norm_eps=None, attention_bias=None, rope_theta=None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shutil.copy(os.path.join(MODEL_FIXTURES, "qwen3", "model.safetensors"), tmp_path)
    config = checkpoint.load_checkpoint(str(tmp_path)).config
    assert (config.norm_eps, config.o_bias, config.rope_theta) == (1e-6, False, 10000.0)


@pytest.mark.parametrize("changes, message", [
    (dict(num_hidden_layers=20000), "config.json has 20000 layers; the weights hold 2"),
    (dict(head_dim=2 * 10**9), "config.json's heads make queries 8000000000 wide"),
], ids=["layers", "head-dim"])
def test_sizes_unlike_the_weights_fail_before_the_model_is_built(tmp_path, changes, message):
    """Checked against the weights first: built, 20,000 layers take 20 s, and a head_dim of
    2e9 allocates 8 GB of RoPE table."""
    write_fixture_config(tmp_path, "qwen3", **changes)
    shutil.copy(os.path.join(MODEL_FIXTURES, "qwen3", "model.safetensors"), tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint.load_checkpoint(str(tmp_path))


def test_sliding_window_that_does_not_apply_is_accepted(tmp_path):
    """Qwen's published configs set a sliding_window with use_sliding_window false: full
    attention, served; Mistral's window as long as the context is full attention too."""
    for name, changes in (("qwen2", dict(sliding_window=64)), ("mistral", dict(sliding_window=256))):
        write_fixture_config(tmp_path, name, **changes)
        with open(tmp_path / "config.json") as f:
            checkpoint.config_from_hf(json.load(f), str(tmp_path))


def test_transformers5_config_form_gives_the_same_config():
    """transformers 5 writes rope_parameters (rope_theta inside it) where published configs
    write rope_theta and rope_scaling: both read the same."""
    with open(os.path.join(MODEL_FIXTURES, "llama3-tied", "config.json")) as f:
        published = json.load(f)
    newer = dict(published, rope_parameters=dict(published["rope_scaling"],
                                                 rope_theta=published["rope_theta"]))
    del newer["rope_scaling"], newer["rope_theta"]
    assert checkpoint.config_from_hf(newer, "x") == checkpoint.config_from_hf(published, "x")
    assert checkpoint.config_from_hf(published, "x").rope_scaling["factor"] == 8.0


# ----------------------------------------------------------------------------- bf16

# llama31-bf16: Llama 3.1's RoPE (theta 5e5, llama3 scaling by 8 over an original 2,048
# positions) and transformers' logits in bf16 at every 64th position of one 2,048-token prompt
# and at its last. Max |logit change| there: bf16's op order alone moves a logit by up to 0.23
# (transformers' eager attention against its sdpa, the reference), nanoserve's differs from the
# reference by 0.016 (the reference's own rounding to bf16); RoPE's inv_freq rounded to bf16
# (the bug this guards against) moves one by 4.1, and by over 0.5 at every position from 320 on.
BF16_FIXTURE = os.path.join(MODEL_FIXTURES, "llama31-bf16")
BF16_TOL = 0.5  # max |logit or log-probability - transformers' in bf16|


def bf16_reference() -> dict[str, torch.Tensor]:
    """input_ids (1, 2048); positions (33,); transformers' bf16 logits there (33, vocab), as
    fp32; top1 (33,), their argmax."""
    return checkpoint.read_safetensors(os.path.join(BF16_FIXTURE, "reference.safetensors"))


def over_tolerance(positions: torch.Tensor, errors) -> dict[int, float]:
    """The positions whose error (a tensor or list, one per position) is BF16_TOL or more."""
    return {p: round(float(e), 3) for p, e in zip(positions.tolist(), errors) if e >= BF16_TOL}


@torch.inference_mode()
def test_bf16_logits_equal_transformers_bf16_at_positions_up_to_2047():
    """A model cast to bf16 keeps RoPE's frequencies and angles in fp32, as transformers does,
    so its logits are transformers' bf16 logits at every recorded position up to 2,047 (with
    inv_freq rounded to bf16, an angle is radians off by position 1,000), and its greedy token
    is transformers' wherever that one's top two logits are more than 2 * BF16_TOL apart."""
    ref = bf16_reference()
    model = checkpoint.load_checkpoint(BF16_FIXTURE).to(torch.bfloat16)
    hidden = model.dense_hidden_states(ref["input_ids"])[0, ref["positions"]]  # (33, C) bf16
    got = model.compute_logits(hidden)                                         # (33, vocab) fp32
    errors = (got - ref["logits"]).abs().amax(-1)
    over = over_tolerance(ref["positions"], errors)
    assert not over, f"max |logit error| >= {BF16_TOL} at positions {over}"
    top_two = ref["logits"].topk(2, dim=-1).values
    decided = top_two[:, 0] - top_two[:, 1] > 2 * BF16_TOL
    assert decided.sum() >= 8  # of 33 positions: the comparison says something
    assert torch.equal(got.argmax(-1)[decided], ref["top1"][decided])


def test_bf16_engine_log_probabilities_equal_transformers_bf16_at_positions_up_to_2047(tmp_path):
    """The engine serving in bf16 (dtype="bfloat16": the engine casts the model), the prompt
    prefilled in chunks of 512 through the paged cache: at every recorded position, the top 20
    log-probabilities it returns (prompt_logprobs; logprobs for the last position) are
    transformers' bf16 ones."""
    ref = bf16_reference()
    llm = fixture_llm("llama31-bf16", tmp_path, dtype="bfloat16", kv_cache_tokens=2304,
                      max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20, prompt_logprobs=20)
    out = llm.generate([ref["input_ids"][0].tolist()], params)[0]
    by_position = out.prompt_logprobs[1:] + out.outputs[0].logprobs  # position p's next token
    want = ref["logits"].log_softmax(dim=-1)
    errors = [max(abs(logprob - want[i, token].item()) for token, logprob in top.items())
              for i, top in enumerate(by_position[p] for p in ref["positions"].tolist())]
    over = over_tolerance(ref["positions"], errors)
    assert not over, f"max |log-probability error| >= {BF16_TOL} at positions {over}"
    assert_no_leaks(llm.engine)

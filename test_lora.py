"""LoRA adapters (lora.py): an adapter's output is the base model's with it merged, a step
mixing adapters equals each alone, the prefix cache keeps adapters apart, the device slots
and host cache page adapters in and out, and every adapter that cannot be served is refused
by name. The adapters are random (B nonzero), written by lora.save_random_lora."""
import json
import math
import os
import re

import pytest
import torch

import kernels
import linear

from checkpoint import read_safetensors, write_safetensors
import watch
from conftest import (HERE, assert_no_leaks, http, run_to_end, server_thread, start_server, stop,
                      tiny, token_ids)
from display import render_trace
from linear import LoRAMapping
from lora import LoRARequest, save_random_lora
from nanoserve import EngineConfig, LLM
from sampling import SamplingParams
from server import Server, ServerConfig

GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"tiny": GPT2_TARGETS, "llama-tiny": LLAMA_TARGETS}
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 2, "x" * 37,
           "ROMEO: " * 5]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
# our projections' names for GPT-2's (the adapter's B rows of c_attn are q, k, v stacked)
GPT2_MODULES = {"attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj",
                "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def lora_llm(preset: str = "tiny", **kwargs) -> LLM:
    return tiny(preset=preset, enable_lora=True, **kwargs)


def adapter(tmp_path, preset: str, name: str = "a", r: int = 8, seed: int = 0,
            lora_id: int = 1, **config) -> LoRARequest:
    """A random adapter for the preset's model, its directory under tmp_path."""
    path = str(tmp_path / name)
    save_random_lora(path, MODELS[preset], TARGETS[preset], r=r, seed=seed, **config)
    return LoRARequest(name, lora_id, path)


MODELS = {}  # preset -> a model of its shape, for writing adapters


@pytest.fixture(scope="module", autouse=True)
def models():
    for preset in TARGETS:
        MODELS[preset] = tiny(preset=preset).engine.model
    yield
    MODELS.clear()


def merge(model, path: str) -> None:
    """W += lora_alpha / r (or / sqrt(r), rsLoRA) x B A for every adapted projection, read from
    the adapter's files here (not through lora.py): the reference an adapter must equal."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config["use_rslora"] else r)
    tensors = read_safetensors(os.path.join(path, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            ours, rows = our_weight(model, module)
            params[ours][rows] += scale * b @ a


def our_weight(model, module: str) -> tuple[str, slice]:
    """Our weight parameter and its rows for a PEFT module name (q_proj: qkv_proj's first)."""
    if module.startswith("transformer."):
        _, layer, inner = module.removeprefix("transformer.").split(".", 2)
        return f"model.layers.{layer}.{GPT2_MODULES[inner]}.weight", slice(None)
    parent, _, name = module.rpartition(".")
    c = model.config
    q, kv, hidden = c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.intermediate_size
    merged = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
              "v_proj": ("qkv_proj", q + kv, kv), "gate_proj": ("gate_up_proj", 0, hidden),
              "up_proj": ("gate_up_proj", hidden, hidden)}
    if name not in merged:
        return f"{module}.weight", slice(None)
    fused, start, size = merged[name]
    return f"{parent}.{fused}.weight", slice(start, start + size)


def own_logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [entry[token] for token, entry in zip(completion.token_ids, completion.logprobs)]


def assert_same_outputs(got, expected) -> None:
    assert token_ids(got) == token_ids(expected)
    for g, e in zip(got, expected):
        assert own_logprobs(g) == pytest.approx(own_logprobs(e), abs=1e-4)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("r", [1, 8, 16])
def test_an_adapters_output_equals_the_base_model_with_it_merged(tmp_path, preset, r):
    request = adapter(tmp_path, preset, r=r, lora_alpha=2.0 * r)
    got = lora_llm(preset).generate(PROMPTS, GREEDY, lora_request=request)
    merged = tiny(preset=preset)
    merge(merged.engine.model, request.lora_path)
    assert_same_outputs(got, merged.generate(PROMPTS, GREEDY))
    assert token_ids(got) != token_ids(tiny(preset=preset).generate(PROMPTS, GREEDY))


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path):
    request = adapter(tmp_path, "llama-tiny", r=16, lora_alpha=8.0, use_rslora=True)
    got = lora_llm("llama-tiny").generate(PROMPTS, GREEDY, lora_request=request)
    merged = tiny(preset="llama-tiny")
    merge(merged.engine.model, request.lora_path)
    assert_same_outputs(got, merged.generate(PROMPTS, GREEDY))


def test_an_adapter_in_pytorch_bin_form_equals_its_safetensors_form(tmp_path):
    request = adapter(tmp_path, "tiny")
    tensors = read_safetensors(os.path.join(request.lora_path, "adapter_model.safetensors"))
    bin_path = tmp_path / "bin"
    bin_path.mkdir()
    torch.save({k: t.clone() for k, t in tensors.items()}, bin_path / "adapter_model.bin")
    (bin_path / "adapter_config.json").write_text(
        open(os.path.join(request.lora_path, "adapter_config.json")).read())
    llm = lora_llm()
    expected = llm.generate(PROMPTS, GREEDY, lora_request=request)
    got = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("bin", 2, str(bin_path)))
    assert token_ids(got) == token_ids(expected)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_batch_mixing_three_adapters_and_the_base_model_equals_each_alone(tmp_path, preset):
    requests = [adapter(tmp_path, preset, name, r=r, seed=i, lora_id=i + 1)
                for i, (name, r) in enumerate([("a", 1), ("b", 8), ("c", 16)])] + [None]
    llm = lora_llm(preset, max_loras=3)
    prompts = [p for p in PROMPTS for _ in requests]
    loras = requests * len(PROMPTS)
    mixed = llm.generate(prompts, GREEDY, lora_request=loras)
    alone = [llm.generate([p], GREEDY, lora_request=lora)[0] for p, lora in zip(prompts, loras)]
    assert_same_outputs(mixed, alone)
    assert len(set(map(tuple, token_ids(mixed[:4])))) == 4  # each adapter says its own
    assert_no_leaks(llm.engine)


def test_padded_decode_steps_read_each_tokens_slot_from_the_static_buffer(tmp_path):
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("ab")] + [None]
    llm = lora_llm(max_loras=2)
    loras = requests * 2
    prompts = PROMPTS[:2] * 3
    expected = llm.generate(prompts, GREEDY, lora_request=loras)
    llm.engine.model_runner.use_padded_decode()  # the graphs' path, eagerly on a CPU
    assert_same_outputs(llm.generate(prompts, GREEDY, lora_request=loras), expected)


def test_the_cuda_path_with_adapters_gives_the_cpu_paths_tokens(tmp_path, fake_cuda,
                                                               monkeypatch):
    """On "CUDA" (conftest's fake_cuda, on the CPU): the CUDA path's shrink and expand (the
    Triton kernels' references here: test_kernels checks the kernels against them, and
    interpreted at every projection of every step they would take minutes) and decode graphs
    replaying with the slots' static buffer give every token and log-probability the CPU
    path gives."""
    calls = []

    def recorded(kernel):
        def run(*args):
            calls.append(kernel.__name__)
            return kernel(*args)
        return run
    monkeypatch.setattr(linear, "lora_shrink", recorded(kernels.lora_shrink_ref))
    monkeypatch.setattr(linear, "lora_expand", recorded(kernels.lora_expand_ref))
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("ab")] + [None]
    prompts = ["ab", "cd", "ef"]  # small: each token is a program in Triton's interpreter
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    expected = lora_llm(max_loras=2).generate(prompts, params, lora_request=requests)
    llm = lora_llm(max_loras=2, kv_cache_tokens=None, gpu_memory_utilization=0.5,
                   max_num_seqs=4)
    assert sorted(llm.engine.model_runner.graphs) == [1, 2, 4]
    assert_same_outputs(llm.generate(prompts, params, lora_request=requests), expected)
    assert {"lora_shrink_ref", "lora_expand_ref"} <= set(calls)
    assert_no_leaks(llm.engine)


def test_the_prefix_cache_never_shares_kv_between_adapters(tmp_path):
    a = adapter(tmp_path, "tiny", "a", seed=0, lora_id=1)
    b = adapter(tmp_path, "tiny", "b", seed=1, lora_id=2)
    llm = lora_llm()
    stats = llm.engine.stats
    prompt = PROMPTS[1]  # several blocks
    uncached = lora_llm(enable_prefix_caching=False)
    for lora, hits in [(a, False), (b, False), (None, False), (b, True), (a, True)]:
        before = stats.num_cached_tokens
        got = llm.generate([prompt], GREEDY, lora_request=lora)
        assert (stats.num_cached_tokens > before) == hits
        assert_same_outputs(got, uncached.generate([prompt], GREEDY, lora_request=lora))
    assert_no_leaks(llm.engine)


def test_one_slot_pages_four_adapters_in_and_out_and_each_output_is_its_own(tmp_path):
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("abcd")]
    reference = lora_llm(max_loras=4)
    expected = [reference.generate([p], GREEDY, lora_request=lora)[0]
                for p, lora in zip(PROMPTS * 2, requests * 2)]
    llm = lora_llm(max_loras=1)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY, lora_request=lora)
           for p, lora in zip(PROMPTS * 2, requests * 2)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        adapters = {seq.lora_request.lora_int_id for seq in engine.scheduler.running}
        assert len(adapters) <= 1  # a sequence waits while another adapter holds the slot
    got_tokens = [[t for out in outputs[i] for t in out.outputs[0].token_ids] for i in ids]
    assert got_tokens == token_ids(expected)
    assert engine.lora_manager.num_slot_loads >= 4  # evicted and loaded again
    assert_no_leaks(engine)


def test_the_host_cache_evicts_the_least_recently_used_idle_adapter(tmp_path):
    a, b, c = (adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
               for i, name in enumerate("abc"))
    llm = lora_llm(max_loras=1, max_cpu_loras=2)
    manager = llm.engine.lora_manager
    for lora in (a, b, a, c, b):  # b evicted for c (a used since), then read again
        llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)
    assert manager.num_disk_loads == 4
    assert list(manager.host) == [c.lora_int_id, b.lora_int_id]


def test_an_adapter_of_a_live_request_is_never_evicted_from_the_host(tmp_path):
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("abc")]
    llm = lora_llm(max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    for lora in requests:
        engine.add_request(PROMPTS[0], GREEDY, lora_request=lora)
    assert len(engine.lora_manager.host) == 3  # all live: kept past max_cpu_loras
    run_to_end(engine)
    assert len(engine.lora_manager.host) == 1
    assert engine.lora_manager.num_disk_loads == 3
    assert_no_leaks(engine)


def test_adapters_survive_preemption_by_recompute_and_by_swapping(tmp_path):
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("ab")] + [None]
    prompts = [PROMPTS[1]] * 3 + [PROMPTS[2]] * 3  # each prompt under each adapter
    loras = requests * 2
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = token_ids(lora_llm(max_loras=2).generate(prompts, params, lora_request=loras))
    for mode in ("recompute", "swap"):
        llm = lora_llm(max_loras=2, kv_cache_tokens=256, block_size=8, preemption_mode=mode)
        assert token_ids(llm.generate(prompts, params, lora_request=loras)) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- refusals

def edit_config(request: LoRARequest, **changes) -> LoRARequest:
    path = os.path.join(request.lora_path, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | changes, f)
    return request


@pytest.mark.parametrize("changes, message", [
    (dict(r=32), "r 32 is above max_lora_rank 16"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(target_modules=["q_proj", "mlp"]), "target_modules 'mlp' is not served"),
    (dict(target_modules=".*proj"), "target_modules '.*proj' is a regular expression"),
    (dict(target_modules=["c_attn"]), "target_modules 'c_attn' is another architecture's"),
    (dict(base_model_name_or_path=os.path.join(HERE, "checkpoints", "shakespeare")),
     "base_model_name_or_path"),
    (dict(lora_alpha=float("nan")), "lora_alpha"),
    (dict(use_rslora="yes"), "use_rslora"),
])
def test_an_adapter_that_cannot_be_served_is_refused_naming_the_field(tmp_path, changes, message):
    request = edit_config(adapter(tmp_path, "llama-tiny", r=8), **changes)
    llm = lora_llm("llama-tiny")
    with pytest.raises(ValueError, match=re.escape("adapter_config.json " + message)):
        llm.generate(PROMPTS[0], GREEDY, lora_request=request)
    assert_no_leaks(llm.engine)
    assert not llm.engine.lora_manager.num_live


def test_a_shape_unlike_the_base_models_is_refused_naming_the_tensor(tmp_path):
    request = adapter(tmp_path, "llama-tiny", r=8)
    path = os.path.join(request.lora_path, "adapter_model.safetensors")
    tensors = {key: t.clone() for key, t in read_safetensors(path).items()}
    key = next(key for key in tensors if "layers.1.self_attn.k_proj.lora_B" in key)
    tensors[key] = torch.ones(128, 8)  # k_proj's rows are 2 K/V heads of 32: 64
    write_safetensors(tensors, path)
    llm = lora_llm("llama-tiny")
    with pytest.raises(ValueError, match=re.escape(f"{key} has shape (128, 8); the base model's "
                                                   "projection wants (64, 8)")):
        llm.generate(PROMPTS[0], GREEDY, lora_request=request)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("request_args, message", [
    (("", 1, "x"), "lora_name must be a non-empty string"),
    (("a", 0, "x"), "lora_int_id must be a positive integer"),
    (("a", True, "x"), "lora_int_id must be a positive integer"),
    (("a", 1.0, "x"), "lora_int_id must be a positive integer"),
    (("a", 1, None), "lora_path must be a non-empty string"),
])
def test_a_malformed_lora_request_is_refused(request_args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*request_args)


@pytest.mark.parametrize("changes, message", [
    (dict(max_loras=0), "max_loras must be an integer"),
    (dict(max_loras=True), "max_loras must be an integer"),
    (dict(max_lora_rank=2.5), "max_lora_rank must be an integer"),
    (dict(max_cpu_loras=2, max_loras=4), "max_cpu_loras 2 is below max_loras 4"),
    (dict(enable_lora="yes"), "enable_lora must be a bool"),
])
def test_lora_engine_settings_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(preset="tiny", device="cpu", **changes)


def test_a_lora_request_is_refused_unless_lora_is_enabled_or_well_typed(tmp_path):
    request = adapter(tmp_path, "tiny")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        tiny().generate(PROMPTS[0], GREEDY, lora_request=request)
    llm = lora_llm()
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPTS[0], GREEDY, lora_request="a")
    with pytest.raises(ValueError, match="2 prompts but 1 lora requests"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[request])
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("x", 5, str(tmp_path / "no")))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'"):
        llm.generate(PROMPTS[:2], GREEDY,
                     lora_request=[request, LoRARequest("other", 1, request.lora_path)])
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- the server

def completion(url: str, model: str | None, prompt: str = PROMPTS[0]) -> tuple[int, object]:
    body = dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
    if model is not None:
        body["model"] = model
    return http(url, "/v1/completions", body)


def test_the_model_field_picks_the_adapter_and_an_unknown_model_is_a_404(tmp_path):
    a = adapter(tmp_path, "tiny", "a", seed=0)
    b = adapter(tmp_path, "tiny", "b", seed=1, lora_id=2)
    offline = lora_llm()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = ServerConfig(port=0, lora_modules=(f"a={a.lora_path}", json.dumps(
        {"name": "b", "path": b.lora_path, "base_model_name": "tiny"})))
    with server_thread(lora_llm().engine, config) as server:
        for model, lora in [("a", a), ("b", b), ("tiny", None), (None, None)]:
            status, body = completion(server.url, model)
            assert status == 200 and body["model"] == (model or "tiny")
            expected = offline.generate(PROMPTS[0], params, lora_request=lora)[0]
            assert body["choices"][0]["text"] == expected.outputs[0].text
        status, body = completion(server.url, "c")
        assert status == 404 and body["error"]["message"] == "The model `c` does not exist."


def test_use_beam_search_with_an_adapter_is_refused_by_name(tmp_path):
    a = adapter(tmp_path, "tiny", "a")
    engine = lora_llm().engine
    body = dict(prompt=PROMPTS[0], max_tokens=4, n=2, use_beam_search=True, model="a")
    with server_thread(engine, ServerConfig(port=0, lora_modules=(f"a={a.lora_path}",))) as server:
        status, answer = http(server.url, "/v1/completions", body)
    assert status == 400
    assert answer["error"]["message"] == "use_beam_search does not run with a LoRA adapter"
    assert_no_leaks(engine)


def test_v1_models_lists_each_adapter_with_the_base_model_as_parent(tmp_path):
    a = adapter(tmp_path, "tiny", "a")
    config = ServerConfig(port=0, lora_modules=(f"sql={a.lora_path}",))
    with server_thread(lora_llm().engine, config) as server:
        status, body = http(server.url, "/v1/models")
    assert status == 200
    assert [(m["id"], m.get("parent")) for m in body["data"]] == [("tiny", None), ("sql", "tiny")]
    assert body["data"][1]["root"] == a.lora_path


def test_runtime_lora_updating_loads_and_unloads_adapters_only_when_allowed(tmp_path,
                                                                          monkeypatch):
    a = adapter(tmp_path, "tiny", "a")
    load = dict(lora_name="new", lora_path=a.lora_path)
    with server_thread(lora_llm().engine) as server:
        status, body = http(server.url, "/v1/load_lora_adapter", load)
        assert status == 404 and "runtime LoRA updating is off" in body["error"]["message"]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with server_thread(lora_llm().engine) as server:
        assert completion(server.url, "new")[0] == 404
        assert http(server.url, "/v1/load_lora_adapter", load)[0] == 200
        assert completion(server.url, "new")[0] == 200
        status, body = http(server.url, "/v1/load_lora_adapter", load)
        assert status == 400 and "lora_name 'new' is already served" in body["error"]["message"]
        status, body = http(server.url, "/v1/load_lora_adapter",
                            dict(lora_name="bad", lora_path=str(tmp_path / "none")))
        assert status == 400 and "is not a directory" in body["error"]["message"]
        assert http(server.url, "/v1/unload_lora_adapter", dict(lora_name="new"))[0] == 200
        assert completion(server.url, "new")[0] == 404
        assert http(server.url, "/v1/unload_lora_adapter", dict(lora_name="new"))[0] == 404


def test_metrics_count_requests_per_adapter(tmp_path):
    a = adapter(tmp_path, "tiny", "a")
    config = ServerConfig(port=0, lora_modules=(f"a={a.lora_path}", f"b={a.lora_path}"))
    with server_thread(lora_llm().engine, config) as server:
        for model in ("a", "a", "b", "tiny"):
            assert completion(server.url, model)[0] == 200
        _, text = http(server.url, "/metrics")
    assert 'nanoserve:lora_requests_total{lora_name="a"} 2' in text
    assert 'nanoserve:lora_requests_total{lora_name="b"} 1' in text


@pytest.mark.parametrize("module, message", [
    ("a", "lora_modules: 'a' is not name=path"),
    ("=x", "lora_modules: '=x' is not name=path"),
    ('{"name": "a"}', "must be {\"name\": str, \"path\": str"),
    ("{nope", "is not JSON"),
])
def test_malformed_lora_modules_are_refused(module, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig(lora_modules=(module,))


def test_lora_modules_need_lora_enabled_and_a_servable_adapter(tmp_path):
    a = adapter(tmp_path, "tiny", "a", r=32)
    with pytest.raises(ValueError, match=re.escape("lora_modules need LoRA enabled")):
        Server(tiny().engine, ServerConfig(lora_modules=(f"a={a.lora_path}",)))
    with pytest.raises(ValueError, match="r 32 is above max_lora_rank 16"):
        Server(lora_llm().engine, ServerConfig(lora_modules=(f"a={a.lora_path}",)))


def test_the_command_line_serves_lora_modules(tmp_path):
    a = adapter(tmp_path, "tiny", "a")
    proc, url = start_server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                             "--max-cpu-loras", "3", "--lora-modules", f"a={a.lora_path}",
                             json.dumps({"name": "b", "path": a.lora_path}))
    try:
        models = [m["id"] for m in http(url, "/v1/models")[1]["data"]]
        assert models == ["tiny", "a", "b"]
        assert completion(url, "b")[0] == 200
    finally:
        stop(proc)


def test_the_step_trace_and_the_watch_page_show_each_sequences_adapter(tmp_path):
    a = adapter(tmp_path, "tiny", "sql")
    engine = lora_llm().engine
    engine.add_request(PROMPTS[0], GREEDY, "with", lora_request=a)
    engine.add_request(PROMPTS[0], GREEDY, "without")
    engine.step()
    assert engine.last_step.lora_names == {"with": "sql"}
    running = {seq["id"]: seq["lora"] for seq in watch.frame(engine)["running"]}
    assert running == {"with": "sql", "without": None}
    assert "(LoRA sql)" in render_trace([engine.last_step], ["with"])
    run_to_end(engine)


def test_a_request_whose_adapter_has_no_slot_is_passed_over_for_those_of_held_ones(tmp_path):
    a = adapter(tmp_path, "tiny", "a", lora_id=1)
    b = adapter(tmp_path, "tiny", "b", seed=1, lora_id=2)
    engine = lora_llm(max_loras=1).engine
    for request_id, lora in [("a1", a), ("b", b), ("a2", a)]:
        engine.add_request(PROMPTS[0], GREEDY, request_id, lora_request=lora)
    engine.step()
    assert sorted(seq.seq_id for seq in engine.scheduler.running) == ["a1", "a2"]
    run_to_end(engine)
    assert_no_leaks(engine)


def test_adapters_with_ngram_speculation_and_n_samples_equal_them_without(tmp_path):
    """Drafts are verified under the sequence's adapter (its slot covers them), and each of
    a request's n samples runs with it."""
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("ab")] + [None]
    prompts = ["abcabcabcabcabc", "ROMEO: " * 5, "0123456789" * 3]
    expected = lora_llm(max_loras=2).generate(prompts, GREEDY, lora_request=requests)
    speculating = lora_llm(max_loras=2, speculative_config={"method": "ngram",
                                                            "num_speculative_tokens": 3})
    got = speculating.generate(prompts, GREEDY, lora_request=requests)
    assert_same_outputs(got, expected)
    assert speculating.engine.stats.spec_decode_num_draft_tokens > 0
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True)
    llm = lora_llm(max_loras=2)
    both = llm.generate(prompts[:1], seeded, lora_request=requests[:1])[0]
    alone = [llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=1.0,
                                                      seed=7 + i, ignore_eos=True),
                          lora_request=requests[:1])[0] for i in range(2)]
    assert [c.token_ids for c in both.outputs] == [a.outputs[0].token_ids for a in alone]
    assert_no_leaks(llm.engine)


def test_a_step_orders_its_sequences_by_adapter_so_each_adapters_decodes_are_one_run(
        tmp_path, monkeypatch):
    requests = [adapter(tmp_path, "tiny", name, seed=i, lora_id=i + 1)
                for i, name in enumerate("ab")] + [None]
    llm = lora_llm(max_loras=2)
    runs = []
    set_slots = LoRAMapping.set

    def recorded(mapping, token_slots, host_slots=None):
        set_slots(mapping, token_slots, host_slots)
        if token_slots is not None and len(token_slots) == 6:  # the six sequences' decodes
            runs.append([slot for slot, _, _ in kernels.lora_segments(host_slots)])
    monkeypatch.setattr(LoRAMapping, "set", recorded)
    llm.generate(PROMPTS[:2] * 3, GREEDY, lora_request=requests * 2)  # a, b, base, a, b, base
    assert runs and all(sorted(slots) == [0, 1] for slots in runs)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_cpus_lora_layouts_give_the_references_outputs(tmp_path, monkeypatch, preset):
    """Padded over the slots, gathered (a decode batch with a base request) and in place (its
    three adapters' decodes, once the base request is done), a GEMM pair a run (a long prefill
    beside short ones), and the reference's gather a slot: the same tokens and
    log-probabilities, on GPT-2's one-part projections and Llama's merged q/k/v and gate/up."""
    requests = [adapter(tmp_path, preset, name, seed=i, lora_id=i + 1)
                for i, name in enumerate("abc")] + [None]
    prompts = ["x" * 300, "Hi", "Yo", "Hm"]  # their prefills: 3 slots x 300 rows for 306 tokens
    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)
              for tokens in (6, 6, 6, 2)]
    calls = []

    def counted(name, kernel):
        def run(*args):
            calls.append(name)
            return kernel(*args)
        return run

    def padded(y, x, lora_a, lora_bs, layout):
        calls.append("in place" if layout.gather is None else "gathered")
        kernels.add_lora_padded(y, x, lora_a, lora_bs, layout)
    monkeypatch.setattr(linear, "add_lora_padded", padded)
    monkeypatch.setattr(linear, "sgmv_shrink", counted("runs", kernels.sgmv_shrink))
    got = lora_llm(preset, max_loras=3).generate(prompts, params, lora_request=requests)
    assert {"in place", "gathered", "runs"} <= set(calls)
    set_slots = LoRAMapping.set

    def without_host_slots(mapping, token_slots, host_slots=None):  # the reference's path
        set_slots(mapping, token_slots)
    monkeypatch.setattr(LoRAMapping, "set", without_host_slots)
    calls.clear()
    expected = lora_llm(preset, max_loras=3).generate(prompts, params, lora_request=requests)
    assert calls == []
    assert_same_outputs(got, expected)

"""nanoserve's guarantees, one test each. Run: python -m pytest -q test_nanoserve.py

Everything runs on CPU, offline. Tests that need ../shared/data skip with the reason.
"""
import contextlib
import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import bench
import model as M
from kernels import AttentionMetadata, paged_attention, paged_attention_ref, store_kv
from nanoserve import LLM, Engine, EngineConfig, SamplingParams, hub_checkpoint
from paged_cache import BlockTable
from scheduler import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_GPT2 = os.path.join(HERE, "..", "shared", "data", "gpt2")
needs_shared = pytest.mark.skipif(
    not os.path.isdir(SHARED_GPT2), reason="../shared/data/gpt2 (GPT-2 tokenizer files) is absent")

# Prompt lengths 1..150 bytes: single-token, shorter than a block, several blocks, longer
# than the token budgets used below (so chunked prefill really chunks).
PROMPTS = ["A", "Hello there", "The quick brown fox jumps over the lazy dog. " * 3 + "And",
           "x" * 37, "0123456789" * 6, "ROMEO: " * 5]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def tiny(**kwargs) -> LLM:
    """The tiny preset (random weights) with a small KV cache unless a test sets one."""
    return LLM(preset="tiny", **{"kv_cache_tokens": 4096} | kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaks(engine: Engine) -> None:
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert not any(engine.allocator.ref_counts)
    assert not engine.has_unfinished() and not engine.seqs


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Greedy outputs of each prompt served on its own: the reference for batching tests."""
    return [token_ids(tiny().generate([p], GREEDY))[0] for p in PROMPTS]


# ----------------------------------------------------------------------------- exactness

def paged_logits(engine: Engine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, computed by the paged forward in steps of `chunks` tokens."""
    seq = Sequence("s", "", tokens, SamplingParams(), BlockTable(engine.config.block_size))
    rows = []
    for n in chunks:
        assert seq.block_table.ensure(seq.num_computed_tokens + n, engine.allocator)
        batch = engine._prepare({seq: n})
        hidden = engine.model(batch.input_ids, batch.positions, batch.meta,
                              engine.kv_cache.k, engine.kv_cache.v)
        rows.append(engine.model.compute_logits(hidden))
        seq.num_computed_tokens += n
    seq.block_table.release(engine.allocator)
    return torch.cat(rows)


@pytest.mark.parametrize("chunks", [[45], [16, 16, 13], [7, 20, 18], [30] + [1] * 15],
                         ids=["prefill", "chunked-prefill", "uneven-chunks", "decode"])
@torch.inference_mode()
def test_paged_logits_equal_dense_forward(chunks):
    engine = tiny(block_size=8).engine
    tokens = torch.randint(0, 257, (sum(chunks),), generator=torch.Generator().manual_seed(0))
    dense = engine.model.forward_dense(tokens[None])[0]
    paged = paged_logits(engine, tokens.tolist(), chunks)
    rel = (paged - dense).abs().max() / dense.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "static"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_greedy_output_is_independent_of_batching(alone, policy, chunked):
    llm = tiny(policy=policy, chunked_prefill=chunked, token_budget=64 if chunked else 256,
               max_num_seqs=4)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.stats.peak_batch_size > 1
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "static"])
def test_greedy_output_survives_preemption(alone, policy):
    llm = tiny(policy=policy, kv_cache_tokens=192, block_size=16, token_budget=64)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_seeded_sample_is_independent_of_batch():
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    solo = tiny().generate(["Hello"], params)[0].outputs[0].token_ids
    crowd = tiny(kv_cache_tokens=256).generate(
        PROMPTS + ["Hello"], [others] * len(PROMPTS) + [params])[-1].outputs[0].token_ids
    assert crowd == solo
    assert tiny().generate(["Hello"], SamplingParams(max_tokens=30, seed=8, ignore_eos=True)
                           )[0].outputs[0].token_ids != solo


def test_greedy_output_is_the_same_with_triton_attention(alone):
    llm = tiny(attention="triton", token_budget=24, block_size=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:3], params)) == [a[:8] for a in alone[:3]]
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- Triton kernel
# On a machine without CUDA, kernels.py runs the kernel in Triton's interpreter on CPU, so
# inputs are small. Compilation for real GPUs is checked ahead of time, in a subprocess
# without the interpreter (it patches triton.language, and then triton.compile cannot run).

NUM_HEADS = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter

# (context_len, q_len) per sequence; context_len counts this step's tokens, as in the engine.
BATCHES = {
    # decodes (one at position 0) mixed with a whole prompt of 2 query tiles and a prefill chunk
    # whose sequence already cached 70 tokens (2 key steps of BLOCK_N = 64)
    "mixed": [(37, 1), (20, 20), (83, 13), (1, 1), (130, 1), (9, 9)],
    "decode_only": [(5, 1), (64, 1), (71, 1), (16, 1)],
}


def make_batch(seq_shapes, block_size, head_dim, dtype=torch.float32, seed=0):
    """Random q, caches and metadata as Engine._prepare builds them: shuffled blocks, 0-padding."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-ctx // block_size) for ctx, _ in seq_shapes]
    total = sum(num_blocks) + 3  # a few blocks no sequence owns
    k_cache = torch.randn(total, block_size, NUM_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(total, block_size, NUM_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    free = torch.randperm(total, generator=gen).tolist()  # non-contiguous, any order
    tables, slots, starts = [], [], [0]
    for (ctx, q_len), n in zip(seq_shapes, num_blocks):
        table, free = free[:n], free[n:]
        tables.append(table + [0] * (max(num_blocks) - n))
        slots += [table[t // block_size] * block_size + t % block_size
                  for t in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=DEVICE)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), block_tables=tensor(tables, torch.int32),
        context_lens=tensor([ctx for ctx, _ in seq_shapes], torch.int32),
        query_start_loc=tensor(starts, torch.int32),
        max_query_len=max(q for _, q in seq_shapes))
    # This step's K/V go in through store_kv, as in the model; q is a strided view, as there.
    qkv = torch.randn(starts[-1], 3, NUM_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.unbind(1)  # (N, H, D) each
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_kernel_matches_reference(block_size, head_dim, batch):
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], block_size, head_dim)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # fp32 throughout; only the order of the sums differs from the reference.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


COMPILE_SCRIPT = r"""
import kernels, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert not triton.knobs.runtime.interpret
fn = kernels._paged_attention_kernel
# The launcher's tiles; head dim 48, padded to 64 as the launcher does.
constexprs = dict(HEAD_DIM=48, BLOCK_D=64, CACHE_BLOCK_SIZE=16,
                  BLOCK_M=kernels.BLOCK_M, BLOCK_N=kernels.BLOCK_N)
for cc in (80, 90):
    for dtype in ("fp16", "bf16", "fp32"):
        pointers = dict(q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, out_ptr=dtype,
                        block_tables_ptr="i32", context_lens_ptr="i32", query_start_loc_ptr="i32")
        signature = {name: ("constexpr" if name in constexprs
                            else "*" + pointers[name] if name in pointers
                            else "fp32" if name == "sm_scale" else "i32")
                     for name in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32))
        ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
        assert f".target sm_{cc}" in ptx and "_paged_attention_kernel" in ptx, (cc, dtype)
        assert len(cubin) > 0, (cc, dtype)
        print("ok", cc, dtype)
"""


def test_triton_kernel_compiles_for_cuda():
    env = dict(os.environ, TRITON_INTERPRET="0")  # kernels.py keeps an explicit 0
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [word for cc in (80, 90) for dtype in ("fp16", "bf16", "fp32")
                                     for word in ("ok", str(cc), dtype)]


# ----------------------------------------------------------------------------- sampling

def test_top_k_1_is_greedy(alone):
    params = SamplingParams(max_tokens=40, temperature=5.0, top_k=1, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS, params)) == alone


def test_top_p_keeps_the_token_that_crosses_p():
    from nanoserve import sample_one
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample_one(logits, SamplingParams(top_p=0.6), gen) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.6, so token 1 (which crosses 0.6) stays; 2 and 3 go
    assert {sample_one(logits, SamplingParams(top_p=0.5), gen) for _ in range(100)} == {0}


def test_stop_string_ends_generation_and_is_cut():
    llm = LLM()  # the shipped model writes ASCII, so the stop string is plain text
    full = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    stop = full.text[10:13]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full.text[:full.text.find(stop)]
    assert_no_leaks(llm.engine)


def test_max_tokens_and_end_of_text_set_finish_reason():
    llm = tiny()
    assert llm.generate(["Hi"], GREEDY)[0].outputs[0].finish_reason == "length"
    eot = llm.engine.tokenizer.eot_token
    llm.engine.model.compute_logits = lambda h: torch.nn.functional.one_hot(  # always <|endoftext|>
        torch.full((len(h),), eot), 257).float()
    out = llm.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [eot], "")


# ----------------------------------------------------------------------------- bad input, abort

@pytest.mark.parametrize("make, message", [
    (lambda e: e.add_request("", SamplingParams()), "prompt is empty"),
    (lambda e: e.add_request("x" * 1000, SamplingParams(max_tokens=100)), "context is 1024"),
    (lambda e: e.add_request("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda e: e.add_request("hi", SamplingParams(temperature=-1)), "temperature"),
    (lambda e: e.add_request("hi", SamplingParams(top_p=0)), "top_p"),
    (lambda e: e.add_request("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda e: e.add_request("hi", SamplingParams(top_k=-1)), "top_k"),
    (lambda e: e.add_request("hi", SamplingParams(stop=[""])), "stop"),
    (lambda e: e.add_request("y" * 300, SamplingParams(max_tokens=300)), "KV blocks"),
    (lambda e: e.add_request([0, 300], SamplingParams()), "token ids"),
    (lambda e: Engine(EngineConfig(preset="tiny", policy="lifo")), "unknown scheduling policy"),
    (lambda e: Engine(EngineConfig(preset="tiny", block_size=0)), "block_size"),
], ids=["empty", "too-long", "max_tokens", "temperature", "top_p=0", "top_p>1", "top_k",
        "stop", "never-fits-cache", "bad-token-id", "policy", "block_size"])
def test_bad_input_is_rejected_and_engine_keeps_serving(alone, make, message):
    llm = tiny(kv_cache_tokens=512)
    with pytest.raises(ValueError, match=message):
        make(llm.engine)
    assert_no_leaks(llm.engine)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == alone[:2]


def test_unchunked_prompt_over_token_budget_is_rejected():
    with pytest.raises(ValueError, match="chunked prefill is off"):
        tiny(chunked_prefill=False, token_budget=32).engine.add_request("x" * 40, GREEDY)


def test_generate_rejects_whole_batch_if_one_prompt_is_bad():
    llm = tiny()
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("victim_state", ["running", "waiting"])
def test_abort_frees_blocks_and_leaves_others_unchanged(alone, victim_state):
    engine = tiny(max_num_seqs=len(PROMPTS) - 1, token_budget=64).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    victim = ids[0] if victim_state == "running" else ids[-1]
    assert engine.seqs[victim].status.value == victim_state
    engine.abort(victim)
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert victim not in finished
    others = [i for i, request_id in enumerate(ids) if request_id != victim]
    assert [finished[ids[i]] for i in others] == [alone[i] for i in others]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- checkpoints

def hf_gpt2_state(config: M.GPTConfig) -> dict[str, torch.Tensor]:
    """Random GPT-2 weights in Hugging Face's own layout: Conv1D (in, out) weights, mask buffers."""
    g = torch.Generator().manual_seed(0)
    C, V, T = config.n_embd, config.vocab_size, config.n_positions
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    state = {"transformer.wte.weight": r(V, C), "transformer.wpe.weight": r(T, C),
             "transformer.ln_f.weight": 1 + r(C), "transformer.ln_f.bias": r(C)}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        state |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C),
                  h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
                  h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                  h + "attn.bias": torch.tril(torch.ones(1, 1, T, T)),
                  h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
                  h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
                  h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C)}
    return state | {"lm_head.weight": state["transformer.wte.weight"]}


def hf_gpt2_logits(state: dict, config: M.GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2 written directly against the HF tensors (x @ W + b): independent of model.py."""
    F, C, H = torch.nn.functional, config.n_embd, config.n_head
    w = lambda k: state["transformer." + k]  # noqa: E731
    ln = lambda x, k: F.layer_norm(x, (C,), w(k + ".weight"), w(k + ".bias"))  # noqa: E731
    T = len(idx)
    x = w("wte.weight")[idx] + w("wpe.weight")[:T]
    for i in range(config.n_layer):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ w(h + "attn.c_attn.weight") + w(h + "attn.c_attn.bias")
        q, k, v = qkv.split(C, -1)
        q, k, v = (t.view(T, H, C // H).transpose(0, 1) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / (C // H) ** 0.5).masked_fill(
            torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        y = (att @ v).transpose(0, 1).reshape(T, C)
        x = x + y @ w(h + "attn.c_proj.weight") + w(h + "attn.c_proj.bias")
        m = F.gelu(ln(x, h + "ln_2") @ w(h + "mlp.c_fc.weight") + w(h + "mlp.c_fc.bias"),
                   approximate="tanh")
        x = x + m @ w(h + "mlp.c_proj.weight") + w(h + "mlp.c_proj.bias")
    return ln(x, "ln_f") @ w("wte.weight").T


def write_hf_checkpoint(path, state: dict, config: M.GPTConfig, fmt: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "n_layer": config.n_layer, "n_head": config.n_head,
                   "n_embd": config.n_embd, "n_positions": config.n_positions,
                   "vocab_size": config.vocab_size, "layer_norm_epsilon": 1e-5}, f)
    if fmt == "bin":
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0  # safetensors, by hand
    for name, t in state.items():
        blob = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


SMALL = M.GPTConfig(vocab_size=257, n_positions=64, n_embd=48, n_layer=2, n_head=3)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_checkpoint_loads_with_identical_logits(tmp_path, fmt):
    state = saved = hf_gpt2_state(SMALL)
    if fmt == "safetensors":  # HF's safetensors files drop the tied head and the prefix
        saved = {k.removeprefix("transformer."): v for k, v in state.items()
                 if k != "lm_head.weight"}
    write_hf_checkpoint(tmp_path, saved, SMALL, fmt)
    loaded = M.load_checkpoint(str(tmp_path))
    idx = torch.randint(0, 257, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_dense(idx[None])[0],
                                   hf_gpt2_logits(state, SMALL, idx), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), "missing tensor h.1.mlp.c_fc.bias"),
    (lambda s: s.update({"transformer.wpe.weight": torch.zeros(10, 48)}), "wpe.weight has shape"),
], ids=["missing-tensor", "wrong-shape"])
def test_bad_checkpoint_names_the_problem(tmp_path, damage, message):
    state = hf_gpt2_state(SMALL)
    damage(state)
    write_hf_checkpoint(tmp_path, state, SMALL, "safetensors")
    with pytest.raises(ValueError, match=message):
        M.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("header", [b"\xff" * 4, struct.pack("<Q", 10**9) + b"{}",
                                    struct.pack("<Q", 5) + b"nope!"],
                         ids=["truncated", "length-past-end", "not-json"])
def test_corrupt_safetensors_header_is_reported(tmp_path, header):
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "safetensors")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(header)
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        M.load_checkpoint(str(tmp_path))


@needs_shared
def test_gpt2_tokenizer_from_shared_files():
    enc = M.load_tokenizer(SHARED_GPT2)
    assert enc.encode("Hello world") == [15496, 995]
    text = "héllo wörld, 你好, привет, 👋🏽 \u200b\ufeff\t\n"
    assert enc.decode(enc.encode(text)) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256] == [enc.eot_token]
    assert enc.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_gpt2_name_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    M.save_checkpoint(M.GPT(SMALL), str(snapshot))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub_checkpoint("gpt2") == str(snapshot)
    assert LLM(model="gpt2").engine.model.config == SMALL


def test_download_writes_the_file_with_a_progress_line(tmp_path, capsys):
    import functools
    import http.server
    import threading
    from nanoserve import _download
    (tmp_path / "model.safetensors").write_bytes(b"w" * 2_500_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # loopback only
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "hub" / "snapshot" / "model.safetensors"
        _download(f"http://127.0.0.1:{server.server_address[1]}/model.safetensors", str(target))
    finally:
        server.shutdown()
    assert target.read_bytes() == b"w" * 2_500_000 and not os.path.exists(f"{target}.part")
    assert "downloading model.safetensors: 2/2 MB" in capsys.readouterr().err


def test_gpt2_name_offline_without_cache_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ValueError, match="not in the Hugging Face cache.*pass --model DIR"):
        LLM(model="gpt2")


def test_shipped_model_loads_and_seeded_sample_is_reproducible():
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=1)
    first = LLM().generate(["ROMEO:"], params)[0].outputs[0]
    assert LLM().generate(["ROMEO:"], params)[0].outputs[0] == first
    assert len(first.text) > 20


def test_cli_streams_the_text_then_a_summary():
    run = subprocess.run([sys.executable, "nanoserve.py", "--prompt", "ROMEO:",
                          "--prompt", "JULIET:", "--max-tokens", "30", "--seed", "0"],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ROMEO:") and "\n\nJULIET:" in run.stdout
    assert "generated tokens" in run.stderr and "peak batch 2" in run.stderr


def test_cli_reports_bad_input_without_a_traceback():
    run = subprocess.run([sys.executable, "nanoserve.py", "--prompt", "x", "--top-p", "2"],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip() == "error: top_p must be in (0, 1], got 2.0"


# ----------------------------------------------------------------------------- bench.py
# bench.py at a tiny scale: its JSON is complete and consistent. Never its speed.

TINY = ("--num-requests 8 --prompt-len 16 --limits 8 16 --online-requests 6 --online-limit 12 "
        "--mean-output-len 6 --rates 40 inf --max-num-seqs 4 --token-budget 24").split()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(TINY + ["--out", str(out)])
    return json.loads(out.read_text()), printed.getvalue()


def test_bench_json_is_complete_and_consistent(bench_run):
    result, printed = bench_run
    cfg = result["config"]
    assert set(result["versions"]) >= {"torch", "device", "threads"}
    assert list(result["offline"]) == ["8", "16"] and cfg["modes"] == list(bench.MODES)
    for limit, runs in result["offline"].items():
        lengths = runs["lengths"]
        assert len(lengths) == 8 and all(1 <= n <= int(limit) for n in lengths)
        assert list(runs["modes"]) == cfg["modes"]
        for mode, r in runs["modes"].items():
            assert r["output_tokens"] == sum(lengths), (limit, mode)
            assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
            assert r["same_tokens"] == 1.0, (limit, mode)  # greedy: batching changes nothing
            assert 0 < r["kv_real_share"] <= 1 and 0 < r["seqs_per_step"] <= 4
            assert r["kv_slots_mean"] <= r["kv_slots_peak"] and r["preemptions"] >= 0
            if mode not in ("naive", "no-chunk"):
                assert r["tokens_per_step"] <= 24
        assert runs["modes"]["naive"]["vs_naive"] == runs["modes"]["static"]["vs_static"] == 1
    assert list(result["online"]) == ["40.0", "inf"]
    for runs in result["online"].values():
        assert list(runs) == [m for m in cfg["modes"] if m != "naive"]
        for r in runs.values():
            assert r["requests"] == 6 and r["output_tokens"] == sum(result["online_lengths"])
            for metric in ("ttft", "tpot", "itl", "e2e"):
                assert 0 <= r[metric]["p50"] <= r[metric]["p99"]
            assert r["ttft"]["mean"] <= r["e2e"]["mean"]
    assert [d["batch"] for d in result["hardware"]["decode"]] == [1, 2, 4]
    assert all(d["paged_step_ms"] > 0 < d["dense_step_ms"] for d in result["hardware"]["decode"])
    assert all(isinstance(t["met"], bool) for t in result["targets"])
    for title in ("Offline throughput", "Online", "Decode step", "Targets"):
        assert title in printed


def test_naive_baseline_pads_and_matches_the_engine():
    llm = LLM(preset="tiny")
    prompts = [[5, 6, 7], list(range(40, 60)), [9] * 11]  # left-padded to 20 in one batch
    lengths = [7, 3, 12]
    outputs = llm.generate(prompts, [bench.greedy(n) for n in lengths])
    want = [o.outputs[0].token_ids for o in outputs]
    log = []
    assert bench.naive_batch(llm.engine.model, prompts, lengths, log) == want
    assert len(log) == max(lengths)  # every row runs until the longest finishes

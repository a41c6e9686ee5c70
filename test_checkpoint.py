"""checkpoint.py's guarantees: config.json, safetensors, sharded and published checkpoints,
the Hugging Face cache.
"""
import dataclasses
import json
import os
import shutil
import struct
import threading

import pytest
import torch

import checkpoint
import model as M
from conftest import (HERE, MODEL_FIXTURES, NEAR_TIE, OpLog, assert_no_leaks, checkpoint_llm,
                      fixture_llm, http, server_in_process, token_ids, write_byte_tokenizer)
from nanoserve import LLM
from sampling import SamplingParams
from tokenizer import EOT, Tokenizer, load_tokenizer

SHARED_GPT2 = os.path.join(HERE, "..", "shared", "data", "gpt2")


needs_shared = pytest.mark.skipif(
    not os.path.isdir(SHARED_GPT2), reason="../shared/data/gpt2 (GPT-2 tokenizer files) is absent")


# ----------------------------------------------------------------------------- checkpoints

def hf_gpt2_state(config: M.GPTConfig) -> dict[str, torch.Tensor]:
    """Random GPT-2 weights in Hugging Face's own layout: Conv1D (in, out) weights, mask buffers."""
    g = torch.Generator().manual_seed(0)
    C, V, T = config.n_embd, config.vocab_size, config.n_positions

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1
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

    def w(name):
        return state["transformer." + name]

    def ln(x, name):
        return F.layer_norm(x, (C,), w(name + ".weight"), w(name + ".bias"))
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
    if fmt in ("bin", "legacy-bin"):  # legacy: torch.save's format before the zip one
        torch.save(state, os.path.join(path, "pytorch_model.bin"),
                   _use_new_zipfile_serialization=fmt == "bin")
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


@pytest.mark.parametrize("fmt", ["safetensors", "bin", "legacy-bin"])
def test_hf_checkpoint_loads_with_identical_logits(tmp_path, fmt):
    state = saved = hf_gpt2_state(SMALL)
    if fmt == "safetensors":  # HF's safetensors files drop the tied head and the prefix
        saved = {k.removeprefix("transformer."): v for k, v in state.items()
                 if k != "lm_head.weight"}
    write_hf_checkpoint(tmp_path, saved, SMALL, fmt)
    loaded = checkpoint.load_checkpoint(str(tmp_path))
    idx = torch.randint(0, 257, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_dense(idx[None])[0],
                                   hf_gpt2_logits(state, SMALL, idx), rtol=1e-4, atol=1e-4)


def test_a_saved_checkpoint_ends_at_its_tokenizers_end_of_text(tmp_path):
    """save_checkpoint writes the byte-level tokenizer: its <|endoftext|> (256) is the EOS
    whatever the model's vocab_size (it was vocab_size - 1); a model too narrow to embed the
    tokenizer's ids is refused."""
    wide = M.GPT(M.GPTConfig(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    checkpoint.save_checkpoint(wide, str(tmp_path))
    assert checkpoint.load_model(str(tmp_path)).eos_token_ids == [256]
    narrow = M.GPT(M.GPTConfig(vocab_size=100, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="tokenizer's 257 ids; the model embeds 100"):
        checkpoint.save_checkpoint(narrow, str(tmp_path / "narrow"))


def test_gpt2_checkpoint_round_trips_through_our_llama_names(tmp_path):
    """The shipped GPT-2 checkpoint, loaded (renamed to our Llama-style names, q, k, v split
    out of c_attn, Conv1D weights transposed) and saved again, is the same file's tensors."""
    shipped = os.path.join(HERE, "checkpoints", "shakespeare")
    checkpoint.save_checkpoint(checkpoint.load_checkpoint(shipped), str(tmp_path))
    before = checkpoint.read_safetensors(os.path.join(shipped, "model.safetensors"))
    after = checkpoint.read_safetensors(str(tmp_path / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), "missing tensor h.1.mlp.c_fc.bias"),
    (lambda s: s.update({"transformer.wpe.weight": torch.zeros(10, 48)}), "wpe.weight has shape"),
], ids=["missing-tensor", "wrong-shape"])
def test_bad_checkpoint_names_the_problem(tmp_path, damage, message):
    state = hf_gpt2_state(SMALL)
    damage(state)
    write_hf_checkpoint(tmp_path, state, SMALL, "safetensors")
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("header", [b"\xff" * 4, struct.pack("<Q", 10**9) + b"{}",
                                    struct.pack("<Q", 5) + b"nope!"],
                         ids=["truncated", "length-past-end", "not-json"])
def test_corrupt_safetensors_header_is_reported(tmp_path, header):
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "safetensors")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(header)
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        checkpoint.load_checkpoint(str(tmp_path))


def rewrite_header(path, change) -> None:
    """Rewrite model.safetensors' header in directory path with change(header), its tensor
    bytes kept (the header padded to its old length, so that offsets still hold)."""
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    length = struct.unpack("<Q", data[:8])[0]
    header = change(json.loads(data[8:8 + length]))
    head = header
    if not isinstance(header, bytes):
        head = json.dumps(header, separators=(",", ":")).encode()
    assert len(head) <= length, "the changed header must fit in the old one"
    with open(file, "wb") as f:
        f.write(data[:8] + head.ljust(length) + data[8 + length:])


def first_entry(header: dict) -> str:
    return next(name for name in header if name != "__metadata__")


def size(header: dict) -> int:
    """The first entry's bytes: a negative offset that keeps it is wrong by its sign alone."""
    start, end = header[first_entry(header)]["data_offsets"]
    return end - start


def overlap_first_two(header: dict) -> dict:
    first, second = [name for name in header if name != "__metadata__"][:2]
    start, end = header[first]["data_offsets"]
    size = end - start
    second_start = header[second]["data_offsets"][0]
    header[first]["data_offsets"] = [second_start, second_start + size]
    return header


@pytest.mark.parametrize("change, message", [
    (lambda h: b"[1, 2]", "not a JSON object"),
    (lambda h: h | {first_entry(h): 5}, "corrupt safetensors entry"),
    (lambda h: h | {first_entry(h): h[first_entry(h)] | {"data_offsets": [-size(h), 0]}},
     "corrupt safetensors entry"),
    (lambda h: h | {first_entry(h): h[first_entry(h)] | {"shape": [-257, -48]}},
     "corrupt safetensors entry"),
    (overlap_first_two, "overlap"),
    (lambda h: json.dumps(h, separators=(",", ":")).replace(
        '"__metadata__"', f'"{first_entry(h)}"', 1).encode(), "a key comes twice"),
], ids=["not-an-object", "entry-not-an-object", "negative-offset", "negative-shape",
        "overlapping-tensors", "repeated-name"])
def test_a_damaged_safetensors_entry_is_refused_not_read(tmp_path, change, message):
    """A damaged header is an error naming the file, never a tensor read from the wrong
    bytes: a negative offset would read the header as weights, an overlap another tensor."""
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "safetensors")
    rewrite_header(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


def test_integer_tensors_are_not_weights(tmp_path):
    state = hf_gpt2_state(SMALL)
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].to(torch.int64)
    checkpoint.write_safetensors(state, str(tmp_path / "model.safetensors"))
    write_hf_checkpoint(tmp_path / "x", state, SMALL, "bin")  # its config.json, beside
    shutil.copy(tmp_path / "x" / "config.json", tmp_path)
    with pytest.raises(ValueError, match="ln_f.weight holds torch.int64, not weights"):
        checkpoint.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("content, message", [
    (b"not a pickle", "is not a PyTorch state dict"),
    (b"", "is not a PyTorch state dict"),
    (None, "is not a state dict of tensors"),
], ids=["garbage", "empty", "a-list"])
def test_a_pytorch_model_bin_that_is_no_state_dict_is_refused(tmp_path, content, message):
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "bin")
    file = tmp_path / "pytorch_model.bin"
    if content is None:
        torch.save([torch.zeros(2)], file)
    else:
        file.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(str(tmp_path))


def mapped_ranges(file) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `file` (Linux's /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == os.path.realpath(file):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_pytorch_model_bin_is_memory_mapped_not_read_whole(tmp_path):
    """As a safetensors file is: loaded on a CPU in the file's dtype, a parameter is a view of
    the mapped file (host memory: its pages), not of a copy torch.load read whole."""
    write_hf_checkpoint(tmp_path, hf_gpt2_state(SMALL), SMALL, "bin")  # fp32, as loaded
    model = checkpoint.load_checkpoint(str(tmp_path))
    embedding = model.model.embed_tokens.weight.data_ptr()  # wte: stored as used, no transpose
    ranges = mapped_ranges(tmp_path / "pytorch_model.bin")
    assert any(start <= embedding < end for start, end in ranges)


# ----------------------------------------------------------------------------- checkpoints as published

def test_sharded_checkpoint_loads_as_the_whole_one(tmp_path):
    """model.safetensors.index.json: each tensor from the shard its weight_map names."""
    source = os.path.join(MODEL_FIXTURES, "mistral")
    tensors = checkpoint.read_safetensors(os.path.join(source, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    for shard, shard_names in shards.items():
        shard_tensors = {name: tensors[name] for name in shard_names}
        checkpoint.write_safetensors(shard_tensors, str(tmp_path / shard))
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    whole = checkpoint.load_checkpoint(source).state_dict()
    sharded = checkpoint.load_checkpoint(str(tmp_path)).state_dict()
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)
    first_shard, second_shard = shards
    copy = {names[0]: tensors[names[0]] * 0} | {name: tensors[name] for name in names[10:]}
    checkpoint.write_safetensors(copy, str(tmp_path / second_shard))
    with pytest.raises(ValueError, match=f"holds {names[0]}, which .* places in {first_shard}"):
        checkpoint.load_checkpoint(str(tmp_path))  # a second copy would win without a word
    outside = weight_map | {names[0]: "../" + first_shard}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": outside}))
    with pytest.raises(ValueError, match="weight_map names '../model-00001-of-00002"):
        checkpoint.load_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / second_shard).unlink()
    with pytest.raises(ValueError, match="lists shard model-00002-of-00002.safetensors, which is "
                                         "missing"):
        checkpoint.load_checkpoint(str(tmp_path))


def test_a_shard_may_hold_a_tensor_its_index_omits(tmp_path):
    """Some transformers versions write Llama's RoPE buffer (rotary_emb.inv_freq) into a shard
    but not into the index's weight_map: such a checkpoint loads as the whole one (the buffer
    dropped, RoPE's frequencies computed). Only a tensor the index places in another shard is
    refused (test_sharded_checkpoint_loads_as_the_whole_one)."""
    source = os.path.join(MODEL_FIXTURES, "mistral")
    whole = checkpoint.load_checkpoint(source)
    tensors = checkpoint.read_safetensors(os.path.join(source, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    buffer = {"model.layers.0.self_attn.rotary_emb.inv_freq": whole.rotary.inv_freq}
    for i, (shard, shard_names) in enumerate(shards.items()):
        shard_tensors = {name: tensors[name] for name in shard_names} | (buffer if i else {})
        checkpoint.write_safetensors(shard_tensors, str(tmp_path / shard))
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    sharded = checkpoint.load_checkpoint(str(tmp_path)).state_dict()
    assert all(torch.equal(t, sharded[name]) for name, t in whole.state_dict().items())


def test_every_eos_id_of_the_checkpoint_ends_a_request(tmp_path):
    """eos_token_id as an int or a list, in generation_config.json and config.json: each one
    ends a request (the union, generation_config's first), and min_tokens bans them all."""
    llm = fixture_llm("qwen3", tmp_path)
    prompt = [5, 6, 7]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, second = llm.generate([prompt], greedy)[0].outputs[0].token_ids[:2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [second, 256]}))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"eos_token_id": [first]}))
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    assert llm.engine.eos_token_ids == [second, 256, first]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, min_tokens=3))[0]
    assert not {first, second} & set(out.outputs[0].token_ids[:3])


def test_an_eos_id_past_the_vocabulary_is_refused_naming_the_file(tmp_path):
    fixture_llm("qwen3", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 5000]}))
    with pytest.raises(ValueError, match="generation_config.json eos_token_id \\[5, 5000\\] is "
                                         "not a token id of the model \\(0 to 256\\)"):
        checkpoint_llm(tmp_path)


def test_checkpoint_without_eos_ids_ends_at_the_tokenizers_end_of_text(tmp_path):
    llm = fixture_llm("qwen3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = checkpoint_llm(tmp_path, kv_cache_tokens=1024).engine
    assert engine.eos_token_ids == [256] and llm.engine.eos_token_ids == [256]


def test_embedding_rows_past_the_tokenizer_are_never_sampled(tmp_path):
    """A model that embeds 300 ids served with a 257-id tokenizer (as Qwen pads its embedding
    past its tokenizer): the extra rows' logits are the largest, yet never sampled, never
    scored, and a request may not name them."""
    config = dataclasses.replace(SMALL, vocab_size=300)
    state = {k: v for k, v in hf_gpt2_state(config).items() if k != "lm_head.weight"}
    state["transformer.wte.weight"][257:] = 0
    write_hf_checkpoint(tmp_path, state, config, "safetensors")
    with torch.no_grad():  # the padding rows made 10x the last hidden state: their logits win
        model = checkpoint.load_checkpoint(str(tmp_path))
        hidden = model.dense_hidden_states(torch.tensor([[1, 2, 3]]))
    state["transformer.wte.weight"][257:] = 10 * hidden[0, -1]
    write_hf_checkpoint(tmp_path, state, config, "safetensors")
    write_byte_tokenizer(tmp_path)
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    assert llm.engine.vocab_size == 257
    dense = llm.engine.model.forward_dense(torch.tensor([[1, 2, 3]]))[0, -1]
    assert dense.argmax() >= 257  # the padding wins, where it is not cut off
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, temperature=1.5, seed=0,
                                                   logprobs=5))[0].outputs[0]
    first = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert first.outputs[0].token_ids[0] < 257
    assert max(out.token_ids) < 257
    assert all(token_id < 257 for entry in out.logprobs for token_id in entry)
    with pytest.raises(ValueError, match="token ids must be integers in"):
        llm.generate([[1, 299]], SamplingParams(max_tokens=1))


def test_a_model_name_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    """--model Org/Name: the snapshot in $HF_HUB_CACHE that has a config.json; else the error
    says where it looked and how to download it."""
    snapshot = tmp_path / "models--Org--Tiny-Llama" / "snapshots" / "abc123"
    fixture_llm("llama3-tied", snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    llm = LLM(model="Org/Tiny-Llama", kv_cache_tokens=1024, device="cpu")
    assert llm.engine.checkpoint.path == str(snapshot)
    with pytest.raises(ValueError, match=r"nor in the Hugging Face cache .*huggingface-cli "
                                         r"download Org/Missing"):
        LLM(model="Org/Missing", device="cpu")


def test_dtype_auto_is_float32_on_a_cpu_and_the_checkpoints_on_cuda(tmp_path):
    """The fixtures say torch_dtype bfloat16: auto on a CPU computes in float32 (exact), on
    CUDA (which asks for no dtype) it takes bfloat16 from the checkpoint (run_dtype, called
    here directly), and bfloat16 for a checkpoint that says nothing."""
    engine = fixture_llm("qwen3", tmp_path, dtype="auto").engine
    assert engine.checkpoint.dtype == torch.float32
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert checkpoint.run_dtype(None, torch.bfloat16) == torch.bfloat16
    assert checkpoint.run_dtype(None, None) == torch.bfloat16
    assert checkpoint.run_dtype(torch.float16, torch.bfloat16) == torch.float16


def test_a_checkpoint_loads_without_random_weights_and_in_its_own_dtype_without_a_copy():
    """The model is built on the meta device (its random init touches no memory) and takes
    the file's tensors as its parameters: in the file's dtype on a CPU not one byte is
    copied (the parameters are views of the memory-mapped file) but the stacked projections,
    concatenated once each (q, k, v into qkv_proj; gate, up into gate_up_proj), equal to the
    file's bits."""
    path = os.path.join(MODEL_FIXTURES, "qwen3")  # bf16 weights
    with OpLog() as log:
        model = checkpoint.load_checkpoint(path, torch.bfloat16, "cpu")
    # what writes real memory: RoPE's frequencies alone (head_dim / 2 values, computed)
    writes = ("normal_", "uniform_", "zero_", "fill_", "copy_", "_to_copy", "clone", "cat")
    written = [(name, numel) for name, device, numel, _ in log.ops
               if device == "cpu" and name.startswith(writes) and numel > model.config.head_dim]
    assert written == []
    merges = [name for name, *_ in log.ops if name.startswith("cat")]  # of a list: no device
    assert merges == ["cat.default"] * 2 * model.config.n_layer
    stored = checkpoint.read_safetensors(os.path.join(path, "model.safetensors"))
    params = model.state_dict()  # Hugging Face's names: the stacked ones split, as views
    assert all(torch.equal(params[name], t) and params[name].dtype == torch.bfloat16
               for name, t in stored.items())
    assert model.rotary.inv_freq.dtype == torch.float32  # RoPE's frequencies stay exact


def test_a_checkpoint_converts_each_tensor_once_to_the_dtype_it_runs_in():
    """Loaded in fp32 from bf16, each stored tensor is converted exactly once, straight into
    the parameter the model keeps, and the model computes as before the change of loader."""
    path = os.path.join(MODEL_FIXTURES, "qwen3")
    with OpLog() as log:
        model = checkpoint.load_checkpoint(path)
    stored = checkpoint.read_safetensors(os.path.join(path, "model.safetensors"))
    conversions = [name for name, device, numel, dtype in log.ops
                   if name.startswith("_to_copy") and dtype == torch.bfloat16]
    assert len(conversions) == len(stored)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    params = model.state_dict()  # Hugging Face's names: the stacked ones split, as views
    assert all(torch.equal(params[name], t.float()) for name, t in stored.items())


def test_an_engine_in_bfloat16_runs_the_checkpoint_in_bfloat16(tmp_path):
    """--dtype bfloat16 on a CPU: weights and KV cache in bf16, RoPE's frequencies in fp32,
    and the greedy tokens those of the same model loaded in fp32 then cast to bf16."""
    llm = fixture_llm("qwen3", tmp_path, dtype="bfloat16")
    engine = llm.engine
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.model_runner.k_caches.dtype == torch.bfloat16
    assert engine.model.rotary.inv_freq.dtype == torch.float32
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate([[1, 2, 3, 4, 5]], params)[0].outputs[0].token_ids
    cast = fixture_llm("qwen3", tmp_path / "cast", dtype="float32")
    cast.engine.model.to(torch.bfloat16)
    cast.engine.model_runner.k_caches = cast.engine.model_runner.k_caches.to(torch.bfloat16)
    cast.engine.model_runner.v_caches = cast.engine.model_runner.v_caches.to(torch.bfloat16)
    want = cast.generate([[1, 2, 3, 4, 5]], params)[0].outputs[0].token_ids
    assert got == want


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_a_checkpoint_runs_in_the_dtype_its_config_names(tmp_path, key):
    """Asked for no dtype (--dtype auto on CUDA), a checkpoint runs in config.json's
    torch_dtype, or transformers 5's dtype key: float16 here, since the fixtures' bfloat16 is
    also what a checkpoint that names none runs in."""
    shutil.copytree(os.path.join(MODEL_FIXTURES, "qwen3"), tmp_path, dirs_exist_ok=True)
    write_byte_tokenizer(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(hf | {key: "float16"}))
    loaded = checkpoint.load_model(str(tmp_path))
    assert loaded.dtype == torch.float16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float16}


def test_a_tied_checkpoint_that_stores_its_heads_copy_loads_tied(tmp_path):
    """Some tied checkpoints store lm_head.weight, a copy of the embedding, as well (the
    fixtures and published files in these tests do not): the copy is dropped, and the head
    is the embedding, one parameter."""
    source = os.path.join(MODEL_FIXTURES, "qwen3")  # tied
    tensors = checkpoint.read_safetensors(os.path.join(source, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    checkpoint.write_safetensors(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    model = checkpoint.load_checkpoint(str(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def write_published_qwen(path) -> Tokenizer:
    """A tiny Qwen2 checkpoint laid out as Qwen2.5-Instruct is published: config.json (bf16,
    a sliding_window that use_sliding_window turns off), two safetensors shards and their
    index, the embedding padded past the tokenizer, a tokenizer.json (the Qwen2-style
    fixture), a ChatML template in tokenizer_config.json, and generation_config.json with two
    EOS ids and sampling defaults. Random weights in bf16. Returns its tokenizer."""
    tokenizer_dir = os.path.join(HERE, ".ci", "fixtures", "tokenizers", "qwen2")
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), path)
    tokenizer = load_tokenizer(tokenizer_dir)
    hf = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_theta=1e6, rope_scaling=None, hidden_act="silu", tie_word_embeddings=True,
              vocab_size=tokenizer.n_vocab + 42, sliding_window=64, use_sliding_window=False,
              max_window_layers=2, torch_dtype="bfloat16", eos_token_id=800)
    (path / "config.json").write_text(json.dumps(hf))
    torch.manual_seed(0)
    model = M.GPT(checkpoint.config_from_hf(hf, str(path)))
    state = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()
             if name != "lm_head.weight"}  # tied: published without it
    names = sorted(state)
    weight_map = {}
    for i, shard_names in enumerate((names[:9], names[9:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        shard_tensors = {name: state[name] for name in shard_names}
        checkpoint.write_safetensors(shard_tensors, str(path / shard))
        weight_map |= dict.fromkeys(shard_names, shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                     "<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        chat_template=chat_template, eos_token="<|im_end|>", bos_token=None)))
    (path / "generation_config.json").write_text(json.dumps(dict(
        eos_token_id=[802, 800], temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=12)))
    return tokenizer


@torch.inference_mode()
def test_a_checkpoint_as_published_serves_end_to_end(tmp_path):
    """Everything a published checkpoint brings, at once: the greedy reply to a chat equals a
    dense greedy loop over the model's own weights (bf16 on disk, fp32 here) on the prompt
    the template renders, taking only the tokenizer's ids, ending at an EOS of
    generation_config.json; an unset field takes the checkpoint's default."""
    tokenizer = write_published_qwen(tmp_path)
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=2048)
    engine = llm.engine
    assert engine.eos_token_ids == [802, 800] and engine.vocab_size == tokenizer.n_vocab
    assert engine.sampling_defaults == dict(temperature=0.7, top_p=0.8, top_k=20, max_tokens=12)
    messages = [dict(role="user", content="Wherefore art thou?")]
    prompt = engine.chat_template.render(messages, {})
    assert prompt == "<|im_start|>user\nWherefore art thou?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    want = []
    for _ in range(12):  # the dense greedy loop, over the tokenizer's ids only
        logits = engine.model.forward_dense(torch.tensor([ids + want]))[0, -1, :tokenizer.n_vocab]
        want.append(int(logits.argmax()))
        if want[-1] in (802, 800):
            break
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    default = llm.generate([prompt])[0].outputs[0]  # the checkpoint's defaults: at most 12
    assert len(default.token_ids) <= 12 and max(default.token_ids) < tokenizer.n_vocab
    with server_in_process(engine) as url:
        status, reply = http(url, "/v1/chat/completions", dict(messages=messages, temperature=0,
                                                              max_tokens=12))
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == out.outputs[0].text
    assert_no_leaks(engine)


REPETITION_PENALTY_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".ci",
                                          "fixtures", "repetition_penalty.json")


def straddling_gpt2_state() -> dict[str, torch.Tensor]:
    """hf_gpt2_state(SMALL) with the most likely tokens' logits straddling 0, so that both of
    the repetition penalty's rules (divide a positive logit, multiply a negative one) pick
    tokens: every token's embedding is -1 in channel 0 (the position embeddings' +1 there
    cancels it in the input), so the tied head adds the same -h[0] to every logit, and ln_f's
    bias in channel 0 is raised by 1.5 to make that about -1.5: it moves all logits alike, so
    their ranking is what it would be without it."""
    state = hf_gpt2_state(SMALL)
    state["transformer.wte.weight"][:, 0] = -1.0  # lm_head.weight is the same tensor
    state["transformer.wpe.weight"][:, 0] += 1.0
    state["transformer.ln_f.bias"][0] += 1.5
    return state


def write_random_gpt2(path) -> None:
    """straddling_gpt2_state() as a Hugging Face GPT-2 directory that LLM(model=path) loads:
    the weights plus byte-level tokenizer files (ids 0-255 the bytes, 256 <|endoftext|>).
    .ci/make_repetition_penalty_fixture.py loads the same directory."""
    write_hf_checkpoint(path, straddling_gpt2_state(), SMALL, "safetensors")
    write_byte_tokenizer(path)


def tokens_before_near_tie(gaps: list[float]) -> int:
    """How many leading tokens of a greedy reference any correct implementation must match:
    those before the first whose top-two logits were within NEAR_TIE (there either token is
    right, and after it the two continue from different texts)."""
    return next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps))


def test_greedy_repetition_penalty_equals_transformers(tmp_path):
    """Greedy decoding with repetition_penalty picks the tokens that Hugging Face transformers'
    generate(do_sample=False, repetition_penalty=p) picks on the same random GPT-2, several
    penalties (above and below 1) batched together. The reference is a fixture that
    .ci/make_repetition_penalty_fixture.py recorded, so the tests do not need transformers."""
    if not os.path.exists(REPETITION_PENALTY_FIXTURE):
        pytest.skip(f"{REPETITION_PENALTY_FIXTURE} is missing; make it with "
                    "python .ci/make_repetition_penalty_fixture.py (needs transformers)")
    with open(REPETITION_PENALTY_FIXTURE) as f:
        cases = json.load(f)["cases"]
    write_random_gpt2(tmp_path)
    llm = checkpoint_llm(tmp_path)
    params = [SamplingParams(max_tokens=len(case["token_ids"]), temperature=0, ignore_eos=True,
                             repetition_penalty=case["repetition_penalty"]) for case in cases]
    outputs = token_ids(llm.generate([case["prompt_token_ids"] for case in cases], params))
    compared = 0
    for case, got in zip(cases, outputs):
        n = tokens_before_near_tie(case["top_two_gaps"])
        assert got[:n] == case["token_ids"][:n], case
        compared += n
    total = sum(len(case["token_ids"]) for case in cases)
    assert compared >= total // 2, f"near-ties left only {compared} of {total} tokens to compare"


@needs_shared
def test_gpt2_tokenizer_from_shared_files_gives_gpt2_ids_and_round_trips_text():
    enc = load_tokenizer(SHARED_GPT2)
    assert enc.encode("Hello world") == [15496, 995]
    text = "héllo wörld, 你好, привет, 👋🏽 \u200b\ufeff\t\n"
    assert enc.decode(enc.encode(text)) == text
    assert enc.encode("<|endoftext|>") == [50256] == [enc.token_id(EOT)]
    assert enc.encoding.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_gpt2_name_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    checkpoint.save_checkpoint(M.GPT(SMALL), str(snapshot))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert checkpoint.hub_checkpoint("gpt2") == str(snapshot)
    assert LLM(model="gpt2").engine.model.config == SMALL


def test_download_writes_the_file_with_a_progress_line(tmp_path, capsys):
    import functools
    import http.server
    (tmp_path / "model.safetensors").write_bytes(b"w" * 2_500_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # loopback only
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "hub" / "snapshot" / "model.safetensors"
        url = f"http://127.0.0.1:{server.server_address[1]}/model.safetensors"
        checkpoint._download(url, str(target))
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
    first = LLM(device="cpu").generate(["ROMEO:"], params)[0].outputs[0]
    assert LLM(device="cpu").generate(["ROMEO:"], params)[0].outputs[0] == first
    assert len(first.text) > 20


# ----------------------------------------------------------------------------- config.json as published

CONFIGS = os.path.join(HERE, ".ci", "fixtures", "configs")  # README.md there: where each is from
LLAMA32_SCALING = dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                       original_max_position_embeddings=8192)
# Each config -> GPTConfig fields it must give. published/: the Hub's files; resaved/: public
# copies re-saved by transformers (_name_or_path, another torch_dtype, add_cross_attention).
PUBLISHED = {
    "published/openai-community--gpt2": dict(
        n_layer=12, n_head=12, n_kv_head=12, head_dim=64, n_embd=768, vocab_size=50257,
        n_positions=1024, norm="layernorm", position_encoding="learned",
        tie_word_embeddings=True),
    "published/Qwen--Qwen2.5-0.5B-Instruct": dict(
        n_layer=24, n_head=14, n_kv_head=2, head_dim=64, vocab_size=151936, n_positions=32768,
        tie_word_embeddings=True, qkv_bias=True, o_bias=False, rope_theta=1e6,
        rope_scaling=None),
    "published/meta-llama--Llama-3.2-1B-Instruct": dict(
        n_layer=16, n_head=32, n_kv_head=8, head_dim=64, vocab_size=128256,
        intermediate_size=8192, tie_word_embeddings=True, qkv_bias=False, rope_theta=5e5,
        rope_scaling=LLAMA32_SCALING),
    "published/Qwen--Qwen3-0.6B": dict(
        n_layer=28, n_head=16, n_kv_head=8, head_dim=128, n_embd=1024, vocab_size=151936,
        tie_word_embeddings=True, qk_norm=True, qkv_bias=False, rope_theta=1e6,
        rope_scaling=None),
    "published/HuggingFaceTB--SmolLM2-135M-Instruct": dict(
        n_layer=30, n_head=9, n_kv_head=3, head_dim=64, n_embd=576, vocab_size=49152,
        tie_word_embeddings=True, rope_theta=1e5, rope_scaling=None, norm_eps=1e-5),
    "resaved/DannyMeb--iShrink-LLM-Compression-Framework--Llama-3.2-1B-Instruct": dict(
        n_layer=16, n_head=32, n_kv_head=8, head_dim=64, rope_scaling=LLAMA32_SCALING),
    "resaved/infinityarpan--qwen-25-api--Qwen2.5-0.5B-Instruct": dict(
        n_layer=24, n_head=14, n_kv_head=2, head_dim=64, qkv_bias=True, rope_scaling=None),
    "resaved/jackyluo-learning--forcing-audit-artifact--gpt2": dict(
        n_layer=12, n_head=12, head_dim=64, vocab_size=50257, tie_word_embeddings=True),
}
SMALL_LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, head_dim=16, n_embd=64, vocab_size=257,
                   n_positions=256, intermediate_size=128, norm="rmsnorm", mlp="swiglu")
# Each family as transformers 5 saves it (transformers5/, make_saved_configs.py).
SAVED = {
    "gpt2": dict(n_layer=2, n_head=4, n_kv_head=4, head_dim=16, n_embd=64, vocab_size=257,
                 n_positions=256, norm="layernorm", tie_word_embeddings=True),
    "llama": SMALL_LLAMA | dict(tie_word_embeddings=False, qkv_bias=False, rope_theta=1e4,
                                rope_scaling=None),
    "llama3": SMALL_LLAMA | dict(tie_word_embeddings=True, rope_theta=5e5, rope_scaling=dict(
        factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
        original_max_position_embeddings=64)),
    "qwen2": SMALL_LLAMA | dict(tie_word_embeddings=True, qkv_bias=True, o_bias=False),
    "qwen3": SMALL_LLAMA | dict(head_dim=32, tie_word_embeddings=True, qk_norm=True,
                                qkv_bias=False),
    "mistral": SMALL_LLAMA | dict(tie_word_embeddings=False, qkv_bias=False, rope_scaling=None),
}
# Every PretrainedConfig attribute transformers 4 writes when it writes them all (to_dict(),
# "Model config ..." in its logs, to_json_file(use_diff=False)), each at its default.
TRANSFORMERS4_DEFAULTS = dict(
    return_dict=True, output_hidden_states=False, output_attentions=False, torchscript=False,
    use_bfloat16=False, tf_legacy_loss=False, pruned_heads={}, chunk_size_feed_forward=0,
    is_encoder_decoder=False, is_decoder=False, cross_attention_hidden_size=None,
    add_cross_attention=False, tie_encoder_decoder=False, max_length=20, min_length=0,
    do_sample=False, early_stopping=False, num_beams=1, num_beam_groups=1,
    diversity_penalty=0.0, temperature=1.0, top_k=50, top_p=1.0, typical_p=1.0,
    repetition_penalty=1.0, length_penalty=1.0, no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0, bad_words_ids=None, num_return_sequences=1,
    output_scores=False, return_dict_in_generate=False, forced_bos_token_id=None,
    forced_eos_token_id=None, remove_invalid_values=False, exponential_decay_length_penalty=None,
    suppress_tokens=None, begin_suppress_tokens=None, finetuning_task=None,
    id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1},
    tokenizer_class=None, prefix=None, sep_token_id=None, decoder_start_token_id=None,
    task_specific_params=None, problem_type=None, _name_or_path="meta-llama/Llama-3.2-1B",
    _commit_hash="4e20de362430cd3b72f300e6b0f18e50e7166e08",
    _attn_implementation_autoset=True)


def read_config(name: str) -> dict:
    with open(os.path.join(CONFIGS, name + ".json")) as f:
        return json.load(f)


def fields(config: M.GPTConfig, want: dict) -> dict:
    return {name: getattr(config, name) for name in want}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_gives_the_models_shape(name):
    """config.json of gpt2, Qwen2.5-0.5B-Instruct, Llama-3.2-1B-Instruct, Qwen3-0.6B and
    SmolLM2-135M-Instruct as the Hub has them, and re-saved copies of them (_name_or_path,
    GPT-2 saved by transformers 5 with add_cross_attention false): each is served, with its
    sizes, biases, tying and RoPE."""
    want = PUBLISHED[name]
    assert fields(checkpoint.config_from_hf(read_config(name), name), want) == want


@pytest.mark.parametrize("form", ["", "-full"], ids=["save_pretrained", "full"])
@pytest.mark.parametrize("family", sorted(SAVED))
def test_transformers5_saved_config_gives_the_models_shape(family, form):
    """Each family's config.json as transformers 5 writes it: by save_pretrained (architectures,
    dtype, GPT-2's add_cross_attention false, pad_token_id null, rope_parameters, layer_types)
    and in full (_name_or_path, id2label, return_dict, is_encoder_decoder false, ...)."""
    want = SAVED[family]
    config = checkpoint.config_from_hf(read_config(f"transformers5/{family}{form}"), family)
    assert fields(config, want) == want


def test_transformers4_full_config_is_served():
    """A config with every PretrainedConfig attribute transformers 4 writes in full, each at its
    default (generation defaults, pruned_heads {}, torchscript false, ...), gives the config
    of the keys that matter alone."""
    published = read_config("published/meta-llama--Llama-3.2-1B-Instruct")
    full = published | TRANSFORMERS4_DEFAULTS
    assert checkpoint.config_from_hf(full, "x") == checkpoint.config_from_hf(published, "x")


def test_metadata_at_any_value_changes_nothing():
    """Metadata (any key starting with "_" among it), training-only settings and generation
    defaults are served whatever their value: the GPTConfig is the same."""
    saved = read_config("transformers5/qwen3")
    metadata = dict(_name_or_path="/data/run-7/checkpoint-500", _commit_hash="abc",
                    _model_name_or_path="Qwen/Qwen3-0.6B", _attn_implementation_autoset=True,
                    architectures=None, dtype="float16", transformers_version="4.30.0",
                    id2label={"0": "a", "1": "b", "2": "c"}, num_labels=3,
                    problem_type="regression", temperature=0.7, top_p=0.8, max_length=4096,
                    use_cache=False, output_hidden_states=True, torchscript=True,
                    is_decoder=True, chunk_size_feed_forward=4, attention_dropout=0.1,
                    initializer_range=0.5, gradient_checkpointing=True, pad_token_id=7)
    served = checkpoint.config_from_hf(saved, "x")
    assert checkpoint.config_from_hf(saved | metadata, "x") == served


NOT_NEUTRAL = [
    ("gpt2", "add_cross_attention", True,
     "config.json add_cross_attention True is not served (cross-attention; only False)"),
    ("qwen3", "cross_attention_hidden_size", 64, "cross_attention_hidden_size 64 is not served"),
    ("llama", "is_encoder_decoder", True,
     "is_encoder_decoder True is not served (an encoder-decoder model; only False)"),
    ("qwen2", "tie_encoder_decoder", True, "tie_encoder_decoder True is not served"),
    ("gpt2", "pruned_heads", {"0": [1, 2]},
     "pruned_heads {'0': [1, 2]} is not served (attention heads pruned away; only {})"),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True,
     "scale_attn_by_inverse_layer_idx True is not served"),
    ("gpt2", "tie_word_embeddings", False,
     "tie_word_embeddings False is not served (an LM head of its own; only True)"),
    ("gpt2", "activation_function", "relu",
     "activation_function 'relu' is not served (another activation; only 'gelu_new' or "
     "'gelu_pytorch_tanh')"),
    ("gpt2", "n_ctx", 512, "n_ctx 512 is not served"),
    ("mistral", "hidden_act", "gelu", "hidden_act 'gelu' is not served"),
    ("qwen2", "use_mrope", True, "use_mrope True is not served (Qwen2-VL's multimodal RoPE"),
]


@pytest.mark.parametrize("family, key, value, message", NOT_NEUTRAL,
                         ids=[key for _, key, _, _ in NOT_NEUTRAL])
def test_a_flag_away_from_its_neutral_value_is_refused_by_name(family, key, value, message):
    """A flag transformers writes at its neutral value, set to another (cross-attention, an
    encoder-decoder, pruned heads, GPT-2's own flags): refused by name, with what it would
    bring and the value served."""
    hf = read_config(f"transformers5/{family}-full") | {key: value}
    with pytest.raises(ValueError) as error:
        checkpoint.config_from_hf(hf, "x")
    assert message in str(error.value)


@pytest.mark.parametrize("family, flag, want", [
    ("llama", "attention_bias", dict(qkv_bias=True, o_bias=True, mlp_bias=False)),
    ("llama", "mlp_bias", dict(qkv_bias=False, o_bias=False, mlp_bias=True)),
    ("qwen3", "attention_bias", dict(qkv_bias=True, o_bias=True, mlp_bias=False)),
], ids=["llama-attention", "llama-mlp", "qwen3-attention"])
def test_a_bias_flag_set_gives_its_biases(family, flag, want):
    """attention_bias true gives Llama and Qwen3 biases on q, k, v and o; mlp_bias true gives
    Llama its MLP's. Every fixture and published config here has them false."""
    hf = read_config(f"transformers5/{family}") | {flag: True}
    assert fields(checkpoint.config_from_hf(hf, "x"), want) == want


@pytest.mark.parametrize("family, key, value", [
    ("gpt2", "quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128}),
    ("llama", "auto_map", {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
    ("qwen3", "partial_rotary_factor", 0.5),
    ("mistral", "num_experts_per_tok", 2),
    ("llama3", "attn_logit_softcapping", 50.0),
], ids=["quantized", "remote-code", "partial-rope", "experts", "softcapping"])
def test_an_unknown_key_is_still_refused_by_name(family, key, value):
    """A key config_from_hf does not know may change the computation: refused by name."""
    hf = read_config(f"transformers5/{family}") | {key: value}
    with pytest.raises(ValueError, match=f"config.json key '{key}' is not served"):
        checkpoint.config_from_hf(hf, "x")


# ----------------------------------------------------------------------------- SmolLM2 as published

# HuggingFaceTB/SmolLM2-135M-Instruct's files besides the weights (README.md there: where from);
# .ci/fixtures/smollm2/check_smollm2.py runs the real model against transformers
SMOLLM2 = os.path.join(HERE, ".ci", "fixtures", "smollm2")
SMOLLM2_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                 "generation_config.json"]
# config.json's sizes cut, the layout kept: grouped heads 9:3 (3 query heads a K/V head),
# head_dim apart from hidden_size / heads, its vocabulary, tied head, RoPE and RMSNorm
SMALL_SMOLLM2 = dict(num_hidden_layers=2, hidden_size=72, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=16, intermediate_size=128)
# What the real tokenizer gives, recorded with tokenizers 0.23.3 and transformers 5.24.0 from
# the fixture's tokenizer.json (Tokenizer.from_file(...).encode(text).ids) and its chat
# template (AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True,
# tokenize=False), then encode(..., add_special_tokens=False)).
SMOLLM2_TEXT = ("Hello, world! It's 2024: naïve café costs 3.50 €.\n"
                "\tdef f(x):  return x**2  # 你好 👋")
SMOLLM2_TEXT_IDS = [19556, 28, 905, 17, 657, 506, 216, 34, 32, 34, 36, 42, 15486, 46494, 37366,
                    3499, 216, 35, 30, 37, 32, 24927, 30, 198, 197, 1604, 275, 24, 104, 727, 216,
                    1003, 1792, 828, 34, 216, 907, 216, 18645, 250, 48392, 138, 15107, 235, 229]
SMOLLM2_MESSAGES = [dict(role="user", content="What is 2+2?")]
SMOLLM2_CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n")
SMOLLM2_CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                    7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27,
                    34, 47, 2, 198, 1, 520, 9531, 198]
IM_END = 2  # <|im_end|>: generation_config.json's eos_token_id, the end of a turn


def write_small_smollm2(path) -> dict:
    """SmolLM2-135M-Instruct's checkpoint directory as published (the committed files), but
    small: config.json's sizes SMALL_SMOLLM2, and random fp32 weights under Hugging Face's
    Llama names (tied: no lm_head.weight), written here by name, not from model.py. Returns
    the config.json written."""
    for name in SMOLLM2_FILES:
        shutil.copy(os.path.join(SMOLLM2, name), path)
    with open(os.path.join(SMOLLM2, "config.json")) as f:
        hf = json.load(f) | SMALL_SMOLLM2
    (path / "config.json").write_text(json.dumps(hf))
    g = torch.Generator().manual_seed(0)
    C, V, inner = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    q, kv = (hf["head_dim"] * hf[key] for key in ("num_attention_heads", "num_key_value_heads"))

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    state = {"model.embed_tokens.weight": r(V, C), "model.norm.weight": 1 + r(C)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": 1 + r(C),
                  p + "self_attn.q_proj.weight": r(q, C), p + "self_attn.k_proj.weight": r(kv, C),
                  p + "self_attn.v_proj.weight": r(kv, C), p + "self_attn.o_proj.weight": r(C, q),
                  p + "post_attention_layernorm.weight": 1 + r(C),
                  p + "mlp.gate_proj.weight": r(inner, C), p + "mlp.up_proj.weight": r(inner, C),
                  p + "mlp.down_proj.weight": r(C, inner)}
    checkpoint.write_safetensors(state, str(path / "model.safetensors"))
    return hf


def test_smollm2_tokenizer_gives_the_published_ids():
    """SmolLM2's own tokenizer.json (digits one by one, special tokens) and chat template give
    the ids Hugging Face's tokenizers and transformers give, and decode back to the text (the
    bytes its vocabulary lacks: test_tokenizer.py's missing_bytes fixture)."""
    tokenizer = load_tokenizer(SMOLLM2)
    assert tokenizer.encode(SMOLLM2_TEXT) == SMOLLM2_TEXT_IDS
    assert tokenizer.decode(SMOLLM2_TEXT_IDS) == SMOLLM2_TEXT
    assert tokenizer.encode(SMOLLM2_CHAT) == SMOLLM2_CHAT_IDS
    assert tokenizer.token_id("<|im_end|>") == IM_END


@torch.inference_mode()
def test_smollm2_as_published_serves_a_chat_end_to_end(tmp_path):
    """SmolLM2-135M-Instruct's own files with small random weights of its layout: it loads
    (grouped heads, tied head, its RoPE), its template renders the chat as transformers does,
    greedy decoding equals a dense greedy loop over the model's weights, and over HTTP the
    chat answers 200 with that text; <|im_end|> (generation_config.json's EOS) ends the turn
    and is not in the reply."""
    hf = write_small_smollm2(tmp_path)
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    engine = llm.engine
    config = engine.model.config
    assert (config.n_layer, config.n_head, config.n_kv_head, config.head_dim, config.n_embd) == (
        2, 9, 3, 16, 72)
    assert config.tie_word_embeddings and config.rope_theta == 1e5 and config.norm == "rmsnorm"
    assert engine.eos_token_ids == [IM_END] and engine.vocab_size == hf["vocab_size"]
    prompt = engine.chat_template.render(SMOLLM2_MESSAGES, {})
    assert prompt == SMOLLM2_CHAT
    want = []
    for _ in range(8):  # the dense greedy loop
        logits = engine.model.forward_dense(torch.tensor([SMOLLM2_CHAT_IDS + want]))[0, -1]
        want.append(int(logits.argmax()))
        if want[-1] == IM_END:
            break
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids == SMOLLM2_CHAT_IDS and out.outputs[0].token_ids == want
    with server_in_process(engine) as url:
        status, reply = http(url, "/v1/chat/completions", dict(
            messages=SMOLLM2_MESSAGES, temperature=0, max_tokens=8))
        assert status == 200 and reply["usage"]["prompt_tokens"] == len(SMOLLM2_CHAT_IDS)
        assert reply["choices"][0]["message"]["content"] == out.outputs[0].text
        assert reply["choices"][0]["finish_reason"] == ("stop" if IM_END in want else "length")
        # <|im_end|> made the likeliest token: the turn ends there, with no text
        status, reply = http(url, "/v1/chat/completions", dict(
            messages=SMOLLM2_MESSAGES, temperature=0, max_tokens=8, logit_bias={IM_END: 100}))
    assert status == 200 and reply["choices"][0]["message"]["content"] == ""
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 1
    assert_no_leaks(engine)


def resident_bytes(address: int) -> int:
    """The bytes of this process's memory (smaps' Rss) in the mapping that holds address."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms ...
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's smaps")
def test_a_merged_pieces_file_pages_leave_the_process_memory(tmp_path):
    """q/k/v and gate/up are copied into qkv_proj and gate_up_proj at load; the pieces' pages
    of the mapped file, read for the copy, are let go (else a load held them beside the copy:
    1.64x a SmolLM2 file at its peak, against 1.12x). A tensor that is not a view of the file
    is left alone."""
    path = str(tmp_path / "w.safetensors")
    checkpoint.write_safetensors({"piece": torch.randn(64, 4096), "kept": torch.ones(4096)}, path)
    tensors = checkpoint.read_safetensors(path)
    piece = tensors["piece"]
    piece.sum()  # read: its pages are resident
    before = resident_bytes(piece.data_ptr())
    checkpoint.release_file_pages({piece.data_ptr()}, piece)
    assert before - resident_bytes(piece.data_ptr()) >= 60 * 4096 * 4 // 2
    assert torch.equal(tensors["kept"], torch.ones(4096))
    copy = torch.randn(64, 4096)
    kept = copy.clone()
    checkpoint.release_file_pages({piece.data_ptr()}, copy)  # not a file view: untouched
    assert torch.equal(copy, kept)

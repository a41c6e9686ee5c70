"""model.py: GPT-2, shaped for serving, and what loads and trains it.

In order:
- the model: GPTConfig and its PRESETS; CausalSelfAttention, MLP, Block, GPT. Two forward paths
  run the same layers. `GPT.forward` is the engine's: one flat batch of tokens (N, C), every op
  but attention on all scheduled tokens at once (Orca's "selective batching"), attention reading
  and writing the paged KV cache through kernels.py, told where everything is by an
  AttentionMetadata. `GPT.forward_dense` is plain GPT-2 on (B, T): the training path and the
  paged path's reference; `GPT.dense_hidden_states` is its body, which can also keep K/V in a
  DenseKVCache, contiguous per sequence as Hugging Face keeps them (bench.py's naive baseline).
- tokenizers: the byte-level one of the presets, GPT-2's BPE files (tiktoken does the encoding),
  and the Detokenizer that turns a request's tokens into text a step at a time, stop strings
  included (each request's scheduler.Sequence holds one).
- checkpoints: Hugging Face GPT-2 directories read and written (safetensors by hand, Conv1D
  weights transposed on load), the hub download, load_model (what nanoserve.py calls).
- training: `python model.py --train FILE` trains the shipped byte-level model.

Left out: dropout, every architecture but GPT-2's (no rotary embeddings, no grouped-query
attention), tensor parallelism and quantisation.
Shape legend: N tokens in the flat batch, B batch, T time, C n_embd, H heads, D head dim.
"""
import argparse
import codecs
import inspect
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import AttentionMetadata, paged_attention_ref, store_kv


@dataclass
class GPTConfig:
    vocab_size: int = 257             # 256 bytes + <|endoftext|> (GPT-2: 50257)
    n_positions: int = 1024           # context length: prompt + generated tokens
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS = {"tiny": GPTConfig(),  # 3.5M parameters: tests, benchmarks, quick runs
           "gpt2": GPTConfig(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)}


@dataclass
class DenseKVCache:
    """K/V kept contiguous per sequence, as Hugging Face's generate keeps them: per layer, keys
    and values (B, H, max_len, D), a row per sequence. Positions 0..length hold K/V; a forward
    writes its T new tokens' at length..length + T, then length moves past them. Memory for
    max_len positions is taken up front for every row, whatever each will use: what the paged
    cache (kernels.py, paged_cache.py) avoids. bench.py's naive baseline runs on it."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def zeros(cls, config: GPTConfig, batch: int, max_len: int,
              like: torch.Tensor) -> "DenseKVCache":
        """An empty cache of `batch` rows, max_len positions each, in like's dtype and device."""
        shape = (batch, config.n_head, max_len, config.head_dim)
        keys = [like.new_zeros(shape) for _ in range(config.n_layer)]
        values = [like.new_zeros(shape) for _ in range(config.n_layer)]
        return cls(keys, values)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new tokens' k, v (B, H, T, D) into `layer` at length..length + T; return the
        layer's keys and values so far, (B, H, length + T, D) each."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (..., C) -> q, k, v (..., H, D)."""
        parts = self.c_attn(x).split(x.shape[-1], dim=-1)
        return tuple(t.unflatten(-1, (self.n_head, self.head_dim)) for t in parts)

    def forward(self, x, meta, k_cache, v_cache, attention):
        """Paged: x is the flat batch (N, C); each token's K/V are stored at its slot in the
        layer's k_cache, v_cache (NB, BS, H, D), then `attention` (kernels.py) reads each
        sequence's context back through its block table."""
        q, k, v = self.qkv(x)  # (N, H, D)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        y = attention(q, k_cache, v_cache, meta, 1.0 / math.sqrt(self.head_dim))
        return self.c_proj(y.flatten(1))

    def forward_dense(self, x, cache: DenseKVCache | None = None, layer: int = 0, mask=None):
        """Dense: x is (B, T, C). No cache: causal attention within x. A cache: x's K/V go into
        `layer` of it, and x attends to every cached position that `mask` allows."""
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x))  # (B, H, T, D)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values = cache.store(layer, k, v)  # (B, H, length + T, D)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """A transformer layer, pre-LayerNorm as in GPT-2: x + attention, then x + MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, meta, k_cache, v_cache, attention):
        """Paged: x (N, C); the arguments after x are CausalSelfAttention.forward's."""
        x = x + self.attn(self.ln_1(x), meta, k_cache, v_cache, attention)
        return x + self.mlp(self.ln_2(x))

    def forward_dense(self, x, cache: DenseKVCache | None = None, layer: int = 0, mask=None):
        """Dense: x (B, T, C); the arguments after x are CausalSelfAttention.forward_dense's."""
        x = x + self.attn.forward_dense(self.ln_1(x), cache, layer, mask)
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Linear):
    """The logits, computed in fp32 whatever the model's dtype: rounded to bf16 first, GPT-2's
    logits (tens in size) would lose up to a few tenths, moving log-probabilities and deciding
    near-ties in greedy by rounding. In bf16 the weight's fp32 copy costs a read of it a step
    (0.15 GB for GPT-2, on the few rows that sample); in fp32 both casts are free."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, C) -> (n, vocab) fp32
        return F.linear(hidden.float(), self.weight.float())


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.n_positions, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)))
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's init
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: torch.Tensor, v_caches: torch.Tensor, attention=paged_attention_ref):
        """Paged forward of the flat batch: input_ids, positions (N,) -> hidden states (N, C).
        Caches K/V in k_caches, v_caches (n_layer, NB, BS, H, D); `attention` is from kernels.py."""
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(positions)  # (N, C)
        for i, block in enumerate(tr.h):
            x = block(x, meta, k_caches[i], v_caches[i], attention)
        return tr.ln_f(x)

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
        tr = self.transformer
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = tr.wte(idx) + tr.wpe(positions)  # (B, T, C)
        for layer, block in enumerate(tr.h):
            x = block.forward_dense(x, cache, layer, mask)
        if cache is not None:  # every layer wrote its K/V at length..length + T
            cache.length += idx.shape[1]
        return tr.ln_f(x)


# ----------------------------------------------------------------------------- tokenizers
EOT = "<|endoftext|>"
GPT2_PATTERN = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"


def gpt2_byte_chars() -> list[tuple[int, str]]:
    """GPT-2's 256 one-byte tokens in id order, as (byte, the character vocab.json writes)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return [(b, chr(b)) for b in printable] + [(b, chr(256 + n)) for n, b in enumerate(others)]


def byte_tokenizer() -> tiktoken.Encoding:
    """256 byte tokens (GPT-2's first 256 ids) plus <|endoftext|> = 256: GPT-2 without merges."""
    ranks = {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}
    return tiktoken.Encoding(name="bytes", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: 256})


def tokenizer_files(path: str) -> tuple[str, str]:
    """The vocabulary and merges files in directory `path`: Hugging Face's names, else OpenAI's."""
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        vocab_file = os.path.join(path, vocab_name)
        merges_file = os.path.join(path, merges_name)
        if os.path.exists(vocab_file) and os.path.exists(merges_file):
            return vocab_file, merges_file
    raise ValueError(f"{path} has no tokenizer: expected vocab.json + merges.txt "
                     "or encoder.json + vocab.bpe")


def load_tokenizer(path: str) -> tiktoken.Encoding:
    """GPT-2 BPE: Hugging Face's vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe.
    The ranks the merges give must be the ids the vocabulary gives."""
    vocab_file, merges_file = tokenizer_files(path)
    byte_of = {ch: b for b, ch in gpt2_byte_chars()}

    def to_bytes(chars: str) -> bytes:  # the files write a token a character per byte
        return bytes(byte_of[c] for c in chars)

    ranks = {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}
    with open(merges_file, encoding="utf-8") as f:
        merges = [line.split() for line in f.read().split("\n")[1:] if line]  # line 0: #version
    ranks |= {to_bytes(a) + to_bytes(b): rank for rank, (a, b) in enumerate(merges, start=256)}
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if EOT not in vocab:
        raise ValueError(f"{vocab_file} has no {EOT} token")
    eot_id = vocab.pop(EOT)
    if {to_bytes(t): i for t, i in vocab.items()} != ranks:
        raise ValueError(f"{vocab_file} and {merges_file} disagree on the token ranks")
    return tiktoken.Encoding(name=os.path.basename(os.path.normpath(path)), pat_str=GPT2_PATTERN,
                             mergeable_ranks=ranks, special_tokens={EOT: eot_id})


class Detokenizer:
    """A request's text, decoded a token at a time: a step costs what its new tokens cost. An
    unfinished UTF-8 character waits in the decoder; stop strings are looked for in the new
    text and the longest one's overlap; text that could start one is held back until it
    cannot, so what was streamed is never taken back."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.max_stop_len = max(map(len, stop), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.num_sent_chars = 0  # text returned by new_text so far

    def append(self, token: int, check_stop: bool = True) -> str | None:
        """Add a token's text (none for end-of-text, or an id past the tokenizer); return the
        stop string it completed (unless not check_stop: before min_tokens), the text cut
        before it (or after it, if include_stop)."""
        tok = self.tokenizer
        search_from = max(0, len(self.text) - self.max_stop_len + 1)  # a stop string's overlap
        new_bytes = tok.decode_single_token_bytes(token) if token < tok.eot_token else b""
        self.text += self.decoder.decode(new_bytes)
        if not check_stop:
            return None
        # One token can complete several stop strings: the earliest in the text wins, whatever
        # the list's order; of those found at the same place ("ab" and "abc"), the longest.
        found = None
        found_at = -1
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at < 0:
                continue
            if found is None or at < found_at or (at == found_at and len(stop) > len(found)):
                found = stop
                found_at = at
        if found is None:
            return None
        end = found_at
        if self.include_stop:
            end = found_at + len(found)
        self.text = self.text[:end]
        return found

    def flush(self) -> None:
        """The text ended: the bytes of an unfinished character become U+FFFD."""
        self.text += self.decoder.decode(b"", final=True)

    def new_text(self, finished: bool) -> str:
        """Text not returned yet, less (unless finished) what could still become a stop string."""
        end = len(self.text)
        for n in range(0 if finished else min(self.max_stop_len - 1, end), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                end -= n
                break
        new = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return new


# ----------------------------------------------------------------------------- checkpoints
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "U8": torch.uint8}
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # HF's Conv1D stores (in, out); nn.Linear wants (out, in)
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints",
                             "shakespeare")  # trained by train() below, shipped with the repo


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A .safetensors file: 8-byte little-endian header length, a JSON header, raw tensors."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else len(data)
    if len(data) < 8 or 8 + n > len(data):
        raise ValueError(f"{path}: corrupt safetensors header (length {n}, file {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        start, end = info["data_offsets"]
        numel = math.prod(info["shape"])
        if dtype is None or end - start != numel * dtype.itemsize or 8 + n + end > len(data):
            raise ValueError(f"{path}: corrupt safetensors entry for {name}: {info}")
        tensors[name] = torch.frombuffer(data, dtype=dtype, count=numel,
                                         offset=8 + n + start).reshape(info["shape"])
    return tensors


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


def load_checkpoint(path: str) -> GPT:
    """A Hugging Face GPT-2 directory: config.json + model.safetensors or pytorch_model.bin."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} is not a GPT-2 checkpoint directory: no config.json")
    with open(config_file) as f:
        hf = json.load(f)
    sizes = {k: hf[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    model = GPT(GPTConfig(**sizes, layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5)))
    safetensors_file = os.path.join(path, "model.safetensors")
    pickle_file = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(safetensors_file):
        tensors = read_safetensors(safetensors_file)
    elif os.path.exists(pickle_file):
        tensors = torch.load(pickle_file, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} has no model.safetensors or pytorch_model.bin")
    model.transformer.load_state_dict(_from_hf_state(tensors, model.transformer.state_dict(), path))
    return model


def _from_hf_state(hf_state: dict, expected: dict, path: str) -> dict:
    """HF's tensors, named as in model.transformer, Conv1D weights transposed; shapes checked."""
    state = {}
    for key, t in hf_state.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the LM head is tied to wte
        state[key] = t.t() if key.endswith(CONV1D_WEIGHTS) else t
    for key, want in expected.items():
        if key not in state:
            raise ValueError(f"{path}: checkpoint is missing tensor {key}")
        if state[key].shape != want.shape:
            raise ValueError(f"{path}: tensor {key} has shape {tuple(state[key].shape)}; "
                             f"config.json implies {tuple(want.shape)}")
    if unexpected := sorted(set(state) - set(expected)):
        raise ValueError(f"{path}: unexpected tensors {unexpected[:5]}")
    return state


def load_model(model: str | None = None, preset: str | None = None, seed: int = 0
               ) -> tuple[GPT, tiktoken.Encoding]:
    """A preset (seeded random weights), a checkpoint dir, a GPT-2 name or the shipped model."""
    if preset is not None:
        torch.manual_seed(seed)
        return GPT(PRESETS[preset]), byte_tokenizer()
    path = model or DEFAULT_MODEL
    if path in HUB_MODELS and not os.path.isdir(path):
        path = hub_checkpoint(path)
    if not os.path.isdir(path):
        raise ValueError(f"model {path!r} is neither a checkpoint directory nor one of "
                         f"{', '.join(HUB_MODELS)}")
    return load_checkpoint(path), load_tokenizer(path)


HUB_FILES = ("config.json", "vocab.json", "merges.txt", "model.safetensors")


def hub_checkpoint(name: str) -> str:
    """A GPT-2 checkpoint from the local Hugging Face cache, else downloaded into it."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    cached = find_in_hub_cache(name, hub)
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


def find_in_hub_cache(name: str, hub: str) -> str | None:
    """The first snapshot of `name` (or openai-community/`name`) in the hub cache that holds
    every file of HUB_FILES, or None."""
    for repo in (name, f"openai-community/{name}"):
        snapshots = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots")
        if not os.path.isdir(snapshots):
            continue
        for snapshot in sorted(os.listdir(snapshots)):
            path = os.path.join(snapshots, snapshot)
            if all(os.path.exists(os.path.join(path, file_name)) for file_name in HUB_FILES):
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
    """Write `model` as a Hugging Face GPT-2 directory, with the byte-level tokenizer files."""
    os.makedirs(path, exist_ok=True)
    state = {key: (t.t() if key.endswith(CONV1D_WEIGHTS) else t).to(dtype).contiguous()
             for key, t in model.transformer.state_dict().items()}  # lm_head is wte: not saved
    write_safetensors(state, os.path.join(path, "model.safetensors"))
    c = model.config
    hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_ctx=c.n_positions,
              bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1, **asdict(c))
    vocab = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: 256}
    for name, text in [("config.json", json.dumps(hf, indent=2)), ("vocab.json", json.dumps(vocab)),
                       ("merges.txt", "#version: 0.2\n")]:  # bytes only: no merges
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)


# ----------------------------------------------------------------------------- training

def train(args) -> None:
    """Train a byte-level GPT-2 on a text file (its last 10% held out for validation) and save
    it as a Hugging Face GPT-2 directory in fp16, ready for `nanoserve.py --model DIR`.

    The recipe of the shipped checkpoint (checkpoints/shakespeare/) is these defaults, run on
    tinyshakespeare.txt (in ../shared/data/) with --out checkpoints/shakespeare: 6 layers,
    6 heads, n_embd 192 (2,915,520 parameters), context 1024 bytes; 1300 AdamW steps of 8,192
    bytes each (lr 2e-3, 100 warmup steps, cosine to 2e-4, weight decay 0.1 on matrices,
    gradients clipped at 1, seed 1337).

    A context curriculum: the first --short-steps (900) steps see 32 windows of 256 bytes,
    the last 400 see 8 windows of 1024 (as many bytes a step), and at the switch the position
    embeddings 256..1023, never trained until then, start as a copy of position 255's. Why:
    two runs at 1024 bytes from the start (1100 x 8 and 2200 x 4 windows, about 29 minutes
    each) sat near 2.45 nats/byte, about what byte frequencies give, for half the run, and
    ended at 1.954 and 1.935; short windows first learn the short-range statistics at 4x the
    windows a step, and the long phase only has to extend them.

    Validation loss (the held-out 111,540 bytes, 1024-byte windows): 5.59 at step 0, 1.76 at
    1000, 1.59 at 1200, and 1.573 nats/byte at the end with the fp16 weights as shipped (the
    steps before 1000 score worse: they count positions the short windows never trained).
    About 32 minutes on 2 idle CPU cores."""
    torch.manual_seed(args.seed)
    train_data, val_data = read_split(args.train)
    model = GPT(GPTConfig(n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                          n_head=args.n_head))
    opt = adamw(model, args.lr)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, {len(train_data):,} train bytes, "
          f"{len(val_data):,} validation bytes")
    t0 = time.time()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val {evaluate(model, val_data, args.seq_len):.4f} nats/byte  "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        seq_len = args.short_seq_len if step < args.short_steps else args.seq_len
        if step == args.short_steps and step > 0:
            # the first full-length step: positions never trained start as the last trained one
            wpe = model.transformer.wpe.weight.data
            wpe[args.short_seq_len:] = wpe[args.short_seq_len - 1]
        x, y = random_windows(train_data, args.batch_size * args.seq_len // seq_len, seq_len)
        loss = F.cross_entropy(model.forward_dense(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    save_checkpoint(model, args.out)
    shipped = load_checkpoint(args.out)  # fp16 weights, as served
    print(f"saved {args.out}: {num_params:,} parameters, context {args.seq_len}, "
          f"{(time.time() - t0) / 60:.1f} min, "
          f"val {evaluate(shipped, val_data, args.seq_len):.4f} nats/byte (fp16 weights)")


def read_split(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A UTF-8 text file as byte tokens: its first 90% to train on, its last 10% held out."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    split = int(len(text) * 0.9)
    train_data = byte_tensor(text[:split])
    val_data = byte_tensor(text[split:])
    return train_data, val_data


def byte_tensor(text: str) -> torch.Tensor:
    """Text -> its byte tokens (n,), int64."""
    return torch.tensor(byte_tokenizer().encode_ordinary(text), dtype=torch.long)


def adamw(model: GPT, lr: float) -> torch.optim.AdamW:
    """AdamW, with weight decay on the matrices only (not on biases and LayerNorm gains)."""
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                              {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99))


def random_windows(data: torch.Tensor, batch_size: int,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size windows of `data` at random starts: inputs x (B, T) and targets y (B, T), the
    byte after each of x's."""
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,))
    windows = torch.stack([data[i:i + seq_len + 1] for i in starts])  # (B, T + 1)
    x = windows[:, :-1]
    y = windows[:, 1:]
    return x, y


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, seq_len: int) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of `data`."""
    n = (len(data) - 1) // seq_len
    x = data[:n * seq_len].view(n, seq_len)
    y = data[1:n * seq_len + 1].view(n, seq_len)  # the next bytes
    losses = [F.cross_entropy(model.forward_dense(xb).flatten(0, 1), yb.flatten(), reduction="sum")
              for xb, yb in zip(x.split(64), y.split(64))]
    return sum(loss.item() for loss in losses) / y.numel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=inspect.cleandoc(train.__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="UTF-8 text file; its last 10%% is held out")
    p.add_argument("--out", default=os.path.join("checkpoints", "trained"),
                   help="checkpoint directory to write; serve it with --model DIR "
                   "(default: %(default)s)")
    for flag, default in [("--steps", 1300), ("--batch-size", 8), ("--seq-len", 1024),
                          ("--short-steps", 900), ("--short-seq-len", 256), ("--n-layer", 6),
                          ("--n-head", 6), ("--n-embd", 192), ("--lr", 2e-3), ("--warmup", 100),
                          ("--eval-every", 200), ("--seed", 1337)]:
        p.add_argument(flag, type=type(default), default=default, help="(default: %(default)s)")
    train(p.parse_args())

"""GPT-2, shaped for serving: one flat batch of tokens in, paged KV cache on the side.

Every op but attention runs on all scheduled tokens of all sequences at once, as one
(N, C) tensor (Orca's "selective batching"); attention reads and writes the paged cache
through kernels.py, told where everything is by an explicit AttentionMetadata.
`forward_dense` is the plain cache-free GPT-2 on (B, T) batches: the training path and
the reference the paged path is tested against.

Parameter names are Hugging Face's, so real GPT-2 checkpoints load without renaming
(Conv1D weights are transposed into nn.Linear on load). Also here: the byte-level and
GPT-2 tokenizers (tiktoken), safetensors read/write, and a short trainer
(`python model.py --train FILE --out DIR`).

Shape legend: N tokens in the flat batch, B batch, T time, C n_embd, H heads, D head dim.
Left out: dropout, weight init schemes beyond GPT-2's, anything but GPT-2.
"""
import argparse
import json
import math
import os
import struct
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


PRESETS = {
    "tiny": GPTConfig(),  # 3.5M parameters: tests, benchmarks, quick runs
    "gpt2": GPTConfig(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, meta=None, k_cache=None, v_cache=None, attention=None):
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        if meta is None:  # dense: x is (B, T, C)
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        N, C = x.shape  # paged: x is the flat batch (N, C)
        q, k, v = (t.view(N, self.n_head, self.head_dim) for t in (q, k, v))  # (N, H, D)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        y = attention(q, k_cache, v_cache, meta, 1.0 / math.sqrt(self.head_dim))
        return self.c_proj(y.reshape(N, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, *attn_args):
        x = x + self.attn(self.ln_1(x), *attn_args)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.n_positions, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: torch.Tensor, v_caches: torch.Tensor,
                attention=paged_attention_ref) -> torch.Tensor:
        """Paged forward of the flat batch: input_ids, positions (N,) -> hidden states (N, C).

        k_caches, v_caches are (n_layer, NB, BS, H, D); this step's K/V are written into them.
        `attention` is one of kernels.py's backends (same signature), chosen by the engine.
        """
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(positions)  # (N, C)
        for i, block in enumerate(tr.h):
            x = block(x, meta, k_caches[i], v_caches[i], attention)
        return tr.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, C) -> logits (n, vocab), in fp32 for sampling."""
        return self.lm_head(hidden).float()

    def forward_dense(self, idx: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of token ids (B, T) -> logits (B, T, vocab)."""
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        return self.compute_logits(tr.ln_f(x))


# ----------------------------------------------------------------------------- tokenizers

EOT = "<|endoftext|>"
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
                r"""|\s++$|\s+(?!\S)|\s""")


def gpt2_byte_chars() -> list[tuple[int, str]]:
    """GPT-2's 256 one-byte tokens in id order, as (byte, the character vocab.json writes).

    Printable bytes come first as themselves; the rest are mapped to chr(256 + n).
    """
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return [(b, chr(b)) for b in printable] + [(b, chr(256 + n)) for n, b in enumerate(others)]


def _encoding(name: str, ranks: dict[bytes, int], eot_id: int) -> tiktoken.Encoding:
    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: eot_id})


def byte_tokenizer() -> tiktoken.Encoding:
    """256 byte tokens (GPT-2's first 256 ids) plus <|endoftext|> = 256: GPT-2 without merges."""
    return _encoding("bytes", {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}, 256)


def load_tokenizer(path: str) -> tiktoken.Encoding:
    """GPT-2 BPE from vocab.json + merges.txt (Hugging Face's names) or encoder.json +
    vocab.bpe (OpenAI's); the merges must agree with the vocabulary's ranks."""
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        vocab_file, merges_file = os.path.join(path, vocab_name), os.path.join(path, merges_name)
        if os.path.exists(vocab_file) and os.path.exists(merges_file):
            break
    else:
        raise ValueError(f"{path} has no tokenizer: expected vocab.json + merges.txt "
                         "or encoder.json + vocab.bpe")
    byte_of = {ch: b for b, ch in gpt2_byte_chars()}
    to_bytes = lambda s: bytes(byte_of[c] for c in s)  # noqa: E731
    ranks = {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}
    with open(merges_file, encoding="utf-8") as f:
        merges = [line.split() for line in f.read().split("\n")[1:] if line]  # line 0: #version
    for rank, (first, second) in enumerate(merges, start=256):
        ranks[to_bytes(first) + to_bytes(second)] = rank
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if EOT not in vocab:
        raise ValueError(f"{vocab_file} has no {EOT} token")
    eot_id = vocab.pop(EOT)
    if {to_bytes(t): i for t, i in vocab.items()} != ranks:
        raise ValueError(f"{vocab_file} and {merges_file} disagree on the token ranks")
    return _encoding(os.path.basename(os.path.normpath(path)), ranks, eot_id)


# ----------------------------------------------------------------------------- checkpoints

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "U8": torch.uint8}
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # HF's Conv1D stores (in, out); nn.Linear wants (out, in)


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A .safetensors file: 8-byte little-endian header length, a JSON header, raw tensors."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if len(data) < 8:
        raise ValueError(f"{path}: corrupt safetensors header (file is {len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
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
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())


def config_from_hf(hf: dict) -> GPTConfig:
    return GPTConfig(vocab_size=hf["vocab_size"], n_positions=hf["n_positions"],
                     n_embd=hf["n_embd"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                     layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def load_checkpoint(path: str) -> GPT:
    """A Hugging Face GPT-2 directory: config.json + model.safetensors or pytorch_model.bin."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} is not a GPT-2 checkpoint directory: no config.json")
    with open(config_file) as f:
        model = GPT(config_from_hf(json.load(f)))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        hf_state = read_safetensors(os.path.join(path, "model.safetensors"))
    elif os.path.exists(os.path.join(path, "pytorch_model.bin")):
        hf_state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                              weights_only=True)
    else:
        raise ValueError(f"{path} has no model.safetensors or pytorch_model.bin")
    model.load_state_dict(_from_hf_state(hf_state, model.state_dict(), path))
    return model


def _from_hf_state(hf_state: dict, expected: dict, path: str) -> dict:
    """Rename HF keys to ours (add 'transformer.'), transpose Conv1D weights, check shapes."""
    state = {}
    for key, t in hf_state.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the LM head is tied to wte
        state["transformer." + key] = t.t() if key.endswith(CONV1D_WEIGHTS) else t
    state["lm_head.weight"] = state.get("transformer.wte.weight")
    for key, want in expected.items():
        got, name = state.get(key), key.removeprefix("transformer.")
        if got is None:
            raise ValueError(f"{path}: checkpoint is missing tensor {name}")
        if got.shape != want.shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(got.shape)}; "
                             f"config.json implies {tuple(want.shape)}")
    if unexpected := sorted(set(state) - set(expected)):
        raise ValueError(f"{path}: unexpected tensors {unexpected[:5]}")
    return state


HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints",
                             "shakespeare")  # trained by train() below, shipped with the repo


def load_model(model: str | None = None, preset: str | None = None, seed: int = 0
               ) -> tuple[GPT, tiktoken.Encoding]:
    """(model, tokenizer): random seeded weights of a preset, a checkpoint directory, a GPT-2
    name from the Hugging Face cache (downloaded once if missing), or the shipped model."""
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



def hub_checkpoint(name: str) -> str:
    """A GPT-2 checkpoint from the local Hugging Face cache, else downloaded into it."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    files = ("config.json", "vocab.json", "merges.txt", "model.safetensors")
    for repo in (name, f"openai-community/{name}"):
        snapshots = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots")
        for snap in sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []:
            if all(os.path.exists(os.path.join(snapshots, snap, f)) for f in files):
                return os.path.join(snapshots, snap)
    advice = (f"{name} is not in the Hugging Face cache ({hub}) and cannot be downloaded"
              f" ({{}}); pass --model DIR with a GPT-2 checkpoint directory, or no --model"
              f" for the built-in Shakespeare model")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise ValueError(advice.format("HF_HUB_OFFLINE is set"))
    target = os.path.join(hub, f"models--openai-community--{name}", "snapshots", "main")
    for f in files:
        url = f"https://huggingface.co/openai-community/{name}/resolve/main/{f}"
        try:
            _download(url, os.path.join(target, f))
        except OSError as e:
            raise ValueError(advice.format(e)) from None
    return target


def _download(url: str, path: str) -> None:
    with urllib.request.urlopen(url, timeout=10) as r:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # only once the hub has answered
        with open(path + ".part", "wb") as f:
            _copy_with_progress(r, f, os.path.basename(path))
    os.replace(path + ".part", path)


def _copy_with_progress(r, f, name: str) -> None:
    total, done = int(r.headers.get("Content-Length") or 0), 0
    while chunk := r.read(1 << 20):
        done += f.write(chunk)
        print(f"\rdownloading {name}: {done / 1e6:.0f}/{total / 1e6:.0f} MB", end="",
              file=sys.stderr)
    print(file=sys.stderr)


def save_checkpoint(model: GPT, path: str, dtype=torch.float16) -> None:
    """Write `model` as a Hugging Face GPT-2 directory, with the byte-level tokenizer files."""
    os.makedirs(path, exist_ok=True)
    state = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        key = key.removeprefix("transformer.")
        state[key] = (t.t() if key.endswith(CONV1D_WEIGHTS) else t).to(dtype).contiguous()
    write_safetensors(state, os.path.join(path, "model.safetensors"))
    c = model.config
    hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_ctx=c.n_positions,
              bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1, **asdict(c))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())} | {EOT: 256}, f)
    with open(os.path.join(path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")


# ----------------------------------------------------------------------------- training

def train(args) -> None:
    """Train a byte-level GPT on a text file; the last 10% is held out for validation."""
    torch.manual_seed(args.seed)
    with open(args.train, encoding="utf-8") as f:
        text = f.read()
    split = int(len(text) * 0.9)
    enc = byte_tokenizer()
    train_data = torch.tensor(enc.encode_ordinary(text[:split]), dtype=torch.long)
    val_data = torch.tensor(enc.encode_ordinary(text[split:]), dtype=torch.long)
    config = GPTConfig(n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                       n_head=args.n_head)
    model = GPT(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    print(f"{model.num_params() / 1e6:.2f}M parameters, {len(train_data):,} train bytes, "
          f"{len(val_data):,} validation bytes")
    t0 = time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            print(f"step {step:5d}  val {evaluate(model, val_data, args.seq_len):.4f} nats/byte  "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        if step == args.steps:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(len(train_data) - args.seq_len - 1, (args.batch_size,))
        x = torch.stack([train_data[i:i + args.seq_len] for i in starts])
        y = torch.stack([train_data[i + 1:i + 1 + args.seq_len] for i in starts])
        loss = F.cross_entropy(model.forward_dense(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    save_checkpoint(model, args.out)
    shipped = load_checkpoint(args.out)  # fp16 weights, as served
    print(f"saved {args.out}: {model.num_params():,} parameters, context {args.seq_len}, "
          f"{(time.time() - t0) / 60:.1f} min, "
          f"val {evaluate(shipped, val_data, args.seq_len):.4f} nats/byte (fp16 weights)")


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, seq_len: int) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of `data`."""
    model.eval()
    n = (len(data) - 1) // seq_len
    x = data[:n * seq_len].view(n, seq_len)
    y = data[1:n * seq_len + 1].view(n, seq_len)
    total = sum(F.cross_entropy(model.forward_dense(xb).flatten(0, 1), yb.flatten(),
                                reduction="sum").item()
                for xb, yb in zip(x.split(64), y.split(64)))
    model.train()
    return total / y.numel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Train a byte-level GPT-2 on a text file.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train", required=True, help="UTF-8 text file; its last 10%% is held out")
    p.add_argument("--out", default=os.path.join("checkpoints", "trained"),
                   help="directory to write the checkpoint to (the shipped model is "
                   "checkpoints/shakespeare; serve a new one with --model DIR)")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256, help="also the model's context length")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    train(p.parse_args())

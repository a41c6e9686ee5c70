"""python train.py --train FILE: train a byte-level GPT-2 on a text file, the recipe of the
shipped checkpoint (train()'s docstring), and save it as a Hugging Face checkpoint directory,
ready for python nanoserve.py --model DIR. Training runs GPT.forward_dense (model.py)."""
import argparse
import inspect
import math
import os
import time

import torch
import torch.nn.functional as F

from checkpoint import load_checkpoint, save_checkpoint
from model import GPT, GPTConfig
from tokenizer import byte_tokenizer


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
            wpe = model.model.embed_positions.weight.data
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
    return torch.tensor(byte_tokenizer().encoding.encode_ordinary(text), dtype=torch.long)


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

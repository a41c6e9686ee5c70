"""bench.py: what continuous batching buys, measured. The Anyscale/Orca experiment at this scale.

Every request has the same prompt length; output lengths are drawn from an exponential
distribution, capped at a generation limit, and EOS is ignored, so each request generates
exactly its length. The same requests, on the same weights, go through five modes:

    naive     padded static batches over a dense per-batch KV cache (Hugging Face pipelines)
    static    request-level batching on the paged engine: a batch is admitted when none runs
    fcfs      continuous (iteration-level) batching, first come first served
    sjf       continuous batching, shortest job first
    no-chunk  continuous fcfs without chunked prefill

and four views come out: offline throughput per limit, online latency under Poisson arrivals,
what each step held (batch, KV slots, preemptions), and the hardware (paged decode step vs a
dense one, model FLOP/s vs a measured matmul rate). Tables go to stdout, every figure to JSON.

    python bench.py --out bench.json                  # about 5 minutes on 2 CPU cores
    python bench.py --num-requests 1000 --prompt-len 512 --limits 32 128 512 1536 \\
        --online-limit 512 --rates 2 4 8 --preset gpt2 --device cuda --threads 0 \\
        --max-num-seqs 128 --kv-cache-tokens 262144  # the original's scale, on a GPU

Left out: real text and tokenizers, network serving (the online loop calls the engine
directly), and the original's memory limit: every mode gets the same batch size here.
"""
import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve import Engine, EngineConfig, SamplingParams, load_model

MODES = {  # mode -> (table label, EngineConfig overrides); naive does not use the engine
    "naive": ("naive: padded static batches, dense KV cache", None),
    "static": ("static: request-level batching, paged", dict(policy="static")),
    "fcfs": ("continuous, fcfs", dict(policy="fcfs")),
    "sjf": ("continuous, sjf", dict(policy="sjf")),
    "no-chunk": ("continuous, no chunked prefill", dict(policy="fcfs", chunked_prefill=False)),
}


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class BenchConfig:
    num_requests: int = arg(200, "requests in each offline run")
    prompt_len: int = arg(128, "tokens in every prompt (random ids)")
    mean_output_len: float = arg(128.0, "mean of the exponential output lengths, before the cap")
    limits: tuple = arg((32, 128, 512), "generation limits: output lengths are capped at each")
    online_requests: int = arg(100, "requests in each online run")
    online_limit: int = arg(128, "generation limit of the online runs")
    rates: tuple = arg((8.0, 16.0, 32.0), "Poisson arrival rates (requests/s) of the online sweep")
    modes: tuple = arg(tuple(MODES), "modes to run, a subset of " + " ".join(MODES))
    max_num_seqs: int = arg(32, "batch size of every mode, naive included")
    token_budget: int = arg(512, "tokens per engine step (no-chunk: at least prompt + limit)")
    kv_cache_tokens: int = arg(0, "paged KV cache capacity in tokens; 0: the engine's default")
    block_size: int = arg(16, "tokens per KV block")
    preset: str = arg("tiny", "model shape, random seeded weights: tiny (3.5M) or gpt2 (124M)")
    device: str = arg("cpu", "cpu or cuda")
    threads: int = arg(1, "torch CPU threads (0: torch's default); 1 is steadier on shared cores")
    seed: int = arg(0, "seeds the weights, prompts, lengths and arrivals")
    out: str = arg("bench.json", "where to write every figure as JSON")

    def __post_init__(self):
        if unknown := set(self.modes) - set(MODES):
            raise ValueError(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")


def parse_args(argv=None) -> BenchConfig:
    """The flags are BenchConfig's fields; defaults and help live only there."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(BenchConfig):
        many = isinstance(f.default, tuple)
        kind = type(f.default[0] if many else f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, nargs="+" if many else None,
                       default=f.default, help=f.metadata["help"] + " (default: %(default)s)")
    try:
        return BenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in vars(p.parse_args(argv)).items()})
    except ValueError as e:
        p.error(str(e))


# ----------------------------------------------------------------------------- workload

def make_workload(cfg: BenchConfig, n: int, limit: int) -> tuple[list[list[int]], list[int]]:
    """n prompts of prompt_len random token ids, and their output lengths capped at `limit`.

    The draws depend only on the seed, so every limit sees the same requests, capped harder.
    """
    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(0, 256, (n, cfg.prompt_len)).tolist()
    lengths = np.ceil(rng.exponential(cfg.mean_output_len, n)).clip(1, limit).astype(int)
    return prompts, lengths.tolist()


def greedy(length: int) -> SamplingParams:
    return SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)


# ----------------------------------------------------------------------------- naive baseline

def dense_forward(model, idx, positions, mask, caches, start: int) -> torch.Tensor:
    """GPT-2 over new tokens idx (B, T) at positions (B, T) with a contiguous KV cache.

    caches[layer] = (k, v), each (B, H, max_len, D); the new K/V land at start..start+T-1 and
    attention reads keys 0..start+T-1 where mask (B, 1, T, start+T) allows (None: all).
    Returns the last position's logits (B, vocab).
    """
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(positions)  # (B, T, C)
    B, T, C = x.shape
    for block, (k_cache, v_cache) in zip(tr.h, caches):
        attn = block.attn
        q, k, v = attn.c_attn(block.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))
        k_cache[:, :, start:start + T], v_cache[:, :, start:start + T] = k, v  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k_cache[:, :, :start + T],
                                           v_cache[:, :, :start + T], attn_mask=mask)
        x = x + attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + block.mlp(block.ln_2(x))
    return model.compute_logits(tr.ln_f(x[:, -1]))


def new_caches(model, batch: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c, w = model.config, model.lm_head.weight
    shape = (batch, c.n_head, max_len, c.head_dim)
    return [(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(c.n_layer)]


@torch.inference_mode()
def naive_batch(model, prompts: list[list[int]], lengths: list[int], log: list) -> list[list[int]]:
    """One static batch the Hugging Face pipelines way: prompts left-padded to the longest, a
    contiguous cache sized for the longest output, every row computed until the longest ends."""
    dev = model.lm_head.weight.device
    B, P, L = len(prompts), max(map(len, prompts)), max(lengths)
    pads = torch.tensor([P - len(p) for p in prompts], device=dev)
    idx = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=dev)  # (B, P)
    valid = torch.arange(P + L, device=dev)[None] >= pads[:, None]              # (B, P+L) keys
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    mask = (causal & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)  # pads: self
    positions = (torch.arange(P, device=dev)[None] - pads[:, None]).clamp(min=0)
    caches = new_caches(model, B, P + L)
    tokens = [dense_forward(model, idx, positions, mask[:, None], caches, 0).argmax(-1)]
    for t in range(1, L):
        mask = None if not pads.any() else valid[:, None, None, :P + t]
        tokens.append(dense_forward(model, tokens[-1][:, None], positions[:, -1:] + t, mask,
                                    caches, P + t - 1).argmax(-1))
    for t in range(L):  # cached after step t: each prompt and the outputs fed back so far
        real = sum(len(p) + min(t, n - 1) for p, n in zip(prompts, lengths))
        log.append((B, B * P if t == 0 else B, real, B * (P + L)))
    out = torch.stack(tokens, 1).tolist()  # (B, L)
    return [row[:n] for row, n in zip(out, lengths)]


# ----------------------------------------------------------------------------- engine runs

def make_engine(cfg: BenchConfig, mode: str, limit: int) -> Engine:
    """A fresh engine for `mode`, on the same seeded weights as every other."""
    overrides = MODES[mode][1]
    budget = cfg.token_budget
    if not overrides.get("chunked_prefill", True):  # as in vLLM: a whole recompute fits a step
        budget = max(budget, cfg.prompt_len + limit)
    engine = Engine(EngineConfig(preset=cfg.preset, device=cfg.device, seed=cfg.seed,
                                 block_size=cfg.block_size,
                                 kv_cache_tokens=cfg.kv_cache_tokens or None,
                                 max_num_seqs=cfg.max_num_seqs, token_budget=budget, **overrides))
    return engine


def logged_step(engine: Engine, log: list) -> list:
    """engine.step(), logging what the step held: (sequences, tokens, cached tokens of the
    running sequences, KV slots in their blocks)."""
    stats, allocator = engine.stats, engine.allocator
    seqs, tokens = stats.num_batched_seqs, stats.num_batched_tokens
    outputs = engine.step()
    if stats.num_batched_seqs > seqs:
        real = sum(s.num_computed_tokens for s in engine.scheduler.running)
        held = (allocator.num_blocks - allocator.num_free_blocks) * engine.config.block_size
        log.append((stats.num_batched_seqs - seqs, stats.num_batched_tokens - tokens, real, held))
    return outputs


def step_stats(log: list, preemptions: int) -> dict:
    """What the steps held: batch occupancy, KV slots, and the share holding real tokens."""
    seqs, tokens, real, slots = np.array(log, dtype=np.float64).T
    return dict(steps=len(log), seqs_per_step=seqs.mean(), tokens_per_step=tokens.mean(),
                kv_slots_mean=slots.mean(), kv_slots_peak=int(slots.max()),
                kv_real_share=real.sum() / slots.sum(), preemptions=preemptions)


def run_offline(cfg: BenchConfig, mode: str, prompts, lengths, limit: int, model=None):
    """Every request queued at once and served to the end: useful output tokens per second.

    Returns (figures, each request's output tokens)."""
    log, B = [], cfg.max_num_seqs
    if mode == "naive":
        start = time.perf_counter()
        outputs = [out for i in range(0, len(prompts), B)
                   for out in naive_batch(model, prompts[i:i + B], lengths[i:i + B], log)]
        preemptions = 0
    else:
        engine = make_engine(cfg, mode, limit)
        start, done = time.perf_counter(), {}
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(prompt, greedy(n), str(i))
        while engine.has_unfinished():
            done.update((o.request_id, o.outputs[0].token_ids)
                        for o in logged_step(engine, log) if o.finished)
        outputs = [done[str(i)] for i in range(len(prompts))]
        preemptions = engine.scheduler.num_preemptions
    wall, num_tokens = time.perf_counter() - start, sum(map(len, outputs))
    return dict(output_tokens=num_tokens, wall_s=wall, tok_s=num_tokens / wall,
                ms_per_step=wall / len(log) * 1e3, **step_stats(log, preemptions)), outputs


def run_online(cfg: BenchConfig, mode: str, prompts, lengths, rate: float) -> dict:
    """Requests arrive by a Poisson process at `rate` requests/s and are served as they come.

    The clock is simulated: it moves by the measured wall time of each engine iteration (admit
    what has arrived, then one step) and, when the engine is idle, jumps to the next arrival.
    A real-time loop sees the same thing (a request that arrives mid-step waits for the next
    step) plus idle waiting; skipping that makes a sweep cost only compute, and keeps the
    arrivals identical across modes. vLLM's serving benchmark uses the wall clock.
    """
    gaps = np.random.default_rng(cfg.seed + 1).exponential(1 / rate, len(prompts))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    engine = make_engine(cfg, mode, cfg.online_limit)
    times, clock, i = [[] for _ in prompts], 0.0, 0
    while i < len(prompts) or engine.has_unfinished():
        if not engine.has_unfinished():
            clock = max(clock, arrivals[i])
        start = time.perf_counter()
        while i < len(prompts) and arrivals[i] <= clock:
            engine.add_request(prompts[i], greedy(lengths[i]), str(i))
            i += 1
        outputs = engine.step()
        clock += time.perf_counter() - start
        for o in outputs:
            times[int(o.request_id)].append(clock)
    return latency_stats(arrivals, times)


def latency_stats(arrivals, times: list[list[float]]) -> dict:
    """vLLM's serving metrics. TTFT: arrival to first token; TPOT: (e2e - ttft) / (n - 1);
    ITL: every gap between a request's tokens; E2E: arrival to last token."""
    duration = max(t[-1] for t in times) - arrivals[0]
    num_tokens = sum(map(len, times))
    return dict(ttft=summary([t[0] - a for a, t in zip(arrivals, times)]),
                tpot=summary([(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]),
                itl=summary(np.concatenate([np.diff(t) for t in times])),
                e2e=summary([t[-1] - a for a, t in zip(arrivals, times)]),
                requests=len(times), output_tokens=num_tokens, duration_s=duration,
                request_throughput=len(times) / duration, output_throughput=num_tokens / duration)


def summary(xs) -> dict:
    xs = np.asarray(xs, dtype=np.float64)
    if not len(xs):
        return dict(mean=None, p50=None, p99=None)
    return dict(mean=xs.mean(), p50=np.percentile(xs, 50), p99=np.percentile(xs, 99))


# ----------------------------------------------------------------------------- hardware view

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def flops_per_token(model, context: int) -> float:
    """Forward FLOPs of one token: 2 per matmul weight (the tied lm_head counted, position
    embeddings not) plus attention's QK^T and AV over `context` cached tokens."""
    c, weights = model.config, model.num_params() - model.transformer.wpe.weight.numel()
    return 2 * weights + 4 * c.n_layer * context * c.n_embd


def matmul_gflops(model, n: int = 1024, reps: int = 10) -> float:
    """This machine's rate on a large square matmul in the model's dtype: the ceiling."""
    a = torch.randn(n, n, dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
    times = []
    for _ in range(3):
        sync(a.device.type)
        start = time.perf_counter()
        for _ in range(reps):
            a @ a
        sync(a.device.type)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 * reps / min(times) / 1e9


@torch.inference_mode()
def decode_step(cfg: BenchConfig, model, batch: int, steps: int = 16, rounds: int = 3) -> dict:
    """Decode step time of the paged engine vs a dense contiguous-cache forward of the same
    weights, both on `batch` sequences with context from prompt_len on. Rounds alternate
    between the two and the median round counts, which evens out a shared machine."""
    B, P, n, dev = batch, cfg.prompt_len, (rounds + 1) * steps, cfg.device
    prompts, _ = make_workload(cfg, B, 1)
    engine = make_engine(cfg, "fcfs", n)
    for prompt in prompts:
        engine.add_request(prompt, greedy(n))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1
                                          for s in engine.scheduler.running):
        engine.step()  # until every sequence decodes
    caches, positions = new_caches(model, B, P + n), torch.arange(P, device=dev).expand(B, P)
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    tokens = [dense_forward(model, torch.tensor(prompts, device=dev), positions, causal,
                            caches, 0).argmax(-1)]

    def dense_step():  # feeds token t of every row, at position P + t - 1
        t = len(tokens)
        tokens.append(dense_forward(model, tokens[-1][:, None], positions[:, -1:] + t, None,
                                    caches, P + t - 1).argmax(-1))
    paged, dense = [], []
    for _ in range(rounds):
        for step, times in ((engine.step, paged), (dense_step, dense)):
            sync(dev)
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync(dev)
            times.append((time.perf_counter() - start) / steps)
    paged_s, dense_s, context = np.median(paged), np.median(dense), P + rounds * steps // 2
    flops = B * flops_per_token(model, context)
    return dict(batch=B, context=context, paged_step_ms=paged_s * 1e3, dense_step_ms=dense_s * 1e3,
                paging_overhead=paged_s / dense_s - 1, paged_gflops=flops / paged_s / 1e9,
                dense_gflops=flops / dense_s / 1e9)


# ----------------------------------------------------------------------------- report

def add_ratios(runs: dict) -> None:
    """Throughput over naive's and static's; and static's steps over this mode's: the ratio
    if a step cost the same whatever it held, as a GPU's memory-bound decode step nearly does."""
    for run in runs.values():
        for base in ("naive", "static"):
            run[f"vs_{base}"] = run["tok_s"] / runs[base]["tok_s"] if base in runs else None
        run["steps_vs_static"] = (runs["static"]["steps"] / run["steps"]
                                  if "static" in runs else None)


def targets(result: dict) -> list[dict]:
    """The issue's targets as measured: fcfs over static, static over naive, paged vs dense."""
    found, off = [], result["offline"]
    for limit, goal in (("128", 2.0), ("512", 3.0)):
        if (r := off.get(limit, {}).get("modes", {}).get("fcfs", {}).get("vs_static")) is not None:
            found.append((f"fcfs / static, limit {limit}", f">= {goal}", r, r >= goal))
    for limit, runs in off.items():
        if (r := runs["modes"].get("static", {}).get("vs_naive")) is not None:
            found.append((f"static / naive, limit {limit}", "> 1", r, r > 1))
    r = 1 + result["hardware"]["decode"][-1]["paging_overhead"]
    found.append(("paged / dense decode step", "<= 1.15", r, r <= 1.15))
    return [dict(target=t, goal=g, measured=r, met=bool(met)) for t, g, r, met in found]


def table(title: str, header: list, rows: list[list]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return title + "\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines)


def report(result: dict) -> str:
    """Every table, in markdown."""
    cfg, off, hw = result["config"], result["offline"], result["hardware"]
    x = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
    ms = lambda s: " / ".join("-" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
                              for v in s.values())
    cols, modes = ["mode"] + [f"limit {limit}" for limit in off], cfg["modes"]
    run = lambda m: [off[limit]["modes"][m] for limit in off]  # noqa: E731
    return "\n\n".join([
        table("Offline throughput, useful output tokens/s", cols,
              [[MODES[m][0]] + [f"{r['tok_s']:.0f}" for r in run(m)] for m in modes]),
        table("Throughput ratio to naive / to static", cols,
              [[MODES[m][0]] + [f"{x(r['vs_naive'])} / {x(r['vs_static'])}" for r in run(m)]
               for m in modes]),
        table("Steps (offline): what each held, what it cost, and KV slots holding real tokens",
              ["limit", "mode", "steps", "static steps / steps", "ms/step", "seqs/step",
               "tokens/step", "KV slots mean", "KV slots peak", "real share", "preemptions"],
              [[limit, m, r["steps"], x(r["steps_vs_static"]), f"{r['ms_per_step']:.1f}",
                f"{r['seqs_per_step']:.1f}", f"{r['tokens_per_step']:.1f}",
                f"{r['kv_slots_mean']:.0f}", r["kv_slots_peak"], f"{r['kv_real_share']:.2f}",
                r["preemptions"]] for limit in off for m, r in off[limit]["modes"].items()]),
        table(f"Online, limit {cfg['online_limit']}, Poisson arrivals; mean / p50 / p99",
              ["rate req/s", "mode", "TTFT ms", "TPOT ms", "ITL ms", "E2E ms", "req/s", "tok/s"],
              [[rate, m, ms(r["ttft"]), ms(r["tpot"]), ms(r["itl"]), ms(r["e2e"]),
                f"{r['request_throughput']:.1f}", f"{r['output_throughput']:.0f}"]
               for rate, runs in result["online"].items() for m, r in runs.items()]),
        table(f"Decode step, paged engine vs dense contiguous cache; a {hw['matmul_n']}^2 matmul "
              f"runs at {hw['matmul_gflops']:.0f} GFLOP/s",
              ["batch", "context", "paged ms", "dense ms", "paging overhead", "paged GFLOP/s",
               "dense GFLOP/s", "paged / matmul"],
              [[d["batch"], d["context"], f"{d['paged_step_ms']:.2f}", f"{d['dense_step_ms']:.2f}",
                f"{d['paging_overhead']:+.0%}", f"{d['paged_gflops']:.1f}",
                f"{d['dense_gflops']:.1f}", f"{d['paged_gflops'] / hw['matmul_gflops']:.1%}"]
               for d in hw["decode"]]),
        table("Targets", ["target", "goal", "measured", "met"],
              [[t["target"], t["goal"], f"{t['measured']:.2f}", "yes" if t["met"] else "NO"]
               for t in result["targets"]])])


def main(argv=None) -> None:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_model(EngineConfig(preset=cfg.preset, device=cfg.device, seed=cfg.seed))[0]
    result = dict(config=asdict(cfg), offline={}, online={}, versions=dict(
        python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
        device=cfg.device, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        processor=platform.processor(), load_average_start=os.getloadavg()))
    start = time.perf_counter()
    progress = lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}",  # noqa: E731
                                 file=sys.stderr, flush=True)
    for mode in cfg.modes:  # warm-up, not timed
        run_offline(cfg, mode, *make_workload(cfg, cfg.max_num_seqs, 8), 8, model)
    for limit in cfg.limits:
        prompts, lengths = make_workload(cfg, cfg.num_requests, limit)
        runs, first = {}, None
        for mode in cfg.modes:
            runs[mode], outputs = run_offline(cfg, mode, prompts, lengths, limit, model)
            first = first or outputs  # greedy: every mode should produce the same tokens
            runs[mode]["same_tokens"] = float(np.mean([a == b for a, b in zip(outputs, first)]))
            progress(f"offline, limit {limit}, {mode}: {runs[mode]['tok_s']:.0f} tok/s")
        add_ratios(runs)
        result["offline"][str(limit)] = dict(lengths=lengths, modes=runs)
    prompts, lengths = make_workload(cfg, cfg.online_requests, cfg.online_limit)
    result["online_lengths"] = lengths
    for rate in cfg.rates:
        runs = result["online"][str(rate)] = {}
        for mode in (m for m in cfg.modes if m != "naive"):
            runs[mode] = run_online(cfg, mode, prompts, lengths, rate)
            progress(f"online, {rate} req/s, {mode}: "
                     f"TTFT p50 {runs[mode]['ttft']['p50'] * 1e3:.0f} ms")
    batches = [2 ** i for i in range(cfg.max_num_seqs.bit_length()) if 2 ** i < cfg.max_num_seqs]
    batches.append(cfg.max_num_seqs)  # powers of two, then the batch size itself
    result["hardware"] = dict(decode=[decode_step(cfg, model, b) for b in batches],
                              matmul_n=1024, matmul_gflops=matmul_gflops(model, 1024))
    result["targets"] = targets(result)
    result["versions"]["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - start
    print(report(result))
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=1)
    progress(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()

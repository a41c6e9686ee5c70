"""bench.py: what continuous batching buys, measured. The Anyscale/Orca experiment at this scale.

The same requests (random prompts, exponential output lengths capped at a limit, EOS ignored) on
the same weights through each of the MODES, at equal batch size and at equal KV memory: offline
throughput, the steps, online latency (Poisson arrivals), the hardware view against a roofline;
tables to stdout, all to JSON. --url URL: the online sweep against a server (README: Over HTTP).

    python bench.py --out bench.json         # about 5 minutes on 2 CPU cores; .ci/gpu: on a GPU
"""
import argparse
import json
import os
import platform
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from model import PRESETS
from kernels import sample
from nanoserve import Engine, EngineConfig, SamplingParams, add_config_args, check_fields, option

MODES = {  # mode -> (what it is, EngineConfig overrides); naive does not use the engine
    "naive": ("naive: padded static batches, dense KV cache", None),
    "static": ("static: request-level batching, paged", dict(policy="static")),
    "fcfs": ("continuous, fcfs", dict(policy="fcfs")),
    "sjf": ("continuous, sjf", dict(policy="sjf")),
    "no-chunk": ("continuous, no chunked prefill", dict(enable_chunked_prefill=False)),
    "no-cache": ("continuous, fcfs, no prefix caching", dict(enable_prefix_caching=False))}


@dataclass
class BenchConfig:
    num_requests: int = option(160, "requests in each offline run")
    prompt_len: int = option(128, "tokens in every prompt (random ids)")
    mean_output_len: float = option(128.0, "mean of the exponential output lengths, uncapped")
    limits: tuple = option((32, 128, 512), "generation limits: output lengths are capped at each")
    online_requests: int = option(100, "requests in each online run")
    online_limit: int = option(128, "generation limit of the online runs")
    rates: tuple = option((8.0, 16.0, 32.0), "Poisson arrival rates (requests/s), online sweep")
    modes: tuple = option(tuple(MODES)[:-1], "modes to run", choices=list(MODES))
    shared_prefix_len: int = option(0, "tokens of one prefix before every prompt", low=0)
    turns: int = option(1, "offline: turns a conversation (its last turn, answer, own tokens)")
    max_num_seqs: int = option(32, "equal batch: the batch size of every mode, naive included")
    kv_budget: int = option(0, "equal memory: each mode's KV tokens; 0: 32 x (prompt + 128)", low=0)
    memory_max_num_seqs: int = option(256, "equal memory: the paged modes' batch size limit")
    max_num_batched_tokens: int = option(512, "tokens per step (no-chunk: >= prompt + limit)")
    kv_cache_tokens: int = option(0, "paged KV cache capacity in tokens; 0: the engine's default",
                                  low=0)
    block_size: int = option(16, "tokens per KV block")
    host_output_lens: tuple = option((10, 900), "host cost: output lengths, timed at one context")
    preset: str = option("tiny", "random weights of a shape: tiny 3.5M, gpt2 124M", choices=PRESETS)
    device: str = option("cpu", "cpu or cuda")
    threads: int = option(1, "torch CPU threads (0: torch's default); 1: steadier on shared cores",
                          low=0)
    hardware_preset: str = option("", "also the hardware view of this shape, batch 1/8/32/64, "
                                  "torch's default threads (gpt2: ~1 min)", choices=["", *PRESETS])
    seed: int = option(0, "seeds the weights, prompts, lengths and arrivals", low=0)
    out: str = option("bench.json", "where to write every figure as JSON")
    url: str = option("", "an OpenAI-compatible server (http://host:port): the online sweep on it")
    compare: bool = option(False, "with --url: the online sweep in process too (fcfs)")


def parse_args(argv=None) -> BenchConfig:
    """The flags are BenchConfig's fields; defaults and help live only there."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, BenchConfig)
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in vars(p.parse_args(argv)).items()})
    prompt = cfg.prompt_len + cfg.shared_prefix_len
    cfg = replace(cfg, kv_budget=cfg.kv_budget or 32 * (prompt + 128))
    try:  # ranges, as the engine checks its own (argparse checked each mode)
        check_fields(replace(cfg, modes=cfg.modes[0]))
    except ValueError as e:
        p.error(str(e))
    if min(cfg.limits + cfg.host_output_lens) < 1 or not all(r > 0 for r in cfg.rates):
        p.error("--limits and --host-output-lens must be >= 1, --rates > 0")
    if cfg.kv_budget < prompt + max(cfg.limits):
        p.error(f"--kv-budget {cfg.kv_budget} holds no sequence of prompt + largest limit tokens")
    return cfg


def make_workload(cfg: BenchConfig, n: int, limit: int, shared=False) -> tuple[list, list[int]]:
    """n prompts: [the shared prefix +] prompt_len random ids; lengths capped at `limit`."""
    rng, prefix = np.random.default_rng(cfg.seed), np.random.default_rng(cfg.seed + 2).integers(
        0, 256, cfg.shared_prefix_len * shared).tolist()
    prompts = [prefix + p for p in rng.integers(0, 256, (n, cfg.prompt_len)).tolist()]
    return prompts, list(map(int, np.ceil(rng.exponential(cfg.mean_output_len, n)).clip(1, limit)))


def greedy(length: int) -> SamplingParams:
    return SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)


def dense_forward(model, idx, positions, mask, caches, start: int) -> torch.Tensor:
    """The last position's logits (B, vocab) of new tokens idx (B, T) at positions (B, T); their K/V
    go to caches[layer] = (k, v) (B, H, max_len, D) at start..; mask (B, 1, T, start+T) or None."""
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
    w, shape = model.lm_head.weight, (batch, model.config.n_head, max_len, model.config.head_dim)
    return [(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(model.config.n_layer)]


@torch.inference_mode()
def naive_batch(model, prompts: list[list[int]], lengths: list[int], log: list) -> list[list[int]]:
    """A static batch the Hugging Face way: prompts left-padded, a dense cache, rows to the end."""
    dev, B, P, L = model.lm_head.weight.device, len(prompts), max(map(len, prompts)), max(lengths)
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
    log += [(B, B * P if t == 0 else B, sum(len(p) + min(t, n - 1) for p, n in zip(  # cached
        prompts, lengths)), B * (P + L)) for t in range(L)]  # after step t: prompts, outputs
    return [row[:n] for row, n in zip(torch.stack(tokens, 1).tolist(), lengths)]  # (B, L) rows


def make_engine(cfg: BenchConfig, mode: str = "fcfs", limit: int = 0, **overrides) -> Engine:
    """A fresh engine for `mode`, on the same seeded weights as every other."""
    args = dict(preset=cfg.preset, device=cfg.device, seed=cfg.seed, block_size=cfg.block_size,
                kv_cache_tokens=cfg.kv_cache_tokens or None, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens) | MODES[mode][1] | overrides
    if not args.get("enable_chunked_prefill", True):  # as in vLLM: a whole recompute fits a step
        args["max_num_batched_tokens"] = max(args["max_num_batched_tokens"],
                                             cfg.prompt_len + cfg.shared_prefix_len + limit)
    return Engine(EngineConfig(**args))


def run_offline(cfg: BenchConfig, mode: str, prompts, lengths, limit: int, model=None):
    """All requests queued at once, run to the end: (useful tokens/s, what steps held; outputs)."""
    log, B, N = [], cfg.max_num_seqs, len(prompts)
    if mode == "naive":
        start, preemptions, hit_rate = time.perf_counter(), 0, 0.0
        outputs = [out for i in range(0, N, B)
                   for out in naive_batch(model, prompts[i:i + B], lengths[i:i + B], log)]
    else:
        engine = make_engine(cfg, mode, limit)
        start, done, engine.step_records = time.perf_counter(), {}, []
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(prompt, greedy(n), str(i))
        while engine.has_unfinished():
            for o in engine.step():  # deltas: the tokens new since the request's last output
                done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
                if o.finished and (k := int(o.request_id)) + N < N * cfg.turns:  # its next turn
                    engine.add_request(o.prompt_token_ids + done[o.request_id] + prompts[k % N][
                        -cfg.prompt_len:], greedy(lengths[k % N]), str(k + N))
        log = [(len(r.scheduled), sum(r.scheduled.values()), r.num_kv_tokens,  # as naive's
                r.kv_blocks_used * engine.block_pool.block_size) for r in engine.step_records]
        outputs = [done[str(k)] for k in range(N * cfg.turns)]  # turn by turn
        preemptions = sum(len(r.preempted) for r in engine.step_records)
        hit_rate = engine.stats.num_cached_tokens / engine.stats.num_prompt_tokens  # prefix cache
    wall, num_tokens = time.perf_counter() - start, sum(map(len, outputs))
    seqs, tokens, real, slots = np.array(log, dtype=np.float64).T
    return dict(output_tokens=num_tokens, wall_s=wall, tok_s=num_tokens / wall, steps=len(log),
                ms_per_step=wall / len(log) * 1e3, tokens_computed=int(tokens.sum()),
                seqs_per_step=seqs.mean(), seqs_peak=int(seqs.max()), tokens_per_step=tokens.mean(),
                kv_slots_mean=slots.mean(), kv_slots_peak=int(slots.max()),
                kv_real_share=real.sum() / slots.sum(), preemptions=preemptions,
                prefix_hit_rate=hit_rate), outputs


def run_online(cfg: BenchConfig, mode: str, prompts, lengths, rate: float) -> dict:
    """Poisson arrivals at `rate`/s: in process, a clock that skips idle time; "http": threads."""
    gaps = np.random.default_rng(cfg.seed + 1).exponential(1 / rate, len(prompts))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    if mode == "http":
        def send(arrival, prompt, n):  # the times (s after start) of its chunks; its tokens
            time.sleep(max(0.0, start + arrival - time.perf_counter()))
            times, tokens = [], None
            for line in http_open(cfg.url, "/v1/completions", dict(
                    model=model, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                    stream=True, stream_options=dict(include_usage=True))):  # "data: {json}"
                chunk = json.loads(line[5:]) if line.startswith(b"data: {") else {}
                if chunk.get("choices"):  # a chunk of text (or held back), as vLLM times them
                    times.append(time.perf_counter() - start)
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if not times:  # not a stream of OpenAI's chunks
                raise ConnectionError(f"{cfg.url}/v1/completions streamed no choices")
            return times, tokens or len(times)  # tokens: the usage chunk's count, or a chunk's
        model = json.load(http_open(cfg.url, "/v1/models"))["data"][0]["id"]  # the first listed
        start = time.perf_counter()
        times, tokens = zip(*ThreadPoolExecutor(len(prompts)).map(send, arrivals, prompts, lengths))
    else:
        engine = make_engine(cfg, mode, cfg.online_limit)
        times, clock, i = [[] for _ in prompts], 0.0, 0
        while i < len(prompts) or engine.has_unfinished():
            clock = clock if engine.has_unfinished() else max(clock, arrivals[i])  # idle: a jump
            start = time.perf_counter()
            while i < len(prompts) and arrivals[i] <= clock:
                engine.add_request(prompts[i], greedy(lengths[i]), str(i))
                i += 1
            outputs = engine.step()
            clock += time.perf_counter() - start
            for o in outputs:
                times[int(o.request_id)].append(clock)
        tokens = [len(t) for t in times]
    # vLLM's metrics: TTFT, TPOT (e2e - ttft) / (n - 1), ITL (token gaps; HTTP: chunks), E2E
    summary = lambda xs: dict(zip(("mean", "p50", "p99"), [np.mean(xs), *np.percentile(  # noqa
        xs, [50, 99])] if len(xs) else [None] * 3))
    duration, num_tokens = max(t[-1] for t in times) - arrivals[0], sum(tokens)
    return dict(ttft=summary([t[0] - a for a, t in zip(arrivals, times)]),
                tpot=summary([(t[-1] - t[0]) / (n - 1) for t, n in zip(times, tokens) if n > 1]),
                itl=summary(np.concatenate([np.diff(t) for t in times])),
                e2e=summary([t[-1] - a for a, t in zip(arrivals, times)]),
                requests=len(times), output_tokens=num_tokens, duration_s=duration,
                request_throughput=len(times) / duration, output_throughput=num_tokens / duration)


def http_open(url: str, path: str, body: dict | None = None):
    """GET url + path, or POST body as JSON (no proxy); errors: a one-line ConnectionError."""
    try:
        return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            urllib.request.Request(url.rstrip("/").removesuffix("/v1") + path, body and json.dumps(
                body).encode(), {"Content-Type": "application/json"}), timeout=600)
    except Exception as e:  # an HTTPError holds the server's answer: OpenAI's error, as JSON
        raise ConnectionError(f"{url}{path} answered {e.code}: {e.read().decode()}" if hasattr(
            e, "code") else f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def synced_clock(device: str) -> float:
    """time.perf_counter() once the device has done all it was given."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def per_call(fn, reps: int, device: str) -> float:
    """Seconds per call of fn over reps calls."""
    start = synced_clock(device)
    for _ in range(reps):
        fn()
    return (synced_clock(device) - start) / reps


@torch.inference_mode()
def decode_step(cfg, model, batch: int, prompt_len=0, first=1, steps=16, rounds=3) -> dict:
    """Decode steps of `batch` sequences of prompt_len tokens from output `first` on: the paged
    step, its forward and logits (the rest: host part), a dense-cache forward with its logits;
    median of alternate rounds."""
    B, P, n, dev = batch, prompt_len or cfg.prompt_len, rounds * steps, cfg.device
    engine = make_engine(cfg, max_num_seqs=B, max_num_batched_tokens=B * P,
                         kv_cache_tokens=B * (P + first + n + cfg.block_size))
    for prompt in make_workload(replace(cfg, prompt_len=P), B, 1)[0]:
        engine.add_request(prompt, greedy(first + n + 1))
    seqs, spent = engine.scheduler.running, []
    while not seqs or min(s.num_output_tokens for s in seqs) < first:  # all prompts in one step,
        engine.step()                                                  # then decodes
    clock = lambda sign: lambda *_: spent.append(sign * synced_clock(dev))  # noqa: E731 (None)
    for module in (engine.model, engine.model.lm_head):  # the forward, then the logits
        module.register_forward_pre_hook(clock(-1)), module.register_forward_hook(clock(1))
    C, out0 = len(seqs[0].token_ids) - 1, np.mean([s.num_output_tokens for s in seqs])  # cached
    caches = new_caches(model, B, C + n + 1)
    tokens = [torch.tensor([[s.token_ids[-1]] for s in seqs], device=dev)]
    dense_forward(model, torch.tensor([s.token_ids[:-1] for s in seqs], device=dev),
                  torch.arange(C, device=dev).expand(B, C),
                  torch.ones(C, C, dtype=torch.bool, device=dev).tril(), caches, 0)
    dense_step = lambda: tokens.append(dense_forward(  # noqa: E731 (the newest token of each row)
        model, tokens[-1], torch.full((B, 1), C + len(tokens) - 1, device=dev), None, caches,
        C + len(tokens) - 1).argmax(-1, keepdim=True))
    paged, forward_s, dense = [], [], []
    for _ in range(rounds):
        spent.clear()
        paged.append(per_call(engine.step, steps, dev))
        forward_s.append(sum(spent) / steps)
        dense.append(per_call(dense_step, steps, dev))
    paged_s, dense_s, output_len = np.median(paged), np.median(dense), out0 + (n - 1) / 2
    # forward FLOPs: 2 per matmul weight (tied lm_head counted, wpe not), attention's QK^T, AV
    c, context = model.config, P + output_len  # both the means over the timed steps
    weights = sum(p.numel() for p in model.parameters()) - c.n_positions * c.n_embd
    flops = B * (2 * weights + 4 * c.n_layer * context * c.n_embd)
    return dict(batch=len(seqs), prompt_len=P, output_len=output_len, context=context,
                flops=flops, weight_bytes=weights * model.lm_head.weight.element_size(),
                paged_step_ms=paged_s * 1e3, forward_ms=np.median(forward_s) * 1e3,
                host_ms=np.median(np.subtract(paged, forward_s)) * 1e3,
                dense_step_ms=dense_s * 1e3, paging_overhead=paged_s / dense_s - 1)


def hardware_view(cfg: BenchConfig, model, batches, steps=16, host_output_lens=()) -> dict:
    """Decode steps at each batch size against a roofline measured in the same run: max(weight
    bytes / copy bandwidth, FLOPs / matmul rate), what the step would cost if it only streamed
    the weights or only multiplied at a big square matmul's rate. Host cost: at the largest
    batch and one context (top + 16), a step at each output length n (centred on n)."""
    w, x, y = (torch.randn(n, dtype=model.lm_head.weight.dtype, device=cfg.device)
               for n in ((1024, 1024), 2 ** 25, 2 ** 25))  # x, y: 128 MiB each in fp32
    matmul = 2 * 1024 ** 3 / min(per_call(lambda: w @ w, 10, cfg.device) for _ in range(3))
    copy = 2 * x.nbytes / min(per_call(lambda: y.copy_(x), 3, cfg.device) for _ in range(3))
    top = max(host_output_lens, default=0)  # copy: bytes read + written, as STREAM counts them
    rows = [decode_step(cfg, model, b, steps=steps) for b in batches] + [decode_step(
        cfg, model, batches[-1], top + 16 - n, max(1, n - 10), steps=4, rounds=5)
        for n in host_output_lens]
    for d in rows:
        d["roofline_ms"] = max(d["weight_bytes"] / copy, d["flops"] / matmul) * 1e3
    return dict(decode=rows[:len(batches)], host_cost=rows[len(batches):], preset=cfg.preset,
                threads=torch.get_num_threads(), matmul_n=1024, matmul_gflops=matmul / 1e9,
                copy_gb_s=copy / 1e9)


@torch.inference_mode()
def sampling_time(cfg: BenchConfig, rows: int = 64, reps: int = 50, rounds: int = 5) -> dict:
    """Sampling `rows` seeded requests (T 0.8, top-p 0.95) as the engine does, in ms."""
    engine = make_engine(cfg, max_num_seqs=rows, max_num_batched_tokens=rows,
                         kv_cache_tokens=rows * cfg.block_size)
    for i, prompt in enumerate(make_workload(cfg, rows, 1)[0]):
        engine.add_request(prompt[:1], SamplingParams(temperature=0.8, top_p=0.95, seed=i))
    out = engine.execute(engine.scheduler.schedule())  # one step's logits, not applied
    seqs = list(out.sampled_token_ids)

    def step():
        return sample(out.logits, engine.sampling_tensors(seqs), engine.generator)
    return dict(rows=len(seqs), vocab=out.logits.shape[1], sample_ms=1e3 * np.median(
        [per_call(step, reps, cfg.device) for _ in range(rounds)]))


def targets(result: dict) -> list[dict]:
    """The issues' targets, each against the measured figure it cites."""
    off, mem, hw, big = (result.get(k) or {} for k in (
        "offline", "equal_memory", "hardware", "hardware_big"))
    get = lambda runs, limit, m, key: runs.get(limit, {}).get("modes", {}).get(m, {}).get(key)  # noqa
    both = lambda a, b: [(rate, r[a], r[b]) for rate, r in result["online"].items()  # noqa
                         if a in r and b in r]  # the online runs of modes a and b, by rate
    found = [(f"equal memory: fcfs / {b}, limit {limit}", ">=", goal, get(mem, limit, "fcfs", "vs_"
              + b)) for b, limit, goal in (("static", "128", 2.5), ("static", "512", 3.6),
                                           ("naive", "128", 3.7), ("naive", "512", 9.5))]
    found += [(f"static / naive, limit {limit}", ">", 1, get(off, limit, "static", "vs_naive"))
              for limit in off]
    for rate, h, f in both("http", "fcfs"):
        found += [(f"HTTP / in process, output tok/s, rate {rate}", ">=", 0.9,
                   h["output_throughput"] / f["output_throughput"]),
                  (f"HTTP - in process, TTFT p50 ms, rate {rate}", "<=", 5,
                   (h["ttft"]["p50"] - f["ttft"]["p50"]) * 1e3)]
    found += [(f"fcfs / no prefix caching, tok/s, limit {limit}", ">=", 1.5, get(
        off, limit, "fcfs", "vs_no-cache")) for limit in list(off) * bool(
        result["config"]["shared_prefix_len"])]
    found += [(f"no prefix caching / fcfs, mean TTFT, rate {rate}", ">=", 3, n["ttft"]["mean"] /
               f["ttft"]["mean"]) for rate, n, f in both("no-cache", "fcfs")]
    for view in [v for v in (hw, big) if v]:  # at batch 32, or the largest below
        d = [d for d in view["decode"] if d["batch"] <= 32][-1]
        found += [(f"{view['preset']}, batch {d['batch']}: paged / dense decode step", "<=",
                   1.15, 1 + d["paging_overhead"])] + [
            (f"{view['preset']}, batch {d['batch']}: roofline / decode step", ">=", 0.5,
             d["roofline_ms"] / d["paged_step_ms"])] * (view is big)
    if hw:
        short, long = hw["host_cost"]
        found += [(f"decode step, batch {long['batch']}, output {long['output_len']:.0f} / "
                   f"{short['output_len']:.0f}, same context", "<=", 1.1,
                   long["paged_step_ms"] / short["paged_step_ms"]),
                  ("  its host part (step less model forward)", "<=", 1.1,
                   long["host_ms"] / short["host_ms"]),
                  (f"sampling {hw['sampling']['rows']} rows (top-p, seeded), ms", "<", 1,
                   hw["sampling"]["sample_ms"])]
    return [dict(target=t, goal=f"{op} {goal}", measured=r, met=bool(
        {">=": r >= goal, ">": r > goal, "<=": r <= goal, "<": r < goal}[op]))
        for t, op, goal, r in found if r is not None]


def table(title: str, rows: list[dict], keys: str) -> str:
    """A markdown table of rows' values at keys (also the JSON's keys), floats to 2 decimals."""
    keys = keys.split()
    cells = [keys, ["---"] * len(keys)] + [[
        f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    return title + "".join("\n| " + " | ".join(c) + " |" for c in cells)


def report(result: dict) -> str:
    """Every table there are figures for (with --url: online and targets), in markdown."""
    cfg, hw, big = result["config"], result.get("hardware"), result.get("hardware_big")
    both = {"equal_batch": result["offline"], "equal_memory": result.get("equal_memory", {})}
    decode = lambda hw, extra="": table(  # noqa: E731
        f"Decode step, {hw['preset']}, {hw['threads']} threads (ms): the paged engine's (forward: "
        "its model forward, host: the rest), a dense contiguous cache's, and the roofline: max("
        f"weight bytes / {hw['copy_gb_s']:.1f} GB/s copied, FLOPs / {hw['matmul_gflops']:.0f} "
        f"GFLOP/s of a {hw['matmul_n']}^2 matmul){extra}", [d | dict(
            of_roofline=d["roofline_ms"] / d["paged_step_ms"]) for d in hw["decode"] + hw[
            "host_cost"]], "batch prompt_len output_len paged_step_ms forward_ms host_ms "
        "dense_step_ms paging_overhead roofline_ms of_roofline")
    tables = [table(
        f"Offline, at equal batch size ({cfg['max_num_seqs']}) and at equal KV memory ("
        f"{cfg['kv_budget']} tokens): useful output tokens/s, ratios of throughput and of steps, "
        "sequences a step, KV slots (mean, peak, share holding real tokens), preemptions", [
            dict(experiment=e, limit=limit, mode=m) | r for e, runs in both.items()
            for limit in runs for m, r in runs[limit]["modes"].items()],
        "experiment limit mode tok_s vs_naive vs_static max_num_seqs steps steps_vs_static "
        "ms_per_step seqs_per_step seqs_peak tokens_per_step kv_slots_mean kv_slots_peak "
        "kv_real_share preemptions"), decode(hw, "; last %d rows: the host cost by output "
                                             "length, at one context" % len(hw["host_cost"]))
              ] if hw else []
    return "\n\n".join(tables + [decode(v) for v in [big] if v] + [table(
        f"Online, limit {cfg['online_limit']}, Poisson arrivals", [
            dict(rate=rate, mode=m, **{f"{k}_{s}_ms": r[k][s] * 1e3 for k in (
                "ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p99")}) | r
            for rate, runs in result["online"].items() for m, r in runs.items()],
        "rate mode ttft_mean_ms ttft_p50_ms ttft_p99_ms tpot_mean_ms itl_p50_ms itl_p99_ms "
        "e2e_mean_ms e2e_p50_ms request_throughput output_throughput")] + [table(
            "Targets", ts, "target goal measured met") for ts in [result["targets"]] if ts])


def offline(cfg: BenchConfig, model, memory: bool, progress) -> dict:
    """Every mode on the same requests at each limit, at equal batch size (cfg.max_num_seqs) or,
    with `memory`, on kv_budget tokens of KV memory each: naive and static reserve prompt + limit
    a sequence up front (as Hugging Face and FasterTransformer did); the paged modes, as they go."""
    found = {}
    for limit in cfg.limits:
        prompts, lengths = make_workload(cfg, cfg.num_requests, limit, shared=True)
        runs, first = {}, None
        for mode in cfg.modes:
            batch = min(cfg.num_requests, cfg.kv_budget // (len(prompts[0]) + limit)) \
                if mode in ("naive", "static") else cfg.memory_max_num_seqs
            mode_cfg = replace(cfg, kv_cache_tokens=cfg.kv_budget, max_num_seqs=batch) \
                if memory else cfg
            runs[mode], outputs = run_offline(mode_cfg, mode, prompts, lengths, limit, model)
            first = first or outputs  # greedy: every mode should produce the same tokens
            runs[mode] |= dict(max_num_seqs=mode_cfg.max_num_seqs, same_tokens=float(np.mean(
                [a == b for a, b in zip(outputs, first)])))
            progress(f"offline, equal {('batch', 'memory')[memory]}, limit {limit}, {mode}: "
                     f"{runs[mode]['tok_s']:.0f} tok/s")
        for r in runs.values():  # static steps / steps: the gain if every step cost the same
            r |= {f"vs_{b}": r["tok_s"] / runs[b]["tok_s"] if b in runs else None
                  for b in ("naive", "static", "no-cache")}
            r["steps_vs_static"] = runs["static"]["steps"] / r["steps"] if "static" in runs \
                else None
        found[str(limit)] = dict(lengths=lengths, modes=runs)
    return found


def main(argv=None) -> None:
    cfg, default_threads = parse_args(argv), torch.get_num_threads()
    torch.set_num_threads(cfg.threads or default_threads)
    sweep = make_workload(cfg, cfg.online_requests, cfg.online_limit, shared=True)  # online
    result = dict(config=asdict(cfg), offline={}, online={}, online_lengths=sweep[1], versions=dict(
        python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
        device=cfg.device, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        processor=platform.processor(), load_average_start=os.getloadavg()))
    start = time.perf_counter()
    progress = lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}",  # noqa: E731
                                 file=sys.stderr, flush=True)
    modes = ["http", "fcfs"][:1 + cfg.compare]  # with --url: the server, and fcfs to compare
    if not cfg.url:
        modes, model = [m for m in cfg.modes if m != "naive"], make_engine(cfg).model  # naive's
        for mode in cfg.modes:  # warm-up, not timed
            run_offline(cfg, mode, *make_workload(cfg, cfg.max_num_seqs, 8), 8, model)
        result["offline"] = offline(cfg, model, False, progress)
        result["equal_memory"] = offline(cfg, model, True, progress)
        B = cfg.max_num_seqs  # the decode sweep: powers of two, then the batch size itself
        hw = result["hardware"] = hardware_view(cfg, model, [2 ** i for i in range(
            B.bit_length()) if 2 ** i < B] + [B], host_output_lens=cfg.host_output_lens)
        hw["sampling"] = sampling_time(cfg)
        progress("hardware view")
    try:
        for rate in cfg.rates:
            runs = result["online"][str(rate)] = {}
            for mode in modes:
                r = runs[mode] = run_online(cfg, mode, *sweep, rate)
                progress(f"online, {rate} req/s, {mode}: TTFT p50 {r['ttft']['p50'] * 1e3:.0f} "
                         f"ms, {r['output_throughput']:.0f} tok/s")
    except ConnectionError as e:  # the server at --url: one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.hardware_preset and not cfg.url:  # the bigger shape, on all cores
        torch.set_num_threads(default_threads)
        big = replace(cfg, preset=cfg.hardware_preset, threads=0)
        result["hardware_big"] = hardware_view(big, make_engine(
            big, kv_cache_tokens=big.block_size).model, (1, 8, 32, 64), steps=8)
        progress(f"hardware view, {cfg.hardware_preset}")
    result |= dict(targets=targets(result), wall_s=time.perf_counter() - start)
    result["versions"]["load_average_end"] = os.getloadavg()
    print(report(result))
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""tensor_parallel.py: one model split across N processes (Megatron-LM's tensor parallelism,
vLLM's tensor_parallel_size), two all-reduces a layer putting the pieces back together.

Rank 0 is the engine's own process: the scheduler, the block pool, sampling and everything
else run there once, unchanged. Ranks 1..N-1 are worker processes (start_workers) that hold
only their slices of the weights and of the KV cache and run only the model: each step,
rank 0's model, as it is called, sends its inputs (token ids, positions, the attention
metadata) down a pipe to every worker (TensorParallel.send_step), and all N run the same forward in
lockstep, meeting at each all-reduce. A worker's forward output is thrown away: the hidden
states after the last all-reduce are the same on every rank, and rank 0 alone makes logits.

The cut (Shard), for one layer of the shipped GPT-2 (C = 192, 6 heads of D = 32, MLP 768,
vocabulary 257) at N = 2, rank r of 2, N tokens in the step:

    embed_tokens   (257, 192) -> rank 0 rows 0..128, rank 1 rows 129..256 (vocab-parallel):
                   an id outside a rank's rows looks up zeros; all-reduce: (N, 192)
    qkv_proj       q, k, v each (192, 192) -> each part's rows of the rank's 3 heads, stacked:
                   (288, 192), column-parallel; out (N, 288) = q, k, v of heads 3r..3r+2
    attention      the rank's 3 heads, over its KV cache (NB, BS, 3, 32): half the K/V bytes
    o_proj         (192, 192) -> its columns of the rank's heads (192, 96), row-parallel:
                   out (N, 192) a partial sum; all-reduce; the bias added by rank 0 alone
    up_proj        (768, 192) -> rows 384r..384r+383 (384, 192): column-parallel, GELU per rank
    down_proj      (192, 768) -> columns 384r..384r+383 (192, 384): row-parallel, all-reduce
    norms, positions  whole on every rank (C numbers each)
    lm_head        on rank 0 only, whole (its vocabulary rows: no gather of logits)

So a layer costs two all-reduces of (N, C) fp32 activations, 2 x N x 768 bytes here, and a
step one more for the embedding. Llama's gate_proj and up_proj are cut as up_proj is (each
part its rows, then stacked); K/V heads that do not divide by N are replicated when N is a
multiple of them (vLLM's way: rank r holds K/V head r // (N / Hkv)), else refused.

What it buys, for Llama-3.1-8B in bf16 on GPUs reading 4.8 TB/s: 32 layers make 65
all-reduces of 4,096 values a token, and a ring all-reduce sends 2(N-1)/N of them:

    N   weights a GPU   KV a token   all-reduce a token   weight read a step
    1   16 GB           128 KiB        0                  3.3 ms
    2    8 GB            64 KiB      520 KiB              1.7 ms
    4    4 GB            32 KiB      780 KiB              0.8 ms
    8    2 GB            16 KiB      910 KiB              0.4 ms

At batch 64, N = 8 moves 58 MiB a step (0.13 ms on NVLink), but 65 all-reduces at ~10 us each
take 0.65 ms: latency, not bandwidth, bounds the gain.

Processes: workers come from multiprocessing's fork server (start_workers says why), one
thread each on a CPU, one GPU each on CUDA (cuda:r). They meet in a gloo (CPU) or NCCL (CUDA)
process group through a TCPStore on a free port that rank 0 opens. A worker that dies is
found before the next step sends (its process is not alive) or by the all-reduce it left
(gloo: the connection closes): WorkerDiedError, which ends the engine
(nanoserve.is_device_error). So does a forward that failed on rank 0 alone
(TensorParallelError at the next one): the workers would wait in its all-reduces, out of
step, so they are stopped. Workers end when the engine is closed or dropped, and at exit (a
weakref finalizer); a worker whose pipe closes (rank 0 died) ends.

LoRA: each projection's adapters are cut as its weight (LoRAShard); rank 0 sends each adapter
it puts in a slot to the workers, and each step's token slots with its inputs.

Swapping: each rank has a swap space for its heads; rank 0 sends each copy out or in to the
workers before its own.

Left out: a vocab-parallel LM head (rank 0 holds it whole), CUDA graphs under N > 1
(enforce_eager required).
"""
import dataclasses
import datetime
import multiprocessing
import os
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cuda_runtime
from checkpoint import (DEFAULT_MODEL, DTYPES, checkpoint_path, config_from_hf, load_model,
                        read_json)
from kernels import AttentionMetadata, select_attention
from linear import LoRAMapping, Linear, projections, row_parallel
from model import GPT, PRESETS, GPTConfig
from paged_cache import kv_cache_torch_dtype
from swap import SwapSpace

JOIN_TIMEOUT = datetime.timedelta(seconds=60)  # a process group's rendezvous and its ops
STARTUP_SECONDS = 120   # a worker's start and load, at most (imports on a busy machine)
SHUTDOWN_SECONDS = 5    # a worker's exit after it is told to, before it is killed
DEATH_SECONDS = 1       # a worker's exit after its connection closed, before we say so


class TensorParallelError(RuntimeError):
    """The ranks cannot run another step together: the engine must be restarted."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process died or left the group."""


@dataclass
class CommStats:
    """What rank 0's all-reduces and step channel cost (bench.py --tensor-parallel reads it)."""
    num_all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_seconds: float = 0.0
    num_steps: int = 0             # forwards sent down the channel
    channel_seconds: float = 0.0   # rank 0's time packing and sending them


def check_tensor_parallel(config: GPTConfig, world_size: int) -> None:
    """ValueError unless the model cuts into world_size equal shares: query heads and the
    MLP's width divide by it, and K/V heads divide by it or it by them (replicated)."""
    if config.n_head % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"{config.n_head} attention heads: each rank holds whole heads")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the MLP's width "
                         f"{config.intermediate_size}")
    kv = config.n_kv_head
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {kv} K/V heads: "
                         "neither divides the other, so K/V heads can be neither split nor "
                         "replicated evenly across ranks")


def model_config(config) -> GPTConfig:
    """The whole model's shape, read before anything loads: the preset's, or config.json's."""
    if config.preset is not None:
        return PRESETS[config.preset]
    path = checkpoint_path(config.model or DEFAULT_MODEL)
    return config_from_hf(read_json(os.path.join(path, "config.json")), path)


class Shard:
    """Rank `rank`'s share of a model cut across world_size ranks (see the module docstring):
    its shapes (config), its slices of each checkpoint tensor (narrow), and the model built
    from them with its all-reduces (build). comm: the rank's Communicator, whose group is
    joined after the load."""

    def __init__(self, rank: int, world_size: int, comm: "Communicator"):
        self.rank = rank
        self.world_size = world_size
        self.comm = comm
        # each row-parallel projection's rows' max|w| over all their columns, read in build
        # before the cut: its quantization scales are then N = 1's (quantize)
        self.row_amax: dict[str, torch.Tensor] = {}

    def config(self, full: GPTConfig) -> GPTConfig:
        """The rank's shapes: its query heads, K/V heads and MLP slice (vocabulary whole: the
        embedding is cut apart from the config)."""
        check_tensor_parallel(full, self.world_size)
        return dataclasses.replace(full, n_head=full.n_head // self.world_size,
                                   n_kv_head=max(1, full.n_kv_head // self.world_size),
                                   head_dim=full.head_dim,
                                   intermediate_size=full.intermediate_size // self.world_size)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(start, rows) of the rank's embedding rows: ceil(V / N) a rank, the last fewer."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(vocab_size, self.rank * per_rank)
        return start, min(per_rank, vocab_size - start)

    def kv_head_start(self, n_kv_head: int) -> int:
        """The first K/V head the rank holds: split (Hkv / N each) or replicated (N / Hkv
        ranks share one)."""
        if n_kv_head >= self.world_size:
            return self.rank * (n_kv_head // self.world_size)
        return self.rank // (self.world_size // n_kv_head)

    def narrow(self, full: GPTConfig, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The rank's slice of one tensor of the state dict (Hugging Face's names, q/k/v and
        gate/up apart): a view of the (memory-mapped) tensor, copied only when placed. None:
        the rank holds none of it (the LM head, off rank 0)."""
        module, _, param = name.rpartition(".")
        projection = module.rpartition(".")[2]
        local = self.config(full)
        d = full.head_dim
        if projection == "q_proj":
            return tensor.narrow(0, self.rank * local.n_head * d, local.n_head * d)
        if projection in ("k_proj", "v_proj"):
            start = self.kv_head_start(full.n_kv_head)
            return tensor.narrow(0, start * d, local.n_kv_head * d)
        if projection in ("gate_proj", "up_proj"):
            rows = local.intermediate_size
            return tensor.narrow(0, self.rank * rows, rows)
        if projection in ("o_proj", "down_proj") and param == "weight":
            columns = tensor.shape[1] // self.world_size
            return tensor.narrow(1, self.rank * columns, columns)
        if projection in ("o_proj", "down_proj"):  # the bias: added once, after the sum
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name == "model.embed_tokens.weight":
            return tensor.narrow(0, *self.vocab_rows(full.vocab_size))
        if name == "lm_head.weight" and self.rank > 0:
            return None
        return tensor

    def build(self, full: GPTConfig, tensors: dict[str, torch.Tensor], device: str,
              dtype: torch.dtype) -> GPT:
        """The rank's model from the whole state dict's tensors (views, Hugging Face's names):
        built on the meta device in the rank's shapes, each slice copied once to device in
        dtype; o_proj and down_proj all-reduce their outputs, the embedding is
        vocab-parallel; rank 0 keeps the whole LM head (tied: the embedding's rows, of which
        its own embedding slice is a view)."""
        local = self.config(full)
        with torch.device("meta"):
            model = GPT(local)
        start, rows = self.vocab_rows(full.vocab_size)
        placed = {}
        for name in list(tensors):
            view = tensors.pop(name).detach()
            if name == "lm_head.weight" and full.tie_word_embeddings:
                continue  # the embedding's, placed with it
            if name == "model.embed_tokens.weight" and self.rank == 0 and full.tie_word_embeddings:
                placed["lm_head.weight"] = view.to(device, dtype).contiguous()
                placed[name] = placed["lm_head.weight"].narrow(0, start, rows)
                continue
            module, _, param = name.rpartition(".")
            if module.endswith(("o_proj", "down_proj")) and param == "weight":
                self.row_amax[module] = view.abs().amax(dim=1).float()
            piece = self.narrow(full, name, view)
            if piece is not None:
                placed[name] = piece.to(device, dtype).contiguous()
        with torch.device("meta"):  # its weight comes next, as every other
            model.model["embed_tokens"] = VocabParallelEmbedding(start, rows, full.n_embd,
                                                                 self.comm.all_reduce)
        if self.rank > 0:
            model.lm_head = None  # workers make no logits
        model.load_state_dict(placed, assign=True)
        for layer in model.model.layers:
            row_parallel(layer.self_attn.o_proj, self.comm.all_reduce)
            row_parallel(layer.mlp.down_proj, self.comm.all_reduce)
        parts = {}  # each projection's parts' Hugging Face names, in order
        for name, (linear, _) in projections(model).items():
            parts.setdefault(linear, []).append(name)
        for linear, names in parts.items():
            linear.lora_shard = LoRAShard(self, full, names)
        return model.to(device)


    def quantize(self, model: GPT, quant_method: str) -> None:
        """Quantize the rank's projections after the cut (linear.quantize_model's, per rank): a
        column-parallel part's channels are whole here, a row-parallel one's take the whole
        rows' max (row_amax), so every q and scale is a slice of N = 1's."""
        linears = {}  # each Linear once (a merged one is several projections), by a name
        for name, (linear, _) in projections(model).items():
            linears.setdefault(linear, name)
        for linear, name in linears.items():
            amax = self.row_amax.get(name)
            if amax is not None:
                amax = amax.to(linear.weight.device)
            linear.quantize_(quant_method, amax)


class LoRAShard:
    """A projection's adapters cut as its weight is (set_lora calls it with the whole a (r, I)
    and b (O, r)): a column-parallel part keeps its rows of b (A whole: x A^T is the same on
    every rank), a row-parallel one its columns of a (b whole: each rank's term, its slice of x
    times its columns of A, then B, is a partial sum, added up by the projection's
    all-reduce with the base's)."""

    def __init__(self, shard: Shard, full: GPTConfig, names: list[str]):
        self.shard = shard
        self.full = full
        self.names = names  # per part: "model.layers.0.self_attn.q_proj", ...
        self.row_parallel = names[0].endswith(("o_proj", "down_proj"))

    def __call__(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple:
        name = self.names[part] + ".weight"
        if self.row_parallel:
            return self.shard.narrow(self.full, name, a), b
        return a, self.shard.narrow(self.full, name, b)


class VocabParallelEmbedding(nn.Module):
    """The token embedding cut by vocabulary rows (vLLM's VocabParallelEmbedding): a rank looks
    up the ids among its rows [start, start + rows) and gives zeros for the others; the
    all-reduce's sum is each id's row, exactly (one rank's row plus zeros)."""

    def __init__(self, start: int, rows: int, embedding_dim: int, all_reduce):
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (...,) -> (..., C)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.all_reduce(x.masked_fill(outside[..., None], 0))


class Communicator:
    """A rank's process group and its all-reduce, counted (CommStats). The group is set once
    joined (rank 0 loads its weights while the workers start)."""

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.stats = CommStats()
        self.workers: list | None = None  # rank 0: the workers' processes, to name a dead one

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor summed over the ranks, in place (contiguous), returned."""
        start = time.perf_counter()
        try:
            self.group.allreduce([tensor]).wait()
        except RuntimeError as e:  # gloo: a peer closed its connection, or the op timed out
            if self.workers is not None:
                find_dead_worker(self.workers)
            raise WorkerDiedError(f"an all-reduce failed: {str(e).splitlines()[0]}") from e
        stats = self.stats
        stats.num_all_reduces += 1
        stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        stats.all_reduce_seconds += time.perf_counter() - start
        return tensor


def join_group(store: dist.TCPStore, rank: int, world_size: int, device: str):
    """The ranks' process group: gloo on a CPU, NCCL on CUDA (a group object of its own, not
    torch.distributed's global one: two engines in one process each have theirs)."""
    if str(device).startswith("cuda"):
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, JOIN_TIMEOUT)


# ------------------------------------------------------------------------------ the channel

STEP_TENSORS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                "query_start_loc")


def pack_step(input_ids, positions, meta: AttentionMetadata, k_caches) -> dict:
    """A forward's inputs as host arrays (pickled by value: no shared-memory file a step)."""
    tensors = dict(input_ids=input_ids, positions=positions, slot_mapping=meta.slot_mapping,
                   block_tables=meta.block_tables, context_lens=meta.context_lens,
                   query_start_loc=meta.query_start_loc)
    step = {name: t.cpu().numpy() for name, t in tensors.items()}
    return step | dict(max_query_len=meta.max_query_len, num_decodes=meta.num_decodes,
                       num_blocks=k_caches.shape[1])


def unpack_step(step: dict, device: str) -> tuple:
    """pack_step undone on a worker's device: (input_ids, positions, meta, num_blocks)."""
    t = {name: torch.from_numpy(step[name]).to(device) for name in STEP_TENSORS}
    meta = AttentionMetadata(slot_mapping=t["slot_mapping"], block_tables=t["block_tables"],
                             context_lens=t["context_lens"], query_start_loc=t["query_start_loc"],
                             max_query_len=step["max_query_len"], num_decodes=step["num_decodes"])
    return t["input_ids"], t["positions"], meta, step["num_blocks"]


# ------------------------------------------------------------------------------ rank 0's side

class TensorParallel:
    """Rank 0's handle on the workers: start them (with the group's rendezvous), send each
    forward down their pipes (a forward pre-hook on rank 0's model), check they live, close
    them. shard: what load_model builds rank 0's model with."""

    def __init__(self, config):
        self.world_size = config.tensor_parallel_size
        self.full_config = model_config(config)
        check_tensor_parallel(self.full_config, self.world_size)  # before any worker starts
        self.comm = Communicator(0, self.world_size)
        self.shard = Shard(0, self.world_size, self.comm)
        self.device = config.device
        self.lora_mapping: LoRAMapping | None = None  # rank 0's adapters' slots a token
        self.in_step = False  # a forward was sent and rank 0's has not returned
        self.processes, self.pipes = start_workers(config)
        self.comm.workers = self.processes  # (not a method of ours: no cycle, so collecting
                                            # the engine stops the workers at once)
        self._finalizer = weakref.finalize(self, stop_workers, self.processes, self.pipes)

    def attach(self, model: GPT) -> None:
        """After rank 0 has loaded its shard: wait until every worker has loaded its own, join
        the group, and send every forward of model to the workers from now on."""
        for rank, pipe in enumerate(self.pipes, start=1):
            self._wait_for(rank, pipe, "loaded")
        # opened after the fork (no child holds its socket), on a free port (0: the OS picks)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, True, timeout=JOIN_TIMEOUT,
                              wait_for_workers=False)
        self._send(("join", store.port))
        self.comm.group = join_group(store, 0, self.world_size, self.device)
        model.register_forward_pre_hook(self.send_step)
        model.register_forward_hook(self.step_done)

    def prepare(self, model_runner) -> None:
        """Once rank 0's model runner is built: each worker allocates its KV cache, as many
        blocks as rank 0's (its heads only); with LoRA, every adapter rank 0 puts in a slot
        goes to the workers too, and rank 0 reads adapters against the whole model's shapes
        (a meta model: no memory), its slots holding its slices (LoRAShard)."""
        self._send(("allocate", model_runner.k_caches.shape[1]))
        swap_space = model_runner.swap_space
        if swap_space is not None:  # as many host blocks a worker, its heads only
            self._send(("swap_space", swap_space.num_blocks))
            swap_space.mirror = self.mirror_swap
        manager = model_runner.lora_manager
        if manager is None:
            return
        with torch.device("meta"):
            manager.model = GPT(self.full_config).to(model_runner.dtype)
        manager.mirror = self.mirror_lora
        self.lora_mapping = manager.mapping

    def mirror_swap(self, direction: str, pairs: list[tuple[int, int]]) -> None:
        """Rank 0 copies blocks out to its swap space or back in: the workers do the same."""
        self._send(("swap", (direction, pairs)))

    def mirror_lora(self, slot: int, lora) -> None:
        """Rank 0 loaded adapter `lora` (a lora.LoRAModel) into `slot`: the workers do too,
        from its whole A and B (fp32 arrays: bf16 has no numpy type; exact both ways)."""
        weights = {name: (a.float().numpy(), b.float().numpy())
                   for name, (a, b) in lora.weights.items()}
        self._send(("lora", (slot, weights)))

    def _wait_for(self, rank: int, pipe, expected: str) -> None:
        """The worker's next message, which must be `expected`; WorkerDiedError if it died or
        reported an error, or said nothing within STARTUP_SECONDS."""
        deadline = time.monotonic() + STARTUP_SECONDS
        while not pipe.poll(0.1):
            self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel rank {rank} did not start within "
                                      f"{STARTUP_SECONDS} s")
        try:
            message = pipe.recv()
        except EOFError:
            message = None
        if message != expected:
            self.check_alive()
            raise WorkerDiedError(f"tensor-parallel rank {rank} failed to start: {message}")

    def check_alive(self) -> None:
        check_alive(self.processes)

    def send_step(self, _model, args) -> None:
        """The forward pre-hook: model(input_ids, positions, meta, k_caches, ...)'s inputs to
        every worker, which runs the same forward."""
        self.check_alive()
        if self.in_step:  # rank 0's last forward raised; the workers wait in its all-reduces
            stop_workers(self.processes, self.pipes, wait=False)
            raise TensorParallelError("rank 0's last forward failed part-way, leaving the "
                                      "workers out of step; the engine must be restarted")
        self.in_step = True
        start = time.perf_counter()
        step = pack_step(*args[:4])
        if self.lora_mapping is not None and self.lora_mapping.token_slots is not None:
            step["lora_slots"] = self.lora_mapping.token_slots.cpu().numpy()
        self._send(("forward", step))
        self.comm.stats.num_steps += 1
        self.comm.stats.channel_seconds += time.perf_counter() - start

    def step_done(self, _model, _args, _output) -> None:
        """The forward hook: rank 0's forward returned, so every all-reduce was met."""
        self.in_step = False

    def _send(self, message) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(message)
            except OSError:  # a broken pipe: its worker is gone
                self.check_alive()
                raise

    def close(self) -> None:
        """Stop the workers (also done when this is collected, or at exit)."""
        self._finalizer()


def start_workers(config) -> tuple[list, list]:
    """Ranks 1..N-1, each a process running worker_main with a pipe to it, forked by
    multiprocessing's fork server: a process of its own that imported this module once (the
    first engine waits for it) and has no thread, so a worker starts in a fraction of a
    second and safely. Forking the engine's process itself crashed workers now and then (a
    segfault, a hang: another engine's gloo threads held locks at the fork), and spawning
    imports torch anew each time (seconds)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tensor_parallel"])
    processes, pipes = [], []
    for rank in range(1, config.tensor_parallel_size):
        ours, theirs = context.Pipe()
        process = context.Process(target=worker_main, args=(config, rank, theirs),
                                  name=f"nanoserve-tp{rank}", daemon=True)
        process.start()
        theirs.close()
        processes.append(process)
        pipes.append(ours)
    return processes, pipes


def check_alive(processes: list) -> None:
    """WorkerDiedError naming the first worker (rank 1, 2, ...) that is not running."""
    for rank, process in enumerate(processes, start=1):
        if not process.is_alive():
            raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {process.pid}) "
                                  f"died (exit code {process.exitcode})")


def find_dead_worker(processes: list) -> None:
    """After an all-reduce failed: WorkerDiedError naming the worker that died, once its exit
    is seen (its connection may close a moment before), else nothing."""
    for process in processes:
        process.join(DEATH_SECONDS)
    check_alive(processes)


def stop_workers(processes: list, pipes: list, wait: bool = True) -> None:
    """Tell each worker to exit (None), wait SHUTDOWN_SECONDS (unless not `wait`: they are
    stuck), kill what is left."""
    for pipe in pipes:
        try:
            pipe.send(None)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + (SHUTDOWN_SECONDS if wait else 0)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


# ------------------------------------------------------------------------------ a worker

class Worker:
    """A rank > 0: its model shard and its KV cache, running each forward rank 0 sends."""

    def __init__(self, config, model: GPT, dtype: torch.dtype, device: str):
        self.model = model
        self.dtype = dtype
        self.device = device
        self.block_size = config.block_size
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        self.attention = select_attention(config.attention, device)
        self.k_caches = None
        self.v_caches = None
        self.swap_space: SwapSpace | None = None  # with preemption_mode swap or auto
        self.lora_mapping: LoRAMapping | None = None
        if config.enable_lora:  # slots as rank 0's, in this rank's shapes
            self.lora_mapping = LoRAMapping()
            for linear in model.modules():
                if isinstance(linear, Linear):
                    linear.create_lora_weights(config.max_loras, config.max_lora_rank,
                                               self.lora_mapping)
            self.projections = projections(model)

    def load_lora(self, slot: int, weights: dict) -> None:
        """LoRAManager._load_slot's copy, on this rank: every projection's slot reset, then
        the adapter's (whole) A and B set, each Linear keeping its slices."""
        for linear in self.model.modules():
            if isinstance(linear, Linear):
                linear.reset_lora(slot)
        for name, (a, b) in weights.items():
            linear, part = self.projections[name]
            linear.set_lora(slot, part, torch.from_numpy(a).to(self.device, self.dtype),
                            torch.from_numpy(b).to(self.device, self.dtype))

    def allocate(self, num_blocks: int) -> None:
        self.k_caches, self.v_caches = self.caches(num_blocks)

    def swap(self, direction: str, pairs: list[tuple[int, int]]) -> None:
        """Rank 0's copy_out or copy_in, on this rank's caches and swap space."""
        copy = getattr(self.swap_space, direction)
        copy(self.k_caches, self.v_caches, pairs)

    def caches(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_layer, num_blocks, BS, its K/V heads, D) zeros, K and V."""
        c = self.model.config
        shape = (c.n_layer, num_blocks, self.block_size, c.n_kv_head, c.head_dim)
        k = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        return k, torch.zeros_like(k)

    @torch.inference_mode()
    def forward(self, step: dict) -> None:
        """Rank 0's forward, on this rank's shard. A step on another cache than the engine's
        (the profile's scratch cache at start) runs on scratch zeros of its size."""
        input_ids, positions, meta, num_blocks = unpack_step(step, self.device)
        k_caches, v_caches = self.k_caches, self.v_caches
        if k_caches is None or k_caches.shape[1] != num_blocks:
            k_caches, v_caches = self.caches(num_blocks)
        if self.lora_mapping is not None:
            self.lora_mapping.set(None)
            if "lora_slots" in step:
                host_slots = step["lora_slots"].tolist()
                token_slots = torch.from_numpy(step["lora_slots"]).to(self.device)
                if cuda_runtime.is_cuda(self.device):
                    host_slots = None  # the Triton kernels read the slots on the device
                self.lora_mapping.set(token_slots, host_slots)
        self.model(input_ids, positions, meta, k_caches, v_caches, self.attention)


def worker_main(config, rank: int, pipe) -> None:
    """A worker's life: load its shard, join the group at the port rank 0 sends, then run what
    rank 0 sends until told to stop (None) or rank 0's end of the pipe closes."""
    device = "cpu"
    if str(config.device).startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    comm = Communicator(rank, config.tensor_parallel_size)
    try:
        shard = Shard(rank, comm.world_size, comm)
        checkpoint = load_model(config.model, config.preset, config.seed, device,
                                DTYPES.get(config.dtype), config.quantization, shard=shard)
    except Exception as e:  # noqa: BLE001 (told to rank 0, which raises it)
        pipe.send(f"{type(e).__name__}: {e}")
        return
    pipe.send("loaded")
    worker = Worker(config, checkpoint.model.eval(), checkpoint.dtype, device)
    while True:
        try:
            message = pipe.recv()
        except EOFError:
            return
        if message is None:
            return
        kind, payload = message
        if kind == "join":
            store = dist.TCPStore("127.0.0.1", payload, comm.world_size, False,
                                  timeout=JOIN_TIMEOUT)
            comm.group = join_group(store, rank, comm.world_size, device)
        elif kind == "allocate":
            worker.allocate(payload)
        elif kind == "swap_space":
            worker.swap_space = SwapSpace(payload, worker.k_caches, worker.v_caches)
        elif kind == "swap":
            worker.swap(*payload)
        elif kind == "lora":
            worker.load_lora(*payload)
        else:
            worker.forward(payload)

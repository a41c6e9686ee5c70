"""tensor_parallel.py: one model split across N processes (Megatron-LM's tensor parallelism,
vLLM's tensor_parallel_size), two all-reduces a layer putting the pieces back together.

Rank 0 is the engine's own process: the scheduler, the block pool, sampling and everything
else run there once, unchanged. Ranks 1..N-1 are worker processes (start_workers) that hold
only their slices of the weights and of the KV cache and run only the model: each step,
rank 0's model, as it is called, sends its inputs (token ids, positions, the attention
metadata) down a pipe to every worker (TensorParallel.send_step), and all N run the same
forward in lockstep, meeting at each all-reduce. A worker's forward output is thrown away.
The logits are made the same way: each call of rank 0's LM head, whatever its rows (the
sampling positions, prompt log-probabilities a chunk at a time, a verify's drafts, the
profile's), tells the workers the rows' shape (send_logits), broadcasts the rows, and
gathers every rank's slice of the vocabulary (VocabParallelLMHead).

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
    lm_head        (257, 192), tied: the embedding's slice, (129, 192) and (128, 192); for R
                   rows, a broadcast of (R, 192) from rank 0, each rank's logits (R, 129)
                   (rank 1's padded with a zero column), gathered on rank 0: (R, 257)

So a layer costs two all-reduces of (N, C) fp32 activations, 2 x N x 768 bytes here, a step
one more for the embedding, and its logits a broadcast of R x C values (C / V of the
logits' bytes; it spares the workers keeping their hidden states and being told which rows)
and a gather of R x V fp32 logits. Llama's gate_proj and up_proj are cut as up_proj is (each
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

CUDA graphs: a replayed graph runs no Python, so no hook of ours tells the workers. Rank 0's
model runner tells them instead (capturing, replaying): when it makes its decode graphs,
each worker captures its own for the same sizes, in the same order (largest first), over
static buffers filled as rank 0's, so each capture's warm-up meets rank 0's all-reduces; before
each replay, rank 0 sends the padded size and the buffers' rows, and every rank replays its
graph of that size: the same shapes, the same all-reduces. Rank 0's forwards on its padded
path send nothing. A CPU worker told to capture (rank 0 on the tests' fake_cuda) runs each
size eagerly instead, as a capture's warm-up does. Untried on GPUs: none lent has two.

Left out: vLLM's custom all-reduce (faster than NCCL's at a decode's sizes); CommStats counts
no collective a replayed graph runs.
"""
import contextlib
import dataclasses
import datetime
import multiprocessing
import os
import time
import weakref
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cuda_runtime
from checkpoint import (DEFAULT_MODEL, DTYPES, checkpoint_path, config_from_hf, load_model,
                        read_json)
from kernels import AttentionMetadata, select_attention
from linear import LoRAMapping, Linear, projections, row_parallel
from model import GPT, PRESETS, GPTConfig, LMHead
from model_runner import DecodeBuffers, capture_graphs
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
    num_gathers: int = 0           # the LM head's (each after a broadcast of its rows)
    gather_bytes: int = 0          # the rows broadcast, and the logits gathered (all ranks')
    gather_seconds: float = 0.0
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
        """(start, rows) of the rank's embedding and LM head rows (vocab_rows)."""
        return vocab_rows(vocab_size, self.world_size, self.rank)

    def kv_head_start(self, n_kv_head: int) -> int:
        """The first K/V head the rank holds: split (Hkv / N each) or replicated (N / Hkv
        ranks share one)."""
        if n_kv_head >= self.world_size:
            return self.rank * (n_kv_head // self.world_size)
        return self.rank // (self.world_size // n_kv_head)

    def narrow(self, full: GPTConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's slice of one tensor of the state dict (Hugging Face's names, q/k/v and
        gate/up apart): a view of the (memory-mapped) tensor, copied only when placed."""
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
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return tensor.narrow(0, *self.vocab_rows(full.vocab_size))
        return tensor

    def build(self, full: GPTConfig, tensors: dict[str, torch.Tensor], device: str,
              dtype: torch.dtype) -> GPT:
        """The rank's model from the whole state dict's tensors (views, Hugging Face's names):
        built on the meta device in the rank's shapes, each slice copied once to device in
        dtype; o_proj and down_proj all-reduce their outputs, the embedding and the LM head
        are vocab-parallel (tied: the LM head's rows are the embedding's slice, one tensor)."""
        local = self.config(full)
        with torch.device("meta"):
            model = GPT(local)
        start, rows = self.vocab_rows(full.vocab_size)
        placed = {}
        for name in list(tensors):
            view = tensors.pop(name).detach()
            if name == "lm_head.weight" and full.tie_word_embeddings:
                continue  # the embedding's, placed with it
            module, _, param = name.rpartition(".")
            if module.endswith(("o_proj", "down_proj")) and param == "weight":
                self.row_amax[module] = view.abs().amax(dim=1).float()
            placed[name] = self.narrow(full, name, view).to(device, dtype).contiguous()
        if full.tie_word_embeddings:
            placed["lm_head.weight"] = placed["model.embed_tokens.weight"]
        with torch.device("meta"):  # their weights come next, as every other
            model.model["embed_tokens"] = VocabParallelEmbedding(start, rows, full.n_embd,
                                                                 self.comm.all_reduce)
            model.lm_head = VocabParallelLMHead(full.vocab_size, full.n_embd, self.comm)
        model.load_state_dict(placed, assign=True)
        if full.tie_word_embeddings:  # one parameter, as GPT() ties them
            model.lm_head.weight = model.model.embed_tokens.weight
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


class VocabParallelLMHead(LMHead):
    """The LM head cut by vocabulary rows as the embedding is (vLLM's ParallelLMHead), on every
    rank: rank 0's hidden rows (n, C) go to every rank (a broadcast: n x C values, a fraction
    C / V of the logits' bytes), each rank makes the logits of its rows (n, ceil(V / N)), the
    last rank's padded with zeros to that width, and rank 0 gathers them, side by side, the
    padding dropped: (n, V) fp32 there, None on a worker. Rank 0's caller is any (the
    sampling positions, prompt log-probabilities in chunks, a verify's, the profile's): the
    workers are told only the rows' shape (TensorParallel.send_logits)."""

    def __init__(self, vocab_size: int, embedding_dim: int, comm: "Communicator"):
        start, rows = vocab_rows(vocab_size, comm.world_size, comm.rank)
        super().__init__(embedding_dim, rows, bias=False)
        self.comm = comm
        self.width = -(-vocab_size // comm.world_size)  # each rank's logits, padded
        self.rank_rows = [vocab_rows(vocab_size, comm.world_size, rank)[1]
                          for rank in range(comm.world_size)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (n, C) -> (n, V) fp32
        hidden = self.comm.broadcast(hidden.contiguous())
        local = super().forward(hidden)  # (n, rows)
        if local.shape[1] < self.width:
            local = F.pad(local, (0, self.width - local.shape[1]))
        parts = self.comm.gather(local)
        if parts is None:
            return None
        return torch.cat([part[:, :rows] for part, rows in zip(parts, self.rank_rows)], dim=1)


def vocab_rows(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, rows) of a rank's vocabulary rows: ceil(V / N) a rank, the last fewer."""
    per_rank = -(-vocab_size // world_size)
    start = min(vocab_size, rank * per_rank)
    return start, min(per_rank, vocab_size - start)


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
        seconds = self._run("an all-reduce", self.group.allreduce, [tensor])
        stats = self.stats
        stats.num_all_reduces += 1
        stats.all_reduce_bytes += nbytes(tensor)
        stats.all_reduce_seconds += seconds
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor, into tensor (contiguous, its shape) on every rank, returned."""
        seconds = self._run("a broadcast", self.group.broadcast, tensor, 0)
        self.stats.gather_bytes += nbytes(tensor)
        self.stats.gather_seconds += seconds
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (contiguous, one shape) on rank 0, in rank order; None on the
        others."""
        parts = []
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        seconds = self._run("a gather", self.group.gather, parts, tensor, 0)
        stats = self.stats
        stats.num_gathers += 1
        stats.gather_bytes += nbytes(tensor) * len(parts)
        stats.gather_seconds += seconds
        return parts or None

    def _run(self, what: str, op, *args) -> float:
        """One collective op run to its end: its seconds; WorkerDiedError if it failed."""
        start = time.perf_counter()
        try:
            op(*args).wait()
        except RuntimeError as e:  # gloo: a peer closed its connection, or the op timed out
            if self.workers is not None:
                find_dead_worker(self.workers)
            raise WorkerDiedError(f"{what} failed: {str(e).splitlines()[0]}") from e
        return time.perf_counter() - start


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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


DECODE_BUFFERS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                  "lora_slots")


def buffer_rows(buffers: DecodeBuffers, size: int) -> dict:
    """The static buffers' first `size` rows as host arrays, by name (a padded decode step's
    inputs: DecodeBuffers)."""
    return {name: getattr(buffers, name)[:size].cpu().numpy() for name in DECODE_BUFFERS}


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
        self.padded = False  # rank 0 runs its padded decode path: its forwards send nothing
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
        model.lm_head.register_forward_pre_hook(self.send_logits)
        model.lm_head.register_forward_hook(self.step_done)

    def prepare(self, model_runner) -> None:
        """Once rank 0's model runner is built: each worker allocates its KV cache, as many
        blocks as rank 0's (its heads only); with LoRA, every adapter rank 0 puts in a slot
        goes to the workers too, and rank 0 reads adapters against the whole model's shapes
        (a meta model: no memory), its slots holding its slices (LoRAShard)."""
        self._send(("allocate", model_runner.k_caches.shape[1]))
        model_runner.tensor_parallel = self  # its graphs' captures and replays (no cycle)
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
        every worker, which runs the same forward (unless it replays a graph: replaying)."""
        if self.padded:
            return
        self._start_step()
        start = time.perf_counter()
        step = pack_step(*args[:4])
        if self.lora_mapping is not None and self.lora_mapping.token_slots is not None:
            step["lora_slots"] = self.lora_mapping.token_slots.cpu().numpy()
        self._send(("forward", step))
        self.comm.stats.num_steps += 1
        self.comm.stats.channel_seconds += time.perf_counter() - start

    def send_logits(self, _lm_head, args) -> None:
        """The LM head's forward pre-hook: the shape and dtype of the hidden rows rank 0 makes
        logits of, to every worker, which joins the head's broadcast and gather."""
        self._start_step()
        hidden = args[0]
        self._send(("logits", (tuple(hidden.shape), hidden.dtype)))

    def capturing(self, buffers: DecodeBuffers, sizes: list[int], capture: bool):
        """Around rank 0's use_padded_decode making its graphs (capture) or eager padded runs
        of each size: each worker makes its own, from rank 0's static buffers (their padding
        rows), in the same order, so the capture's warm-up runs meet in their all-reduces."""
        return self._padded(("graphs", (sizes, capture, buffer_rows(buffers, sizes[-1]))))

    def replaying(self, buffers: DecodeBuffers, size: int):
        """Around rank 0's replay of its graph of `size`: each worker replays its own, its
        static buffers' first `size` rows made rank 0's first (a graph runs no hook of ours)."""
        return self._padded(("decode", (size, buffer_rows(buffers, size))))

    @contextlib.contextmanager
    def _padded(self, message):
        """The workers told `message`, then rank 0's padded decode path runs, its forwards
        sending nothing (on a CPU, fake_cuda's replays run them eagerly)."""
        self._start_step()
        self._send(message)
        self.padded = True
        try:
            yield
        finally:
            self.padded = False
        self.in_step = False

    def _start_step(self) -> None:
        """Before rank 0 runs something with the workers: they live, and rank 0's last one
        ended."""
        self.check_alive()
        if self.in_step:  # rank 0's last forward raised; the workers wait in its collectives
            stop_workers(self.processes, self.pipes, wait=False)
            raise TensorParallelError("rank 0's last forward failed part-way, leaving the "
                                      "workers out of step; the engine must be restarted")
        self.in_step = True

    def step_done(self, _module, _args, _output) -> None:
        """The model's or the LM head's forward hook: rank 0's returned, so every collective
        was met."""
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
        self.buffers: DecodeBuffers | None = None  # rank 0's padded decode path, if it has one
        self.graphs: dict[int, object] = {}        # batch size -> its replay (or eager run)
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
                token_slots = torch.from_numpy(step["lora_slots"]).to(self.device)
                self.lora_mapping.set(token_slots, step["lora_slots"].tolist())
        self.model(input_ids, positions, meta, k_caches, v_caches, self.attention)

    def make_graphs(self, sizes: list[int], capture: bool, rows: dict) -> None:
        """Rank 0's use_padded_decode on this rank: static buffers filled as rank 0's (rows),
        and for each size a run of the model over their first rows, captured in a CUDA graph
        (capture, on CUDA: largest first, sharing a pool, as rank 0's) or run eagerly. A CPU
        rank told to capture (rank 0 on conftest's fake_cuda) runs each size once, as a
        capture's warm-up does: every all-reduce of rank 0's warm-ups is met."""
        width = rows["block_tables"].shape[1]
        self.buffers = DecodeBuffers.make(sizes[-1], width, self.device)
        self.fill_buffers(rows)
        self.graphs = {size: partial(self.run_decode, size) for size in sizes}
        if not capture:
            return
        if cuda_runtime.is_cuda(self.device):
            self.graphs = capture_graphs(self.run_decode, sizes, self.device)
            return
        for size in reversed(sizes):  # a CPU rank: each capture's warm-up, eagerly
            self.graphs[size]()

    def fill_buffers(self, rows: dict) -> None:
        """Rank 0's static buffers' first rows (buffer_rows), into this rank's."""
        for name, values in rows.items():
            getattr(self.buffers, name)[:len(values)].copy_(torch.from_numpy(values))

    def replay(self, size: int, rows: dict) -> None:
        """Rank 0's replay of its graph of `size`: this rank's, over rank 0's inputs."""
        self.fill_buffers(rows)
        self.graphs[size]()

    @torch.inference_mode()
    def run_decode(self, size: int) -> None:
        """The model over the static buffers' first `size` rows (ModelRunner._run_decode's)."""
        b = self.buffers
        if self.lora_mapping is not None:  # no CPU layout: the slots' static buffer is read
            self.lora_mapping.set(b.lora_slots[:size])
        self.model(b.input_ids[:size], b.positions[:size], b.metadata(size), self.k_caches,
                   self.v_caches, self.attention)

    @torch.inference_mode()
    def logits(self, shape: tuple, dtype: torch.dtype) -> None:
        """Rank 0's LM head call on rows of `shape`: they come by its broadcast, and this
        rank's logits go to its gather (VocabParallelLMHead)."""
        self.model.compute_logits(torch.empty(shape, dtype=dtype, device=self.device))


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
        elif kind == "logits":
            worker.logits(*payload)
        elif kind == "graphs":
            worker.make_graphs(*payload)
        elif kind == "decode":
            worker.replay(*payload)
        else:
            worker.forward(payload)

"""The device side of a step: the KV cache, the step's inputs, the forward, logits, sampling,
and decode in CUDA graphs. The engine (nanoserve.py) decides what runs and what its tokens
mean; ModelRunner runs it, as vLLM's GPU model runner and nano-vllm's ModelRunner split it.

In this file, in order: what a step passes along (Batch, ModelOutput), to_host (the step's
waits for the device), the KV cache's sizing on CUDA (kv_cache_bytes, profiled at start), the
static buffers of graphed decode steps (DecodeBuffers, capture_sizes), then ModelRunner:
execute_model (build the inputs, run, sample, gather log-probabilities) and the graphs.

CUDA graphs. A decode step launches some 40 kernels a layer from Python (about 1,000 a step
for a 24-layer model), each costing the host a few microseconds: at small batches the GPU
waits for the launches, not for memory. A CUDA graph records a step's launches once and
replays them with one call. Its tensors' addresses are fixed at capture, so a graphed step
reads its inputs from static buffers (DecodeBuffers) that each step fills in place. A graph
is captured for each of a few batch sizes (capture_sizes: 1, 2, 4, 8, then every 16), largest
first and sharing one memory pool; a decode step of b sequences replays the graph of the next
size up, its padding entries writing their K/V to the null block (the last of the cache, which
no sequence owns) and attending to it alone. Block tables are always the whole width
max_model_len needs, so the kernels' shapes are the graph's. Prefills and mixed steps run
eagerly; the logits and sampling run outside the graph (their shapes vary with the
requests' parameters). `enforce_eager` (vLLM's flag) turns graphs off. Under tensor
parallelism every rank captures and replays its own, rank 0 telling the workers each size
(tensor_parallel.TensorParallel.replaying). The padded path also
runs eagerly on a CPU (use_padded_decode, for the tests): its tokens are the unpadded path's.
"""
import itertools
import time
from dataclasses import dataclass, field
from functools import partial

import torch

import cuda_runtime
from input_batch import InputBatch
from kernels import AttentionMetadata, max_chunk_tokens, paged_attention, select_attention
from lora import LoRAManager
from paged_cache import allocate_kv_cache, cdiv, kv_bytes_per_token, kv_cache_torch_dtype
from sampling import invalid_logits, sample, sampling_tensors, upload
from scheduler import Sequence
from spec_decode import SpecDecodeMetadata, accept_runs, count_drafts, output_offsets, verify
from structured_output import apply_grammar_bitmask
from swap import SwapSpace, copy_blocks, swap_space_blocks

KV_CACHE_BYTES = 1 << 30  # the CPU's KV cache, by default: a full context for every sequence,
                          # within 1 GiB (on CUDA: gpu_memory_utilization of the GPU's memory)
NO_DRAFTS: tuple[int, ...] = ()  # a sequence's drafts in a step that verifies none
MAX_CAPTURE_SIZE = 512    # the largest batch a decode graph is captured for (nano-vllm's)
PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions whose logits and log-softmax are made at once:
                              # 1,024 x a 152k vocabulary is 0.6 GB of fp32 logits, where an
                              # 8k-token chunk's all at once took some 15 GB


@dataclass
class Batch:
    """One step's model inputs, flattened over the scheduled sequences (see _prepare_inputs)."""
    input_ids: torch.Tensor         # (N,) the new tokens of every scheduled sequence
    positions: torch.Tensor         # (N,) each token's position in its sequence
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor    # (R,) the flat-batch index of the last token of each
                                    # sequence that samples (vLLM's name), and of each of its
                                    # drafts: R = n + the step's drafts
    sample_seqs: list[Sequence]     # (n,) the sequences with no uncomputed token left
    prompt_logits_indices: torch.Tensor  # (m,) the tokens whose next is a prompt token to
                                    # score (prompt_logprobs)
    prompt_targets: torch.Tensor    # (m,) those next tokens
    prompt_seqs: list[Sequence]     # (m,) their sequences
    is_decode: bool = False         # every sequence has one new token: a graph may run it
    # (n,) each sampling sequence's drafts verified this step ([] for none); None: no drafts
    # in the step, one entry a sequence
    sample_drafts: list[list[int]] | None = None
    lora_slots: torch.Tensor | None = None  # (N,) int64 each token's LoRA slot, -1 none; None:
                                            # no adapter in the step (lora.py)
    lora_host_slots: list[int] | None = None  # the same on the host (a CPU's LoRA layouts)


@dataclass
class ModelOutput:
    """What execute_model gives the engine's update(): the tokens emitted by each sequence with
    no uncomputed token left (one, or with drafts the accepted ones and one more), the
    log-probabilities asked for, and the sequences that failed."""
    sampled_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # (R, vocab) fp32: the sampling positions' (Batch)
    sample_seqs: list[Sequence] = field(default_factory=list)  # each sampling position's
                                                               # sequence, in a step without drafts
    logprobs: dict[Sequence, list[dict]] = field(default_factory=dict)  # each emitted token's
    prompt_logprobs: dict[Sequence, list[dict]] = field(default_factory=dict)  # scored this step
    failed: dict[Sequence, str] = field(default_factory=dict)  # failed alone -> the error
    fell_back: bool = False  # the batch failed, and each sequence ran alone (Engine.execute)


def to_host(tensor: torch.Tensor) -> list:
    """A device tensor's values as (nested) Python lists. The only place a step waits for the
    device (once for the sampled tokens; twice more, ids and values, when a request asks for
    log-probabilities): a CUDA test runs whole steps with every other wait made an error."""
    return tensor.tolist()


NAN_LOGITS = ("the model's logits are NaN or infinite (in float16, an activation past 65,504 "
              "overflows: try --dtype bfloat16)")


def kv_cache_bytes(total: int, used: int, peak_activations: int, penalty_state: int,
                   gpu_memory_utilization: float) -> int:
    """What the KV cache may take of a GPU of `total` bytes: gpu_memory_utilization of it, less
    what is in use before the cache (`used`: the weights, the CUDA context, other processes),
    the peak of a forward at the token budget (`peak_activations`) and the penalty state
    (max_num_seqs x vocab). Example: 80 GB at 0.9 with 2 GB used, 3 GB of activations and
    0.2 GB of penalty state leave 72 - 5.2 = 66.8 GB."""
    budget = int(total * gpu_memory_utilization) - used - peak_activations - penalty_state
    if budget <= 0:
        raise ValueError(f"no GPU memory is left for the KV cache: gpu_memory_utilization "
                         f"{gpu_memory_utilization} of {total / 2**30:.1f} GiB, with "
                         f"{used / 2**30:.1f} GiB in use and {peak_activations / 2**30:.1f} GiB "
                         "for activations; raise gpu_memory_utilization or lower "
                         "max_num_batched_tokens")
    return budget


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 16, and
    max_num_seqs itself (at most MAX_CAPTURE_SIZE); a batch replays the next size up."""
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {1, 2, 4, 8, largest} | set(range(16, largest + 1, 16))
    return sorted(size for size in sizes if size <= largest)


@dataclass
class DecodeBuffers:
    """A graphed decode step's inputs and output, at the largest captured batch size B: each
    step writes its b decodes' entries first and pads the rest; a graph of size s reads the
    first s entries."""
    input_ids: torch.Tensor         # (B,) int64
    positions: torch.Tensor         # (B,) int64
    slot_mapping: torch.Tensor      # (B,) int64; padding: the null block's first slot
    block_tables: torch.Tensor      # (B, W) int32, W the whole table width; padding: null block
    context_lens: torch.Tensor      # (B,) int32; padding: 1
    query_start_loc: torch.Tensor   # (B + 1,) int32: 0, 1, 2, ... (a token a sequence)
    lora_slots: torch.Tensor        # (B,) int64 each decode's LoRA slot; padding, base: -1
    hidden: torch.Tensor | None = None  # (B, C): the graphs' output

    @classmethod
    def make(cls, size: int, width: int, device: str) -> "DecodeBuffers":
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(input_ids=zeros(size), positions=zeros(size), slot_mapping=zeros(size),
                   block_tables=zeros(size, width, dtype=torch.int32),
                   context_lens=zeros(size, dtype=torch.int32), lora_slots=zeros(size) - 1,
                   query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device))

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a decode step padded to `size`: its first `size` entries."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, num_decodes=size)


class ModelRunner:
    """The model, its KV cache, the persistent batch and the decode graphs, on one device."""

    def __init__(self, config, model, dtype: torch.dtype, vocab_size: int,
                 eos_token_ids: list[int], draft_kv_bytes_per_token: int = 0):
        """draft_kv_bytes_per_token: a draft model's K/V bytes a token (0: none), whose cache
        holds as many tokens as this one's (it mirrors every running sequence): the two share
        the memory the cache is sized from, and the draft's weights are loaded already."""
        self.config = config
        self.model = model
        self.device = config.device
        self.dtype = dtype  # the model's
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)  # the cache's
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.attention = select_attention(config.attention, config.device)
        self.generator = torch.Generator(config.device).manual_seed(config.seed)
        c = model.config
        self._check_chunk_fits_the_grid(c.n_head // c.n_kv_head)
        self.lora_manager: LoRAManager | None = None  # adapters' slots, before the KV cache
        if config.enable_lora:                         # is sized from what is left
            self.lora_manager = LoRAManager(model, config.max_loras, config.max_lora_rank,
                                            config.max_cpu_loras or config.max_loras,
                                            config.device)
        self.kv_bytes_per_token = kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim,
                                                     self.kv_cache_dtype)
        self.draft_kv_bytes_per_token = draft_kv_bytes_per_token
        # K and V for every layer and K/V head: grouped-query attention's saving is here. The
        # caches of all layers, k_caches and v_caches (n_layer, NB + 1, BS, Hkv, D); layer i's
        # is [i]; block NB, past the pool's, is the null block (graphs' padding writes there).
        self.k_caches, self.v_caches, self.block_pool = allocate_kv_cache(
            c.n_layer, c.n_kv_head, c.head_dim, self._kv_cache_tokens(c.n_positions),
            config.block_size, config.device, self.kv_cache_dtype, config.enable_prefix_caching)
        self.null_block = self.block_pool.num_blocks
        self.swap_space: SwapSpace | None = None  # host blocks, when preemption may swap
        if config.preemption_mode != "recompute":
            num_host_blocks = swap_space_blocks(config.swap_space, config.block_size,
                                                self.kv_bytes_per_token)
            self.swap_space = SwapSpace(num_host_blocks, self.k_caches, self.v_caches)
        self.input_batch: InputBatch | None = None  # made by prepare(), once max_model_len is
        self.buffers: DecodeBuffers | None = None   # known; with graphs or use_padded_decode
        self.graphs: dict[int, object] = {}         # batch size -> its replay (or eager run)
        # rank 0's handle on the tensor-parallel workers (set by it): they capture and replay
        # their graphs as these are (tensor_parallel.TensorParallel.capturing, replaying)
        self.tensor_parallel = None

    def _check_chunk_fits_the_grid(self, group_size: int) -> None:
        """ValueError at the start, not at a long prompt's step, if a chunk of the token budget
        would pass the Triton kernel's grid limit (kernels.max_chunk_tokens)."""
        budget = self.config.max_num_batched_tokens
        if self.attention is paged_attention and budget > max_chunk_tokens(group_size):
            raise ValueError(f"max_num_batched_tokens {budget} is more than Triton attention "
                             f"can prefill at once at {group_size} query heads a K/V head "
                             f"(CUDA's grid limit): at most {max_chunk_tokens(group_size)}")

    # --- the KV cache's size ------------------------------------------------------------

    def _kv_cache_tokens(self, context: int) -> int:
        """kv_cache_tokens if given; on CUDA, what gpu_memory_utilization leaves (profiled);
        on a CPU, a full context (max_model_len's, or the model's) for every one of
        max_num_seqs sequences, within KV_CACHE_BYTES. A draft's cache, as many tokens, takes
        its share of either."""
        config = self.config
        if config.kv_cache_tokens is not None:
            return config.kv_cache_tokens
        bytes_per_token = self.kv_bytes_per_token + self.draft_kv_bytes_per_token
        if cuda_runtime.is_cuda(self.device):
            return self._profile_kv_cache_bytes() // bytes_per_token
        if config.max_model_len is not None:
            context = config.max_model_len
        return min(config.max_num_seqs * context, KV_CACHE_BYTES // bytes_per_token)

    def _profile_kv_cache_bytes(self) -> int:
        """Run a forward of max_num_batched_tokens tokens (and the logits of max_num_seqs rows)
        on a scratch cache, and size the KV cache from the memory it peaked at."""
        free, total, peak_activations = cuda_runtime.profile_memory(self.device,
                                                                    self._profile_forward)
        num_input_batches = 1 + (self.draft_kv_bytes_per_token > 0)  # a draft has its own
        penalty_state = num_input_batches * self.config.max_num_seqs * self.vocab_size * (4 + 1)
        return kv_cache_bytes(total, total - free, peak_activations, penalty_state,
                              self.config.gpu_memory_utilization)

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """One prefill of the token budget, as chunks of at most a context each, over a scratch
        cache just large enough, then the logits of max_num_seqs rows and their softmax."""
        config = self.config
        c = self.model.config
        num_tokens = config.max_num_batched_tokens
        chunk = min(num_tokens, c.n_positions)
        lens = [chunk] * (num_tokens // chunk)  # sequences of a context each, and the rest
        if num_tokens % chunk:
            lens.append(num_tokens % chunk)
        block_size = config.block_size
        blocks_a_seq = cdiv(chunk, block_size)
        shape = (c.n_layer, blocks_a_seq * len(lens), block_size, c.n_kv_head, c.head_dim)
        k_caches = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        v_caches = torch.zeros_like(k_caches)
        tables = torch.arange(blocks_a_seq * len(lens), dtype=torch.int32, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        slots = torch.cat([s * blocks_a_seq * block_size + torch.arange(n, device=self.device)
                           for s, n in enumerate(lens)])
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(len(lens), blocks_a_seq),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                                         device=self.device),
            max_query_len=chunk)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, meta, k_caches, v_caches, self.attention)
        rows = hidden[-1:].expand(min(config.max_num_seqs, num_tokens), -1)
        self.compute_logits(rows).softmax(dim=-1)

    # --- the persistent batch and the graphs ----------------------------------------------

    def prepare(self, max_model_len: int) -> None:
        """Once max_model_len is known: the persistent batch (its tables that wide), and on
        CUDA, unless enforce_eager, the decode graphs."""
        config = self.config
        self.input_batch = InputBatch(config.max_num_seqs, max_model_len, config.block_size,
                                      self.vocab_size, config.device)
        if cuda_runtime.is_cuda(self.device) and not config.enforce_eager:
            self.use_padded_decode(capture=True)

    def remove(self, seq: Sequence) -> None:
        """seq left the running batch (finished, preempted or failed): its row is free."""
        self.input_batch.remove(seq)

    def truncate(self, seq: Sequence) -> None:
        """seq's table lost blocks (rejected drafts): its row forgets them."""
        self.input_batch.truncate(seq)

    def swap(self, swapped_out: dict[Sequence, list[tuple[int, int]]],
             swapped_in: dict[Sequence, list[tuple[int, int]]],
             block_copies: dict[Sequence, list[tuple[int, int]]] | None = None) -> None:
        """The step's block copies, before its forward: every copy out (device -> host), then
        copy-on-write's (device -> device, one op; their rows' tables are uploaded again),
        then every copy in (host -> device). A block freed by one may be taken by a later
        one: a swap-out's by a copy's new block, a copy's shared block (its other owner
        preempted) by a swap-in."""
        for pairs in swapped_out.values():
            self.swap_space.copy_out(self.k_caches, self.v_caches, pairs)
        if block_copies:
            for seq in block_copies:  # a block of its table changed: its row starts again
                self.input_batch.remove(seq)
            pairs = [pair for seq_pairs in block_copies.values() for pair in seq_pairs]
            copy_blocks(self.k_caches, self.v_caches, pairs)
        for pairs in swapped_in.values():
            self.swap_space.copy_in(self.k_caches, self.v_caches, pairs)

    def execute_timed(self, num_scheduled_tokens: dict[Sequence, int],
                      spec_decode_tokens: dict[Sequence, list[int]]) -> ModelOutput:
        """execute_model, its time given to the swap space if any (the prefill rate that
        --preemption-mode auto weighs the copies against: SwapSpace.time_step). The step
        waits for the device at its end (to_host), so its wall time is the device's."""
        if self.swap_space is None:
            return self.execute_model(num_scheduled_tokens, spec_decode_tokens)
        start = time.perf_counter()
        output = self.execute_model(num_scheduled_tokens, spec_decode_tokens)
        seconds = time.perf_counter() - start
        # a decode runs one token, or one and its drafts; any other sequence's are prefill's
        num_prefill_tokens = sum(n for seq, n in num_scheduled_tokens.items()
                                 if n > 1 and seq not in spec_decode_tokens)
        self.swap_space.time_step(num_prefill_tokens, sum(num_scheduled_tokens.values()),
                                  seconds)
        return output

    def use_padded_decode(self, capture: bool = False) -> None:
        """Run decode steps padded to capture_sizes through static buffers: captured in CUDA
        graphs (capture, on CUDA), or run eagerly (the tests' way to check, on a CPU, that the
        padded path gives the unpadded path's tokens)."""
        sizes = capture_sizes(self.config.max_num_seqs)
        width = self.input_batch.block_tables.shape[1]
        self.buffers = DecodeBuffers.make(sizes[-1], width, self.device)
        self._fill_padding(0)
        if self.tensor_parallel is None:
            self._make_graphs(sizes, capture)
            return
        with self.tensor_parallel.capturing(self.buffers, sizes, capture):
            self._make_graphs(sizes, capture)

    def _make_graphs(self, sizes: list[int], capture: bool) -> None:
        """self.graphs: each size's captured graph (capture), or its eager padded run."""
        if not capture:
            self.graphs = {size: partial(self._run_decode, size) for size in sizes}
            return
        self.graphs = capture_graphs(self._run_decode, sizes, self.device)

    @torch.inference_mode()
    def _run_decode(self, size: int) -> None:
        """The model over the static buffers' first `size` rows, into buffers.hidden."""
        b = self.buffers
        if self.lora_manager is not None:  # a graph reads the slots from the static buffer
            self.lora_manager.mapping.set(b.lora_slots[:size])
        hidden = self.model(b.input_ids[:size], b.positions[:size], b.metadata(size),
                            self.k_caches, self.v_caches, self.attention)  # (size, C)
        if b.hidden is None:
            b.hidden = torch.empty((len(b.input_ids), hidden.shape[1]), dtype=hidden.dtype,
                                   device=hidden.device)
        b.hidden[:size].copy_(hidden)

    def _fill_padding(self, start: int) -> None:
        """Rows from `start` on are padding: token 0 at position 0, written to the null block's
        first slot, attending to it alone (a context of 1)."""
        b = self.buffers
        b.input_ids[start:] = 0
        b.positions[start:] = 0
        b.slot_mapping[start:] = self.null_block * self.config.block_size
        b.block_tables[start:] = self.null_block
        b.context_lens[start:] = 1
        b.lora_slots[start:] = -1

    def _graph_size(self, batch: Batch) -> int | None:
        """The captured size a decode batch replays (the next one up), or None: eager."""
        if not self.graphs or not batch.is_decode:
            return None
        num_seqs = len(batch.input_ids)
        return next((size for size in sorted(self.graphs) if size >= num_seqs), None)

    def _forward(self, batch: Batch) -> torch.Tensor:
        """The model over the step's tokens: (N, C), from a graph's replay if one fits."""
        size = self._graph_size(batch)
        if size is None:
            if self.lora_manager is not None:
                self.lora_manager.mapping.set(batch.lora_slots, batch.lora_host_slots)
            return self.model(batch.input_ids, batch.positions, batch.attn_metadata,
                              self.k_caches, self.v_caches, self.attention)
        num_seqs = len(batch.input_ids)
        b = self.buffers
        meta = batch.attn_metadata
        if batch.lora_slots is not None:
            b.lora_slots[:num_seqs].copy_(batch.lora_slots)
        else:
            b.lora_slots[:num_seqs] = -1
        b.input_ids[:num_seqs].copy_(batch.input_ids)
        b.positions[:num_seqs].copy_(batch.positions)
        b.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        b.context_lens[:num_seqs].copy_(meta.context_lens)
        width = meta.block_tables.shape[1]
        b.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        b.block_tables[:num_seqs, width:] = 0  # a table's unused columns: never read
        self._fill_padding(num_seqs)
        if self.tensor_parallel is None:
            self.graphs[size]()
            return b.hidden[:num_seqs]
        with self.tensor_parallel.replaying(b, size):  # the workers replay theirs
            self.graphs[size]()
        return b.hidden[:num_seqs]

    # --- a step -------------------------------------------------------------------------

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, C) -> fp32 logits (n, vocab_size), contiguous: the tokenizer's
        ids only, so an embedding row past them is never sampled (one copy when the
        embedding has such rows: sampling then passes over dense rows)."""
        logits = self.model.compute_logits(hidden)
        if logits.shape[1] == self.vocab_size:
            return logits
        return logits[:, :self.vocab_size].contiguous()

    def execute_model(self, num_scheduled_tokens: dict[Sequence, int],
                      spec_decode_tokens: dict[Sequence, list[int]] | None = None
                      ) -> ModelOutput:
        """Build the inputs, run the model over every scheduled token, sample a token for each
        sequence with no uncomputed token left (verify its drafts, spec_decode_tokens, if it
        has any), gather the log-probabilities asked for. A sequence whose logits are NaN
        fails alone (output.failed)."""
        batch = self._prepare_inputs(num_scheduled_tokens, spec_decode_tokens)
        hidden = self._forward(batch)                                      # (N, C)
        logits = self.compute_logits(hidden[batch.logits_indices])         # (R, vocab) fp32
        output = ModelOutput(logits=logits, sample_seqs=batch.sample_seqs)
        if batch.sample_drafts is not None:
            return self._verify(batch, hidden, logits, output)
        if not batch.sample_seqs and not batch.prompt_seqs:
            return output
        token_ids = batch.prompt_targets[:0]  # none sampled: an empty id tensor, on the device
        invalid = token_ids
        if batch.sample_seqs:
            token_ids, invalid = self._sample(batch.sample_seqs, logits)
        if wants_logprobs(batch):
            self._gather_logprobs(batch, hidden, logits, token_ids, batch.sample_seqs, output)
        # The step's wait for the sampled tokens and whether each one's logits were NaN, in
        # one read (log-probabilities, if asked for, were read above: two more).
        sampled, is_invalid = to_host(torch.stack([token_ids, invalid]))
        for seq, token, nan in zip(batch.sample_seqs, sampled, is_invalid):
            if nan:
                output.failed[seq] = NAN_LOGITS
                continue
            output.sampled_token_ids[seq] = [token]
        return output

    def _verify(self, batch: Batch, hidden: torch.Tensor, logits: torch.Tensor,
                output: ModelOutput) -> ModelOutput:
        """A step with drafts: sample at every sampling position of its sequences (k + 1 for
        k drafts, each as if its tokens had come one step at a time), keep each sequence's
        accepted run (spec_decode.verify, accept_runs), then count its tokens and gather
        their log-probabilities."""
        seqs = batch.sample_seqs
        drafts = batch.sample_drafts
        num_sampled_tokens = [1 + len(seq_drafts) for seq_drafts in drafts]
        position_seqs = [seq for seq, n in zip(seqs, num_sampled_tokens) for _ in range(n)]
        tensors = sampling_tensors(position_seqs, self.vocab_size, self.eos_token_ids, self.device,
                                   output_offsets(num_sampled_tokens))
        if any(seq.params.has_penalties for seq in seqs):
            tensors.penalties = count_drafts(self.input_batch.penalties(seqs),
                                             num_sampled_tokens, drafts)
        masked = apply_grammar_bitmask(position_seqs, logits)  # a constrained one has no drafts
        spec = self._spec_decode_metadata(seqs, drafts)
        drawn, accepted = verify(masked, tensors, spec, self.generator)
        invalid = invalid_logits(logits).to(drawn.dtype)
        drawn, accepted, invalid = to_host(torch.stack([drawn, accepted, invalid]))
        emitted = accept_runs(num_sampled_tokens, drafts, drawn, accepted)
        if tensors.penalties is not None:
            self.input_batch.count_emitted(seqs, emitted)
        first = 0  # the sequence's first sampling position
        emitted_positions = []  # each emitted token's sampling position, the token, its sequence
        emitted_targets = []
        emitted_seqs = []
        for seq, n, tokens in zip(seqs, num_sampled_tokens, emitted):
            positions = range(first, first + len(tokens))
            first += n
            if any(invalid[position] for position in positions):
                output.failed[seq] = NAN_LOGITS
                continue
            output.sampled_token_ids[seq] = tokens
            emitted_positions += positions
            emitted_targets += tokens
            emitted_seqs += [seq] * len(tokens)
        if wants_logprobs(batch):
            emitted_ids = upload(dict(positions=emitted_positions, targets=emitted_targets),
                                 torch.int64, self.device)
            self._gather_logprobs(batch, hidden, logits[emitted_ids["positions"]],
                                  emitted_ids["targets"], emitted_seqs, output)
        return output

    def _spec_decode_metadata(self, seqs: list[Sequence], drafts: list[list[int]]
                              ) -> SpecDecodeMetadata:
        """What verify() needs of a step's drafts, one entry a sampling position: the draft
        after the position's token (0 at a sequence's last), whether there is one, and the
        proposer's q."""
        position_drafts = []
        has_draft = []
        for seq_drafts in drafts:
            position_drafts += seq_drafts + [0]
            has_draft += [1] * len(seq_drafts) + [0]
        ints = upload(dict(drafts=position_drafts, has_draft=has_draft), torch.int64,
                      self.device)
        draft_probs = None
        if any(seq.draft_probs is not None for seq in seqs):
            draft_probs = torch.cat([self._draft_probs(seq, len(seq_drafts))
                                     for seq, seq_drafts in zip(seqs, drafts)])
        return SpecDecodeMetadata(draft_token_ids=ints["drafts"],
                                  has_draft=ints["has_draft"].bool(), draft_probs=draft_probs)

    def _draft_probs(self, seq: Sequence, num_drafts: int) -> torch.Tensor:
        """(1 + num_drafts, vocab): seq's draft distributions, then zeros (its last sampling
        position has no draft); all zeros for a sequence without them."""
        probs = torch.zeros(1 + num_drafts, self.vocab_size, device=self.device)
        if seq.draft_probs is None:
            return probs
        probs[:num_drafts] = seq.draft_probs[:num_drafts]
        return probs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled token ids (n,) and whether each one's logits are invalid (n,) int64."""
        tensors = sampling_tensors(seqs, self.vocab_size, self.eos_token_ids, self.device)
        if any(seq.params.has_penalties for seq in seqs):
            tensors.penalties = self.input_batch.penalties(seqs)
        masked = apply_grammar_bitmask(seqs, logits)  # structured output: first of all
        token_ids = sample(masked, tensors, self.generator)
        if tensors.penalties is not None:
            self.input_batch.count_sampled(tensors.penalties, token_ids)
        return token_ids, invalid_logits(logits).to(token_ids.dtype)

    def _gather_logprobs(self, batch: Batch, hidden: torch.Tensor, logits: torch.Tensor,
                         token_ids: torch.Tensor, sampled_seqs: list[Sequence],
                         output: ModelOutput) -> None:
        """Fill output.logprobs (each sampled token's: token_ids (n,), from logits (n, vocab),
        of sampled_seqs (n,), a sequence once a token it emitted) and output.prompt_logprobs
        (each prompt token scored this step): the token's own log-probability and the top k of
        its row, from the model's log-softmax (before temperature, top-k and top-p, as vLLM
        returns them). The prompt positions' logits are made PROMPT_LOGPROBS_CHUNK positions
        at a time (a long prompt's would not fit at once); token ids and values are read in
        one copy each."""
        seqs = sampled_seqs + batch.prompt_seqs  # a scored token each
        num_sampled = len(sampled_seqs)
        # per scored token: how many top log-probabilities it asked for (None: none at all)
        wants = [sampled.params.logprobs for sampled in sampled_seqs]
        wants += [scored.params.prompt_logprobs for scored in batch.prompt_seqs]
        top_k = max([want for want in wants if want is not None], default=0)
        found = [top_logprobs(logits, token_ids, top_k)]  # (ids, values), in order
        indices = batch.prompt_logits_indices
        for start in range(0, len(indices), PROMPT_LOGPROBS_CHUNK):
            end = start + PROMPT_LOGPROBS_CHUNK
            prompt_logits = self.compute_logits(hidden[indices[start:end]])  # (chunk, vocab)
            found.append(top_logprobs(prompt_logits, batch.prompt_targets[start:end], top_k))
        ids = to_host(torch.cat([found_ids for found_ids, _ in found]))      # (n + m, 1 + k)
        values = to_host(torch.cat([found_values for _, found_values in found]))
        for i, seq in enumerate(seqs):
            its_top_k = wants[i]
            if its_top_k is None:
                continue
            entry = {ids[i][0]: values[i][0]}  # the token itself, then its top its_top_k
            entry |= dict(zip(ids[i][1:1 + its_top_k], values[i][1:1 + its_top_k]))
            if i < num_sampled:
                output.logprobs.setdefault(seq, []).append(entry)
            else:
                output.prompt_logprobs.setdefault(seq, []).append(entry)

    def _prepare_inputs(self, num_scheduled_tokens: dict[Sequence, int],
                        spec_decode_tokens: dict[Sequence, list[int]] | None = None) -> Batch:
        """The step's inputs, flattened over the scheduled sequences (those of one new token
        first: attention launches them apart) and sent to the device in one pinned,
        non-blocking copy. Example, block_size 4, three sequences:

            A  decode: 6 tokens computed, 1 new     row 0 of the input batch, holding [3, 7]
            C  decode: 2 tokens computed, 1 new     row 2, holding [1]
            B  prompt chunk: 10-token prompt, 4 computed, 3 new     row 1, holding [5]; its
               block table gained block 2 this step

            input_ids        [a6, c2, b4, b5, b6]     (token t of A written a6)
            positions        [ 6,  2,  4,  5,  6]
            query_start_loc  [0, 1, 2, 5]             (B owns tokens 2..4; num_decodes 2)
            context_lens     [7, 3, 7]
            rows             [0, 2, 1]                (each sequence's row in the input batch)
            token_rows       [0, 2, 1, 1, 1]          (each token's sequence's row)
            new blocks       rows [1], columns [1], block ids [2]
            block_tables     [[3, 7, 0 ...], [1, 0, 0 ...], [5, 2, 0 ...]]   (on the device)
            slot_mapping     [30,  6,  8,  9, 10]     (on the device: A's 6 is in its second
                                                       block, 7: 7 * 4 + 6 % 4 = 30)
            logits_indices   [0, 1]                   (B has tokens left to compute: no sample)

        Only the blocks a table gained go up; the tables stay on the device, in the input
        batch (input_batch.py), and the slots are read from them there: a step costs what is
        new in it, not its sequences' blocks."""
        batch_order = has_many_new_tokens
        if self.lora_manager is not None:  # and each adapter's sequences together
            batch_order = partial(adapter_order, self.lora_manager)
        decodes_first = sorted(num_scheduled_tokens.items(), key=batch_order)
        spec_decode_tokens = spec_decode_tokens or {}
        ints, sample_seqs, prompt_seqs = self._flatten_inputs(decodes_first, spec_decode_tokens)
        lora_slots = None
        if self.lora_manager is not None:  # each token's adapter slot, if any has one
            lora_slots = self.lora_manager.token_slots(decodes_first)
        if lora_slots is not None:
            ints["lora_slots"] = lora_slots
        sample_drafts = None
        if spec_decode_tokens:
            sample_drafts = [spec_decode_tokens.get(seq, []) for seq in sample_seqs]
        tensors = upload(ints, torch.int64, self.device)
        # the blocks attention reads: those of the longest context (a table holds no more)
        max_num_blocks = cdiv(max(ints["context_lens"]), self.block_pool.block_size)
        block_tables = self.input_batch.step_block_tables(
            tensors["rows"], tensors["new_block_rows"], tensors["new_block_columns"],
            tensors["new_block_ids"], max_num_blocks)
        slot_mapping = self.input_batch.slot_mapping(tensors["token_rows"], tensors["positions"])
        max_query_len = max(num_scheduled_tokens.values())
        num_decodes = sum(num_new == 1 for num_new in num_scheduled_tokens.values())
        shared_prefixes = None
        if self.block_pool.num_forks:  # beam search: each request's beams' common blocks
            shared_prefixes = beam_shared_prefixes(decodes_first, self.block_pool.block_size)
        attn_metadata = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables,
            context_lens=tensors["context_lens"].to(torch.int32),
            query_start_loc=tensors["query_start_loc"].to(torch.int32),
            max_query_len=max_query_len, num_decodes=num_decodes,
            shared_prefixes=shared_prefixes)
        return Batch(input_ids=tensors["input_ids"], positions=tensors["positions"],
                     attn_metadata=attn_metadata, logits_indices=tensors["logits_indices"],
                     sample_seqs=sample_seqs,
                     prompt_logits_indices=tensors["prompt_logits_indices"],
                     prompt_targets=tensors["prompt_targets"], prompt_seqs=prompt_seqs,
                     is_decode=max_query_len == 1, sample_drafts=sample_drafts,
                     lora_slots=tensors.get("lora_slots"), lora_host_slots=lora_slots)

    def _flatten_inputs(self, scheduled: list[tuple[Sequence, int]],
                        spec_decode_tokens: dict[Sequence, list[int]]
                        ) -> tuple[dict[str, list[int]], list[Sequence], list[Sequence]]:
        """_prepare_inputs' host half: its lists of ints by name (input_ids, positions, ...),
        the sequences that sample and those whose prompt tokens are scored: one pass over the
        scheduled sequences, the example above's lists built side by side. A sequence's
        drafts follow its own new token, and each of them samples too (a logits row each)."""
        input_ids = []
        positions = []
        context_lens = []
        query_start_loc = [0]
        rows = []            # each sequence's row in the input batch
        token_rows = []      # each token's sequence's row
        new_block_rows = []  # (row, column, block id) of each block a table gained
        new_block_columns = []
        new_block_ids = []
        logits_indices = []
        sample_seqs = []     # the sequences that sample, in the order of logits_indices
        prompt_logits_indices = []
        prompt_targets = []
        prompt_seqs = []     # the sequence of each of prompt_logits_indices
        # the features' checks, once a step: a plain step pays no lookup or call a sequence
        any_drafts = bool(spec_decode_tokens)
        any_forked = self.block_pool.num_forks > 0  # copy-on-write shares blocks only then
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new  # with drafts, past token_ids: they follow its last token
            if any_forked:  # copy-on-write: no block written is shared
                seq.block_table.assert_owned(start)
            first_token = query_start_loc[-1]
            row, first_column, gained = self.input_batch.new_blocks(seq)
            input_ids += seq.token_ids[start:end]  # the slice ends at token_ids' end
            if any_drafts:
                input_ids += spec_decode_tokens.get(seq, NO_DRAFTS)
            positions += range(start, end)
            context_lens.append(end)
            query_start_loc.append(first_token + num_new)
            rows.append(row)
            token_rows += [row] * num_new
            if gained:  # most decodes fill a block they hold
                new_block_rows += [row] * len(gained)
                new_block_columns += range(first_column, first_column + len(gained))
                new_block_ids += gained
            if end >= len(seq.token_ids):  # none uncomputed left: sample the next
                if any_drafts:  # its last token's row, then each draft's (none if it has none)
                    first_sampled = first_token + len(seq.token_ids) - 1 - start
                    logits_indices += range(first_sampled, first_token + num_new)
                else:
                    logits_indices.append(first_token + num_new - 1)
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None:
                for position in prompt_positions_to_score(seq, start, end):
                    prompt_logits_indices.append(first_token + position - start)
                    prompt_targets.append(seq.token_ids[position + 1])
                    prompt_seqs.append(seq)
        ints = dict(input_ids=input_ids, positions=positions, context_lens=context_lens,
                    query_start_loc=query_start_loc, rows=rows, token_rows=token_rows,
                    new_block_rows=new_block_rows, new_block_columns=new_block_columns,
                    new_block_ids=new_block_ids, logits_indices=logits_indices,
                    prompt_logits_indices=prompt_logits_indices, prompt_targets=prompt_targets)
        return ints, sample_seqs, prompt_seqs


def beam_shared_prefixes(scheduled: list[tuple[Sequence, int]], block_size: int
                         ) -> list[tuple[list[int], int]]:
    """Cascade attention's groups (kernels.paged_attention_cpu): for each beam-search request
    with two beams or more decoding in the step, their indices among the scheduled sequences
    and P, the blocks all of them hold from their first on. Example, blocks of 4, three beams
    of a 9-token prompt at 14 tokens: tables [A, B, C, D], [A, B, E, F], [A, B, C, G] -> P = 2:
    A and B are attended once for the three, each beam's own blocks apart. Only a request's
    own beams are grouped, never sequences sharing a cached prompt: what a beam attends
    together depends on its request alone, not on what else runs."""
    beams_of = {}
    for s, (seq, num_new) in enumerate(scheduled):
        if seq.beams is not None and num_new == 1:
            beams_of.setdefault(id(seq.beams), []).append(s)
    groups = []
    for group in beams_of.values():
        if len(group) < 2:
            continue
        tables = [scheduled[s][0].block_table.block_ids for s in group]
        num_shared = 0
        for blocks in zip(*tables):
            if len(set(blocks)) > 1:
                break
            num_shared += 1
        # every shared block is full and before each beam's new token (copy-on-write gives a
        # beam its own copy of a block it writes into), so each beam has keys of its own left
        shortest = min(scheduled[s][0].num_computed_tokens for s in group)
        num_shared = min(num_shared, shortest // block_size)
        if num_shared:
            groups.append((group, num_shared))
    return groups


def top_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits (r, vocab) and each row's target token (r,) -> (ids, values), each
    (r, 1 + top_k): the target and its log-probability, then the row's top_k."""
    logprobs = logits.log_softmax(dim=-1)
    top = logprobs.topk(top_k, dim=-1)
    targets = targets[:, None]
    return (torch.cat([targets, top.indices], dim=1),
            torch.cat([logprobs.gather(1, targets), top.values], dim=1))


def wants_logprobs(batch: Batch) -> bool:
    """Whether a step gathers log-probabilities: some sequence asked for its sampled tokens'
    or has prompt tokens to score."""
    return any(seq.params.logprobs is not None for seq in batch.sample_seqs) \
        or bool(batch.prompt_seqs)


def capture_graphs(run_decode, sizes: list[int], device) -> dict:
    """Each size's run_decode(size) captured in a CUDA graph, largest first (the smaller ones
    reuse its memory pool): size -> its replay. Rank 0's, and each tensor-parallel worker's."""
    graphs = {}
    pool = None
    for size in reversed(sizes):
        graphs[size], pool = cuda_runtime.capture_graph(partial(run_decode, size), pool)
    cuda_runtime.synchronize(device)
    return graphs


def has_many_new_tokens(scheduled: tuple[Sequence, int]) -> bool:
    """The sort key that puts the sequences of one new token (decodes) first."""
    return scheduled[1] > 1


def adapter_order(lora_manager: LoRAManager, scheduled: tuple[Sequence, int]) -> tuple[bool, int]:
    """The sort key with adapters: decodes first (has_many_new_tokens), then by adapter slot,
    so each adapter's tokens of each kind are one run (kernels.lora_segments: one GEMM pair
    a run on the CPU, not one a token)."""
    return has_many_new_tokens(scheduled), lora_manager.slot_of(scheduled[0])


def prompt_positions_to_score(seq: Sequence, start: int, end: int) -> range:
    """The positions among start..end-1 whose next token is a prompt token not scored yet
    (a recomputation after preemption scores nothing twice)."""
    first_unscored = len(seq.prompt_logprobs) - 1
    last_prompt_position = seq.num_prompt_tokens - 1
    return range(max(start, first_unscored), min(end, last_prompt_position))

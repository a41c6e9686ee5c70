"""Disaggregated prefill and decode: a KV connector that hands a prompt's K/V from the instance
that computed it (the producer) to the one that decodes it (the consumer), through a folder.

Prefill is compute-bound and decode bandwidth-bound; on one instance a long prompt's prefill
stalls every decode beside it. Disaggregated serving (DistServe, Splitwise, Mooncake; vLLM's
kv_transfer_config) runs them apart: the prefill instance computes the prompt and sends its
K/V; the decode instance admits the request as if the prompt were cached and computes only
the rest. This is vLLM's ExampleConnector (earlier SharedStorageConnector): the transport is
files, one a full block, named by the prefix cache's block hash (paged_cache.hash_block: the
SHA-256 chain of the block's tokens and every block before it), so any instance that shares a
prefix finds it. Real deployments move the blocks GPU to GPU instead (NIXL, LMCache,
Mooncake's transfer engine); the hooks are the same, so another transport could take its place.

    kv_transfer_config = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}

The hooks, with the names of vLLM's connector base class, where the engine calls them:

    scheduler side   get_num_new_matched_tokens(seq, num_computed_tokens)  admission: how many
                       more prompt tokens the folder holds entries for, past the prefix
                       cache's hit, and load_async (always True here)
                     update_state_after_alloc(seq, block_ids, num_external_tokens)  the fresh
                       blocks they go to: a background thread starts reading them
                     request_finished(seq)  the sequence ended: forget its match and its load
    worker side      get_finished()    at each step's start: the loads read since, and how
                                       many of their tokens arrived good
                     start_load_kv()   first thing in the step: copy those into their blocks
                     save_kv(seq)      after the step that finished seq's prompt: its full
                                       blocks to the folder (vLLM saves layer by layer during
                                       the forward; here all at once)

Loading is asynchronous, as in vLLM: a long prompt's entries take a while to read and check
(on the tiny preset, 2,048 tokens are 16 MiB: about 8 ms to read, 13 to hash, 5 to parse and
check the headers, 4 to make tensors, 7 to copy into the cache; BENCHMARKS.md section 18), and
read inside a step they stalled every decode beside them. So the scheduler admits the request,
takes its blocks and parks it (vLLM's WAITING_FOR_REMOTE_KVS, Scheduler.loading) while one
background thread reads and checks its entries (file reads, hashing and torch's copies release
the GIL); the others go on decoding. At a later step's start the scheduler sees the load
finished (get_finished), the engine copies the K/V into the blocks before anything else writes
or reads them (a swap out in that same step included), and the request runs from past them.
A parked request is never preempted: its blocks were reserved at admission like a running
sequence's, and it holds them only for one read; aborted, it frees them at once (the thread
writes no cache block, and its read is dropped).

Example, block_size 16, a 40-token prompt. The producer (the proxy sent it max_tokens 1)
computes 40 tokens and writes blocks 0 and 1 (tokens 0-31; 32-39 fill no block). The consumer
asks get_num_new_matched_tokens: (32, True); it admits the request with two fresh blocks and
parks it; a step or two later the blocks are read, copied in, num_computed_tokens becomes 32
and the step computes tokens 32-39 (at least the last token is always computed: its logits
give the first sample).

Failure is never wrong output (vLLM's kv_load_failure_policy "recompute"): every entry is
checked before it is used: its model, the tokens and parent hash it is for, its shapes, dtype
and a SHA-256 of its bytes. A missing entry ends the match; one trimmed away after the match,
or truncated, corrupted, foreign or unreadable, ends the load there, and all but the trimmed
are counted (num_load_failures): the tokens from there are computed, as vLLM does when the
worker reports a failed block after scheduling. An entry is written to a temporary name and
renamed, so no reader sees half of one; the folder is bounded (max_entries, max_bytes in the
extra config): the oldest entries go first.

In this file: KVTransferConfig and parse_kv_transfer_config, the entry format (write_entry,
read_entry), ExampleConnector. Left out: layer-by-layer transfer, synchronous loads (vLLM's
load_async False), saving decoded tokens, transfer between machines.
"""
import functools
import hashlib
import json
import math
import os
import struct
import tempfile
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from options import json_fields
from paged_cache import hash_block

CONNECTORS = ("ExampleConnector", "SharedStorageConnector")  # vLLM's names, new and old
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute",)  # vLLM's kv_load_failure_policy; "fail" is left out
EXTRA_KEYS = ("shared_storage_path", "max_entries", "max_bytes")
MAGIC = b"NSKV1\n"                 # an entry's first bytes: the format and its version
SUFFIX = ".kv"                     # an entry's file name: its block hash in hex, then this
HEADER_LENGTH = struct.Struct("<Q")  # after the magic: the JSON header's length in bytes
LOAD_WAIT_SECONDS = 0.1  # the longest an idle step waits for a load: the engine's lock is
                         # held meanwhile (an abort waits), and a stuck read must not hang it


@dataclass
class KVTransferConfig:
    """vLLM's kv_transfer_config: the connector, this instance's role, and the connector's own
    settings (kv_connector_extra_config: shared_storage_path, the folder, required;
    max_entries and max_bytes, its bounds, optional)."""
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: unknown kv_connector {self.kv_connector!r}; "
                             f"choose one of {', '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: unknown kv_role {self.kv_role!r}; choose "
                             f"one of {', '.join(ROLES)}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError("kv_transfer_config: kv_load_failure_policy must be recompute, got "
                             f"{self.kv_load_failure_policy!r}")
        self._check_extra_config(self.kv_connector_extra_config)

    @staticmethod
    def _check_extra_config(extra: dict) -> None:
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object, "
                             f"got {extra!r}")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown kv_connector_extra_config key "
                             f"{unknown[0]!r}; known: {', '.join(EXTRA_KEYS)}")
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("kv_transfer_config: kv_connector_extra_config needs "
                             f"shared_storage_path, a folder; got {path!r}")
        for name in ("max_entries", "max_bytes"):
            value = extra.get(name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"kv_transfer_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(value) -> KVTransferConfig | None:
    """None, a KVTransferConfig, a dict or its JSON text (the command line's) -> a validated
    KVTransferConfig or None; ValueError naming the field for anything else."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    value = json_fields("kv_transfer_config", value, KVTransferConfig)
    for name in ("kv_connector", "kv_role"):
        if name not in value:
            raise ValueError(f"kv_transfer_config needs {name}")
    return KVTransferConfig(**value)


# --- an entry: one full block's K/V ------------------------------------------------------

@dataclass
class EntryKey:
    """What an entry must be for: the model, the block's parent hash and tokens (which give
    its hash, the file's name), and the K/V's dtype and shape, a block's of every layer:
    (n_layer, block_size, n_kv_head, head_dim)."""
    model_id: str
    parent_hash: bytes
    token_ids: list[int]
    dtype: torch.dtype
    shape: tuple[int, ...]

    @functools.cached_property
    def block_hash(self) -> bytes:  # once: the file's name and the next block's parent
        return hash_block(self.parent_hash, self.token_ids)

    def header(self) -> dict:
        return {"model": self.model_id, "parent_hash": self.parent_hash.hex(),
                "token_ids": self.token_ids, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape)}


class BadEntry(ValueError):
    """An entry that is there but is not the K/V asked for: truncated, corrupted, foreign."""


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, any dtype (bfloat16 too), from any device."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def write_entry(path: str, key: EntryKey, k: torch.Tensor, v: torch.Tensor) -> int:
    """Write a block's K and V (each key.shape) to path: the magic, the header's length, the
    JSON header (key.header() and the payload's SHA-256), the payload (K's bytes, V's). Written
    under a temporary name in the same folder and renamed: a reader sees all of it or none.
    Returns the bytes written."""
    payload = tensor_bytes(k) + tensor_bytes(v)
    header = json.dumps(key.header() | {"sha256": hashlib.sha256(payload).hexdigest()}).encode()
    folder = os.path.dirname(path)
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=SUFFIX + ".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + HEADER_LENGTH.pack(len(header)) + header + payload)
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise
    return len(MAGIC) + HEADER_LENGTH.size + len(header) + len(payload)


def read_entry(path: str, key: EntryKey) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The K and V (each key.shape, key.dtype, on the CPU) an entry holds, and its size in
    bytes; FileNotFoundError if there is none, BadEntry if it is not exactly what key asks
    for (each check says which)."""
    with open(path, "rb") as f:
        data = f.read()
    start = len(MAGIC) + HEADER_LENGTH.size
    if len(data) < start or not data.startswith(MAGIC):
        raise BadEntry("not an entry (its magic or header length is missing)")
    (header_length,) = HEADER_LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + header_length])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadEntry("its header is not JSON (truncated?)") from None
    if not isinstance(header, dict):
        raise BadEntry("its header is not an object")
    checksum = header.pop("sha256", None)
    expected = key.header()
    for name, value in expected.items():
        if header.get(name) != value:
            raise BadEntry(f"its {name} is {header.get(name)!r:.80}, not {value!r:.80}")
    payload = data[start + header_length:]
    num_bytes = 2 * math.prod(key.shape) * key.dtype.itemsize
    if len(payload) != num_bytes:
        raise BadEntry(f"its payload is {len(payload)} bytes, not {num_bytes} (truncated?)")
    if hashlib.sha256(payload).hexdigest() != checksum:
        raise BadEntry("its checksum does not match its bytes (corrupted)")
    kv = torch.frombuffer(bytearray(payload), dtype=key.dtype).view(2, *key.shape)
    return kv[0], kv[1], len(data)


# --- the connector ---------------------------------------------------------------------------

@dataclass
class KVTransferStats:
    """What the connector moved since it was last asked (take_stats): the engine's StepRecord
    carries it into EngineStats and /metrics."""
    num_load_bytes: int = 0      # entries read (checked), in bytes
    load_seconds: float = 0.0    # reading and checking them (in the background), copying them
    num_load_failures: int = 0   # entries there but bad: the tokens from there recomputed
    num_saved_tokens: int = 0    # tokens whose K/V were written (producer)
    num_saved_bytes: int = 0


@dataclass
class LoadResult:
    """What a background load read for one sequence: the checked K/V of its matched blocks
    from the first on, as long as each was there and good (k, v: each a block's of every
    layer), and what it cost."""
    entries: list[tuple[torch.Tensor, torch.Tensor]]
    num_bytes: int
    num_failures: int
    seconds: float


@dataclass
class PendingLoad:
    """A sequence's load under way: the blocks its K/V go to and the background read."""
    block_ids: list[int]
    future: Future


class ExampleConnector:
    """vLLM's ExampleConnector on one machine: the K/V of full blocks through a shared folder.
    One object holds both sides (vLLM splits them between the scheduler and the workers):
    `matched` is the scheduler side's state; `loads`, `to_load` and the cache tensors the
    worker's."""

    def __init__(self, config: KVTransferConfig, model_id: str, block_size: int,
                 k_caches: torch.Tensor, v_caches: torch.Tensor):
        self.config = config
        extra = config.kv_connector_extra_config
        self.folder = extra["shared_storage_path"]
        self.max_entries = extra.get("max_entries")
        self.max_bytes = extra.get("max_bytes")
        os.makedirs(self.folder, exist_ok=True)
        self.model_id = model_id
        self.block_size = block_size
        self.register_kv_caches(k_caches, v_caches)
        # scheduler side: per waiting sequence, the keys of the entries the folder holds past
        # its cached prefix (looked up once, until admitted or finished)
        self.matched: dict = {}   # seq -> (num_computed_tokens looked up from, [EntryKey])
        # worker side: the admitted sequences' loads under way, read by one background thread
        # (file reads, hashing and torch ops release the GIL, so the steps go on meanwhile);
        # a finished one's copies wait in to_load for the next start_load_kv
        self.loads: dict = {}     # seq -> PendingLoad
        self.to_load: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (block id, k, v)
        self.executor: ThreadPoolExecutor | None = None  # started at the first load
        self.stats = KVTransferStats()

    def register_kv_caches(self, k_caches: torch.Tensor, v_caches: torch.Tensor) -> None:
        """Worker side (vLLM's name): the cache tensors, (n_layer, NB + 1, BS, Hkv, D) each."""
        self.k_caches = k_caches
        self.v_caches = v_caches
        n_layer, _, block_size, n_kv_head, head_dim = k_caches.shape
        self.block_shape = (n_layer, block_size, n_kv_head, head_dim)

    def take_stats(self) -> KVTransferStats:
        """What was moved since the last call."""
        stats, self.stats = self.stats, KVTransferStats()
        return stats

    def close(self) -> None:
        """Stop the background thread once the loads under way are read (their results are
        dropped); nothing is loaded after."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
        self.loads.clear()

    # --- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        """How many of seq's tokens past its first num_computed_tokens (the prefix cache's
        hit, whole blocks) the folder holds entries for, whole blocks, never seq's last token
        (its logits give the next sample), and whether they load asynchronously (vLLM's
        pair): always, when there are any. Only the entries' names are looked at here; they
        are read and checked in the background (update_state_after_alloc). (0, False) for a
        producer alone. A match is kept until the sequence is admitted; one preempted and
        readmitted looks again."""
        if not self.config.is_consumer:
            return 0, False
        looked_up = self.matched.get(seq)
        if looked_up is None or looked_up[0] != num_computed_tokens:
            looked_up = (num_computed_tokens, self._find_matching(seq, num_computed_tokens))
        if not looked_up[1]:  # nothing kept: an entry written meanwhile is found next time
            self.matched.pop(seq, None)
            return 0, False
        self.matched[seq] = looked_up
        return len(looked_up[1]) * self.block_size, True

    def update_state_after_alloc(self, seq, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """seq was admitted with num_external_tokens from the folder, these fresh blocks for
        them (one a matched block, in order): their entries are read and checked in the
        background from now on; get_finished says when."""
        _, keys = self.matched.pop(seq, (0, []))
        keys = keys[:num_external_tokens // self.block_size]
        if not keys:
            return
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv_load")
        future = self.executor.submit(self._read_entries, keys)
        self.loads[seq] = PendingLoad(block_ids[:len(keys)], future)

    def request_finished(self, seq) -> None:
        """seq ended (finished, aborted, failed): what was matched for it is dropped, and its
        load, if under way, is forgotten (the thread writes no cache block, so the blocks
        may be freed at once)."""
        self.matched.pop(seq, None)
        load = self.loads.pop(seq, None)
        if load is not None:
            load.future.cancel()  # not started yet: never read; else read and dropped

    def _find_matching(self, seq, num_computed_tokens: int) -> list[EntryKey]:
        """The keys of seq's blocks from block num_computed_tokens // block_size on, as long
        as each has an entry in the folder."""
        keys = []
        num_blocks = (len(seq.token_ids) - 1) // self.block_size
        for i, key in self._keys(seq, num_blocks):
            if i * self.block_size < num_computed_tokens:
                continue
            if not os.path.exists(self._path(key.block_hash)):
                break
            keys.append(key)
        return keys

    def _read_entries(self, keys: list[EntryKey]) -> LoadResult:
        """In the background thread: the checked K/V of these entries, as long as each is
        still there (another instance may have trimmed it) and good; a bad or unreadable one
        is counted and ends the run. Touches nothing the steps use."""
        start = time.perf_counter()
        result = LoadResult(entries=[], num_bytes=0, num_failures=0, seconds=0.0)
        for key in keys:
            try:
                k, v, num_bytes = read_entry(self._path(key.block_hash), key)
            except FileNotFoundError:
                break
            except (BadEntry, OSError):  # bad, or unreadable: computed instead, and counted
                result.num_failures += 1
                break
            result.num_bytes += num_bytes
            result.entries.append((k, v))
        result.seconds = time.perf_counter() - start
        return result

    def _keys(self, seq, num_blocks: int):
        """(block index, its EntryKey) of seq's first num_blocks blocks, the
        hash chain from its table's cache salt (a LoRA adapter's, else empty), as the prefix
        cache chains them."""
        parent_hash = seq.block_table.cache_salt
        bs = self.block_size
        for i in range(num_blocks):
            key = EntryKey(self.model_id, parent_hash, seq.token_ids[i * bs:(i + 1) * bs],
                           self.k_caches.dtype, self.block_shape)
            yield i, key
            parent_hash = key.block_hash

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, block_hash.hex() + SUFFIX)

    # --- worker side ---------------------------------------------------------------------

    def get_finished(self, wait: bool = False) -> dict:
        """The sequences whose loads have finished since the last call -> how many of their
        matched tokens arrived good (whole blocks from the first: a missing or bad entry ends
        the run, and the tokens from there are computed). Their K/V are copied into their
        blocks at the next start_load_kv. wait: block until at least one has finished (the
        engine has nothing else to do), or LOAD_WAIT_SECONDS have passed. vLLM's returns the
        ids, and another hook the blocks whose load failed; in one process, one dict."""
        if wait and self.loads:
            futures.wait([load.future for load in self.loads.values()],
                         timeout=LOAD_WAIT_SECONDS, return_when=futures.FIRST_COMPLETED)
        finished = {}
        for seq, load in list(self.loads.items()):
            if not load.future.done():
                continue
            del self.loads[seq]
            result = load.future.result()
            for block_id, (k, v) in zip(load.block_ids, result.entries):
                self.to_load.append((block_id, k, v))
            self.stats.num_load_bytes += result.num_bytes
            self.stats.num_load_failures += result.num_failures
            self.stats.load_seconds += result.seconds
            finished[seq] = len(result.entries) * self.block_size
        return finished

    def start_load_kv(self) -> None:
        """At the step's start, before anything else writes the cache: copy the K/V of each
        finished load into its blocks (slots block_id * block_size ... + block_size - 1 of
        every layer)."""
        if not self.to_load:
            return
        start = time.perf_counter()
        for block_id, k, v in self.to_load:
            self.k_caches[:, block_id].copy_(k, non_blocking=True)
            self.v_caches[:, block_id].copy_(v, non_blocking=True)
        self.to_load = []
        self.stats.load_seconds += time.perf_counter() - start

    def save_kv(self, seq) -> None:
        """Producer: after the step that computed the last of seq's prompt, write each full
        block of the prompt that the folder does not hold yet, then trim the folder."""
        if not self.config.is_producer:
            return
        num_blocks = seq.num_prompt_tokens // self.block_size
        wrote = False
        for i, key in self._keys(seq, num_blocks):
            path = self._path(key.block_hash)
            if os.path.exists(path):
                continue
            block_id = seq.block_table.block_ids[i]
            self.stats.num_saved_bytes += write_entry(path, key, self.k_caches[:, block_id],
                                                      self.v_caches[:, block_id])
            self.stats.num_saved_tokens += self.block_size
            wrote = True
        if wrote:
            self._trim()

    def _trim(self) -> None:
        """Remove the oldest entries until the folder is within max_entries and max_bytes."""
        if self.max_entries is None and self.max_bytes is None:
            return
        entries = []
        for entry in os.scandir(self.folder):
            if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                continue
            try:
                status = entry.stat()
            except FileNotFoundError:  # another instance removed it meanwhile
                continue
            entries.append((status.st_mtime_ns, entry.name, status.st_size))
        entries.sort()
        total = sum(size for _, _, size in entries)
        while entries and self._over_bounds(len(entries), total):
            _, name, size = entries.pop(0)
            total -= size
            try:
                os.remove(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass  # another instance removed it first: gone either way

    def _over_bounds(self, num_entries: int, num_bytes: int) -> bool:
        too_many = self.max_entries is not None and num_entries > self.max_entries
        too_large = self.max_bytes is not None and num_bytes > self.max_bytes
        return too_many or too_large


def make_kv_connector(config: KVTransferConfig | None, model_id: str, block_size: int,
                      k_caches: torch.Tensor, v_caches: torch.Tensor
                      ) -> ExampleConnector | None:
    """The connector kv_transfer_config names (both names are ExampleConnector), or None."""
    if config is None:
        return None
    return ExampleConnector(config, model_id, block_size, k_caches, v_caches)

"""The engine's state as the watch page (watch.html) draws it: one frame per step.

A frame is a JSON-able dict made after a step from what the engine already keeps, its
StepRecord and its block pool and queues; the engine knows nothing of it:

    {"step": 7,                           the scheduler's step number
     "record": {"scheduled": {"0": 1}, "phases": {"0": "decode"}, ...},
                                          the step's StepRecord (None before any step)
     "budget": 64, "block_size": 8,       max_num_batched_tokens; tokens a block
     "blocks": "1c.1",                    a character a block: block_states
     "running": [{"id": "0", "computed": 9, "tokens": 10, "prompt": 6, "blocks": [0, 3],
                  "host_blocks": []}],
     "waiting": [{"id": "2", "computed": 12, "tokens": 30, "prompt": 30, "blocks": [],
                  "host_blocks": [4, 5]}],        swapped out: its K/V in host blocks 4, 5
     "swap_space": {"blocks": 256, "used": 2}}   the host pool (None without one: recompute)

running is in admission order, waiting in the order they will be admitted, after those that
hold blocks while a KV connector loads their K/V (Scheduler.loading). The command line
(cli.py, --trace-html) keeps a run's frames in a FrameLog and writes them into the page
(write_page), to replay offline; the server (server.py) builds a frame after each step only
while a page at / watches, and sends it as a server-sent event.
"""
import dataclasses
import json
import os

from nanoserve import Engine
from paged_cache import BlockPool
from scheduler import Sequence

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watch.html")
FRAMES_ELEMENT = '<script type="application/json" id="frames"></script>'  # in PAGE, empty

# A block's reference count -> its character: "." free, "1" one owner, "2" to "9" shared
# (9: nine or more); a free block that still holds a cached prefix is "c" (block_states).
REF_COUNT_CHARS = bytes.maketrans(bytes(range(256)), b".123456789" + b"9" * 246)
CACHED_FREE = ord("c")


def frame(engine: Engine) -> dict:
    """The engine's state now, after its last step, as the page draws it (the module's
    docstring shows one)."""
    scheduler = engine.scheduler
    record = engine.last_step
    waiting = scheduler.waiting.in_order(scheduler.num_schedule_calls + 1)  # as the next
    return {"step": engine.stats.num_steps,                              # schedule() admits
            "record": None if record is None else dataclasses.asdict(record),
            "budget": engine.config.max_num_batched_tokens,
            "block_size": engine.block_pool.block_size,
            "blocks": block_states(engine.block_pool),
            "running": [sequence(seq) for seq in scheduler.running],
            "waiting": [sequence(seq) for seq in scheduler.loading + waiting],
            "swap_space": swap_space(engine)}


def sequence(seq: Sequence) -> dict:
    """One sequence as a queue shows it: its tokens computed of all it has, its prompt's
    length, its block table, its host blocks while swapped out, and the prompt tokens whose
    K/V a KV connector loaded rather than computed (its first loaded // block_size blocks,
    after any prefix-cache hit)."""
    return {"id": seq.seq_id, "computed": seq.num_computed_tokens, "tokens": len(seq.token_ids),
            "prompt": seq.num_prompt_tokens, "blocks": list(seq.block_table.block_ids),
            "host_blocks": list(seq.host_block_ids),
            "loaded": seq.num_external_computed_tokens,  # its first tokens' K/V loaded from
                                                          # another instance (kv_connector.py)
            "lora": seq.lora_request.lora_name if seq.lora_request is not None else None}


def swap_space(engine: Engine) -> dict | None:
    """The host pool of swapped-out blocks: its size and the blocks in use (None: there is
    none, preemption recomputes)."""
    if engine.model_runner.swap_space is None:
        return None
    return {"blocks": engine.model_runner.swap_space.num_blocks, "used": engine.swap_blocks_used}


def block_states(pool: BlockPool) -> str:
    """Every block's state, a character each (REF_COUNT_CHARS): "." free, "c" free but
    holding a cached prefix, "1" in use, "2" to "9" shared by that many sequences.

    Built from bytes, not a loop over every block: a frame is made after every step while a
    page watches, and a pool holds thousands of blocks (4,096: 0.2 ms here, not 1 ms). A
    reference count above 255 does not fit a byte; it is cut to 9 first."""
    ref_counts = pool.ref_counts
    try:
        counts = bytes(ref_counts)
    except ValueError:  # a count above 255
        counts = bytes(min(count, 9) for count in ref_counts)
    states = bytearray(counts.translate(REF_COUNT_CHARS))
    for block_id in pool.hash_to_block_id.values():
        if ref_counts[block_id] == 0:
            states[block_id] = CACHED_FREE
    return states.decode("ascii")


class FrameLog:
    """A run's frames, one for each step that made a record (--trace-html): call add() after
    every step."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.frames: list[dict] = []

    def add(self) -> None:
        """The frame of the step just run, if it made a record (an idle step makes none)."""
        if not self.engine.step_recorded:
            return
        self.frames.append(frame(self.engine))


def page(frames: list[dict] | None = None) -> str:
    """The page: live (frames None: it follows /watch/events), or replaying these frames,
    which it holds as JSON in its frames element. Every "<" in the JSON is written \\u003c, so
    no text in it ("</script>", "<!--") can end the element early."""
    with open(PAGE, encoding="utf-8") as f:
        html = f.read()
    if frames is None:
        return html
    data = json.dumps(frames, separators=(",", ":")).replace("<", "\\u003c")
    filled = FRAMES_ELEMENT.replace("></", f">{data}</")
    return html.replace(FRAMES_ELEMENT, filled, 1)


def write_page(path: str, frames: list[dict]) -> None:
    """Write the page replaying `frames` to path (OSError if it cannot be written)."""
    html = page(frames)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)

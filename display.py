"""What a run shows on a terminal while it works and after: the progress line and the trace.

Progress is the one line on stderr that LLM.generate(use_tqdm=...) and piped input redraw as
requests finish; render_trace draws the engine's StepRecords (nanoserve.py) as the picture
continuous batching is taught with: a row per request, a column per step. Both only read what
the engine reports (RequestOutput, StepRecord).
"""
import math
import sys
import time


def progress_wanted(use_tqdm) -> bool:
    """Whether to draw the progress line: use_tqdm True or False says so; None (the default)
    only when stderr is a terminal, never into a pipe or a log."""
    if use_tqdm is None:
        return sys.stderr.isatty()
    if not isinstance(use_tqdm, bool):
        raise ValueError(f"use_tqdm must be None, True or False, got {use_tqdm!r}")
    return use_tqdm


class Progress:
    """A long job's progress: one line on stderr, redrawn in place ("\\r") at most 10 times a
    second (and whenever every prompt is done): prompts done of total, elapsed time, input
    tokens/s (a prompt counts once its first token is out) and output tokens/s. clear() blanks
    it, the cursor back at column 0: called before anything goes to stdout and at the end, so
    the line and the results never garble each other. Disabled, it draws nothing."""

    def __init__(self, total: int, enabled: bool):
        self.total = total      # prompts to serve (piped stdin adds each line it submits)
        self.enabled = enabled
        self.done = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.started = set()    # ids of the requests with output so far, not finished yet
        self.start = time.perf_counter()
        self.drawn_at = -math.inf
        self.width = 0          # characters on the line now: what clear() blanks

    def count(self, delta: "RequestOutput") -> None:  # noqa: F821 (nanoserve.py)
        """Add a delta output's tokens: its prompt's with its request's first output."""
        if delta.request_id not in self.started:
            self.started.add(delta.request_id)
            self.input_tokens += len(delta.prompt_token_ids)
        for completion in delta.outputs:  # one sample's new tokens (a request may have n)
            self.output_tokens += len(completion.token_ids)
        if delta.finished:
            self.started.discard(delta.request_id)
            self.done += 1

    def draw(self) -> None:
        """Redraw the line, unless it was drawn under 0.1 s ago and prompts are left to do."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.drawn_at < 0.1 and self.done < self.total:
            return
        self.drawn_at = now
        elapsed = now - self.start
        line = (f"{self.done}/{self.total} prompts, {elapsed:.1f} s, input "
                f"{self.input_tokens / elapsed:.0f} tok/s, output "
                f"{self.output_tokens / elapsed:.0f} tok/s").ljust(self.width)
        print("\r" + line, end="", file=sys.stderr, flush=True)
        self.width = len(line)

    def clear(self) -> None:
        """Blank the line, the cursor back at column 0."""
        if not self.width:  # nothing drawn since the last clear
            return
        print("\r" + " " * self.width + "\r", end="", file=sys.stderr, flush=True)
        self.width = 0


TRACE_LEGEND = ("= prompt chunk  o generated token  2-9 that many (accepted drafts)  * end  "
                "x preempted  . waiting  c cache hit  k KV loaded")


def trace_mark(request_id: str, record: "StepRecord") -> str:  # noqa: F821 (nanoserve.py)
    """What one step did for one request, as the trace draws it (TRACE_LEGEND)."""
    if request_id in record.preempted:
        return "x"
    if request_id in record.finished:
        return "*"
    if request_id in record.num_loaded_tokens:  # from another instance (kv_connector.py)
        return "k"
    if request_id in record.num_cached_tokens:
        return "c"
    if request_id in record.num_accepted_tokens and record.num_accepted_tokens[request_id]:
        return str(min(9, 1 + record.num_accepted_tokens[request_id]))
    if request_id in record.sampled:
        return "o"
    if request_id in record.scheduled:
        return "="
    return "."


def lora_note(request_id: str, records: list) -> str:
    """A trace row's ending: the LoRA adapter the request ran with, if any."""
    for record in records:
        if request_id in record.lora_names:
            return f"  (LoRA {record.lora_names[request_id]})"
    return ""


def render_trace(records: list["StepRecord"],  # noqa: F821 (nanoserve.py)
                 request_ids: list[str]) -> str:
    """The timeline that continuous-batching diagrams draw: a row per request, a column per
    step (the requests are taken to have arrived before the first step), a step number
    every ten columns."""
    width = max(len(i) for i in [*request_ids, "request"])
    ruler = ""
    for n in range(len(records)):
        if n % 10 == 0:
            ruler += str(n // 10 % 10)
        else:
            ruler += " "
    rows = [f"{'request':>{width}} | {ruler.rstrip()}"]
    for request_id in request_ids:
        marks = ""
        for record in records:
            marks += trace_mark(request_id, record)
            if request_id in record.finished:
                break
        rows.append(f"{request_id:>{width}} | {marks}{lora_note(request_id, records)}")
    return "\n".join(rows + ["", TRACE_LEGEND])

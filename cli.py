"""The command line: python nanoserve.py --prompt ..., piped stdin, --jsonl, the REPL, --serve.

main() parses the flags, which are generated from the option() fields of EngineConfig,
SamplingParams and ServerConfig (add_config_args: one place maps argparse onto the configs),
builds the Engine and hands it to one front end: --prompt serves every prompt as one batch
and streams its text (--trace draws the steps after); piped lines are submitted as they arrive
and printed whole, in order (--jsonl: a JSON object a line); at a terminal, a REPL; --serve
starts the HTTP server (server.py); --disagg-proxy builds no engine and runs the proxy of
disaggregated prefill and decode (disagg_proxy.py). With a checkpoint that has a chat
template, a --prompt, a piped line and a REPL line are the user's turn through it (the REPL:
one conversation), unless --ignore-chat-template; a --jsonl "prompt" is a completion's, always raw. --trace-html writes
the watch page (watch.py) replaying the run of --prompt or piped input. An error is one
"error: ..." line, never a traceback.
"""
import argparse
import dataclasses
import json
import os
import queue
import sys
import threading
import time
from functools import partial

import torch

import watch
from disagg_proxy import ProxyConfig, serve_proxy
from display import Progress, render_trace
from nanoserve import (CompletionOutput, Engine, EngineConfig, EngineDeadError, RequestOutput,
                       accumulate)
from options import check_int
from sampling import SamplingParams, print_sampling_defaults
from server import ServerConfig, serve
from tokenizer import ChatTemplate


def add_config_args(parser, cls, skip=()) -> None:
    """One flag per option() field of the dataclass `cls`, all of it from the field."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kwargs = {k: v for k, v in f.metadata.items() if k not in ("low", "high", "open_low")}
        kwargs["help"] = kwargs["help"].replace("%", "%%")  # argparse formats help with %
        if not isinstance(kwargs.get("type", str), type):  # a parser: the config runs it on
            kwargs["type"] = str                         # the text, its error names the field
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, tuple):  # of strings when empty
            kwargs |= dict(nargs="+", type=type(f.default[0]) if f.default else str)
        elif "type" not in kwargs and "choices" not in kwargs:
            kwargs["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="nanoserve: continuous batching over a paged KV "
                                "cache", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = partial(argparse_error, p)  # one line, no usage dump
    p.add_argument("--prompt", action="append", help="a prompt; repeat it to serve several "
                   "together as one batch; none: prompts from stdin (at a terminal, a REPL)")
    p.add_argument("--jsonl", action="store_true", help="stdin and stdout: a JSON object a "
                   "line; prompt and SamplingParams fields in; text, token ids, finish out")
    p.add_argument("--ignore-chat-template", action="store_true", help="send --prompt's text, "
                   "piped lines and REPL lines as they are, not as a user turn of the "
                   "checkpoint's chat template (--jsonl's prompts are raw anyway)")
    p.add_argument("--trace", action="store_true", help="with --prompt: the step-by-step "
                   "timeline at the end (to stderr)")
    p.add_argument("--trace-html", metavar="FILE", help="with --prompt, piped input or "
                   "--jsonl: write a page that replays the run step by step (open it in a "
                   "browser); a server's live page is at /")
    p.add_argument("--serve", action="store_true", help="serve OpenAI's API over HTTP")
    p.add_argument("--disagg-proxy", action="store_true", help="no engine: a proxy that sends "
                   "each request to a --prefill instance, then to a --decode one "
                   "(disagg_proxy.py), on --host and --port")
    p.add_argument("--prefill", nargs="+", metavar="URL", help="with --disagg-proxy: the "
                   "prefill instances (kv_producer), taken in turn")
    p.add_argument("--decode", nargs="+", metavar="URL", help="with --disagg-proxy: the decode "
                   "instances (kv_consumer), taken in turn")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch CPU threads: half the cores, so a busy core does not stall steps")
    sampling = p.add_argument_group("sampling (SamplingParams; a flag not given: the "
                                    "checkpoint's generation_config.json value, else the "
                                    "command line's own default, shown)")
    sampling.add_argument("--max-tokens", type=int, default=argparse.SUPPRESS,
                          help="default: the checkpoint's max_new_tokens, else 200; at most "
                          "what the context has left")
    sampling.add_argument("--stop", action="append", help="stop before this string (repeatable)")
    sampling.add_argument("--stop-token-ids", type=int, nargs="+", metavar="ID",
                          help="stop after any of these tokens")
    # logit_bias and structured_outputs are maps: --jsonl lines, the REPL's /set and the HTTP
    # API take them
    add_config_args(sampling, SamplingParams, skip=(
        "max_tokens", "stop", "seed", "logprobs", "prompt_logprobs", "stop_token_ids",
        "logit_bias", "structured_outputs"))
    p.set_defaults(temperature=0.8, top_p=0.95)
    engine = p.add_argument_group("engine (EngineConfig)")
    add_config_args(engine, EngineConfig)
    # vLLM's spelling of --no-enable-prefix-caching, accepted but not listed twice in --help
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    server = p.add_argument_group("server, with --serve (ServerConfig)")
    add_config_args(server, ServerConfig)
    return with_sampling_given(p, argv)


def with_sampling_given(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parsed flags, and as args.sampling_given the sampling flags the command line gave
    ({name: value}): the checkpoint's defaults go under those and over the rest. argparse sets a
    flag's default only where the namespace lacks its name, and a flag given is never None, so
    a name left None was not given: then it gets its default here."""
    names = (*CLI_SAMPLING, "max_tokens")
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(names, None)))
    args.sampling_given = {name: getattr(args, name) for name in names
                           if getattr(args, name) is not None}
    for name in CLI_SAMPLING:
        if getattr(args, name) is None:
            setattr(args, name, parser.get_default(name))
    return args


def argparse_error(parser: argparse.ArgumentParser, message: str) -> None:
    parser.exit(2, f"error: {message}\n")


# Control characters (random weights emit any byte) print as visible escapes, not raw.
VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}
MAX_THREADS = 1024    # --threads at most: torch crashes far past this
CLI_MAX_TOKENS = 200  # the command line's max_tokens, unless a flag, the checkpoint or the
                      # context says otherwise
CLI_SAMPLING = ("n", "temperature", "top_k", "top_p", "stop", "ignore_eos", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                "stop_token_ids", "include_stop_str_in_output")  # the flags cli_params reads


def cli_params(engine: Engine, args: argparse.Namespace, prompt, **fields) -> SamplingParams:
    """The command line's sampling for a prompt: each field from `fields` (a --jsonl line's,
    the REPL's /set), else the flag if given, else the checkpoint's default
    (generation_config_defaults), else the command line's own (the flags' defaults; max_tokens
    200). A default max_tokens is at most what the context leaves (at least 1: a prompt too
    long then says why)."""
    _, token_ids = engine.parse_prompt(prompt)
    defaults = {name: getattr(args, name) for name in CLI_SAMPLING}
    defaults |= dict(max_tokens=CLI_MAX_TOKENS) | engine.sampling_defaults
    defaults["max_tokens"] = engine.max_tokens_within_context(defaults["max_tokens"],
                                                              len(token_ids))
    return SamplingParams(**defaults | args.sampling_given | fields)


def line_params(engine: Engine, args: argparse.Namespace, prompt, **fields) -> SamplingParams:
    """cli_params for a piped line or a REPL prompt, which print one completion each."""
    params = cli_params(engine, args, prompt, **fields)
    if params.n > 1:
        raise ValueError(f"n is {params.n}, but piped lines and the REPL print one completion "
                         "each; n above 1 is for --prompt, the Python API and the server")
    return params


def cli_chat_template(engine: Engine, args: argparse.Namespace) -> ChatTemplate | None:
    """The template --prompt, piped lines and the REPL send their text through: the
    checkpoint's, unless --ignore-chat-template. None: the text is the prompt, as it is."""
    return None if args.ignore_chat_template else engine.chat_template


def chat_turn_prompt(template: ChatTemplate | None, conversation: list[dict], text: str) -> str:
    """The prompt for the user's turn `text` after `conversation`: the template renders them
    all and opens the assistant's turn (the generation prompt, as vLLM's LLM.chat adds it; an
    instruct model may answer a bare text with nothing). No template: the text itself."""
    if template is None:
        return text
    return template.render(conversation + [dict(role="user", content=text)], {})


def echo(text: str, template: ChatTemplate | None) -> str:
    """What prints before the completion of a prompt's text: the text, which a completion
    continues; a chat reply answers it instead, so it starts on a line of its own."""
    return text if template is None else text + "\n"


def run_prompts(engine: Engine, args: argparse.Namespace,
                frames: watch.FrameLog | None = None) -> int:
    """Serve every --prompt as one batch (each through the chat template, if any); stream each
    one's samples in turn (--n: each under its index); a summary, Ctrl-C or not. `frames`
    (--trace-html) gets each step's frame. Returns how many samples failed."""
    template = cli_chat_template(engine, args)
    prompts = [chat_turn_prompt(template, [], text) for text in args.prompt]
    ids = [engine.add_request(prompt, cli_params(engine, args, prompt)) for prompt in prompts]
    samples = [(k, request_id, index) for k, request_id in enumerate(ids)
               for index in range(args.n)]  # in the order they print
    later = {(request_id, index): [] for _, request_id, index in samples}  # deltas not printed
    current = 0  # the sample being printed
    num_failed = 0
    start = time.perf_counter()
    if args.trace:
        engine.step_records = []
    print(sample_heading(args, template, 0, 0), end="", flush=True)
    try:
        while engine.has_unfinished():
            outputs = engine.step()
            if frames is not None:
                frames.add()
            for out in outputs:
                for completion in out.outputs:
                    later[(out.request_id, completion.index)].append(completion)
            while current < len(samples) and later[samples[current][1:]]:
                completion = later[samples[current][1:]].pop(0)
                print_delta(completion)
                if completion.finish_reason is None:
                    continue
                if completion.finish_reason == "error":
                    num_failed += 1
                current += 1
                if current < len(samples):  # the next sample, which prints next
                    prompt_number, _, index = samples[current]
                    print(sample_heading(args, template, prompt_number, index), end="",
                          flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", end="", file=sys.stderr)
        print_summary(engine, time.perf_counter() - start, ids if args.trace else None)
        raise
    print_summary(engine, time.perf_counter() - start, ids if args.trace else None)
    return num_failed


def sample_heading(args: argparse.Namespace, template: ChatTemplate | None, prompt_number: int,
                   index: int) -> str:
    """What prints before a sample's text: its prompt, before the prompt's first sample (after
    a blank line, but for the very first); with --n above 1, the sample's index on a line of
    its own, else a chat reply's line break (echo)."""
    heading = ""
    if index == 0:
        heading = args.prompt[prompt_number].translate(VISIBLE)
    if index == 0 and prompt_number > 0:
        heading = "\n\n" + heading
    if args.n > 1:
        heading += f"\n[{index}] "
    else:
        heading = echo(heading, template)
    return heading


def print_delta(completion: CompletionOutput) -> None:
    """A delta's new text, as it comes; why a request failed, on stderr."""
    print(completion.text.translate(VISIBLE), end="", flush=True)
    if completion.finish_reason == "error":
        print(f"\n[error: {completion.error}]", file=sys.stderr)


def print_summary(engine: Engine, elapsed: float, trace_ids: list[str] | None) -> None:
    """The run's figures on stderr, then the trace of trace_ids if given."""
    stats = engine.stats
    hit_rate = stats.prefix_cache_hit_rate
    print(f"\n\n[{stats.num_prompt_tokens} prompt + {stats.num_generated_tokens} generated "
          f"tokens in {elapsed:.2f} s, {stats.num_generated_tokens / elapsed:.1f} tok/s, "
          f"{stats.num_steps} steps, peak batch {stats.peak_batch_size}, "
          f"{engine.scheduler.num_preemptions} preemptions, prefix cache hits {hit_rate:.0%}; "
          f"KV cache {engine.kv_cache_tokens} tokens, {kv_cache_description(engine)}]",
          file=sys.stderr)
    if trace_ids is not None:
        print(render_trace(engine.step_records, trace_ids), file=sys.stderr)


def kv_cache_description(engine: Engine) -> str:
    """How many tokens a GiB of KV cache holds, and why: "16384 a GiB (2 K/V heads for 8)"."""
    c = engine.model.config
    return f"{engine.kv_tokens_per_gib} a GiB ({c.n_kv_head} K/V heads for {c.n_head})"


def read_lines(stream, lines: queue.Queue) -> None:
    """Put each line of stream into `lines`, then None for the end (a thread's target),
    whatever ends the reading: the loop waits for that None."""
    try:
        for line in stream:
            lines.put(line)
    finally:
        lines.put(None)


def arrived_lines(lines: queue.Queue, wait: bool) -> list[str | None]:
    """The lines read so far (None: the end of input); with `wait`, at least one."""
    arrived = []
    try:
        arrived.append(lines.get(block=wait))
        while True:
            arrived.append(lines.get_nowait())
    except queue.Empty:
        pass
    return arrived


def run_stdin(engine: Engine, args: argparse.Namespace,
              frames: watch.FrameLog | None = None) -> tuple[int, int]:
    """Piped stdin: each line is submitted as it is read, all served as one continuous batch;
    each completion is printed whole, in input order, an error in its place (--jsonl: a JSON
    object a line in and out, an error as {"error": ...}, blank lines skipped; else errors go
    to stderr). When stderr is a terminal, it shows the progress line (Progress), blanked
    before each result is printed and at the end. `frames` (--trace-html) gets each step's
    frame. Returns (lines that failed, lines submitted)."""
    progress = Progress(0, sys.stderr.isatty())
    try:
        return serve_stdin(engine, args, progress, frames)
    finally:
        progress.clear()


def serve_stdin(engine: Engine, args: argparse.Namespace, progress: Progress,
                frames: watch.FrameLog | None) -> tuple[int, int]:
    """run_stdin's loop: read, submit, step, print in order; `progress` counts and draws."""
    lines = queue.Queue()
    threading.Thread(target=read_lines, args=(sys.stdin, lines), daemon=True).start()
    template = None if args.jsonl else cli_chat_template(engine, args)
    whole = {}          # request id -> its whole output so far
    result_index = {}   # request id -> its place in results
    results = []        # per submitted line: None while it runs, then its output or error
    echoes = []         # per submitted line: what prints before its completion (not --jsonl)
    line_number = 0
    num_printed = 0
    num_failed = 0
    eof = False
    while not eof or engine.has_unfinished():
        if not eof:  # take the lines that have arrived; wait for one only when idle
            for line in arrived_lines(lines, wait=not engine.has_unfinished()):
                line_number += 1
                if line is None:
                    eof = True
                elif line.strip() or not args.jsonl:  # --jsonl skips blank lines
                    submitted = submit_line(engine, args, template, line, line_number)
                    echoes.append(echo(line.rstrip("\r\n"), template))
                    if isinstance(submitted, ValueError):
                        results.append(submitted)
                    else:  # a request id
                        result_index[submitted] = len(results)
                        results.append(None)
                        progress.total += 1
        deltas = engine.step()
        if frames is not None:
            frames.add()
        for delta in deltas:
            accumulate(whole, delta)
            progress.count(delta)
            if delta.finished:
                results[result_index.pop(delta.request_id)] = whole.pop(delta.request_id)
        while num_printed < len(results) and results[num_printed] is not None:
            result = results[num_printed]
            progress.clear()
            print_result(result, args.jsonl, echoes[num_printed])
            num_printed += 1
            if isinstance(result, ValueError) or result.outputs[0].finish_reason == "error":
                num_failed += 1
        progress.draw()
    return num_failed, len(results)


def submit_line(engine: Engine, args: argparse.Namespace, template: ChatTemplate | None,
                line: str, line_number: int) -> str | ValueError:
    """Queue one line's request: its request id, or the error (naming the line). A piped line
    is the user's turn through `template`, if any; a --jsonl line's "prompt" is a completion's
    (as vLLM's "prompt" is), sent as it is."""
    try:
        fields = {}
        priority = 0
        if args.jsonl:
            fields = parse_jsonl_line(line)
            prompt = fields.pop("prompt")
            priority = fields.pop("priority", 0)
        else:
            prompt = chat_turn_prompt(template, [], line.rstrip("\r\n"))
        return engine.add_request(prompt, line_params(engine, args, prompt, **fields),
                                  priority=priority)
    except ValueError as e:
        return ValueError(f"line {line_number}: {e}")


def parse_jsonl_line(line: str) -> dict:
    """A --jsonl line: a JSON object of "prompt", SamplingParams fields and "priority" (vLLM's:
    lower first under --policy priority); ValueError naming what is wrong."""
    try:
        fields = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(fields, dict) or "prompt" not in fields:
        raise ValueError('a line must be a JSON object with a "prompt"')
    allowed = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = [name for name in fields if name not in ("prompt", "priority", *allowed)]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; a line holds \"prompt\" and any of "
                         f"{', '.join(allowed)}, priority")
    return fields


def print_result(result: RequestOutput | ValueError, jsonl: bool, echo_text: str) -> None:
    """A finished line: its whole completion after `echo_text` (--jsonl: after nothing; the
    object gives the prompt), or its error."""
    if isinstance(result, ValueError):
        if jsonl:
            print(json.dumps({"error": str(result)}), flush=True)
        else:
            print(f"error: {result}", file=sys.stderr)
        return
    completion = result.outputs[0]
    failed = completion.finish_reason == "error"
    if not jsonl:
        text = echo_text + completion.text
        print(text.translate(VISIBLE), end="\n\n", flush=True)
        if failed:
            print(f"error: {completion.error}", file=sys.stderr)
        return
    fields = dict(prompt=result.prompt, text=completion.text, token_ids=completion.token_ids,
                  finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                  logprobs=completion.logprobs, prompt_logprobs=result.prompt_logprobs)
    if failed:
        fields["error"] = completion.error
    print(json.dumps(fields), flush=True)


REPL_HELP = ("/set NAME VALUE sets a sampling field (max_tokens, temperature, top_k, top_p, "
             "min_p, seed, stop, ignore_eos, presence_penalty, frequency_penalty, "
             "repetition_penalty, min_tokens, stop_token_ids, logit_bias, ...; /set NAME alone "
             "resets it), /help, /quit.\nCtrl-C stops a completion; at the prompt, Ctrl-C or "
             "Ctrl-D ends.")
REPL_CHAT_HELP = ("A chat, through the checkpoint's chat template: each line is your turn in "
                  "one conversation; /clear starts a new one.")


def run_terminal(engine: Engine, args: argparse.Namespace) -> None:
    """At a terminal: each line is a prompt whose completion streams as it is generated. With
    a chat template (cli_chat_template), a chat: each line is the user's turn in one
    conversation, which the template renders whole; the reply streams, then joins the
    conversation (one that Ctrl-C stopped is dropped, with its turn)."""
    settings = {}
    template = cli_chat_template(engine, args)
    conversation = []  # with a template: the user's turns and the replies so far
    print(REPL_HELP if template is None else f"{REPL_HELP}\n{REPL_CHAT_HELP}")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() == "/clear" and template is not None:
            conversation.clear()
            print("a new conversation")
            continue
        if line.startswith("/"):
            if line.strip() == "/quit":
                return
            print(repl_command(line, settings, engine, args))
            continue
        try:
            prompt = chat_turn_prompt(template, conversation, line)
            request_id = engine.add_request(prompt, line_params(engine, args, prompt, **settings))
        except ValueError as e:
            print(f"error: {e}")
            continue
        reply = stream_completion(engine, request_id)
        if template is not None and reply is not None:
            conversation += [dict(role="user", content=line),
                             dict(role="assistant", content=reply)]


def stream_completion(engine: Engine, request_id: str) -> str | None:
    """Step until the request ends, printing its text as it comes: the whole text, or None if
    Ctrl-C stopped it (its blocks freed; back to the prompt) or it failed (why, printed)."""
    text = ""
    error = None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                completion = out.outputs[0]
                text += completion.text
                print(completion.text.translate(VISIBLE), end="", flush=True)
                error = completion.error
    except KeyboardInterrupt:
        engine.abort(request_id)
        engine.step()
        print("\n[interrupted]")
        return None
    if error is not None:
        print(f"\n[error: {error}]")
        return None
    print()
    return text


def repl_command(line: str, settings: dict, engine: Engine, args: argparse.Namespace) -> str:
    """/set NAME [VALUE] or /help: the reply. A value is JSON (0.7, 5, true, null); stop's is
    a string with escapes (/set stop \\n\\n)."""
    words = line.split(maxsplit=2)
    command = words[0]
    name = words[1] if len(words) > 1 else ""
    value = words[2] if len(words) > 2 else ""
    if command == "/help":
        return REPL_HELP + "\nnow: " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
    if command != "/set" or name not in {f.name for f in dataclasses.fields(SamplingParams)}:
        return f"error: unknown command {line!r}; /help lists them"
    if not value:
        settings.pop(name, None)
        return f"{name} reset"
    try:
        parsed = parse_setting(name, value)
        line_params(engine, args, "", **settings | {name: parsed})  # validates
    except ValueError as e:
        return f"error: {e}"
    settings[name] = parsed
    return f"{name} = {parsed!r}"


def parse_setting(name: str, value: str):
    """A /set value: JSON, but for stop, a string whose backslash escapes are read (\\n, \\t,
    \\x41, \\u00e9; any other character is itself); ValueError naming the field."""
    if name == "stop":
        try:  # unicode_escape reads bytes: a character past Latin-1 goes in as its \\u escape
            return [value.encode("latin-1", "backslashreplace").decode("unicode_escape")]
        except UnicodeDecodeError as e:
            raise ValueError(f"stop: a bad escape in {value!r} ({e.reason})") from None
    try:
        return json.loads(value)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not a JSON value (0.7, 5, true, null, "
                         '"text", [1, 2])') from None


def run_front_end(engine: Engine, args: argparse.Namespace,
                  frames: watch.FrameLog | None) -> None:
    """--prompt, the REPL at a terminal, or piped lines (status 1 if any failed)."""
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach the engine, which
        sys.stdin.reconfigure(errors="surrogateescape")  # names them, rather than end the run
    if args.prompt:
        num_failed = run_prompts(engine, args, frames)
        if num_failed:
            print(f"error: {num_failed} of {len(args.prompt) * args.n} samples failed",
                  file=sys.stderr)
            sys.exit(1)
    elif sys.stdin.isatty() and not args.jsonl:
        run_terminal(engine, args)
    else:
        num_failed, num_lines = run_stdin(engine, args, frames)
        if num_failed:
            print(f"error: {num_failed} of {num_lines} lines failed", file=sys.stderr)
            sys.exit(1)


def write_trace_page(path: str, frames: list[dict]) -> None:
    """--trace-html's page; ValueError saying which file could not be written, and why."""
    try:
        watch.write_page(path, frames)
    except OSError as e:
        raise ValueError(f"cannot write --trace-html {path}: {e.strerror or e}") from None


def check_front_end_flags(args: argparse.Namespace) -> None:
    """ValueError for flags that the chosen front end would ignore."""
    if (args.prefill or args.decode) and not args.disagg_proxy:
        raise ValueError("--prefill and --decode are the instances of --disagg-proxy")
    if args.disagg_proxy and (args.serve or args.prompt or args.jsonl):
        raise ValueError("--disagg-proxy runs no engine: it takes no --serve, --prompt or "
                         "--jsonl")
    if args.trace and not args.prompt:
        raise ValueError("--trace needs --prompt")
    if args.jsonl and args.prompt:
        raise ValueError("--jsonl reads prompts from stdin; it takes no --prompt")
    if args.jsonl and args.ignore_chat_template:
        raise ValueError('--jsonl sends each "prompt" as it is (a completion\'s, as vLLM\'s); '
                         "--ignore-chat-template is for --prompt, piped lines and the REPL")
    if not args.serve:
        return
    if args.prompt or args.jsonl:
        raise ValueError("--serve takes no --prompt or --jsonl")
    if args.ignore_chat_template:
        raise ValueError("--serve takes no --ignore-chat-template: a request chooses "
                         "(/v1/completions sends its prompt as it is, /v1/chat/completions "
                         "renders the template)")
    if args.sampling_given:
        flags = ", ".join("--" + name.replace("_", "-") for name in args.sampling_given)
        raise ValueError(f"--serve takes sampling per request, not {flags} (the checkpoint's "
                         "generation_config.json gives the defaults)")


def main(argv=None) -> None:
    """Errors: one "error: ..." line, status 2; piped lines that failed: status 1. Ctrl-C:
    status 130. A closed stdout: quiet."""
    args = parse_args(argv)
    try:
        check_int("--threads", args.threads, 1, MAX_THREADS)
        check_front_end_flags(args)
        if args.disagg_proxy:
            serve_proxy(ProxyConfig(args.prefill or [], args.decode or [], args.host, args.port))
            return
        runs_a_batch = args.prompt or args.jsonl or not sys.stdin.isatty()  # not the REPL
        if args.trace_html is not None and (args.serve or not runs_a_batch):
            raise ValueError("--trace-html needs --prompt, piped input or --jsonl (a server's "
                             "live page is at /)")
        if args.trace_html is not None:  # a bad path fails now, not after the run
            write_trace_page(args.trace_html, [])
        torch.set_num_threads(args.threads)
        config = EngineConfig(**{f.name: getattr(args, f.name)
                                 for f in dataclasses.fields(EngineConfig)})
        server_config = ServerConfig(**{f.name: getattr(args, f.name)
                                        for f in dataclasses.fields(ServerConfig)})
        engine = Engine(config)
        if args.serve:  # the server says which defaults it took as it starts
            serve(engine, server_config)
            return
        print_sampling_defaults(engine.sampling_defaults)
        frames = None if args.trace_html is None else watch.FrameLog(engine)
        try:
            run_front_end(engine, args, frames)
        finally:  # also after Ctrl-C or a failed line: the page shows the steps that ran
            if frames is not None:
                write_trace_page(args.trace_html, frames.frames)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no 2nd error at exit
        sys.exit(1)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except EngineDeadError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)

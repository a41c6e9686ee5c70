"""OpenAI's API as data: a request's JSON to the engine's prompts and SamplingParams, and the
engine's outputs back to OpenAI's JSON.

parse_request checks a completions or chat body (every field typed, known, in range; a chat's
messages through the checkpoint's chat template, or render_chat's transcript for a model
without one) and gives the engine requests it asks for; choice, logprobs_json and usage_of
write the response, whole or as a stream's chunks; HTTPError and error_body are OpenAI's
error shape. Nothing here does I/O: server.py reads the bytes, calls these, and writes the
answer.
"""
import dataclasses

from beam_search import BeamSearchParams
from nanoserve import CompletionOutput, Engine, RequestOutput, as_prompt_list
from options import check_int
from sampling import MAX_LOGPROBS, SamplingParams
from scheduler import MAX_PRIORITY
from tokenizer import ChatTemplate

MAX_SEQUENCES = 256       # prompts x n of one request at most: what it may queue ahead of others
CHAT_TURN_END = "\n\n"    # the chat template ends every turn with a blank line
TRANSCRIPT_ROLES = ("system", "user", "assistant")  # the roles of render_chat's transcript
TEMPLATE_ROLES = (*TRANSCRIPT_ROLES, "tool")        # a checkpoint's template may take tool results

# SamplingParams' fields a request may set, OpenAI's and vLLM's extra ones (top_k, min_p, ...)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                   "stop_token_ids", "include_stop_str_in_output", "logit_bias")
FIELDS = {"model", "n", "stream", "stream_options", "user", "stop", "logprobs", "priority",
          "response_format", "structured_outputs", *SAMPLING_FIELDS}  # both endpoints serve these
CHAT_FIELDS = {"messages", "top_logprobs", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = {"prompt", "echo", "use_beam_search", "length_penalty"}  # vLLM's last two
NEUTRAL = dict(best_of=1, suffix="")  # accepted at these values only
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # vLLM's


class HTTPError(Exception):
    """Answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def typed(body: dict, name: str, default, *kinds):
    """body[name] (absent or null: default); HTTPError 400 unless of one of the JSON kinds."""
    if (value := body.get(name)) is None:
        return default
    if type(value) not in kinds:
        raise HTTPError(400, f"{name} must be of type {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {value!r}", name)
    return value


def check_messages(messages, roles: tuple[str, ...]) -> None:
    """HTTPError 400 unless messages is a non-empty list of {"role": one of roles, "content":
    a string} (other keys are the template's to read)."""
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str)
            for m in messages):
        return
    names = ", ".join(f'"{role}"' for role in roles[:-1]) + f' or "{roles[-1]}"'
    raise HTTPError(400, f'messages must be a non-empty list of {{"role": {names}, "content": '
                    'a string or text parts} ("developer" reads as "system")', "messages")


def plain_messages(messages):
    """Messages as the templates read them: a content given as parts ([{"type": "text", "text":
    ...}], OpenAI's other form) becomes its texts joined by newlines, as vLLM joins them, and
    OpenAI's "developer" role (its new name for instructions) is "system". Anything else is
    left as it is, for check_messages to refuse."""
    if not isinstance(messages, list):
        return messages
    plain = []
    for message in messages:
        if isinstance(message, dict):
            message = dict(message, content=plain_content(message.get("content")))
            if message.get("role") == "developer":
                message["role"] = "system"
        plain.append(message)
    return plain


def plain_content(content):
    """A message's content as a string if it is one or a list of text parts; HTTPError 400
    for a part that is not text (images, audio: no model here reads them)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise HTTPError(400, 'a message\'s content parts must be {"type": "text", "text": '
                            f'a string}}, got {part!r:.80}', "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(messages) -> str:
    """The chat template for a base model: every turn is "ROLE:\\n" + content + a blank line,
    then "ASSISTANT:\\n" for the model to go on; its reply ends at its own blank line."""
    check_messages(messages, TRANSCRIPT_ROLES)
    return "".join(f"{m['role'].upper()}:\n{m['content']}{CHAT_TURN_END}" for m in messages) \
        + "ASSISTANT:\n"


def chat_prompt(body: dict, template: ChatTemplate | None) -> str:
    """A chat request's prompt text: its messages through the checkpoint's template with its
    chat_template_kwargs, else render_chat's transcript (which takes no kwargs); HTTPError
    400 naming the field at fault."""
    kwargs = typed(body, "chat_template_kwargs", {}, dict)
    messages = plain_messages(body.get("messages"))
    if template is None:
        return render_chat(messages)
    check_messages(messages, TEMPLATE_ROLES)
    try:
        return template.render(messages, kwargs)
    except ValueError as e:
        raise HTTPError(400, str(e), "messages") from None


def parse_request(body: dict, engine: Engine, model_name: str, chat: bool,
                  template: ChatTemplate | None, defaults: dict) -> tuple[list, dict]:
    """An OpenAI request -> its sequences [(prompt, SamplingParams)], n for each prompt, and
    how to answer (stream, include_usage, continuous_usage, echo, logprobs k, priority);
    HTTPError 400 if anything is off.
    A chat's prompt is the checkpoint's template, if any (template); a sampling field absent
    or null is the checkpoint's default, if any (defaults: generation_config_defaults')."""
    check_known_fields(body, chat)
    check_model(body, model_name)
    fields = defaults | {name: body[name] for name in SAMPLING_FIELDS
                         if body.get(name) is not None}
    fields["stop"] = typed(body, "stop", [], str, list)
    n = typed(body, "n", 1, int)
    echo = typed(body, "echo", False, bool)
    stream = typed(body, "stream", False, bool)
    typed(body, "user", None, str)  # OpenAI's end-user id: checked, not used
    fields["structured_outputs"], constraint_field = structured_outputs_of(body)
    if chat:  # as token ids, encoded once and as the engine encodes text (special tokens too)
        prompts = [encode_text(engine, chat_prompt(body, template), "messages")]
        default_max_tokens = engine.max_tokens_within_context(defaults.get("max_tokens"),
                                                              len(prompts[0]))
        fields["max_tokens"] = chat_max_tokens(body, default_max_tokens)
        fields["logprobs"] = chat_logprobs(body)
    else:
        prompts = completion_prompts(body)
        fields["logprobs"] = typed(body, "logprobs", None, int)
        if (fields["logprobs"] or 0) > 5:  # OpenAI's limit for completions
            raise HTTPError(400, f"logprobs must be at most 5, got {fields['logprobs']}",
                            "logprobs")
        fields["prompt_logprobs"] = fields["logprobs"] if echo else None
    include_usage, continuous_usage = stream_usage(body, stream)
    options = dict(stream=stream, chat=chat, n=n, k=fields["logprobs"] or 0, echo=echo,
                   include_usage=include_usage, continuous_usage=continuous_usage,
                   priority=request_priority(body), constraint_field=constraint_field)
    if len(prompts) * n > MAX_SEQUENCES:
        raise HTTPError(400, f"the request asks for {len(prompts)} prompts x n {n} samples; "
                        f"at most {MAX_SEQUENCES} in all", "prompt")
    if not chat and typed(body, "use_beam_search", False, bool):
        return [(prompt, beam_search_params(body, fields, options)) for prompt in prompts], \
            options
    typed(body, "length_penalty", 1.0, int, float)  # beam search's: checked, else unused
    transcript = chat and template is None  # a reply there ends at its turn's blank line
    params = sample_params(fields, n, transcript, typed(body, "top_logprobs", 0, int))
    if chat or body.get("max_tokens") is not None or "max_tokens" not in defaults:
        return [(prompt, params) for prompt in prompts], options
    return [(prompt, within_context(engine, prompt, params)) for prompt in prompts], options


def beam_search_params(body: dict, fields: dict, options: dict) -> BeamSearchParams:
    """vLLM's use_beam_search on /v1/completions: n is the beam width (the choices, best
    first), with max_tokens, ignore_eos, temperature (absent: 0), length_penalty, stop and
    include_stop_str_in_output; the sampling fields do not apply. HTTPError 400 for a stream
    (refused, as vLLM refuses it), logprobs or echo, or a bad field."""
    for name, refused in (("stream", options["stream"]), ("logprobs", options["k"]),
                          ("echo", options["echo"]),
                          (options["constraint_field"] or "structured_outputs",
                           fields["structured_outputs"])):
        if refused:
            raise HTTPError(400, f"use_beam_search does not take {name}", name)
    values = dict(beam_width=options["n"], max_tokens=fields.get("max_tokens", 16),
                  ignore_eos=fields.get("ignore_eos", False),
                  temperature=typed(body, "temperature", 0.0, int, float),
                  length_penalty=typed(body, "length_penalty", 1.0, int, float),
                  stop=fields["stop"],
                  include_stop_str_in_output=fields.get("include_stop_str_in_output", False))
    try:
        return BeamSearchParams(**values)
    except ValueError as e:
        bad_field = next((f for f in values if str(e).startswith(f)), None)
        raise HTTPError(400, str(e), "n" if bad_field == "beam_width" else bad_field) from None


def encode_text(engine: Engine, text: str, param: str) -> list[int]:
    """A text's token ids, as the engine encodes a prompt; HTTPError 400 naming param if it
    has none (a lone surrogate)."""
    try:
        return engine.tokenizer.encode(text)
    except ValueError as e:
        raise HTTPError(400, f"{param}: {e}", param) from None


def within_context(engine: Engine, prompt, params: SamplingParams) -> SamplingParams:
    """params with the checkpoint's default max_tokens (the request gave none) cut to what
    the prompt's context leaves (Engine.max_tokens_within_context)."""
    try:
        _, token_ids = engine.parse_prompt(prompt)
    except ValueError as e:
        raise HTTPError(400, str(e), "prompt") from None
    max_tokens = engine.max_tokens_within_context(params.max_tokens, len(token_ids))
    return dataclasses.replace(params, max_tokens=max_tokens)


def check_known_fields(body: dict, chat: bool) -> None:
    """HTTPError 400 naming the first field this endpoint does not serve (a NEUTRAL one is
    accepted at its neutral value)."""
    known = FIELDS | (CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for name, value in body.items():
        if name in known:
            continue
        if name not in NEUTRAL:
            raise HTTPError(400, f"{name} is not supported", name)
        if value not in (None, NEUTRAL[name]):
            raise HTTPError(400, f"{name} is not supported (only {NEUTRAL[name]!r})", name)


def chat_max_tokens(body: dict, default: int) -> int:
    """max_completion_tokens, else max_tokens (its older name), else `default` (the
    checkpoint's, or what the context has left, whichever is less:
    Engine.max_tokens_within_context); HTTPError 400 naming either unless an integer >= 1."""
    max_tokens = default
    for name in ("max_tokens", "max_completion_tokens"):  # the second, if given, wins
        value = body.get(name)
        if value is None:
            continue
        try:
            check_int(name, value, 1)
        except ValueError as e:
            raise HTTPError(400, str(e), name) from None
        max_tokens = value
    return max_tokens


def chat_logprobs(body: dict) -> int | None:
    """A chat's SamplingParams.logprobs: top_logprobs (0 if absent) if logprobs is true, else
    None; HTTPError 400 for a top_logprobs above 0 without logprobs, as vLLM answers it."""
    top_logprobs = typed(body, "top_logprobs", None, int)
    if typed(body, "logprobs", False, bool):
        return top_logprobs or 0
    if top_logprobs is not None and top_logprobs > 0:  # a negative one: sample_params' error
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return None


def request_priority(body: dict) -> int:
    """vLLM's priority field: an integer, lower served first (--policy priority); 0 if absent.
    HTTPError 400 naming it otherwise (a bool, a float, a number past MAX_PRIORITY)."""
    priority = typed(body, "priority", 0, int)
    try:
        check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
    except ValueError as e:
        raise HTTPError(400, str(e), "priority") from None
    return priority


def stream_usage(body: dict, stream: bool) -> tuple[bool, bool]:
    """stream_options' (include_usage, continuous_usage_stats): the usage in a last chunk of
    its own, and in every chunk too (vLLM's, which load tools read to count tokens as they
    come; as in vLLM, only beside include_usage). HTTPError 400 naming stream_options unless
    each is absent or a bool, on a streamed request (as vLLM and OpenAI refuse it)."""
    stream_options = typed(body, "stream_options", None, dict)
    if stream_options is None:
        return False, False
    if not stream:
        raise HTTPError(400, "stream_options needs stream: true", "stream_options")
    for name in stream_options:
        if name not in STREAM_OPTIONS:
            raise HTTPError(400, f"stream_options.{name} is not supported", "stream_options")
    for name, value in stream_options.items():
        if value is not None and type(value) is not bool:
            raise HTTPError(400, f"stream_options.{name} must be of type bool, got {value!r}",
                            "stream_options")
    include_usage = bool(stream_options.get("include_usage"))
    continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
    return include_usage, continuous


def structured_outputs_of(body: dict) -> tuple[dict | None, str | None]:
    """The request's constraint as StructuredOutputsParams' fields (None: none), from vLLM's
    structured_outputs or OpenAI's response_format (not both), and the field that names it
    in a compile error (None: vLLM's, structured_outputs.<kind>). HTTPError 400 naming a
    malformed one; whether it compiles is the server's to ask, off its event loop."""
    structured_outputs = typed(body, "structured_outputs", None, dict)
    response_format = typed(body, "response_format", None, dict)
    if response_format is None:
        return structured_outputs, None
    if structured_outputs is not None:
        raise HTTPError(400, "give response_format or structured_outputs, not both",
                        "response_format")
    return response_format_fields(response_format)


def response_format_fields(response_format: dict) -> tuple[dict | None, str | None]:
    """OpenAI's response_format -> (StructuredOutputsParams' fields, the field compile errors
    name): {"type": "text"}, none; {"type": "json_object"}, any JSON object; {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}, the schema
    (enforced whether strict or not, as vLLM does)."""
    kind = response_format.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return dict(json_object=True), "response_format"
    if kind != "json_schema":
        raise HTTPError(400, 'response_format.type must be "text", "json_object" or '
                        f'"json_schema", got {kind!r}', "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise HTTPError(400, 'response_format.json_schema must be {"name": ..., "schema": an '
                        f'object, "strict": ...}}, got {spec!r:.80}', "response_format")
    return dict(json=spec["schema"]), "response_format.json_schema.schema"


def completion_prompts(body: dict) -> list:
    """The completions endpoint's prompt field as a non-empty list of prompts."""
    prompt = body.get("prompt")
    if isinstance(prompt, (str, list)):
        prompts = as_prompt_list(prompt)
        if prompts:
            return prompts
    raise HTTPError(400, "prompt must be a string, a list of token ids, or a non-empty list of "
                    "those", "prompt")


def sample_params(fields: dict, n: int, transcript: bool, top_logprobs: int) -> SamplingParams:
    """The request's SamplingParams (its n samples are the engine's fan-out: sample i of a
    seeded request uses seed + i); a reply in render_chat's transcript also stops at the end
    of its turn. HTTPError 400 naming a bad field."""
    try:
        check_int("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
        params = SamplingParams(n=n, **fields)
        if transcript:  # within the stop strings' cap too
            params = dataclasses.replace(params, stop=params.stop + [CHAT_TURN_END])
    except ValueError as e:
        bad_field = next((f for f in [*fields, "n", "top_logprobs"] if str(e).startswith(f)), None)
        raise HTTPError(400, str(e), bad_field) from None
    return params


def token_text(tokenizer, token_id: int) -> str:
    """A token as text (a special token's too, as vLLM's logprobs write <|endoftext|>); as
    OpenAI writes it, "bytes:\\xe2\\x80" if it is not UTF-8 alone."""
    data = tokenizer.token_bytes(token_id, skip_special_tokens=False)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def logprob_value(item: tuple[int, float]) -> float:
    return item[1]


def logprobs_json(tokenizer, token_ids: list[int], entries: list, k: int, chat: bool,
                  offset: int = 0) -> dict:
    """Each token's log-probability and the top k, in OpenAI's completions or chat shape (text
    offsets start at `offset`: the characters that earlier chunks of the choice held). An
    entry is {token id: log-probability}; the first prompt token's is None."""
    tops = []
    for entry in entries:
        if entry is None:
            tops.append(None)
        else:
            tops.append(sorted(entry.items(), key=logprob_value, reverse=True)[:k])
    if chat:
        content = []
        for token_id, entry, top in zip(token_ids, entries, tops):
            item = chat_logprob_item(tokenizer, token_id, entry[token_id])
            item["top_logprobs"] = [chat_logprob_item(tokenizer, t, lp) for t, lp in top]
            content.append(item)
        return dict(content=content)
    token_logprobs = []
    top_logprobs = []
    for token_id, entry, top in zip(token_ids, entries, tops):
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(entry[token_id])
            # OpenAI's completions: the top k, then the token itself if not among them
            with_token = dict(top)
            with_token[token_id] = entry[token_id]
            top_logprobs.append({token_text(tokenizer, t): lp for t, lp in with_token.items()})
    text_offset = [offset + len(tokenizer.decode(token_ids[:i], skip_special_tokens=False))
                   for i in range(len(entries))]  # as vLLM's: the lengths of the tokens' texts
    return dict(tokens=[token_text(tokenizer, t) for t in token_ids],
                token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                text_offset=text_offset)


def chat_logprob_item(tokenizer, token_id: int, logprob: float) -> dict:
    return dict(token=token_text(tokenizer, token_id), logprob=logprob,
                bytes=list(tokenizer.token_bytes(token_id, skip_special_tokens=False)))


def choice(tokenizer, index: int, out: RequestOutput, completion: CompletionOutput,
           options: dict, first: bool, offset=0) -> dict:
    """One choice (`completion`, one of out's samples) of a response, or of a stream's chunk
    (then from a delta, `offset` characters into the choice's text)."""
    token_ids = completion.token_ids
    entries = completion.logprobs
    if completion.cumulative_logprob is not None:  # beam search's: not asked for (nor taken)
        entries = None
    text = completion.text
    if first and options["echo"]:  # the prompt (and its log-probabilities) first
        token_ids = out.prompt_token_ids + token_ids
        # the prompt as written, or its ids' text with the special tokens (as /detokenize's)
        prompt = out.prompt or tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        text = prompt + text
        if entries is not None:
            entries = out.prompt_logprobs + entries
    logprobs = None
    if entries is not None:
        logprobs = logprobs_json(tokenizer, token_ids, entries, options["k"],
                                 options["chat"], offset)
    if not options["chat"]:
        return dict(index=index, text=text, logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason)
    message = dict(content=text)
    if first:
        message = dict(role="assistant", content=text)
    message_key = "delta" if options["stream"] else "message"
    return {"index": index, message_key: message, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def usage_of(ids: list[str], whole: dict[str, RequestOutput]) -> dict:
    """OpenAI's usage of one HTTP request: each prompt once, every sample's tokens."""
    prompt_tokens = sum(len(whole[i].prompt_token_ids) for i in ids)
    completion_tokens = sum(len(c.token_ids) for i in ids for c in whole[i].outputs)
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def choice_usage(so_far: RequestOutput, index: int) -> dict:
    """One streamed choice's usage so far (continuous_usage_stats): its prompt, its tokens."""
    prompt_tokens = len(so_far.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in so_far.outputs if c.index == index)
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def error_body(error: "HTTPError") -> dict:
    """OpenAI's error body."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": dict(message=str(error), type=kind, param=error.param, code=error.status)}


def check_model(body: dict, model_name: str) -> None:
    """vLLM's 404 for a request naming a model this server does not serve."""
    name = typed(body, "model", model_name, str)
    if name != model_name:
        raise HTTPError(404, f"The model `{name}` does not exist.", "model")

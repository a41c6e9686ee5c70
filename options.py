"""option(): a configuration dataclass field that is also a command-line flag.

EngineConfig (nanoserve.py), SamplingParams (sampling.py) and ServerConfig (server.py) declare
each field once, with option(default, help, range). check_fields() validates an instance
against those ranges in its __post_init__, so the Python API, the command line and the HTTP
server refuse the same values with the same message; the command line (cli.py) makes the same
fields its flags. check_int and check_float are the checks themselves, for values outside a
dataclass too.
"""
import dataclasses
import json
import math
from dataclasses import field

MAX_UINT64 = 2**64 - 1  # the largest integer a field takes (a seed, say)


def check_int(name: str, value, low: int, high: int = MAX_UINT64) -> None:
    """ValueError naming `name` unless value is an int (a bool is not) in [low, high]."""
    if type(value) is int and low <= value <= high:
        return
    bounds = f">= {low}" if high == MAX_UINT64 else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def check_float(name: str, value, low: float, high: float, open_low: bool) -> None:
    """ValueError naming `name` unless value is a finite number (a bool is not) in [low, high],
    or in (low, high] if open_low."""
    is_number = type(value) in (int, float) and math.isfinite(value)
    above_low = is_number and (value > low if open_low else value >= low)
    if above_low and value <= high:
        return
    opening = "(" if open_low else "["
    raise ValueError(f"{name} must be a number in {opening}{low}, {high}], got {value!r}")


def option(default, help: str, low=1, high=math.inf, open_low=False, **argparse_kwargs):
    """A config field that is also a flag: default, help, type, choices and range, only here."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, open_low=open_low,
                                                **argparse_kwargs))


def check_fields(config) -> None:
    """ValueError naming the first option() field out of its choices, type or range (a bool
    is not a number; NaN and inf are never in range)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        meta = f.metadata
        kind = meta.get("type") or type(f.default)
        if value is None and f.default is None:
            continue
        if not isinstance(kind, type):  # a parser, not a type: it checked the value itself
            continue
        if "choices" in meta:
            if value not in meta["choices"]:
                raise ValueError(f"unknown {f.name} {value!r}; choose one of "
                                 f"{', '.join(map(str, meta['choices']))}")
        elif kind is int:
            check_int(f.name, value, meta["low"], min(meta["high"], MAX_UINT64))
        elif kind is float:
            check_float(f.name, value, meta["low"], meta["high"], meta["open_low"])
        elif type(value) is not kind:
            raise ValueError(f"{f.name} must be a {kind.__name__}, got {value!r}")


def json_fields(name: str, value, config_class) -> dict:
    """A nested config's fields as the API or the command line give them, a dict or its JSON
    text (vLLM's speculative_config, kv_transfer_config) -> that dict, checked to be a JSON
    object of config_class's fields; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(sorted(known))}")
    return value

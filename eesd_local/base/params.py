"""Request parameters: one check of types, bounds and wording for the CLI, the API and the server.

Every number or option a user passes (sampling options, engine options, server flags) goes
through one of these checks before it reaches llama.cpp or the native round loop, which take
32-bit integers: a value of the wrong type (a bool, a float with or without a fraction, a
string that reads like a number, None, a dict) or outside its range raises :class:`ParamError`,
an :class:`EesdError` that names the parameter, the value and the range, the same sentence
whichever way it came in. The server answers it as a 400 with ``param`` set.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from eesd_local.base.defaults import MAX_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError

INT32_MAX = 2**31 - 1  # llama.cpp's and the native loop's int: token counts, top_k, context sizes
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the sampler keeps a seed's low 64 bits (an OpenAI seed is an int64)


class ParamError(EesdError):
    """A parameter of the wrong type or outside its range; ``param`` is its name."""

    def __init__(self, param: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40
_REPR.maxlevel = 2  # a body nested thousands deep is quoted two levels down, never recursed through


def show(value: Any) -> str:
    """A value as the message quotes it: its type where the bare text would mislead, never a long dump."""
    if isinstance(value, str):
        return f"the string {_REPR.repr(value)}"  # "0.5" printed bare reads as the number it is not
    if isinstance(value, bool | int | float) or value is None:
        return _REPR.repr(value)
    return f"a {type(value).__name__} ({_REPR.repr(value)})"


def check_int(name: str, value: Any, lo: int, hi: int = INT32_MAX, *, hint: str | None = None) -> int:
    """``value`` as an int in [lo, hi]; a bool, a float or a numeric string is refused."""
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ParamError(name, f"{name} must be an integer from {lo} to {hi}, got {show(value)}", hint=hint)
    return value


def check_optional_int(name: str, value: Any, lo: int, hi: int = INT32_MAX, *, hint: str | None = None) -> int | None:
    return None if value is None else check_int(name, value, lo, hi, hint=hint)


def check_number(name: str, value: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False,
                 hint: str | None = None) -> float:
    """``value`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``); ints count as numbers."""
    if isinstance(value, np.integer | np.floating):
        value = value.item()
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        try:
            x = float(value)
        except OverflowError:  # an int beyond any float
            ok = False
        else:
            ok = math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi
    if not ok:
        raise ParamError(name, f"{name} must be {_range(lo, hi, lo_open)}, got {show(value)}", hint=hint)
    return float(value)


def _range(lo: float, hi: float, lo_open: bool) -> str:
    low = f"{'>' if lo_open else '>='} {lo:g}"
    if math.isinf(hi):
        return f"a finite number {low}"
    return f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"


def check_choice(name: str, value: Any, choices: tuple[Any, ...], *, hint: str | None = None) -> Any:
    if not any(type(value) is type(c) and value == c for c in choices):  # True is not 1, "1" is not 1
        raise ParamError(name, f"{name} must be one of {', '.join(map(repr, choices))}, got {show(value)}", hint=hint)
    return value


def check_stop(value: Any) -> list[str]:
    """A stop string or a list of them (None: none), as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ParamError("stop", f"stop must be a string or a list of strings, got {show(value)}",
                     hint='e.g. stop=["\\n\\n"]')


@dataclass(frozen=True)
class Sampling:
    """One request's sampling options, checked (what Engine.generate and the server accept)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]


def check_sampling(*, max_tokens: Any = MAX_TOKENS, temperature: Any = TEMPERATURE, top_p: Any = TOP_P, top_k: Any = TOP_K,
                   seed: Any = SEED, stop: Any = None) -> Sampling:
    """Every sampling option checked in one place; raises ParamError naming the first bad one."""
    return Sampling(
        max_tokens=check_int("max_tokens", max_tokens, 1, hint="the most tokens to generate, e.g. 256"),
        temperature=check_temperature(temperature),
        top_p=check_top_p(top_p),
        top_k=check_top_k(top_k),
        seed=check_optional_int("seed", seed, SEED_MIN, SEED_MAX, hint="leave it out for a random seed"),
        stop=check_stop(stop),
    )


def check_temperature(value: Any) -> float:
    return check_number("temperature", value, 0.0, hint="use 0 for greedy decoding")


def check_top_p(value: Any) -> float:
    return check_number("top_p", value, 0.0, 1.0, lo_open=True, hint="use 1 to turn top-p off")


def check_top_k(value: Any) -> int:
    return check_int("top_k", value, 0, hint="use 0 to turn top-k off")

"""Every environment variable paddle_mgrad reads: one table, validated once.

Each :class:`Knob` names a variable, what it accepts and what it does.  The code that
uses a variable reads it with :func:`get` (parsed, validated); ``import paddle_mgrad``
runs :func:`check` once, so a typo such as ``PADDLE_MGRAD_OPS=pyhton`` or
``PADDLE_MGRAD_BUILD_OPS=flase`` stops the process with one line naming the variable and
the accepted values, instead of being ignored (or, worse, read as "on") somewhere deep
inside a training run.  Unknown ``PADDLE_MGRAD_*`` names (a misspelt variable) are not
errors -- other tools may share the prefix -- but :func:`problems` reports them with the
closest known name, and ``python -m paddle_mgrad doctor`` prints them.

The C++ op reads four of these itself on every call (``PADDLE_MGRAD_CPU_BF16``,
``PADDLE_MGRAD_CPU_CHUNK_ROWS``, ``PADDLE_MGRAD_CPU_FP64_KERNEL``, ``PADDLE_MGRAD_CUDA_BIAS``:
tests change them at run time); it validates them again there and fails with an error, never
a crash.

This module imports nothing but the standard library and :mod:`.errors`.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .errors import EnvError, FlagError

__all__ = ["Knob", "KNOBS", "get", "raw", "problems", "check", "EnvError"]

PREFIX = "PADDLE_MGRAD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _boolean(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE or t == "":
        return False
    raise ValueError


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t == "":
            return values[0]
        if t not in values:
            raise ValueError
        return t

    return parse


#: the C++ op's widening chunks: rows x (K + N) x 4 bytes per chunk, so 2^24 rows is already
#: far beyond any memory budget; larger values (up to 2^63) overflowed the chunk count.
MAX_CHUNK_ROWS = 1 << 24


def _chunk_rows(text: str) -> Optional[int]:
    t = text.strip()
    if t == "":
        return None  # empty: the default (what the C++ op does with it too)
    if not (t.isascii() and t.isdigit()):  # no sign, no spaces inside, no exponent
        raise ValueError
    v = int(t)
    if not 1 <= v <= MAX_CHUNK_ROWS:
        raise ValueError
    return v


def _path(text: str) -> Optional[str]:
    if text.strip() == "":
        return None  # set but empty: the default, as for every other knob here
    return os.path.expanduser(text)


#: what ``PADDLE_MGRAD`` accepts (comma-separated features, ``all``; ``0``/empty = off)
ACTIVATION_VALUES = ("recompute", "fused_linear", "all", "0")


def parse_activation(value) -> dict:
    """Parse a ``PADDLE_MGRAD`` value into ``{"recompute": bool, "fused_linear": bool}``.

    ``recompute``, ``fused_linear``, both comma-separated (spaces and case
    ignored), ``all`` (both); ``None``, empty or ``0``: nothing.  Anything else
    raises :class:`~paddle_mgrad.FlagError` with a one-line message.
    """
    out = {"recompute": False, "fused_linear": False}
    text = (value or "").strip().lower()
    if text in ("", "0"):
        return out
    for item in (part.strip() for part in text.split(",")):
        if item == "all":
            out.update(recompute=True, fused_linear=True)
        elif item in out:
            out[item] = True
        else:
            raise FlagError(
                f"PADDLE_MGRAD={value!r}: unknown value {item!r}; allowed: recompute, fused_linear "
                "(comma-separated), all, or 0/empty for off"
            )
    return out


#: the named recompute policies (:mod:`paddle_mgrad.recomputation.policy`), and the variable
#: every recompute call without ``policy=`` reads
RECOMPUTE_POLICIES = ("full", "gemm")
RECOMPUTE_POLICY = "PADDLE_MGRAD_RECOMPUTE_POLICY"


def parse_recompute_policy(text: str, what: str = "the policy") -> str:
    """A recompute policy's name from its text: ``full`` or ``gemm`` (spaces and case ignored;
    empty: ``full``), or ``save:<pattern>[,<pattern>...]`` (spaces around each pattern
    ignored, case kept: class names are compared as written); anything else raises ValueError
    naming ``what`` and the accepted names."""
    text = text.strip()
    if text[:7].lower() == "budget:":
        try:
            fraction = float(text[7:])
        except ValueError:
            fraction = -1.0
        if not 0.0 <= fraction <= 1.0:  # (nan fails too)
            raise ValueError(
                f"{what}: budget: takes a fraction from 0 to 1 of the bytes the "
                "recompute blocks hold without recompute (budget:0.5)"
            )
        return f"budget:{fraction:g}"
    if text[:5].lower() == "save:":
        patterns = [p.strip() for p in text[5:].split(",")]
        if not all(patterns):
            raise ValueError(
                f"{what}: save: takes one or more comma-separated patterns "
                "(globs of sublayer class names or attribute paths: "
                "save:*MLP, save:self_attn,mlp)"
            )
        return "save:" + ",".join(patterns)
    name = text.lower() or "full"
    if name not in RECOMPUTE_POLICIES:
        raise ValueError(
            f"{what}: unknown recompute policy; accepted: "
            f"{', '.join(RECOMPUTE_POLICIES)}, save:<pattern>[,<pattern>...], "
            "budget:<fraction>"
        )
    return name


def save_patterns(name: str) -> Tuple[str, ...]:
    """The patterns of a parsed ``save:`` policy name."""
    return tuple(name[5:].split(","))


def budget_fraction(name: str) -> float:
    """The fraction of a parsed ``budget:`` policy name."""
    return float(name[7:])


@dataclass(frozen=True)
class Knob:
    name: str
    accepted: str  # what the error message lists
    parse: Callable[[str], object]  # text -> value; raises ValueError (or FlagError)
    default: object  # the value when unset
    doc: str


KNOBS: Tuple[Knob, ...] = (
    Knob(
        "PADDLE_MGRAD",
        "recompute, fused_linear (comma-separated), all, or 0/empty for off",
        parse_activation,
        None,
        "switch paddle_mgrad on in every process of this environment (the .pth hook)",
    ),
    Knob(
        "PADDLE_MGRAD_OPS",
        "auto (default) or python",
        _choice("auto", "python"),
        "auto",
        "python: force the pure-Paddle fallback of the fused weight-gradient op",
    ),
    Knob(
        "PADDLE_MGRAD_NO_CUDA",
        "0/1 (or true/false, yes/no, on/off)",
        _boolean,
        False,
        "1: build the op without its CUDA part on a CUDA Paddle",
    ),
    Knob(
        "PADDLE_MGRAD_NO_ONEDNN",
        "0/1 (or true/false, yes/no, on/off)",
        _boolean,
        False,
        "1: build the CPU op with its portable OpenMP GEMM instead of Paddle's oneDNN",
    ),
    Knob(
        "PADDLE_MGRAD_BUILD_OPS",
        "0/1 (or true/false, yes/no, on/off)",
        _boolean,
        False,
        "1 at pip install time: compile the op ahead of time into the wheel",
    ),
    Knob(
        "PADDLE_MGRAD_CACHE",
        "a directory path",
        _path,
        None,
        "where JIT builds of the op are cached (default ~/.cache/paddle_mgrad)",
    ),
    Knob(
        "PADDLE_MGRAD_TRUST_SHARED_CACHE",
        "0/1 (or true/false, yes/no, on/off)",
        _boolean,
        False,
        "1: load op builds from a cache other users can write (warns; see the Security docs)",
    ),
    Knob(
        "PADDLE_MGRAD_CPU_BF16",
        "auto (default), native or widen",
        _choice("auto", "native", "widen"),
        "auto",
        "how bf16 inputs run on the CPU: oneDNN's bf16 GEMM or widen to fp32 + fp32 GEMM",
    ),
    Knob(
        "PADDLE_MGRAD_CPU_CHUNK_ROWS",
        f"an integer from 1 to {MAX_CHUNK_ROWS}",
        _chunk_rows,
        None,
        "rows per chunk when the CPU op widens bf16/fp16 to fp32 (default: by budget)",
    ),
    Knob(
        "PADDLE_MGRAD_CPU_FP64_KERNEL",
        "auto (default) or generic",
        _choice("auto", "generic"),
        "auto",
        "generic: force the portable fp64 micro-kernel of the CPU op",
    ),
    Knob(
        "PADDLE_MGRAD_CUDA_BIAS",
        "auto (default), epilogue or kernel",
        _choice("auto", "epilogue", "kernel"),
        "auto",
        "how the CUDA op computes the bias gradient: cuBLASLt's epilogue fused into the GEMM "
        "where it applies and costs the GEMM nothing, else the deterministic kernel (auto), only "
        "the epilogue (epilogue), or only the kernel (kernel)",
    ),
    Knob(
        "PADDLE_MGRAD_DETERMINISM_CHECK",
        "shapes (default), values or none",
        _choice("shapes", "values", "none"),
        "shapes",
        "how recomputation is checked against the forward pass",
    ),
    Knob(
        RECOMPUTE_POLICY,
        "full (default), gemm, save:<pattern>[,<pattern>...] or budget:<fraction>",
        parse_recompute_policy,
        "full",
        "what recompute keeps from the forward instead of recomputing, for every "
        "recompute call without policy= (Paddle's own included): full keeps nothing, gemm "
        "keeps every fused linear's output, save:<pattern> does not recompute the sublayers "
        "whose class name or attribute path matches (a glob: save:*MLP), budget:<fraction> "
        "keeps the sublayers and linear outputs that spare the most replay time measured in "
        "the first calls, so that the blocks alive at once hold that fraction of what they hold "
        "without recompute",
    ),
    Knob(
        "PADDLE_MGRAD_REPORT",
        "a directory path",
        _path,
        None,
        "write one JSON report per process at exit (what was on, the counters)",
    ),
    Knob(
        "PADDLE_MGRAD_NOX_FREE_VENVS",
        "0/1",
        _boolean,
        False,
        "noxfile only: delete each session's virtualenv once it passes (CI disk)",
    ),
)
_BY_NAME: Dict[str, Knob] = {k.name: k for k in KNOBS}


def raw(name: str, environ=None) -> Optional[str]:
    """The variable's text, or None when unset."""
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a paddle_mgrad environment variable")
    return (os.environ if environ is None else environ).get(name)


def _message(knob: Knob, text: str) -> str:
    return f"{knob.name}={text!r} is not valid; accepted: {knob.accepted}"


def get(name: str, environ=None):
    """The parsed value of ``name`` (its default when unset); raises :class:`EnvError`
    naming the variable and the accepted values when the text is not valid."""
    knob = _BY_NAME[name]
    text = raw(name, environ)
    if text is None:
        return knob.default
    try:
        return knob.parse(text)
    except ValueError as e:
        # PADDLE_MGRAD's own parser (parse_activation) already names the bad item
        raise EnvError(str(e) if knob.name == PREFIX else _message(knob, text)) from None


def problems(environ=None) -> List[Tuple[str, str]]:
    """``[(kind, message)]`` for this environment: kind ``"invalid"`` (a known variable with a
    value it does not accept) or ``"unknown"`` (a ``PADDLE_MGRAD_*`` name we do not read, with
    the closest known name)."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(n for n in env if n == PREFIX or n.startswith(PREFIX + "_")):
        if name in _BY_NAME:
            try:
                get(name, env)
            except EnvError as e:
                out.append(("invalid", str(e)))
        else:
            close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            out.append(("unknown", f"{name} is not a paddle_mgrad variable (ignored){hint}"))
    return out


def check(environ=None) -> None:
    """Raise one :class:`EnvError` listing every invalid variable (unknown names are not
    errors: see :func:`problems`)."""
    bad = [msg for kind, msg in problems(environ) if kind == "invalid"]
    if bad:
        raise EnvError("; ".join(bad))

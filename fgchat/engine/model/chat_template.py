"""Chat templates compiled like transformers compiles them, in a jinja2 sandbox bounded in output
and time while it renders (a template is code from the model repo).

Invariants:
- no value a template builds through an operation that multiplies its inputs (padding, replace,
  format, join, repetition, concatenation, indent, batch fill, ...) passes TEMPLATE_MAX_CHARS: its
  size is predicted from the arguments and the operation is refused BEFORE the value is built;
- every other call's and filter's result is checked after it is built (those grow their inputs
  by a small factor at most, and their inputs are bounded);
- a container is turned into text (output, `~`, string filters, format arguments) only when its
  text is known to stay within the bound, so shared references cannot multiply a repr;
- everything `{{ }}` emits in one render, buffered or not, is counted (_MAX_EMITTED);
- the template's own code reads the clock every _TRACE_EVERY lines, so a loop that builds
  nothing is stopped after TEMPLATE_MAX_SECONDS.
"""

from __future__ import annotations

import inspect
import json
import re
import string
import sys
import threading
import time
from datetime import datetime
from functools import wraps
from typing import Any, Callable

TEMPLATE_MAX_CHARS = 4_000_000  # rendered text (about a million tokens)
TEMPLATE_MAX_SECONDS = 2.0
TEMPLATE_MAX_BITS = 65_536  # integers a template computes
_TRACE_EVERY = 4096  # line events between clock reads
_MAX_FILL = 100_000  # batch/slice counts (jinja's sandbox allows range() this long)
# Everything `{{ }}` emits in one render, including what macros and `{% set %}` blocks buffer.
_MAX_EMITTED = 4 * TEMPLATE_MAX_CHARS
_RENDER = threading.local()  # per render: .emitted


class TemplateBudgetError(Exception):
    """A chat template exceeded TEMPLATE_MAX_CHARS, TEMPLATE_MAX_BITS or TEMPLATE_MAX_SECONDS."""


def _refuse_over(size: int, what: str) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise TemplateBudgetError(f"{what} would pass {TEMPLATE_MAX_CHARS:,} characters")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _parts(value: Any) -> list[Any] | None:
    """The values a container's text is made of (None for a leaf)."""
    from jinja2.utils import Namespace

    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, Namespace):
        return [object.__getattribute__(value, "_Namespace__attrs")]
    return None


def _leaf_size(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value) + 3
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    return 24  # floats, None, Undefined, loop objects, functions: short reprs


def _text_size(value: Any, limit: int = TEMPLATE_MAX_CHARS) -> int:
    """An upper estimate of len(str(value)) computed without building it, capped at limit + 1.
    Each container is measured once however often it is referenced (a repr repeats it, so the
    estimate counts it at each reference), and a container inside itself counts as short."""
    if (top := _parts(value)) is None:
        return _leaf_size(value)
    over = limit + 1
    sizes: dict[int, int] = {}  # id -> size of containers measured
    pending: dict[int, tuple[int, list[Any]]] = {}  # id -> (size of its leaves, its containers)
    stack = [value]
    while stack:
        v = stack[-1]
        if id(v) in sizes:
            stack.pop()
        elif id(v) in pending:  # its containers are measured (or open: a cycle)
            stack.pop()
            leaves, inner = pending.pop(id(v))
            sizes[id(v)] = min(leaves + sum(sizes.get(id(c), 5) for c in inner), over)
        else:
            parts = top if v is value else _parts(v) or []
            leaves, inner = 2 + 2 * len(parts), []
            for p in parts:
                if _parts(p) is None:
                    leaves += _leaf_size(p)
                    if leaves > limit:
                        break
                else:
                    inner.append(p)
            if leaves > limit:
                sizes[id(v)] = over
                stack.pop()
                continue
            pending[id(v)] = (leaves, inner)
            stack.extend(c for c in inner if id(c) not in sizes and id(c) not in pending)
    return sizes[id(value)]


def _refuse_text_over(value: Any, what: str) -> None:
    if not isinstance(value, str):
        _refuse_over(_text_size(value), what)


# ---------------------------------------------------------------- predicted sizes
_SPEC_NUMBER = re.compile(r"\d+")
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _widest_int(values: Any) -> int:
    return max([v for v in values if isinstance(v, int)], default=0)


def _printf_size(fmt: str | bytes, args: Any) -> int:
    """`fmt % args`: the literal text, the arguments' text and every width or precision given."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    fmt_text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    size = len(fmt_text) + sum(_text_size(v) for v in values)
    for spec in _PRINTF_SPEC.finditer(fmt_text):
        for part in spec.groups():
            size += _widest_int(values) if part == "*" else int(part) if part else 0
    return size


def _format_size(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """`fmt.format(...)`: the literal text, the arguments' text and every number in a field's spec
    (a nested `{}` in a spec may take any integer argument)."""
    values = [*args, *kwargs.values()]
    size = len(fmt) + sum(_text_size(v) for v in values)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return size  # format() itself raises its error
    for _literal, _field, spec, _conv in fields:
        if spec:
            size += _widest_int(values) if "{" in spec else sum(int(n) for n in _SPEC_NUMBER.findall(spec))
    return size


def _replaced_size(s: Any, old: Any, new: Any, count: Any) -> int:
    try:
        hits = s.count(old) if len(old) else len(s) + 1
        growth = len(new) - len(old)
    except TypeError:
        return 0  # replace() itself raises its error
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(growth, 0)


def _join_size(sep: Any, items: list[Any]) -> int:
    return sum(_text_size(x) for x in items) + _size(sep) * max(len(items) - 1, 0)


# A str/bytes method's predicted result size: (self, args, kwargs) -> size. join's argument
# arrives as a list (BoundedEnvironment.call measures what it joins).
_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda s, a, k: max(len(s), _int((a or [k.get("width")])[0])),
    "ljust": lambda s, a, k: max(len(s), _int((a or [k.get("width")])[0])),
    "rjust": lambda s, a, k: max(len(s), _int((a or [k.get("width")])[0])),
    "zfill": lambda s, a, k: max(len(s), _int((a or [k.get("width")])[0])),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _int((a or [k.get("tabsize", 8)])[0]),
    "replace": lambda s, a, k: _replaced_size(s, *(list(a) + [None, None])[:2], (list(a) + [-1] * 3)[2]),
    "join": lambda s, a, k: _join_size(s, a[0]) if a else 0,
    "translate": lambda s, a, k: len(s) * max([_size(v) for v in (a[0].values() if a and isinstance(a[0], dict) else [])] + [1]),
    "format": lambda s, a, k: _format_size(s, a, k) if isinstance(s, str) else 0,
    "format_map": lambda s, a, k: _format_size(s, (), a[0]) if isinstance(s, str) and a and isinstance(a[0], dict) else 0,
}


# A filter's predicted result size from its bound arguments (names as jinja2 declares them);
# a predictor may replace an iterable argument with a list it measured.
def _measured_items(a: dict[str, Any], key: str, env: Any) -> list[Any]:
    """The iterable argument `key` as a list (its `attribute` applied), put back into `a`."""
    from jinja2.filters import make_attrgetter

    items = list(a[key])
    if a.get("attribute") is not None:
        items = list(map(make_attrgetter(env, a["attribute"]), items))
        a["attribute"] = None
    a[key] = items
    return items


def _join_filter(a: dict[str, Any], env: Any) -> int:
    return _join_size(a["d"], _measured_items(a, "value", env))


def _sum_filter(a: dict[str, Any], env: Any) -> int:
    items = _measured_items(a, "iterable", env)
    if isinstance(a["start"], (int, float)):
        return 0  # a number
    return _text_size(a["start"]) + sum(_text_size(x) for x in items)


def _fill_count(n: Any, what: str) -> int:
    if isinstance(n, int) and n > _MAX_FILL:
        raise TemplateBudgetError(f"{what} above {_MAX_FILL:,}")
    return 0


def _lines(s: Any) -> int:
    return str(s).count("\n") + 1


_FILTER_SIZES: dict[str, Callable[[dict[str, Any], Any], int]] = {
    "center": lambda a, env: max(_text_size(a["value"]), _int(a["width"])),
    "indent": lambda a, env: _text_size(a["s"]) + _lines(a["s"]) * (_int(a["width"]) or _size(a["width"])),
    "format": lambda a, env: _printf_size(str(a["value"]), a["kwargs"] or a["args"]),
    "replace": lambda a, env: _replaced_size(str(a["s"]), str(a["old"]), str(a["new"]), a["count"]),
    "join": _join_filter,
    "sum": _sum_filter,
    "batch": lambda a, env: _fill_count(a["linecount"], "a batch size") if a["fill_with"] is not None else 0,
    "slice": lambda a, env: _fill_count(a["slices"], "a slice count"),
    "wordwrap": lambda a, env: _text_size(a["s"]) * (1 + _size(a["wrapstring"])),
    "tojson": lambda a, env: _text_size(a["x"]) * (1 + _int(a["indent"]) + _size(a["indent"])),
    "lipsum": lambda a, env: _int(a["n"]) * _int(a["max"]) * 16,
}
# Filters that read a container without turning it into text.
_CONTAINER_FILTERS = frozenset(
    "attr batch count d default dictsort first groupby items join last length list map max min random "
    "reject rejectattr reverse select selectattr slice sort sum unique".split()
)


def _bounded(name: str, func: Callable[..., Any], env: Any, what: str = "") -> Callable[..., Any]:
    """`func` (a filter or global) refusing results over the bound: predicted before the call where
    _FILTER_SIZES knows how, checked after it otherwise."""
    if getattr(func, "jinja_async_variant", False):
        func = func.__wrapped__  # the sync filter (this environment is not async)
    signature = inspect.signature(func)
    predict = _FILTER_SIZES.get(name)
    what = what or f"the {name} filter"

    @wraps(func)  # keeps jinja2's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [v for v in bound.arguments.values() if not _is_jinja_context(v)]
        if name not in _CONTAINER_FILTERS and values:
            _refuse_text_over(values[0], f"{what}'s input")
        if predict is not None:
            _refuse_over(predict(bound.arguments, env), what)
        result = func(*bound.args, **bound.kwargs)
        _refuse_over(_size(result), what)
        return result

    return bounded


def _is_jinja_context(value: Any) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (Environment, EvalContext, Context))


def _bounded_join(join: Callable[[Any], str]) -> Callable[[Any], str]:
    """`~` and block bodies: the parts' text is measured before it is joined."""

    def bounded(seq: Any) -> str:
        parts = list(seq)
        _refuse_over(sum(_text_size(p) for p in parts), "a concatenation")
        return join(parts)

    return bounded


# ---------------------------------------------------------------- rendering
def render_bounded(template: Any, context: dict[str, Any]) -> str:
    """Render with the output size and time bounded: the output is read chunk by chunk, and a
    line tracer on the template's own code (the compiled template is Python) reads the clock every
    _TRACE_EVERY lines, so a loop that outputs nothing is stopped too. Tracing is per thread."""
    deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count % _TRACE_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateBudgetError(f"it ran longer than {TEMPLATE_MAX_SECONDS:g} s")
        return tracer

    def scope(frame: Any, event: str, arg: Any) -> Any:  # trace template code only
        return tracer if frame.f_code.co_filename == "<template>" else None

    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(scope)
    _RENDER.emitted = 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > TEMPLATE_MAX_CHARS:
                raise TemplateBudgetError(f"its output passed {TEMPLATE_MAX_CHARS:,} characters")
            parts.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(parts)


def compile_template(source: str) -> Any:
    """Compile like transformers does: sandboxed, trim_blocks + lstrip_blocks, loopcontrols,
    a non-escaping tojson, raise_exception and strftime_now; bounded as the module says.
    Raises jinja2.TemplateError on a template that does not parse."""
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])
        concat = staticmethod(_bounded_join("".join))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(right, (int, float)) and abs(right) > 64:
                    raise TemplateBudgetError("an exponent above 64")
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > TEMPLATE_MAX_BITS:
                    raise TemplateBudgetError(f"a power above {TEMPLATE_MAX_BITS:,} bits")
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                        if (_size(seq) if isinstance(seq, (str, bytes)) else _text_size(seq)) * n > TEMPLATE_MAX_CHARS:
                            raise TemplateBudgetError(f"a repetition passed {TEMPLATE_MAX_CHARS:,} items")
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > TEMPLATE_MAX_BITS:
                    raise TemplateBudgetError(f"a product above {TEMPLATE_MAX_BITS:,} bits")
            elif operator == "%" and isinstance(left, (str, bytes)):
                _refuse_over(_printf_size(left, right), "a % format")
            elif operator == "+" and isinstance(left, (str, bytes, list, tuple)):
                _refuse_over(_text_size(left) + _text_size(right), "a concatenation")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            owner = getattr(method, "__self__", None)
            name = getattr(method, "__name__", "a call")
            if isinstance(owner, (str, bytes)) and (predict := _METHOD_SIZES.get(name)) is not None:
                if name == "join" and args:
                    args = (list(args[0]), *args[1:])
                _refuse_over(predict(owner, args, kwargs), f"{name}()")
            result = super().call(__context, __obj, *args, **kwargs)
            _refuse_over(_size(result), f"{name}()")
            return result

    def finalize(value: Any) -> Any:
        size = len(value) if isinstance(value, str) else _text_size(value)
        _refuse_over(size, "an output")
        _RENDER.emitted += size
        if _RENDER.emitted > _MAX_EMITTED:
            raise TemplateBudgetError(f"its output and buffers passed {_MAX_EMITTED:,} characters")
        return value

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols], finalize=finalize)
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded(name, f, env) for name, f in env.filters.items()}
    env.globals["lipsum"] = _bounded("lipsum", env.globals["lipsum"], env, "lipsum()")
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    namespace = template.root_render_func.__globals__  # the compiled module's names, shared by its blocks and macros
    for join in ("str_join", "markup_join"):
        if join in namespace:
            namespace[join] = _bounded_join(namespace[join])
    return template

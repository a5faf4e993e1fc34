"""What runs in a compile child (forked by the supervisor, grammar/compiler.py, for one compile):
limit itself, compile with xgrammar, send one answer, exit. Answers: `("done", serialized)`,
`("failed", status, message)`, or `("oom",)` when it ran out of its memory share (the supervisor
says which share, or moves a quick-lane compile to a worker)."""
from __future__ import annotations

import json
import os
import re
import resource
import signal
from multiprocessing.connection import Connection

from .limits import JSON_OBJECT_SCHEMA, GrammarLimits, GrammarRefused

MIB = 1 << 20
# xgrammar's internal checks ("Check failed: (cond) is false: what"): the condition is no user's business
_CHECK_FAILED = re.compile(r"^Check failed: \(.*\) is false: ")
_REPETITION = re.compile(r"Invalid repetition range \{(-?\d+), (-?\d+)\}")
_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")     # "[14:29:10] /project/cpp/x.cc:94: "


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL when the parent goes (and at once if it already went)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def child_main(writer: Connection, info, kind: str, text: str, limits: GrammarLimits, memory: int,
               cpu_s: int) -> None:
    """In the forked child: limit this process, compile, send one answer, exit without cleanup."""
    code = 0
    try:
        die_with_parent(os.getppid())
        _limit_self(memory, cpu_s)
        writer.send(("done", compile_text(info, kind, text, limits)))
    except GrammarRefused as exc:
        writer.send(("failed", exc.status, str(exc)))
    except MemoryError:
        writer.send(("oom",))
    except Exception as exc:        # noqa: BLE001  (any compiler error is this grammar's)
        writer.send(("oom",) if "bad_alloc" in str(exc) else ("failed", 400, compiler_message(exc)))
    except BaseException:           # noqa: BLE001  (never return into the supervisor's loop)
        code = 1
    finally:
        os._exit(code)


def _limit_self(memory: int, cpu_s: int) -> None:
    """An address-space limit of what this process maps now plus `memory`, and a CPU limit
    (SIGXCPU at `cpu_s`, SIGKILL a second later)."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))


def memory_message(limits: GrammarLimits) -> str:
    return (f"Compiling the grammar needed more than its {limits.memory_per_compile // MIB} MiB of memory "
            f"(--grammar-memory / --grammar-compile-workers); simplify the constraint.")


def compile_text(info, kind: str, text: str, limits: GrammarLimits) -> str:
    """Compile `text` of `kind` (StructuredOutputs.key) for `info`; the serialized result."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    # NOTE: compact JSON (no free whitespace): small models otherwise loop on newlines and indents
    if kind == "json":
        compiled = compiler.compile_json_schema(text, any_whitespace=False)
    elif kind == "json_object":
        compiled = compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
    elif kind == "regex":
        compiled = compiler.compile_regex(text)
    elif kind == "choice":
        compiled = compiler.compile_grammar(choice_ebnf(json.loads(text)))
    else:
        compiled = compiler.compile_grammar(text)
    _check_not_empty(xgr, compiled, info)
    data = compiled.serialize_json()
    if len(data) > limits.cache_memory:
        raise GrammarRefused(f"The compiled grammar is {len(data) // MIB} MiB, more than this server keeps for one "
                             f"({limits.cache_memory // MIB} MiB, --grammar-cache-memory); simplify the constraint.")
    return data


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _check_not_empty(xgr, compiled, info) -> None:
    """A grammar whose first step allows no token of the vocabulary can never produce output."""
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits)
    if not bits.any():
        raise GrammarRefused("The constraint allows no token of this model's vocabulary (its language is empty "
                             "for this tokenizer); fix the constraint.")


def compiler_message(exc: BaseException) -> str:
    """One sentence for an error of the grammar compiler: its own words without source locations,
    and its internal checks said as what the user wrote wrong."""
    line = first_line(exc)
    repetition = _REPETITION.search(line)
    if repetition:
        low, high = repetition.groups()
        return (f"The constraint's repetition range {{{low}, {high}}} is invalid: a count is above 2147483647 "
                f"(it wrapped around) or the lower bound is above the upper one; use smaller counts.")
    return f"The grammar compiler rejected the constraint: {_CHECK_FAILED.sub('', line)}"


def first_line(exc: BaseException) -> str:
    """The message of a backend error, without its C++ source location."""
    lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
    line = next((t for t in lines if _LOCATION.match(t)), lines[0] if lines else type(exc).__name__)
    return _LOCATION.sub("", line)[:300].rstrip(".") + "."

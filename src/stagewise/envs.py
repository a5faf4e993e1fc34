"""Every `STAGEWISE_*` environment variable, typed, with its default and meaning (vLLM's envs.py
pattern). Values are read when asked for (`envs.STAGEWISE_CACHE`), never at import, so a variable
set after `import stagewise` counts; nothing else in stagewise reads `os.environ` for one of them.
docs/environment.md is checked against `VARIABLES` by tests/test_docs.py.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

KERNEL_MODES = ("auto", "required", "off")
KERNEL_ISAS = ("native", "avx2", "portable")


@dataclass(frozen=True)
class Variable:
    """One variable: how the docs show it, and how its text becomes a value."""
    name: str
    kind: str                            # what it holds, as the docs say it
    default: str                         # its default, as the docs say it
    meaning: str
    parse: Callable[[str | None], Any]   # the raw value (None: unset) -> the typed value
    internal: bool = False               # set by stagewise for its own child processes, not by users


def _cache(raw: str | None) -> Path:
    return Path(raw) if raw else Path.home() / ".cache" / "stagewise"


def _kernels(raw: str | None) -> str:
    # NOTE: the older spelling STAGEWISE_CPU_KERNELS=0 wins, as it always did
    if os.environ.get("STAGEWISE_CPU_KERNELS", "1") == "0":
        return "off"
    value = (raw or "auto").strip().lower() or "auto"
    if value not in KERNEL_MODES:
        raise ValueError(f"STAGEWISE_KERNELS must be one of {', '.join(KERNEL_MODES)}, got {raw!r}.")
    return value


def _kernel_isa(raw: str | None) -> str:
    value = (raw or "native").strip().lower() or "native"
    if value not in KERNEL_ISAS:
        raise ValueError(f"STAGEWISE_KERNEL_ISA must be one of {', '.join(KERNEL_ISAS)}, got {raw!r}.")
    return value


def _on_unless_zero(raw: str | None) -> bool:
    return raw != "0"


def _text(raw: str | None) -> str | None:
    return raw or None


def _on_if_set(raw: str | None) -> bool:
    return (raw or "").strip() not in ("", "0")


def _malloc(raw: str | None) -> str:
    value = (raw or "auto").strip() or "auto"
    if value not in ("auto", "system") and not value.startswith("/"):
        raise ValueError(f"STAGEWISE_MALLOC must be auto, system or the absolute path of an allocator library, "
                         f"got {raw!r}.")
    return value


def _nice(raw: str | None) -> int:
    text = (raw or "5").strip() or "5"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"STAGEWISE_HTTP_NICE must be a whole number from 0 to 19, got {raw!r}.") from None
    if not 0 <= value <= 19:
        raise ValueError(f"STAGEWISE_HTTP_NICE must be a whole number from 0 to 19, got {raw!r}.")
    return value


VARIABLES: tuple[Variable, ...] = (
    Variable("STAGEWISE_CACHE", "path", "`~/.cache/stagewise`",
             "the cache directory: the default model (`models/`), the demo model, tokenizers built from GGUF "
             "files, built kernels (`kernels/`), Inductor's compiled graphs (`inductor/`)", _cache),
    Variable("STAGEWISE_KERNELS", "`auto` \\| `required` \\| `off`", "`auto`",
             "the C kernels: `auto` uses them and falls back to PyTorch's ops (one log line) where one cannot be "
             "built; `required` makes that an error, as is a build missing an instruction set the CPU has (CI "
             "sets it); `off` runs PyTorch's ops everywhere", _kernels),
    Variable("STAGEWISE_KERNEL_ISA", "`native` \\| `avx2` \\| `portable`", "`native`",
             "the instruction set the C kernels are built for: `native` this CPU's (`-march=native`); `avx2` "
             "x86-64-v3 (AVX2, FMA, F16C: no AVX-512, no AMX) and `portable` the x86-64 baseline (no AVX), each "
             "as on a CPU that has no more, for testing every build on one machine ([Kernels](kernels.md)); "
             "a build this CPU cannot run fails as any build does", _kernel_isa),
    Variable("STAGEWISE_CPU_KERNELS", "`0`", "unset",
             "the older spelling of `STAGEWISE_KERNELS=off` (wins when set to `0`)", _on_unless_zero),
    Variable("STAGEWISE_PACKED_WEIGHTS", "`0`", "unset (packed)",
             "`0` keeps linear weights in the checkpoint layout instead of prepacking them for the CPU kernels",
             _on_unless_zero),
    Variable("STAGEWISE_PIN_THREADS", "`1`", "unset (not pinned)",
             "`1` pins each CPU stage's OpenMP threads to its slice of the affinity mask; off by default because a "
             "pinned thread cannot leave a core another process keeps busy ([Performance](performance.md))",
             _on_if_set),
    Variable("STAGEWISE_KEEP_AWAKE", "`0`", "unset (kept awake)",
             "`0` starts no keeper threads: a CPU stage's idle CPUs may then halt within a step, and each parallel "
             "region pays their wake-up ([Performance](performance.md))", _on_unless_zero),
    Variable("STAGEWISE_ADAPT_THREADS", "`0`", "unset (adapted)",
             "`0` runs every step of a CPU stage on all its torch threads; by default a step of up to 32 rows "
             "runs torch on one thread where every linear layer is quantized (their C kernels split over the "
             "stage's kernel team anyway), or where the model's matrices are small (under 2 MiB each on "
             "average) ([Memory and threads](memory-threads.md))", _on_unless_zero),
    Variable("STAGEWISE_MALLOC", "`auto` \\| `system` \\| path", "`auto`",
             "the command line's memory allocator: `auto` re-executes it once with tcmalloc (or jemalloc) preloaded "
             "where the machine has one (5-10% faster CPU steps than glibc's malloc), `system` keeps glibc's "
             "malloc, a path preloads that library ([Memory and threads](memory-threads.md))", _malloc),
    Variable("STAGEWISE_BALANCE_MICRO_BATCHES", "`0`", "unset (balanced)",
             "benchmark lever: `0` fills the plans in flight first come first served instead of splitting the "
             "decode batch evenly over them ([Pipelines](pipelines.md))", _on_unless_zero),
    Variable("STAGEWISE_HTTP_NICE", "0-19", "`5`",
             "how much lower than the engine the server's HTTP threads run (`nice`), so their bursts wait for an "
             "idle CPU instead of preempting the engine mid-step; `0`: the same priority", _nice),
    Variable("STAGEWISE_API_KEY", "text", "unset",
             "the server's API key when `--api-key` is not given (several keys: comma-separated)", _text),
    Variable("STAGEWISE_CLUSTER_TOKEN", "text", "unset",
             "the secret every node of a pipeline proves on each of its connections when `--cluster-token` is not "
             "given (docs/security.md); one machine without it: a random one per pipeline", _text),
    Variable("STAGEWISE_TEST_CRASH_TOKEN", "`TOKEN[@STAGE]`", "unset",
             "test hook: that stage (default: the last) SIGKILLs itself whenever a plan brings it a request whose "
             "tokens contain `TOKEN` (recovery tests); never set it in production", _text),
    Variable("STAGEWISE_DIST_IFNAME", "`MASTER_ADDR=IFNAME`", "unset",
             "the network interface a node chose, handed to its stage processes", _text, internal=True),
)

_BY_NAME = {v.name: v for v in VARIABLES}

if TYPE_CHECKING:
    STAGEWISE_CACHE: Path
    STAGEWISE_KERNELS: str
    STAGEWISE_KERNEL_ISA: str
    STAGEWISE_CPU_KERNELS: bool
    STAGEWISE_PACKED_WEIGHTS: bool
    STAGEWISE_PIN_THREADS: bool
    STAGEWISE_KEEP_AWAKE: bool
    STAGEWISE_ADAPT_THREADS: bool
    STAGEWISE_MALLOC: str
    STAGEWISE_BALANCE_MICRO_BATCHES: bool
    STAGEWISE_HTTP_NICE: int
    STAGEWISE_API_KEY: str | None
    STAGEWISE_CLUSTER_TOKEN: str | None
    STAGEWISE_TEST_CRASH_TOKEN: str | None
    STAGEWISE_DIST_IFNAME: str | None


def __getattr__(name: str) -> Any:
    """`envs.<name>`: the variable's value now, parsed (a bad value raises ValueError)."""
    var = _BY_NAME.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.parse(os.environ.get(name))


def value_in(name: str, environ: Mapping[str, str]) -> Any:
    """A variable's value in another environment (a child process's), parsed."""
    return _BY_NAME[name].parse(environ.get(name))


def __dir__() -> list[str]:
    return sorted([*globals(), *_BY_NAME])

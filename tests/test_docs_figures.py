"""Measured numbers live in benchmarks/RESULTS.md only: README.md and docs/*.md quote a measured
figure only as RESULTS.md holds it (same number, same unit), or say it in words and link there.

A figure is a number with a unit of time, speed, ratio, share or size, in prose, tables and example
output alike. It is a setting, not a measurement, when it is inside inline code (a value the reader
types), when its clause (the text between `. ; : ( ) |`) says it is one (SETTING_WORDS: "default
60 s", "a 10 s timeout", "at most 1 MiB"), in a table row under a header naming a default or a limit,
in a code block unless it is a time or a speed (what one types, and the sizes and shares a command
works out, are not measured), or where NOT_MEASURED below names it with the reason (a constant of
the code, a fact of a file). Everything else must be found in RESULTS.md.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

_UNIT = (r"ms/token|tok/s|tokens/s|GB/s|GMAC/s|ms|us|µs|sec|seconds?|minutes?|min|hours?|%|×|x|"
         r"MiB|GiB|KiB|MB|GB|KB")
_NUM = r"\d[\d,]*(?:\.\d+)?(?:\s*[-–]\s*\d[\d,]*(?:\.\d+)?)?"
FIGURE = re.compile(rf"(?<![\w.,/-])({_NUM})(?:\s?({_UNIT})|\s(s))(?![\w/])(?!\s*\d)")
TIME_OR_SPEED = re.compile(r"ms/token|tok/s|tokens/s|ms|us|µs|s|sec|seconds?|minutes?|min|hours?")
SETTING_WORDS = re.compile(r"\bdefault(?!\s+model)|\blimits?\b|\bat most\b|\bat least\b|\bup to\b|timeout|"
                           r"≤|\btarget\b|\bbudget\b|\bmargin\b|\bfixed\b|\bconstant\b|--[a-z]", re.I)
CLAUSE_END = re.compile(r"[;:()|]|\.(?=\s|$)")

# (page, the figure as written, why it is a setting or a fact of a file, not a measurement)
_TEAM = "a constant of the kernel team (kernels/csrc/team.c)"
_HEARTBEAT = "a node taken for gone after this silence: SILENT_S, a constant (executor/generations.py)"
NOT_MEASURED = {
    ("README.md", "1 GB"): "triton's installed size, a fact of that package",
    ("README.md", "93 MB"): "the default model's file size, a fact of the file",
    ("install.md", "93 MB"): "the default model's file size, a fact of the file",
    ("memory-threads.md", "92 MiB"): "the default model's weights as its file stores them",
    ("memory-threads.md", "90%"): "CUDA_UTILIZATION, the plan's share of a GPU (runtime/memory.py)",
    ("memory-threads.md", "1 KiB"): "glibc malloc's threshold for merging freed chunks, a constant of glibc",
    ("memory-threads.md", "2 ms"): _TEAM, ("kernels.md", "2 ms"): _TEAM, ("performance.md", "2 ms"): _TEAM,
    ("memory-threads.md", "48 KiB"): _TEAM, ("performance.md", "200 us"): _TEAM,
    ("kv-cache.md", "256 MiB"): "QUEUE_BYTES, the disk writer's queue bound (kvcache/disk_tier.py)",
    ("kv-cache.md", "64 KiB"): "the size of a fingerprint's sample pieces (kvcache/disk_tier.py)",
    ("pipelines.md", "256 MiB"): "STAGE_RUNTIME_BYTES, a constant of the memory plan (runtime/memory.py)",
    ("pipelines.md", "320 MiB"): "DRIVER_RUNTIME_BYTES, a constant of the memory plan (runtime/memory.py)",
    ("pipelines.md", "50 ms"): "SPEED_PROBE_S, how long a node's speed probe runs (runtime/cluster_plan.py)",
    ("pipelines.md", "300 s"): "how long a node waits for the others at the rendezvous, a constant",
    ("pipelines.md", "2 GiB"): "the memory of the example's nodes, given on its command line",
    ("pipelines.md", "1.2 GiB"): "the memory of the example's nodes, given on its command line",
    ("pipelines.md", "700 MiB"): "the memory of the example's nodes, given on its command line",
    ("pipelines.md", "1.5 s"): _HEARTBEAT, ("deployment.md", "1.5 s"): _HEARTBEAT,
    ("recovery.md", "1.5 s"): _HEARTBEAT,
    ("recovery.md", "5 s"): "how long after a rebuild's first token the new spares start, a constant",
    ("quantization.md", "3–4×"): "Q4_K_M's bits per weight against bf16's 16, a fact of the format",
    ("quantization.md", "1.02–1.03×"): "the panels' layout against the file's blocks, a fact of the layout",
    ("serving.md", "50 ms"): "BUSY_PUBLISH_S, how often the core publishes stats (core/core.py)",
    ("serving.md", "5.2 s"): "an example of the message's wording",
    ("serving.md", "20 s"): "an example of the message's wording",
}


def _normal(text: str) -> str:
    text = text.replace("–", "-").replace("—", "-").replace("×", "x").replace("µs", "us").replace("\u202f", " ")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    return re.sub(r"(?<=\d) (?=[a-zA-Z%])", "", text).replace("tokens/s", "tok/s")


def _paragraphs(page: Path):
    """Prose paragraphs joined across their line breaks; each table row and code line on its own,
    a table row with its table's header row."""
    block: list[str] = []
    header = None
    in_code = False
    for line in page.read_text().splitlines() + [""]:
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith("|"):
            if block:
                yield " ".join(block), None, False
                block = []
            if line.startswith("|") and header is None:
                header = line
            yield line, (header if line.startswith("|") else None), in_code
            continue
        header = None
        if line.strip():
            block.append(line)
        elif block:
            yield " ".join(block), None, False
            block = []


def _clause(text: str, at: int) -> str:
    starts = [m.end() for m in CLAUSE_END.finditer(text, 0, at)]
    end = CLAUSE_END.search(text, at)
    return text[starts[-1] if starts else 0:end.start() if end else len(text)]


def measured_figures(page: Path):
    """The figures of a page that its wording does not mark as settings."""
    for text, header, in_code in _paragraphs(page):
        if header and re.search(r"\b(default|limit)\b", header, re.I):
            continue
        code = [m.span() for m in re.finditer(r"`[^`]*`", text)]
        for m in FIGURE.finditer(text):
            if any(a <= m.start() < b for a, b in code) or SETTING_WORDS.search(_clause(text, m.start())):
                continue
            if in_code and not TIME_OR_SPEED.fullmatch(m.group(2) or m.group(3)):
                continue
            if (page.name, m.group(0)) not in NOT_MEASURED:
                yield m.group(0)


def _in_results(figure: str, results: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(_normal(figure))}(?![\d])", results) is not None


def test_every_measured_figure_in_the_docs_is_in_results():
    results = _normal(RESULTS.read_text())
    missing = [f"{page.relative_to(ROOT)}: {figure}"
               for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
               for figure in measured_figures(page) if not _in_results(figure, results)]
    assert not missing, ("these figures read as measurements but benchmarks/RESULTS.md does not hold them; "
                         "quote RESULTS.md or link to its section:\n" + "\n".join(missing))

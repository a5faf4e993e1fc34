"""The hostile battery's requests and probes: constraints and fields an attacker or a careless
client sends (each with the statuses it may get), plain requests and /health timed meanwhile, and
the memory of the server's processes (PSS, so forked compile children are not counted twice)."""
from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from http_checks import httpx

from benchmarks.server_process import descendants, process_parents

C, CHAT, GEN, RESP = "/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
PLAIN = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
OK, REFUSED, TIMED_OUT, NOT_FOUND = {200}, {400}, {408}, {404}
BOUNDED = {400, 408}                      # refused for its memory or its time, whichever ran out first
MIB = 1 << 20
IDS = [3 + (i * 37) % 900 for i in range(480)]      # a prompt of token ids near the tiny model's context


def deep_schema(levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@dataclass(frozen=True)
class Attack:
    name: str
    path: str
    body: dict
    allowed: set[int]
    long_only: bool = False               # heavy enough to be only in the release run
    leave: bool = False                   # a stream the client leaves after its first event


def catalogue(salt: str = "") -> list[Attack]:
    """The battery; `salt` varies the constraints that compile (so repeats are not cache hits)."""
    s = salt
    return [
        # a grammar that finished must finish its row (this killed the engine)
        Attack("ignore_eos+choice", C, {"prompt": "hello", "max_tokens": 20, "ignore_eos": True,
                                        "structured_outputs": {"choice": ["a" + s]}}, OK),
        Attack("ignore_eos+json_object stream", CHAT, {"messages": MSG, "max_tokens": 40, "ignore_eos": True,
                                                       "stream": True, "response_format": {"type": "json_object"}},
               OK),
        Attack("ignore_eos+regex stream", C, {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True,
                                              "structured_outputs": {"regex": "[0-9]{2}" + s}}, OK),
        Attack("ignore_eos+grammar /generate", GEN, {"text": "hello", "sampling_params": {
            "max_tokens": 20, "ignore_eos": True, "structured_outputs": {"grammar": f'root ::= "({s}" [a-c] ")"'}}},
            OK),
        # amplification: n x constrained rows
        Attack("n=16 x 200-item array", C, {"prompt": "list:", "max_tokens": 24, "n": 16, "structured_outputs": {
            "json": {"type": "array", "minItems": 200, "items": {"enum": ["x", "y" + s]}}}}, OK),
        # amplification: a prompt's logprob entries repeated in each of n choices
        Attack("echo+prompt_logprobs 4 prompts x n=16", C, {"prompt": [IDS, IDS[1:], IDS[2:], IDS[3:]], "n": 16,
                                                          "echo": True, "logprobs": 20, "prompt_logprobs": 20,
                                                          "max_tokens": 1}, REFUSED),
        Attack("prompt_logprobs 4 prompts x n=16 (45 MB)", C, {"prompt": [IDS, IDS[1:], IDS[2:], IDS[3:]], "n": 16,
                                                             "prompt_logprobs": 20, "max_tokens": 1}, OK,
               long_only=True),
        # grammar work that stalled or killed the server
        Attack("schema 800 deep (as a string)", CHAT, {"messages": MSG, "max_tokens": 8, "structured_outputs": {
            "json": json.dumps(deep_schema(800))}}, REFUSED),
        Attack("schema 200 deep, 4 prompts x n=16", C, {"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 4,
                                                       "structured_outputs": {"json": json.dumps(deep_schema(200))}},
               REFUSED),
        Attack("regex 100 KB", CHAT, {"messages": MSG, "max_tokens": 8,
                                      "structured_outputs": {"regex": "a*" * 50000}}, REFUSED),
        Attack("regex 60 KB", C, {"prompt": "hi", "max_tokens": 8, "structured_outputs": {"regex": s + "a*" * 30000}},
               BOUNDED),
        Attack("regex a* x 1000 (minutes of CPU)", C, {"prompt": "hi", "max_tokens": 8,
                                                      "structured_outputs": {"regex": s + "a*" * 1000}}, TIMED_OUT),
        Attack("choice of 100k items", C, {"prompt": "hi", "max_tokens": 8, "structured_outputs": {
            "choice": [f"c{i}" for i in range(100_000)]}}, REFUSED),
        Attack("EBNF a* x 1000", GEN, {"text": "hi", "sampling_params": {"max_tokens": 8, "structured_outputs": {
            "grammar": f'root ::= "{s}" ' + '"a"* ' * 1000}}}, BOUNDED | OK, long_only=True),
        Attack("choice of one 60 KB item", C, {"prompt": "hi", "max_tokens": 8, "structured_outputs": {
            "choice": [s + "ab" * 30000]}}, BOUNDED | OK, long_only=True),
        Attack("1000 alternatives", C, {"prompt": "hi", "max_tokens": 8, "structured_outputs": {
            "grammar": "root ::= " + " | ".join(f'"{s}w{i}"' for i in range(1000))}}, BOUNDED | OK, long_only=True),
        # clients that leave mid-stream: their requests end, their blocks are freed
        Attack("leaves mid-stream", C, {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True},
               OK, leave=True),
        Attack("leaves a constrained stream", CHAT, {"messages": MSG, "max_tokens": 200, "ignore_eos": True,
                                                     "stream": True, "structured_outputs": {"regex": s + "[a-z]+"}},
               OK, leave=True),
        # malformed fields: a 4xx naming them, never a 500
        Attack("negative minLength", C, {"prompt": "hi", "structured_outputs": {
            "json": {"type": "string", "minLength": -1}}}, REFUSED),
        Attack("empty language", C, {"prompt": "hi", "structured_outputs": {
            "grammar": "root ::= [^\\x00-\\U0010FFFF]"}}, REFUSED),
        Attack("allowed_token_ids disjoint", C, {"prompt": "hi", "max_tokens": 8, "allowed_token_ids": [5],
                                                 "structured_outputs": {"choice": ["zzzz" + s]}}, REFUSED),
        Attack("min_tokens past every choice", C, {"prompt": "hi", "min_tokens": 3, "structured_outputs": {
            "choice": ["a", "b" + s]}}, REFUSED),
        Attack("unknown model", C, {"model": "gpt-4o", "prompt": "hi"}, NOT_FOUND),
        Attack("logit_bias not a token id", C, {"prompt": "hi", "logit_bias": {"²": 1}}, REFUSED),
        Attack("Responses empty input", RESP, {"input": ""}, REFUSED),
    ]


def distinct_schema(rng: random.Random) -> dict:
    """A small schema no one sent before (the unbounded-cache attack)."""
    return {"type": "object", "properties": {f"k{rng.getrandbits(48)}": {"type": "integer"}}}


def send(client, url: str, attack: Attack) -> tuple[int, float]:
    """(status, seconds) of one request; a stream that sends an error event counts as 500, a request
    that got no answer (a dropped connection, a client timeout) as -1."""
    t0 = time.perf_counter()
    try:
        if not attack.body.get("stream"):
            return client.post(url + attack.path, json=attack.body).status_code, time.perf_counter() - t0
        with client.stream("POST", url + attack.path, json=attack.body) as r:
            status = r.status_code
            for line in r.iter_lines():
                if status == 200 and line.startswith('data: {"error"'):
                    status = 500
                if attack.leave and line.startswith("data: "):
                    break                                 # closing the stream leaves
        return status, time.perf_counter() - t0
    except httpx.HTTPError:
        return -1, time.perf_counter() - t0


@dataclass
class Probe:
    """/health and plain completions, each in a thread of its own, timed until `stop()`."""
    url: str
    health_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Probe":
        self._threads = [threading.Thread(target=self._health, daemon=True),
                         threading.Thread(target=self._plain, daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _health(self) -> None:
        with httpx.Client(timeout=30) as client:
            client.get(self.url + "/health")                 # connect first: time only the answer
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = client.get(self.url + "/health")
                self.health_s.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    self.failures.append(f"/health {r.status_code}")
                time.sleep(0.02)

    def _plain(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = client.post(self.url + C, json=PLAIN)
                self.plain_s.append(time.perf_counter() - t0)
                if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "length":
                    self.failures.append(f"plain {r.status_code} {r.text[:200]}")
                time.sleep(0.05)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def processes(server_pid: int) -> tuple[int | None, int | None, list[int]]:
    """(the engine process, the grammar compile supervisor, its compile children) below the server."""
    tree = process_parents()
    engine = next((p for p, parent in tree.items() if parent == server_pid and "spawn_main" in _cmdline(p)), None)
    supervisor = next((p for p, parent in tree.items() if parent == engine and _is_supervisor(p)), None)
    children = [p for p, parent in tree.items() if supervisor is not None and parent == supervisor]
    return engine, supervisor, children


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_supervisor(pid: int) -> bool:
    return "stagewise.grammar.compiler" in _cmdline(pid)


def pss_bytes(pid: int | None) -> int:
    """Proportional set size of one process (0 once gone)."""
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss_bytes(server_pid: int) -> int:
    return sum(pss_bytes(p) for p in [server_pid, *descendants(server_pid)])


@dataclass
class MemoryWatch:
    """Peak PSS of the engine process and of the whole server tree, sampled every 0.2 s."""
    server_pid: int
    engine_peak: int = 0
    tree_peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "MemoryWatch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            engine, _, _ = processes(self.server_pid)
            self.engine_peak = max(self.engine_peak, pss_bytes(engine))
            self.tree_peak = max(self.tree_peak, tree_pss_bytes(self.server_pid))
            time.sleep(0.2)

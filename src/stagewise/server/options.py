"""What a server is started with beyond the engine config: where it listens, the served model
name, the API key, the request size limit and the timeouts. Imports nothing heavy, so the CLI
builds the server flags from it (each field carries its help text)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import envs
from ..config import flag, parse_size

DEFAULT_MAX_REQUEST_BYTES = 2 << 20     # a 128K-token prompt fits twice as token ids, four times as text
DEFAULT_GRACEFUL_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 20.0
# about 70 bytes of JSON each: 1Mi entries answer a 128K-token prompt scored with top-5 logprobs
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20
API_KEY_ENV = "STAGEWISE_API_KEY"
CACHE_ISOLATION_CHOICES = ("shared", "api-key")
EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ServerOptions:
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "port to listen on")
    served_model_name: str | None = flag(None, "the model name clients see and send (default: the checkpoint's "
                                         "base name)")
    api_key: str | None = flag(None, f"require 'Authorization: Bearer KEY' on /v1/*, /generate, /tokenize and "
                               f"/detokenize; several keys (one per tenant): KEY1,KEY2 (default: ${API_KEY_ENV}, "
                               f"else none)")
    max_request_bytes: int = flag(DEFAULT_MAX_REQUEST_BYTES, "largest request body, e.g. 16MiB; larger ones get 413",
                                  size=True)
    graceful_timeout_s: float = flag(DEFAULT_GRACEFUL_TIMEOUT_S, "on SIGINT/SIGTERM, seconds open requests may "
                                     "finish before they are cut", flag="--graceful-timeout")
    body_timeout_s: float = flag(DEFAULT_BODY_TIMEOUT_S, "seconds a client may take to send a request body; "
                                 "slower ones get 408", flag="--body-timeout")
    allowed_hosts: tuple[str, ...] | None = flag(None, "Host header names accepted besides loopback ones, e.g. "
                                                 "api.example.com (a reverse proxy's); '*': any. Bound to a "
                                                 "loopback address, other Hosts get 421 (DNS rebinding)")
    cache_isolation: str = flag("shared", "shared: requests share the prefix cache unless they name a cache_salt; "
                                "api-key: each API key gets its own cache namespace (a request's cache_salt "
                                "subdivides it), for multi-tenant servers")
    trust_request_chat_template: bool = flag(False, "accept a chat_template in requests (vLLM's flag; templates "
                                             "run sandboxed, but can be slow)")
    default_max_tokens: int | None = flag(None, "max_tokens of a request that sets none (default: 16 on "
                                          "/v1/completions and /generate, the rest of the context on chat and "
                                          "responses), capped at this")
    max_tokens_limit: int | None = flag(None, "the largest max_tokens a request may ask for; more gets 400 "
                                        "(default: what the context holds)")
    max_waiting_requests: int | None = flag(None, "the most sequences (prompts x n of each request) that may wait "
                                            "for the engine (being read, tokenized or queued, not yet "
                                            "generating); more get 429 with Retry-After (default: no limit)")
    max_waiting_requests_per_key: int | None = flag(None, "with --api-key, the most sequences (prompts x n) one key "
                                                    "may have waiting (being read, tokenized or queued, not yet "
                                                    "generating); more get 429 with Retry-After, so one tenant "
                                                    "cannot hold the queue (default: with several keys and "
                                                    "--max-waiting-requests, an equal share of it; else no limit)")
    max_logprob_entries: int = flag(DEFAULT_MAX_LOGPROB_ENTRIES, "the most prompt logprob entries one response "
                                    "may carry (prompt tokens x (1 + top-n), for every choice that shows them); "
                                    "more gets 400")
    tool_call_parser: str | None = flag(None, "how tool calls are read from text for tool_choice auto: hermes, "
                                        "llama3_json or harmony (default: the model family's)")
    distributed_executor_backend: str = flag("mp", "how the pipeline's other nodes start: mp (stagewise's own "
                                             "processes; you start the other nodes with --node-rank, by hand, in a "
                                             "LeaderWorkerSet or under Slurm) or ray (this server places them on a "
                                             "running Ray cluster's nodes and starts them there; docs/deployment.md)")
    ray_address: str | None = flag(None, "the Ray cluster of --distributed-executor-backend ray, HOST:PORT of its "
                                   "head (default: $RAY_ADDRESS, else auto: the cluster this machine belongs to)")

    def __post_init__(self):
        object.__setattr__(self, "max_request_bytes", parse_size(self.max_request_bytes, "max_request_bytes"))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if not self.graceful_timeout_s >= 0:
            raise ValueError(f"graceful_timeout must be a number of seconds >= 0, got {self.graceful_timeout_s}.")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout must be a number of seconds > 0, got {self.body_timeout_s}.")
        for name in ("default_max_tokens", "max_tokens_limit", "max_logprob_entries",
                     "max_waiting_requests", "max_waiting_requests_per_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}.")
        if self.tool_call_parser not in (None, "hermes", "llama3_json", "harmony"):
            raise ValueError(f"tool_call_parser must be hermes, llama3_json or harmony, got "
                             f"{self.tool_call_parser!r}.")
        if self.api_key is not None and not all(k.strip() for k in self.api_key.split(",")):
            raise ValueError("api_key is empty (or lists an empty key); give non-empty keys or leave it out.")
        if self.max_waiting_requests_per_key is not None and not self.api_key:
            raise ValueError("max_waiting_requests_per_key limits each API key: give the keys with --api-key "
                             "KEY1,KEY2 (or leave it out and use --max-waiting-requests).")
        if self.cache_isolation not in CACHE_ISOLATION_CHOICES:
            raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION_CHOICES)}, got "
                             f"{self.cache_isolation!r}.")
        if self.allowed_hosts is not None:
            hosts = self.allowed_hosts.split(",") if isinstance(self.allowed_hosts, str) else self.allowed_hosts
            names = tuple(h.strip().lower().rstrip(".") for item in hosts for h in str(item).split(","))
            if not all(names):
                raise ValueError("allowed_hosts lists an empty name; give host names such as api.example.com.")
            object.__setattr__(self, "allowed_hosts", names)

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.api_key.split(",")) if self.api_key else ()


def served_name_for(model_path: str | None) -> str:
    """The name clients see: the checkpoint directory's (or GGUF file's) base name, never its path."""
    name = Path(str(model_path or "").rstrip("/\\")).name
    return name or "stagewise"


def api_key_from_env() -> str | None:
    return envs.STAGEWISE_API_KEY

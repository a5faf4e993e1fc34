"""Server fixtures: a `python -m stagewise serve` subprocess on 127.0.0.1 and a free port, waited
for through /health with a bounded timeout and always killed in the finalizer; plus the offline
`LLM` on the same checkpoint as the oracle for greedy results."""
from __future__ import annotations

from pathlib import Path

import launcher
import pytest

try:
    import httpx2 as httpx
except ImportError:          # the openai client ships httpx2 here; plain httpx elsewhere
    import httpx

STARTUP_TIMEOUT_S = 120.0


class ServerProcess(launcher.ServerProcess):
    """The shared launcher plus /metrics readers for assertions."""

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        super().wait_healthy(timeout_s)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        out = {}
        for line in text.split("\n"):         # label values may hold U+2028 and friends
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric over the series matching `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total


def start_server(model_dir: Path, tmp_dir: Path, *args: str) -> ServerProcess:
    server = ServerProcess(model_dir, tmp_dir / "server.log", *args)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session", autouse=True)
def early_pp_server(request, tmp_path_factory):
    """Boot the PP=2 server in the background at session start when a selected test needs it, so its
    start-up (stage processes, model load) overlaps the other tests. `pp_server` waits for it."""
    import importlib.util
    wanted = any("pp_server" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted or importlib.util.find_spec("stagewise.executor.multiproc") is None:
        yield None
        return
    srv = ServerProcess(request.getfixturevalue("llama_dir"), tmp_path_factory.mktemp("pp-server") / "server.log",
                        "--pp-size", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def launch():
    """`launch(model_dir, tmp_dir, *flags)` -> a healthy ServerProcess; the caller stops it."""
    return start_server


@pytest.fixture(scope="session")
def server(llama_dir, tmp_path_factory):
    """One server for every test that does not need special flags (starting one costs seconds)."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def scratch_server(llama_dir, tmp_path_factory):
    """A server for tests that try to break it (fuzzing, extreme sampling values), so a failure
    there never takes down the server the other tests share."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("scratch-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def offline(llama_dir):
    """The offline engine on the same checkpoint (the oracle for greedy results)."""
    from stagewise import LLM
    llm = LLM(model=str(llama_dir))
    yield llm
    llm.shutdown()


TENANT_KEYS = ("key-a", "key-b")


@pytest.fixture(scope="session")
def tenant_server(llama_dir, tmp_path_factory):
    """A multi-tenant server: two API keys with a cache namespace each, a reverse proxy's Host name
    allowed, request chat templates trusted, and (emulated) prefill and decode graphs, so every panel
    of the Grafana dashboard has series to show."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("tenant-server"), "--api-key", ",".join(TENANT_KEYS),
                       "--cache-isolation", "api-key", "--allowed-hosts", "proxy.example",
                       "--trust-request-chat-template", "--prefill-graph", "breakable", "--decode-graph",
                       "--prefill-graph-max-tokens", "64", "--decode-graph-max-bs", "8")
    yield srv
    srv.stop()

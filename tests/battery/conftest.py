"""The battery's server: one `stagewise serve` child on the tiny Llama (the server tests' launcher),
with CI's short grammar budget (2 s of CPU per compile) or, under `--long`, the defaults."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))     # launcher, http_checks
import launcher  # noqa: E402

SHORT_BUDGET = ("--grammar-compile-timeout-s", "2")


@pytest.fixture(scope="session")
def long_run(request) -> bool:
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="module")
def battery_server(llama_dir, tmp_path_factory, long_run):
    srv = launcher.ServerProcess(llama_dir, tmp_path_factory.mktemp("battery") / "server.log",
                                 *(() if long_run else SHORT_BUDGET))
    try:
        srv.wait_healthy(120)
        yield srv
    finally:
        srv.stop()

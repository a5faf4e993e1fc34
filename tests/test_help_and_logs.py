"""What the command line and the start-up log tell a user: `--version`, `--log-level` on either side
of the command, how a pipeline's partition was chosen, and how to opt in to graphs under PP."""
import logging

import pytest

from stagewise.cli import build_parser, main
from stagewise.config import EngineConfig
from stagewise.engine import engine as engine_mod
from stagewise.graph.policy import resolve_graph_policy
from stagewise.recovery import supervisor as supervisor_mod


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("stagewise ")


def test_log_level_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["plan"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "error", "plan"]).log_level == "ERROR"
    assert parser.parse_args(["plan", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "serve", "--log-level", "warning"]).log_level == "WARNING"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--log-level", "loud"])


class _Stop(Exception):
    pass


def _no_executor(*args, **kwargs):
    raise _Stop


@pytest.mark.parametrize("partition, logged", [("auto", "partition: auto"), ("even", "partition: even"),
                                               ("1,3", "partition: explicit: 1,3")])
def test_a_pipeline_logs_how_its_partition_was_chosen(llama_dir, monkeypatch, caplog, partition, logged):
    monkeypatch.setattr(supervisor_mod, "make_executor", _no_executor)     # everything before the stages start
    config = EngineConfig.from_kwargs(model=str(llama_dir), pp_size=2, pp_layer_partition=partition,
                                      prefill_graph="off")
    with caplog.at_level(logging.INFO, logger="stagewise"), pytest.raises(_Stop):
        engine_mod.Engine(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partition: ")]
    assert len(lines) == 1 and lines[0].startswith(logged), lines


def test_graphs_under_pp_suggest_what_pays_on_the_device():
    cpu = resolve_graph_policy("auto", pp_size=2, device_type="cpu")
    cuda = resolve_graph_policy("auto", pp_size=2, device_type="cuda")
    assert cpu.backend == cuda.backend == "off"
    assert any("--prefill-graph compiled" in line for line in cpu.log_lines), cpu.log_lines
    assert any("--prefill-graph breakable" in line for line in cuda.log_lines), cuda.log_lines


def test_a_headless_node_names_its_stages_and_layers(llama_dir):
    from stagewise.executor.generations import _stages_text
    config = EngineConfig.from_kwargs(model=str(llama_dir), pp_size=2, nnodes=2, node_rank=1, master_port=29500,
                          pp_layer_partition="1,3")
    assert _stages_text(config, str(llama_dir), [1]) == "stage(s) 1 (layers 1-3)"

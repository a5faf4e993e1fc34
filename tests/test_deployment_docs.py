"""docs/deployment.md: the LeaderWorkerSet manifest and the Slurm script start valid pipelines.

Every `stagewise ...` command they run is parsed by stagewise's own parser (exact flag names: no
abbreviations) and built into its EngineConfig and ServerOptions, after the environment variables
it uses are replaced by sample values; nothing is started."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from stagewise.cli import build_parser, engine_config_of
from stagewise.cli_flags import values_of
from stagewise.config import EngineConfig
from stagewise.server.options import ServerOptions

DOC = Path(__file__).resolve().parent.parent / "docs" / "deployment.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# what each variable the commands use holds at run time (LWS's and Slurm's documented names)
SAMPLES = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "stagewise-0.stagewise.default",
           "SLURM_NODEID": "1", "SLURM_PROCID": "1", "MASTER_ADDR": "node001"}


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(DOC.read_text()) if tag == lang]


def _manifest() -> list[dict]:
    docs = [d for body in _blocks("yaml") for d in yaml.safe_load_all(body) if d]
    assert docs, "docs/deployment.md has no YAML block"
    return docs


def _slurm_script() -> str:
    scripts = [body for body in _blocks("bash") if "#SBATCH" in body]
    assert len(scripts) == 1, "docs/deployment.md needs one bash block with #SBATCH lines"
    return scripts[0]


def _commands(argv: list[str]) -> list[list[str]]:
    """The `stagewise` command one simple command runs, also through `sh -c` / `bash -c` (unexpanded)."""
    for i, word in enumerate(argv):
        if word in ("sh", "bash") and argv[i + 1:i + 2] == ["-c"]:
            return _shell_commands(argv[i + 2])
        if word == "stagewise" or word.endswith("/stagewise"):
            return [argv[i + 1:]]
    return []


def _shell_commands(script: str) -> list[list[str]]:
    """The `stagewise` commands a shell script runs: its simple commands (split at newlines, `;`,
    `&&`, `||`, `|`, `&` outside quotes) that are one, or that run one through `sh -c`."""
    separators = ";&|\n"
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=separators)
    lexer.whitespace, lexer.whitespace_split, lexer.commenters = " \t\r", True, "#"
    found, simple = [], []
    for token in [*lexer, "\n"]:
        if token and set(token) <= set(separators):
            found += _commands(simple)
            simple = []
        else:
            simple.append(token)
    return found


def _expand(argv: list[str]) -> list[str]:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in SAMPLES, f"the command uses ${name}, which this test does not know: {argv}"
        return SAMPLES[name]
    return [VAR.sub(value, word) for word in argv]


def _exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser, its commands' parsers refusing abbreviated flags (a misspelt one fails)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.allow_abbrev = False
    return parser


def _parse(argv: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    """A documented command as stagewise would read it, or the test fails with argparse's sentence."""
    try:
        args = _exact(build_parser()).parse_args(_expand(argv))
    except SystemExit:
        pytest.fail(f"not a valid stagewise command (see the error above): stagewise {shlex.join(argv)}")
    assert args.command == "serve", argv
    ServerOptions(**values_of(ServerOptions, args))
    return args, engine_config_of(args)


def _flag(argv: list[str], name: str) -> str:
    """A flag's raw (unexpanded) value: `--name V` or `--name=V`."""
    for i, word in enumerate(argv):
        if word == name:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} missing from stagewise {shlex.join(argv)}")


def _container(template: dict) -> dict:
    containers = template["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _container_commands(template: dict) -> list[list[str]]:
    container = _container(template)
    commands = _commands(list(container.get("command", [])) + list(container.get("args", [])))
    assert len(commands) == 1, f"one stagewise command per container, got {commands}"
    return commands


def test_the_documented_commands_parse_and_a_misspelt_flag_fails():
    lws = next(d for d in _manifest() if d["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    commands = (_container_commands(template["leaderTemplate"]) + _container_commands(template["workerTemplate"])
                + _shell_commands(_slurm_script()))
    assert len(commands) == 3
    for argv in commands:
        _parse(argv)
    bad = [w.replace("--min-nodes", "--min-node") for w in commands[0]]   # an abbreviation argparse would take
    with pytest.raises(pytest.fail.Exception):
        _parse(bad)
    with pytest.raises(pytest.fail.Exception):
        _parse([w.replace("--node-rank", "--node-rnak") for w in commands[0]])


def test_the_leader_worker_set_starts_one_pipeline_per_group():
    docs = _manifest()
    lws = next(d for d in docs if d.get("kind") == "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    # LWS's default (RecreateGroupOnPodRestart) would restart the whole pipeline for one pod
    assert template["restartPolicy"] == "None"
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    configs = {}
    for role in ("leaderTemplate", "workerTemplate"):
        container = _container(template[role])
        env = {e["name"]: e for e in container["env"]}
        ref = env["STAGEWISE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert re.search(rf"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=",
                         DOC.read_text()), f"docs/deployment.md does not create secret {ref}"
        (argv,) = _container_commands(template[role])
        assert "--cluster-token" not in " ".join(argv)            # the secret stays out of `ps`
        assert re.fullmatch(r"\$\{?LWS_WORKER_INDEX\}?", _flag(argv, "--node-rank"))
        assert re.fullmatch(r"\$\{?LWS_LEADER_ADDRESS\}?", _flag(argv, "--master-addr"))
        _, config = _parse(argv)
        assert config.cluster.nnodes == size and config.parallel.pp_size % size == 0
        assert config.cluster.min_nodes is not None and config.cluster.min_nodes < size
        configs[role] = config.replace(node_rank=0)
    assert configs["leaderTemplate"] == configs["workerTemplate"], "every node runs the same command line"

    leader = _container(template["leaderTemplate"])
    args, _ = _parse(_container_commands(template["leaderTemplate"])[0])
    assert args.host == "0.0.0.0"
    probe = leader["readinessProbe"]["httpGet"]
    ports = {p.get("name"): p["containerPort"] for p in leader["ports"]}
    assert probe["path"] == "/health" and ports.get(probe["port"], probe["port"]) == args.port

    service = next(d for d in docs if d.get("kind") == "Service")
    assert [p["port"] for p in service["spec"]["ports"]] == [args.port]
    selector = service["spec"]["selector"]
    labels = {LWS_NAME_LABEL: lws["metadata"]["name"]}
    leader_labels = {**labels, **template["leaderTemplate"].get("metadata", {}).get("labels", {})}
    worker_labels = {**labels, **template["workerTemplate"].get("metadata", {}).get("labels", {})}
    assert selector.items() <= leader_labels.items(), "the Service selects the leaders"
    assert not selector.items() <= worker_labels.items(), "the Service must not send clients to workers"


def test_the_slurm_script_starts_one_node_per_task():
    script = _slurm_script()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M).group(1))
    srun = " ".join(line for line in script.replace("\\\n", " ").splitlines() if line.lstrip().startswith("srun"))
    assert "--kill-on-bad-exit=0" in srun and "--ntasks-per-node=1" in srun
    assert "torchrun" not in script
    assert re.search(r'^MASTER_ADDR=\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST" \| head -n1\)$', script, re.M)
    assert re.search(r"^export MASTER_ADDR\b", script, re.M)
    assert "STAGEWISE_CLUSTER_TOKEN" in script
    (argv,) = _shell_commands(script)
    assert "--cluster-token" not in " ".join(argv)
    assert re.fullmatch(r"\$\{?SLURM_(NODEID|PROCID)\}?", _flag(argv, "--node-rank"))
    assert re.fullmatch(r"\$\{?MASTER_ADDR\}?", _flag(argv, "--master-addr"))
    # each task expands its own rank: the command is in single quotes, not expanded by the batch shell
    assert re.search(r"'[^']*--node-rank \"?\$\{?SLURM_(NODEID|PROCID)\b[^']*'", script)
    _, config = _parse(argv)
    assert config.cluster.nnodes == nodes and config.parallel.pp_size % nodes == 0
    assert config.cluster.min_nodes is not None and config.cluster.min_nodes < nodes


def test_the_ray_cluster_runs_the_leader_on_the_head_with_the_ray_backend():
    """KubeRay: the head container starts Ray (KubeRay's own command, which the annotation hands it)
    and then the leader with the Ray backend; the workers run Ray alone; one node per stage at most."""
    cluster = next(d for d in _manifest() if d.get("kind") == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = _container(cluster["spec"]["headGroupSpec"]["template"])
    script = " ".join(head["args"])
    assert re.search(r"\$\{?KUBERAY_GEN_RAY_START_CMD\}?\s*&", script), "Ray's start runs in the background"
    (argv,) = _container_commands(cluster["spec"]["headGroupSpec"]["template"])
    args, config = _parse(argv)
    options = ServerOptions(**values_of(ServerOptions, args))
    assert options.distributed_executor_backend == "ray" and args.host == "0.0.0.0"
    assert "--nnodes" not in argv and "--node-rank" not in argv and "--cluster-token" not in " ".join(argv)
    env = {e["name"]: e for e in head["env"]}
    ref = env["STAGEWISE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert re.search(rf"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=", DOC.read_text())
    probe = head["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == args.port
    assert args.port in [p["containerPort"] for p in head["ports"]]
    workers = cluster["spec"]["workerGroupSpecs"]
    for group in workers:
        assert not _commands(list(_container(group["template"]).get("command", [])) +
                             list(_container(group["template"]).get("args", []))), "workers run Ray only"
    assert 1 + sum(g["replicas"] for g in workers) <= config.parallel.pp_size

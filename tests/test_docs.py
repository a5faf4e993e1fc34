"""The manual stays whole: every page in docs/ is in the site's nav (and every nav entry exists),
the README stays a front door whose test command is the one CI runs, and the environment-variable
page lists exactly what src/stagewise/envs.py declares. (`mkdocs build --strict` in .ci/run checks
links and anchors.)"""
import re
from pathlib import Path

from stagewise import envs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest -q'


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r":\s*(\S+\.md)\s*$", nav, flags=re.M)


def test_every_page_is_in_the_nav_and_every_entry_exists():
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    nav = _nav_pages()
    generated = {"results.md"}          # benchmarks/RESULTS.md, added by docs/hooks/results.py
    assert sorted(set(nav) - generated) == pages, "docs/ pages and the nav of mkdocs.yml differ"
    assert len(nav) == len(set(nav))


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_readme_test_command_is_what_ci_runs():
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'pip install\b.*-e "\.\[test\]"', ci) and "\npython -m pytest -q\n" in ci


def _table(internal: bool) -> str:
    rows = ["| variable | value | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.kind} | {v.default} | {v.meaning} |" for v in envs.VARIABLES if v.internal == internal]
    return "\n".join(rows)


def test_the_environment_page_is_envs_py():
    page = (DOCS / "environment.md").read_text()
    for internal in (False, True):
        assert _table(internal) in page, f"docs/environment.md lacks this table from envs.py:\n{_table(internal)}"
    listed = set(re.findall(r"^\| `(STAGEWISE_[A-Z0-9_]+)`", page, flags=re.M))
    assert listed == {v.name for v in envs.VARIABLES}


def test_every_stagewise_variable_in_the_source_is_in_envs_py():
    declared = {v.name for v in envs.VARIABLES}
    for path in sorted((ROOT / "src" / "stagewise").rglob("*.py")):
        for name in re.findall(r"\bSTAGEWISE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            assert name in declared, f"{path.relative_to(ROOT)} names {name}, which src/stagewise/envs.py lacks"


# flags of other programs that the pages show (pip, torchrun, lm_eval, docker, mkdocs, llama.cpp, our pytest,
# kubectl, Slurm's sbatch and srun, Ray's `ray start`)
FOREIGN_FLAGS = {"--index-url", "--no-deps", "--nproc-per-node", "--tasks", "--apply", "--cpus", "--cpuset-cpus",
                 "--strict", "--site-dir", "--merge", "--long", "--from-literal", "--job-name", "--nodes",
                 "--ntasks-per-node", "--exclusive", "--time", "--kill-on-bad-exit", "--wait", "--jobid", "--overlap",
                 "--ntasks", "--nodelist", "--base", "--outfile", "--outtype", "--head", "--address"}
# pages written with features that may land later (kernels.md names --quantization before it exists)
OTHER_HELPERS_PAGES = {"kernels.md", "quantization.md", "performance.md"}


def test_every_flag_the_docs_name_exists():
    from stagewise.cli import build_parser
    parser = build_parser()
    known = set(parser._option_string_actions)
    for action in parser._subparsers._group_actions:    # each command's own flags
        for sub in action.choices.values():
            known |= set(sub._option_string_actions)
    pages = [ROOT / "README.md", *(p for p in DOCS.glob("*.md") if p.name not in OTHER_HELPERS_PAGES)]
    for page in pages:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text()):
            assert flag in known | FOREIGN_FLAGS, f"{page.name} names {flag}, which no stagewise command takes"

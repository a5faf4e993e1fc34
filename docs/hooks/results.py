"""MkDocs hook: measured numbers live in benchmarks/RESULTS.md only, and the site shows that file
as its `results.md` page, with benchmarks/results/ copied beside it as is (tables, plots), so its
own links resolve. Pages link to `../benchmarks/RESULTS.md` (right when the markdown is read in the
repository); the site rewrites those links to the page.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

_LINK = re.compile(r"\]\(\.\./benchmarks/(RESULTS\.md|results/)")


class _Copied(File):
    """A file copied verbatim, never rendered (a results table in markdown stays a raw file)."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files, config):
    bench = Path(config.config_file_path).parent / "benchmarks"
    files.append(File.generated(config, "results.md", abs_src_path=str(bench / "RESULTS.md")))
    for path in sorted((bench / "results").rglob("*")):
        if path.is_file():
            rel = path.relative_to(bench).as_posix()
            files.append(_Copied(rel, str(bench), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "results.md":
        return markdown
    depth = page.file.src_uri.count("/")
    prefix = "../" * depth
    return _LINK.sub(lambda m: f"]({prefix}{'results.md' if m.group(1) == 'RESULTS.md' else 'results/'}", markdown)

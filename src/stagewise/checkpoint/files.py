"""What the driver knows about a checkpoint without building a model: its HF config, layer
count, EOS ids, context length and tokenizer, for HF safetensors directories and for GGUF files
(llama.cpp's format, whose metadata carries the config, the EOS ids and the tokenizer: `gguf_meta`).

Entry points (`LLM`, the CLI, the server) resolve the model path first (`model.source`);
the engine and `stagewise plan` then read these facts from here, so the control plane never
imports model code. Tensor reading lives in `model.loader` / `model.gguf`.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointNotFoundError
from .gguf_meta import gguf_facts, hf_config_from_gguf, tokenizer_from_gguf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
CONTENTS = (f"config.json and either {SINGLE_FILE} or {INDEX_FILE} with its shard files "
            f"(or pass a single {GGUF_SUFFIX} file)")


def require(path: Path, what: str) -> None:
    if not path.exists():
        raise CheckpointNotFoundError(f"{what} {path} does not exist; a checkpoint directory must contain {CONTENTS}.")


def gguf_file_of(model_path: str | Path) -> Path | None:
    """The GGUF file `model_path` names (a `.gguf` file, or a directory with exactly one and no
    config.json), else None."""
    path = Path(model_path)
    if path.suffix == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {path} does not exist; pass an existing {GGUF_SUFFIX} file "
                                          f"or checkpoint directory with --model.")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); pass "
                         f"one of them with --model {path / found[0].name}.")
    return found[0] if found else None


def load_hf_config(model_dir: str | Path):
    """The config of a checkpoint directory (transformers') or GGUF file (a `GGUFConfig` under the same
    attribute names, no transformers import), with clear errors for a missing/bad one."""
    gguf_path = gguf_file_of(model_dir)
    if gguf_path is not None:
        return hf_config_from_gguf(gguf_path)
    from transformers import AutoConfig
    path = Path(model_dir)
    require(path, "Model directory")
    require(path / "config.json", "Config file")
    try:
        return text_view(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"Could not read {path / 'config.json'}: {exc}") from exc


def is_vision_language(hf_config) -> bool:
    """A vision-language checkpoint's config (LLaVA-style: `vision_config` + `text_config`)."""
    return getattr(hf_config, "vision_config", None) is not None and getattr(hf_config, "text_config", None) is not None


def text_view(hf_config):
    """The config the stages and the driver plan with: for a vision-language checkpoint its text model's
    config, named by the checkpoint's architecture, with the full config kept as `multimodal_config`."""
    if not is_vision_language(hf_config):
        return hf_config
    text = hf_config.text_config
    text.architectures = list(hf_config.architectures or [])
    text.multimodal_config = hf_config
    return text


def eos_token_ids_of(model_dir: str | Path, hf_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json; for GGUF, the tokenizer's eos/eot/eom ids."""
    gguf_path = gguf_file_of(model_dir)
    if gguf_path is not None:
        meta = gguf_facts(gguf_path).meta
        ids = (meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom"))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    eos = None
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except (OSError, ValueError):
        pass
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load_tokenizer(path: str | Path):
    """The HF (fast) tokenizer of a checkpoint or tokenizer directory, or the one a GGUF file's metadata
    describes (a `saved_tokenizer.SavedTokenizer`: tokenizers and jinja2, no transformers import)."""
    gguf_path = gguf_file_of(path)
    if gguf_path is not None:
        return tokenizer_from_gguf(gguf_path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"Could not load a tokenizer from {path}: {exc}. Pass --tokenizer DIR "
                         f"or add tokenizer.json to the checkpoint.") from None

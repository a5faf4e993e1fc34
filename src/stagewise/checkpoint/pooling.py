"""How an embedding is pooled from a decoder's last hidden states: what a sentence-transformers
checkpoint says (`modules.json` naming a Pooling module, its `1_Pooling/config.json`), else the
engine's `--pooling` choice. Plain Python: the last stage reads it once."""
from __future__ import annotations

import json
from pathlib import Path

POOLINGS = ("last", "mean")
# sentence-transformers' pooling_mode_* keys -> ours (cls pooling of a decoder would read the first
# token only, which no decoder embedding model uses; it is refused like any other mode we lack)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def resolve_pooling(choice: str, model_path: str | Path) -> str:
    """`choice` (auto | last | mean) made concrete: auto reads the checkpoint's sentence-transformers
    pooling and falls back to last-token pooling (what decoder embedding models such as e5-mistral
    and Qwen3-Embedding use: the last token is the only one that has seen the whole prompt)."""
    if choice != "auto":
        return choice
    return checkpoint_pooling(Path(model_path)) or "last"


def checkpoint_pooling(model_dir: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares, or None when it declares none."""
    modules = model_dir / "modules.json"
    if not model_dir.is_dir() or not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = model_dir / module.get("path", "1_Pooling") / "config.json"
            modes = json.loads(config.read_text()) if config.is_file() else {}
            chosen = [ours for key, ours in _ST_MODES.items() if modes.get(key)]
            others = [k for k, v in modes.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
            if others or len(chosen) != 1:
                raise ValueError(f"{config} asks for pooling {others or chosen or 'none'}; stagewise pools by the "
                                 f"last token or the mean: pass --pooling last or --pooling mean.")
            return chosen[0]
    return None

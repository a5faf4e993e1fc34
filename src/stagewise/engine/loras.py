"""The driver's LoRA adapters: which names requests may run on ({name: path}) and vLLM's runtime
loads and unloads (--enable-lora-runtime-updates). A load is checked here (config, rank, the tensors'
shapes from the files' headers) against the model's facts; the stages read its weights from the same
path with the next plan, which carries the whole table (also the first plan after a pipeline
rebuild), so no request of it runs before they hold it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..checkpoint.lora_files import adapter_facts, check_shapes, parse_lora_modules
from ..errors import LoraInUseError, LoraNotFoundError
from ..request import Request

NAME_CHARS = 256


def target_shapes(facts) -> dict[str, tuple[int, int]]:
    """Each LoRA target's (in, out) features in a Llama-style model of these facts."""
    q, kv = facts.heads * facts.head_dim, facts.kv_heads * facts.head_dim
    h, i = facts.hidden, facts.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def fingerprint(name: str, path: str) -> str:
    """The adapter's name, path and its files' sizes and modification times: a changed adapter (or one
    loaded again from elsewhere) gets a new prefix-cache chain, without reading its weights."""
    root = Path(path)
    try:
        files = sorted(root.iterdir()) if root.is_dir() else [root]
        stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    except OSError:         # unreadable: the stages refuse it with a sentence naming the adapter
        stats = []
    return f"{name}\0{root.resolve()}\0{stats}"


class LoraTable:
    def __init__(self, config, facts):
        self.load_config, self.facts = config.load, facts
        self.table: dict[str, str] = parse_lora_modules(config.load.lora_modules)
        self.keys = {name: fingerprint(name, path) for name, path in self.table.items()}
        self.runtime = bool(config.load.enable_lora_runtime_updates)
        self.due = False            # the next plan carries the table

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.table)

    def key(self, name: str | None) -> str | None:
        """What roots the prefix-cache chain of a request on adapter `name` (Request.lora_key)."""
        return None if name is None else self.keys.get(name)

    def rebuilt(self) -> None:
        """A new pipeline started from the start-up adapters: send it the table as it is now."""
        self.due = self.runtime

    def take(self) -> dict[str, str] | None:
        """The table for the plan being sent, if the stages must learn it."""
        if not self.due:
            return None
        self.due = False
        return dict(self.table)

    def load(self, name: str, path: str, base_names: Iterable[str] = ()) -> None:
        """Read and check adapter `name` at `path`; ValueError (one sentence) if it cannot be served."""
        self._check_on()
        if not name or len(name) > NAME_CHARS:
            raise ValueError(f"lora_name must be 1 to {NAME_CHARS} characters.")
        if name in self.table:
            raise ValueError(f"The LoRA adapter {name!r} is already loaded; unload it first to load it again.")
        if name in base_names:
            raise ValueError(f"lora_name {name!r} is the base model's name; give the adapter another one.")
        if len(self.table) >= self.load_config.max_loras:
            raise ValueError(f"This engine already holds {len(self.table)} LoRA adapters, its --max-loras; unload "
                             f"one first (or start it with a larger --max-loras).")
        if not Path(path).exists():
            raise ValueError(f"LoRA adapter {name!r}: {path} does not exist (give a PEFT adapter directory or a GGUF "
                             f"LoRA file that the server can read).")
        path = str(Path(path).resolve())
        check_shapes(adapter_facts(name, path, self.load_config.max_lora_rank), len(self.facts.layers),
                     target_shapes(self.facts))
        self.table[name], self.keys[name] = path, fingerprint(name, path)
        self.due = True

    def unload(self, name: str, unfinished: Iterable[Request]) -> None:
        """Drop adapter `name`; refused while any of `unfinished` runs on it."""
        self._check_on()
        if name not in self.table:
            raise LoraNotFoundError(f"The LoRA adapter {name[:200]!r} is not loaded; this engine holds "
                                    f"{', '.join(self.table) or 'none'}.")
        using = sum(1 for r in unfinished if r.params.lora == name)
        if using:
            raise LoraInUseError(f"The LoRA adapter {name!r} is in use by {using} unfinished request(s); unload it "
                                 f"once they finish.")
        del self.table[name], self.keys[name]
        self.due = True

    def _check_on(self) -> None:
        if not self.runtime:
            raise ValueError("Runtime LoRA updates are off; start the engine with --enable-lora-runtime-updates.")

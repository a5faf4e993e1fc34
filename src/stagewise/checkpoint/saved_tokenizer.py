"""A tokenizer read from the files transformers saves for a fast tokenizer (tokenizer.json,
tokenizer_config.json, chat_template.jinja) with the `tokenizers` library and jinja2 alone.

It stands in for transformers' tokenizer where stagewise converted one itself (a GGUF file's, see
gguf_meta.py), so the process that serves the model never imports transformers. It has only what
stagewise calls on a tokenizer (encode, decode, the vocabulary, token strings, the chat template),
with transformers' semantics; tests/model/test_gguf.py checks each against transformers on the same
file. The chat template renders as transformers renders it: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, its `raise_exception`, `strftime_now`, `tojson`, `dict` and
`namespace`, the special tokens as variables, the inputs copied into plain JSON types (message keys
holding None dropped, reasoning under its three names) and its `continue_final_message`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # the first is the one templates read
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class SavedTokenizer:
    """`backend_tokenizer` (a `tokenizers.Tokenizer`), the named special tokens and the chat template
    (a string, or a dict of named templates)."""

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: str | dict[str, str] | None):
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self.model_max_length = int(1e30)      # prompt lengths are the engine's to check

    @classmethod
    def from_dir(cls, path: str | Path) -> SavedTokenizer:
        from tokenizers import Tokenizer
        path = Path(path)
        try:
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text())
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception for a damaged file
            raise ValueError(f"The tokenizer files in {path} are missing or damaged ({exc}); delete that directory "
                             f"so that the next start converts the tokenizer again.") from None
        specials = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        return cls(backend, specials, _read_chat_template(path, config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs) -> str | list[int]:
        """One conversation through the chat template, as transformers' `apply_chat_template` renders
        it; `tokenize` gives its ids (no special tokens added, the template wrote them)."""
        template = self._template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply the chat template to an empty conversation; give at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set; continue the "
                             "final message or start a new assistant message, not both.")
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"Chat messages must be dicts, but got {message!r}.")
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        text = render_chat(template, messages, tools=_tool_schemas(tools), documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, chat_template: str | None, tools: list | None) -> str:
        """transformers' choice: a template named in (or passed as) `chat_template`, else the model's;
        of several, "tool_use" when there are tools, else "default"."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"This model has several chat templates and none is the default; pass chat_template "
                             f"with one of {sorted(own)}.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("This model's tokenizer has no chat template; pass chat_template with one.")
        return own


def _token_text(value: str | dict) -> str:
    """A special token as tokenizer_config.json saves it: a string or an AddedToken's dict."""
    return value["content"] if isinstance(value, dict) else str(value)


def _read_chat_template(path: Path, config: dict) -> str | dict[str, str] | None:
    """Where transformers saves templates: chat_template.jinja and additional_chat_templates/NAME.jinja,
    or (older files) tokenizer_config.json's chat_template, a string or a list of {name, template}."""
    saved = config.get("chat_template")
    if isinstance(saved, list):
        templates = {t["name"]: t["template"] for t in saved}
    else:
        main = path / "chat_template.jinja"
        templates = {"default": main.read_text()} if main.exists() else {"default": saved} if saved else {}
        templates.update({p.stem: p.read_text() for p in sorted(path.glob("additional_chat_templates/*.jinja"))})
    if set(templates) == {"default"}:
        return templates["default"]
    return templates or None


def _tool_schemas(tools: list | None) -> list | None:
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("Tools must be given as JSON schemas (dicts).")
    return tools


def render_chat(template: str, messages: list[dict], *, tools: list | None, documents: list | None,
                add_generation_prompt: bool, continue_final_message: bool | str, **variables) -> str:
    """transformers' `render_jinja_template` for one conversation: what the template sees is a copy in
    plain JSON types; `continue_final_message` (True: the "content" field, or a field's name) tags the
    final message's text and cuts the rendering after it, so the model continues that message."""
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("Documents must be a list of dicts with 'title' and 'text' keys.")
    chat = _alias_reasoning(_plain(messages))
    final = _tag_final_message(chat, template, continue_final_message) if continue_final_message else None
    rendered = _compiled(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                          add_generation_prompt=add_generation_prompt, **_plain(variables))
    return rendered if final is None else _cut_after(rendered, final)


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by (`reasoning_content`, `thinking`)."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _tag_final_message(chat: list[dict], template: str, continue_final_message: bool | str) -> str:
    """Append CONTINUE_TAG to the text the model is to continue; returns that text (before the tag)."""
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue.')
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}", but the chat template never reads that field.')
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but the final message has no text to continue.")
        final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
        return final
    for f in fields:
        chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    return final


def _cut_after(rendered: str, final: str) -> str:
    """The rendering up to the tag (and, where the template trimmed the message's trailing space, without it)."""
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the chat template drops part of the final message, so "
                         "it cannot be continued.")
    at = rendered.rindex(CONTINUE_TAG.strip())
    return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()


def _plain(value: Any) -> Any:
    """A copy in plain JSON types, as transformers makes one: objects with methods of their own never
    reach the sandbox (anything else becomes a placeholder naming its type), and tagging the final
    message never edits the caller's."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (enums, ...) carry methods of their own: back to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):     # numpy scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):                       # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """transformers' template environment: sandboxed, trim_blocks and lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env.from_string(template)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`, with which transformers' templates mark the assistant's
    text for its training masks; without masks it renders as its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    """Templates refuse conversations they cannot render with this (the server answers 400)."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """json.dumps itself: jinja2's own tojson escapes HTML characters, which a prompt must keep."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself to reach through."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` refusing underscore-prefixed names, a way to CPython's internals."""

    def __init__(*args, **kwargs):      # jinja2's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a "
                                              f"namespace, but got {name!r}; rename the attribute.")

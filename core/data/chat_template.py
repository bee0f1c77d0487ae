"""Chat templates: the Jinja2 template of a Hugging Face tokenizer, rendered as ``transformers`` renders it.

A Hugging Face tokenizer directory carries its chat template in ``chat_template.jinja`` (newer
layout) or as ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named
templates of which ``default`` is used). :func:`load_chat_template` reads it with the
``bos_token`` and ``eos_token`` the template may refer to; :class:`ChatTemplate` renders a
conversation in jinja2's ``ImmutableSandboxedEnvironment`` with the settings of
``transformers.PreTrainedTokenizerBase.apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a ``tojson`` filter that
does not escape HTML, ``{% generation %}`` blocks), so a conversation renders to the same text.
Megatron's fixed prompt formats (``--sft-tokenizer-prompt-format``) are in :data:`PROMPT_FORMATS`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any

# Megatron's fixed SFT templates (megatron/core/tokenizers/text/libraries/sft_tokenizer.py), by
# their --sft-tokenizer-prompt-format names; "default" is the tokenizer's own template.
_NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + "
    "message['content'].strip() + '\\n' }}{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\\n' + "
    "message['content'].strip() + '\\n' + '<SPECIAL_11>Assistant\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'].strip() + '\\n' }}{% endif %}{% endfor %}")
_NEMOTRON_NANO_V2 = (
    "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\\n' + content.replace('/think', '')"
    ".replace('/no_think', '').strip() + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ '<SPECIAL_11>Assistant\\n' + content.strip() + '\\n<SPECIAL_12>\\n' }}{% endif %}{% endfor %}")
_IDENTITY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

PROMPT_FORMATS: dict[str, str | None] = {
    "default": None,
    "nemotron-h-aligned": _NEMOTRON_H_ALIGNED,
    "nemotron-nano-v2": _NEMOTRON_NANO_V2,
    "identity": _IDENTITY,
}
"""``--sft-tokenizer-prompt-format`` name -> Megatron's template (None: the tokenizer's own)."""


class ChatTemplateError(ValueError):
    """The template cannot render a conversation (its ``raise_exception``, a Jinja error)."""


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` dict's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_text(value: Any, source: str) -> str | None:
    """``chat_template`` of ``tokenizer_config.json``: a string, or named templates (``default`` is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{source}: chat_template is neither a string nor a list with a 'default' template")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja2 chat template with the special tokens it may use."""

    source: str
    """The template's Jinja2 text."""
    origin: str
    """Where it came from (a file, or a prompt format's name), for messages."""
    bos_token: str = ""
    """``bos_token`` as the template sees it."""
    eos_token: str = ""
    """``eos_token`` as the template sees it."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages``; :class:`ChatTemplateError` when the template rejects them."""
        import jinja2

        try:
            return _compile(self.source).render(messages=messages, bos_token=self.bos_token,
                                                eos_token=self.eos_token, add_generation_prompt=add_generation_prompt,
                                                tools=None, documents=None)
        except jinja2.TemplateError as e:  # raise_exception's TemplateError, undefined names, sandbox refusals
            raise ChatTemplateError(f"the chat template ({self.origin}) rejects it: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError) as e:  # e.g. content that is not a string
            raise ChatTemplateError(f"the chat template ({self.origin}) cannot render it: "
                                    f"{type(e).__name__}: {e}") from None


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``, ``ValueError`` naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def load_chat_template(tokenizer_model: str, prompt_format: str = "default") -> ChatTemplate:
    """The chat template of the Hugging Face tokenizer at ``tokenizer_model`` (its directory, or a
    ``tokenizer.json`` in it): ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s
    ``chat_template``; another ``prompt_format`` takes Megatron's fixed template of that name.
    ``ValueError`` naming the files when there is none."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown --sft-tokenizer-prompt-format {prompt_format!r}; known: "
                         f"{', '.join(PROMPT_FORMATS)}")
    directory = tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model) or "."
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    tokens = {"bos_token": _token_text(config.get("bos_token")) or "",
              "eos_token": _token_text(config.get("eos_token")) or ""}
    fixed = PROMPT_FORMATS[prompt_format]
    if fixed is not None:
        return ChatTemplate(fixed, f"--sft-tokenizer-prompt-format {prompt_format}", **tokens)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return _parsed(ChatTemplate(f.read(), jinja_path, **tokens))
    source = _template_text(config.get("chat_template"), config_path)
    if not source:
        raise ValueError(f"--tokenizer-model {tokenizer_model}: no chat template (neither {jinja_path} nor a "
                         f"chat_template in {config_path}); --sft renders conversations with the tokenizer's chat "
                         "template (or pass --sft-tokenizer-prompt-format with one of Megatron's)")
    return _parsed(ChatTemplate(source, config_path, **tokens))


def _parsed(template: ChatTemplate) -> ChatTemplate:
    """``template`` once it compiles; ``ChatTemplateError`` naming where it came from otherwise."""
    try:
        _compile(template.source)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{template.origin}: {e}") from None
    return template


def _raise_exception(message: str) -> None:
    """The templates' ``raise_exception(message)``."""
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """``tojson`` as ``transformers`` defines it: ``json.dumps`` without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """The templates' ``strftime_now(format)``: the local time now."""
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """The compiled template, in the sandboxed environment ``transformers`` renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask markers) renders its body
        (the loss mask is found by rendering prefixes of the conversation, :mod:`core.data.sft_dataset`)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            """The block as a call that renders its body unchanged."""
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e} (line {e.lineno})") from None

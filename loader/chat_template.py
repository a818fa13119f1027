"""Chat templates: OpenAI-style messages to the prompt text a model was tuned on.

A GGUF file usually carries its Hugging Face chat template (a Jinja program) under
`tokenizer.chat_template`; when it does not, a built-in template for the architecture is
used. Either way the template is rendered in an immutable Jinja sandbox, because a
template is code that arrived inside a downloaded file: it must not reach Python
internals, mutate the caller's messages, or turn a user's conversation into a traceback.
Every failure of the template itself becomes a `ChatTemplateError`; a malformed list of
messages is the caller's mistake and raises `InvalidParameters` (a ValueError). The
sandbox is also bounded (loader/template_sandbox.py, template_budget.py,
template_deadline.py): a render that runs longer than RENDER_TIME_LIMIT_S, builds a value
longer than the longest prompt, or builds too much in all stops with a `ChatTemplateError`
naming the limit, on whichever thread it runs, leaving nothing behind.

BOS convention (one rule, the one llama.cpp applies): templates are rendered with the real
BOS text, so a template that writes `{{ bos_token }}` in the middle of a conversation (Llama
2 opens every `[INST]` with it) gets the token it asked for. When the tokenizer adds BOS
itself, `render_for_tokenizer` removes exactly one BOS text from the *start* of the
rendered prompt, so the prompt never begins with two BOS tokens. `render` is the raw call
underneath: it substitutes whatever `bos_token` it is given (default "", which makes
`{{ bos_token }}` vanish everywhere).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension

from eagerlm.errors import InvalidParameters
from eagerlm.loader.errors import ModelFileError
from eagerlm.loader.template_budget import MAX_RENDERED_CHARS, TemplateLimitError, dumps_bounded
from eagerlm.loader.template_deadline import RENDER_TIME_LIMIT_S, run_bounded
from eagerlm.loader.template_sandbox import BoundedSandbox

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class ChatTemplateError(ModelFileError):
    """The chat template is malformed, rejected the conversation, or tried something unsafe."""

    param = "messages"  # what a request to the server renders with it


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> None:
    """HF templates call this to reject a conversation (e.g. roles that do not alternate)."""
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    """Llama 3.x templates stamp "Today Date" with this."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`json.dumps` as HF defines the filter; Jinja's own `tojson` HTML-escapes `<`, `>`, `&`
    and `'`, which would corrupt tool schemas in a prompt. Bounded: an indent multiplies
    with the nesting depth, so `dumps_bounded` measures before it builds."""
    return dumps_bounded(value, ensure_ascii=ensure_ascii, indent=indent,
                         separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (it marks assistant tokens for
    training masks) and renders the body unchanged, so templates using it still load."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it a class set

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _make_environment() -> BoundedSandbox:
    """The environment HF's `apply_chat_template` uses, in the bounded sandbox."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Built-in templates, written from the official model cards / HF tokenizer_config.json
# templates (google/gemma-3-*-it, Qwen/Qwen2.5-*-Instruct and Qwen/Qwen3-*,
# meta-llama/Meta-Llama-3-8B-Instruct, meta-llama/Llama-2-7b-chat-hf). They produce the same
# text as the official ones for system/user/assistant conversations; differences are noted.

# Gemma 3: no system role; a leading system message becomes a prefix of the first user turn
# followed by a blank line. Turn text is trimmed, the assistant is called "model".
_GEMMA3 = """\
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
    {%- set prefix = messages[0].content + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message.role not in ('user', 'assistant') -%}
        {{- raise_exception('Gemma supports a system message only at the start; got role '
                            ~ message.role) -}}
    {%- endif -%}
    {%- if (message.role == 'user') != (loop.index0 is even) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else 'user') ~ '\n' -}}
    {{- (prefix if loop.first else '') ~ message.content | trim ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# ChatML as Qwen2/2.5 use it. The official Qwen2 and Qwen2.5 templates insert a default
# system prompt ("You are a helpful assistant." / "You are Qwen, created by Alibaba
# Cloud...") when none is given; the two disagree, so the built-in inserts none. Files of
# either family carry their own template, which wins over this one.
_CHATML = """\
{%- for message in messages -%}
    {{- '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen3: ChatML plus the official template's reasoning rules (tools left out): an assistant
# turn's <think>...</think> part (or its `reasoning_content`) is dropped before the last
# user message and kept, in a think block, after it; `enable_thinking=False` pre-fills an
# empty think block after the generation prompt.
_QWEN3 = """\
{%- set ns = namespace(last_user=messages | length - 1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set thinking = enable_thinking is not defined or enable_thinking != false -%}
{%- for message in messages -%}
    {%- if message.role != 'assistant' -%}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>\n' -}}
    {%- else -%}
        {%- set content = message.content -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n')
                                       .split('<think>')[-1].lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if loop.index0 > ns.last_user and (loop.last or reasoning) and thinking -%}
            {{- '<|im_start|>assistant\n<think>\n' ~ reasoning.strip('\n') ~ '\n</think>\n\n'
                ~ content.lstrip('\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' ~ content -}}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if not thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# Llama 3 (Meta-Llama-3-*-Instruct): one header per turn, content trimmed. Llama 3.1+ files
# carry their own template (it adds a knowledge-cutoff system header and tools).
_LLAMA3 = """\
{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n' -}}
    {{- message.content | trim ~ '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# Llama 2 chat: BOS opens every [INST], the system prompt sits in <<SYS>> inside the first
# user turn, assistant turns end with EOS. The prompt already ends where the model answers,
# so there is no separate generation prompt. Unlike the official template, a system
# message anywhere but first is rejected instead of silently dropped.
_LLAMA2 = """\
{%- if messages[0].role == 'system' -%}
    {%- set system = '<<SYS>>\n' ~ messages[0].content ~ '\n<</SYS>>\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message.role not in ('user', 'assistant') -%}
        {{- raise_exception('Llama 2 supports a system message only at the start; got role '
                            ~ message.role) -}}
    {%- endif -%}
    {%- if (message.role == 'user') != (loop.index0 is even) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}
    {%- endif -%}
    {%- if message.role == 'user' -%}
        {%- set content = (system if loop.first else '') ~ message.content -%}
        {{- bos_token ~ '[INST] ' ~ content | trim ~ ' [/INST]' -}}
    {%- else -%}
        {{- ' ' ~ message.content | trim ~ ' ' ~ eos_token -}}
    {%- endif -%}
{%- endfor -%}
"""

# Phi-3 / Phi-4-mini (llama.cpp's built-in "phi3"): each turn `<|role|>\n...<|end|>\n`.
_PHI3 = """\
{%- for message in messages -%}
    {{- '<|' ~ message.role ~ '|>\n' ~ message.content ~ '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

# gpt-oss without its own template (llama.cpp's built-in "gpt-oss", the bare harmony
# format): `<|start|>role<|message|>...<|end|>`, an assistant turn ended by <|return|>.
# Real files carry OpenAI's template (channels, tools, reasoning effort), which wins.
_HARMONY = """\
{%- for message in messages -%}
    {{- '<|start|>' ~ message.role ~ '<|message|>' ~ message.content -}}
    {{- '<|return|>' if message.role == 'assistant' else '<|end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start|>assistant' -}}
{%- endif -%}
"""

_BUILTINS: dict[str, str] = {
    "gemma3": _GEMMA3,
    "qwen2": _CHATML,
    "qwen3": _QWEN3,
    "qwen3moe": _QWEN3,
    "llama3": _LLAMA3,
    "llama2": _LLAMA2,
    "phi3": _PHI3,
    "gpt-oss": _HARMONY,
}


_BUILTIN_ARCHITECTURES = {"llama", *(n for n in _BUILTINS if not n.startswith("llama"))}


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI message shape and return shallow copies for the template.

    Copies keep the template's view independent of the caller's objects; the sandbox
    already forbids mutation, this also rules out surprises from dict subclasses.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidParameters(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, "
            f"got {type(messages).__name__}", param="messages")
    if not messages:
        raise InvalidParameters("messages must contain at least one message", param="messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidParameters(f"messages[{i}] must be a dict, got "
                                    f"{type(message).__name__}", param="messages")
        for key in ("role", "content"):
            if key == "content" and _calls_tools(message) and message.get(key) is None:
                continue  # an assistant turn that only called tools has no text
            if key not in message:
                raise InvalidParameters(f"messages[{i}] has no {key!r}", param="messages")
            if not isinstance(message[key], str):
                raise InvalidParameters(f"messages[{i}][{key!r}] must be a str, got "
                                        f"{type(message[key]).__name__}", param="messages")
        if not message["role"]:
            raise InvalidParameters(f"messages[{i}]['role'] must not be empty",
                                    param="messages")
        checked.append(dict(message))
    return checked


def _calls_tools(message: Mapping[str, Any]) -> bool:
    """An assistant message carrying tool calls, in HF's form (a non-empty list under
    `tool_calls`): its content may be None or absent, as HF templates accept."""
    calls = message.get("tool_calls")
    return (message.get("role") == "assistant" and isinstance(calls, Sequence)
            and not isinstance(calls, (str, bytes)) and len(calls) > 0)


class ChatTemplate:
    """A compiled, sandboxed chat template.

    `origin` says where the template came from ("gguf:tokenizer.chat_template" or
    "builtin:<name>"); it is the `field` of every `ChatTemplateError` it raises.
    `variables` are the names the template reads from its context (`messages`, `tools`,
    `enable_thinking`, ...): a variable it never reads, such as `tools` for a template
    written without tool support, has no effect on the prompt.

    `time_limit_s` bounds compiling and each render; tests lower it on the class or on an
    instance to see a runaway template stop quickly.
    """

    time_limit_s: float = RENDER_TIME_LIMIT_S

    def __init__(self, source: str, *, origin: str = "template") -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template must be a string, got "
                                    f"{type(source).__name__}", field=origin)
        self.source = source
        self.origin = origin
        env = _make_environment()
        try:
            self._template = run_bounded(lambda: env.from_string(source), self.time_limit_s)
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except TemplateLimitError as e:
            raise ChatTemplateError(str(e), field=origin) from e
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: "
                                    f"{e.message}", field=origin) from e
        except Exception as e:  # an untrusted program: any failure is the template's
            raise ChatTemplateError(f"chat template does not compile: {e}",
                                    field=origin) from e

    @classmethod
    def builtin(cls, architecture: str, token_texts: Container[str] = ()) -> ChatTemplate:
        """The built-in template for `architecture` (the GGUF `general.architecture`).

        `llama` covers two generations with one architecture name; the vocabulary tells
        them apart: Llama 3 has a `<|start_header_id|>` token, Llama 2 does not.
        """
        name = architecture
        if architecture == "llama":
            name = "llama3" if "<|start_header_id|>" in token_texts else "llama2"
        if name not in _BUILTINS:
            raise ChatTemplateError(
                f"the model file has no {CHAT_TEMPLATE_KEY} and there is no built-in chat "
                f"template for architecture {architecture!r} (built-ins: "
                f"{', '.join(sorted(_BUILTIN_ARCHITECTURES))})", field=CHAT_TEMPLATE_KEY)
        return cls(_BUILTINS[name], origin=f"builtin:{name}")

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], architecture: str,
                      token_texts: Container[str] = ()) -> ChatTemplate:
        """The file's own template when it has one, else the architecture's built-in."""
        source = md.get(CHAT_TEMPLATE_KEY)
        if source is None:
            return cls.builtin(architecture, token_texts)
        return cls(source, origin=f"gguf:{CHAT_TEMPLATE_KEY}")

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
        """Render `messages` to prompt text, substituting the given BOS/EOS texts verbatim.

        `extra` reaches the template as variables (e.g. `enable_thinking=False` for Qwen3,
        `tools=[...]` for templates that support them). Raises `InvalidParameters` for malformed
        messages and `ChatTemplateError` for anything the template does wrong.
        """
        context = dict(extra)
        context.update(messages=_validate_messages(messages),
                       add_generation_prompt=bool(add_generation_prompt),
                       bos_token=bos_token, eos_token=eos_token)
        try:
            return run_bounded(lambda: self._collect(self._template.generate(context)),
                               self.time_limit_s)
        except TemplateLimitError as e:
            raise ChatTemplateError(str(e), field=self.origin) from e
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the conversation: {e}",
                                    field=self.origin) from e
        except jinja2.sandbox.SecurityError as e:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}",
                                    field=self.origin) from e
        except jinja2.UndefinedError as e:
            raise ChatTemplateError(f"chat template used an undefined value: {e}",
                                    field=self.origin) from e
        except ChatTemplateError:
            raise
        except Exception as e:  # an untrusted program: any failure is the template's
            raise ChatTemplateError(f"chat template failed while rendering: "
                                    f"{type(e).__name__}: {e}", field=self.origin) from e

    def render_for_tokenizer(self, messages: Sequence[Mapping[str, Any]], *,
                             tokenizer_adds_bos: bool, bos_text: str, eos_text: str = "",
                             add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render for a tokenizer, never doubling BOS (see the module docstring).

        The template sees the real `bos_text`; if `tokenizer_adds_bos`, one leading
        `bos_text` is removed from the result because the tokenizer will put it back. BOS
        texts later in the prompt stay, and the tokenizer must parse them as special tokens.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_text, eos_token=eos_text, **extra)
        if tokenizer_adds_bos and bos_text and text.startswith(bos_text):
            text = text[len(bos_text):]
        return text

    def _collect(self, pieces: Iterator[str]) -> str:
        """Join the template's output, stopping a runaway template at MAX_RENDERED_CHARS."""
        out: list[str] = []
        total = 0
        for piece in pieces:
            total += len(piece)
            if total > MAX_RENDERED_CHARS:
                raise ChatTemplateError(
                    f"chat template output exceeds {MAX_RENDERED_CHARS} characters",
                    field=self.origin)
            out.append(piece)
        return "".join(out)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} chars)"


__all__ = ["CHAT_TEMPLATE_KEY", "MAX_RENDERED_CHARS", "RENDER_TIME_LIMIT_S", "ChatTemplate",
           "ChatTemplateError"]

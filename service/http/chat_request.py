"""One chat request in no API's terms, and its run on the engine: what every API dialect's
chat route translates onto.

API translations: each API dialect (OpenAI's Chat Completions is service/http/
openai_chat.py; one module per dialect) parses its own body, translates it onto a
`ChatRequest` (the conversation and tools in the chat template's form, the tool-call
parser, the reply's constraint, the sampling of each choice), runs it with
`chat_response` (`start_chat` through service/http/request_lifecycle.py's
`generation_response`), and renders what comes back in its own format: `ChatRun.results`
for a whole reply, `ChatRun.events` for a stream. The dialects are registered in
service/http/api_dialects.py. So the generation, the reasoning split
(dispatch/reasoning.py) and the tool-call parsing (service/api/tool_calls.py) exist once,
whatever the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from eagerlm.dispatch.harmony import HarmonyStream, split_harmony
from eagerlm.dispatch.messages import FinishReason
from eagerlm.dispatch.reasoning import (
    ReasoningBlock,
    ReasoningFormat,
    ReasoningStream,
    Split,
    prompt_opens_reasoning,
    split_reasoning,
)
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.records import Completion, TokenLogprobs
from eagerlm.service.api.streams import MultiStream
from eagerlm.service.api.tool_calls import (
    Reply,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    forced_call,
    format_of_template,
)
from eagerlm.service.http.openai_errors import OpenAIError, bad_request
from eagerlm.service.http.openai_sampling import resolve_max_tokens
from eagerlm.service.http.request_lifecycle import generation_response, prepare
from eagerlm.service.http.server_context import ServerContext

# tools in one request of the Responses and Messages APIs (OpenAI's limit for chat's
# `tools`): a template shows every tool in every prompt
MAX_TOOLS = 128


class ChoiceSampling(Protocol):
    """How a dialect's sampling fields become the engine's parameters for choice `choice`
    (a 400 naming the field for a value the engine refuses)."""

    def sampling_params(self, max_tokens: int, choice: int,
                        constraint: Constraint | None = None) -> SamplingParams: ...


@dataclass(frozen=True)
class ChatRequest:
    """A chat request as the engine runs it, whatever API it came in."""

    messages: list[dict[str, Any]]  # as the chat template takes them
    sampling: ChoiceSampling
    tools: list[dict[str, Any]] | None = None  # as the chat template takes them
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_parser: ToolCallParser | None = None  # None: the reply is all content
    # the tools a forced call may call, with their parameter schemas (None: none forced)
    forced_tools: Sequence[tuple[str, dict[str, Any] | None]] | None = None
    constraint: Constraint | None = None  # the reply's (a response format), if no call is
    max_tokens: int | None = None  # None: all the room the context leaves
    n: int = 1  # choices


class Thinking:
    """One request's reasoning split (dispatch/reasoning.py, or dispatch/harmony.py for a
    harmony model), or none."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str | None) -> None:
        self.harmony = fmt is ReasoningFormat.HARMONY
        self.on = fmt is ReasoningFormat.DEEPSEEK or self.harmony
        self.opened = prompt_opens_reasoning(prompt_text)

    def params(self, params: SamplingParams) -> SamplingParams:
        """Stop strings skip the reasoning (dispatch/token_judge.py)."""
        if not self.on:
            return params
        block = ReasoningBlock.HARMONY if self.harmony else \
            ReasoningBlock.OPEN if self.opened else ReasoningBlock.MAY_OPEN
        return dataclasses.replace(params, reasoning_block=block)

    def split(self, text: str) -> Split:
        if self.harmony:
            return split_harmony(text)
        return split_reasoning(text, self.opened) if self.on else Split(None, text)

    def stream(self) -> ReasoningStream | HarmonyStream | None:
        if self.harmony:
            return HarmonyStream()
        return ReasoningStream(self.opened) if self.on else None


# -- what a streamed chat yields, in the order a client is to see it --------------------

@dataclass(frozen=True)
class ReasoningDelta:
    index: int  # the choice
    text: str


@dataclass(frozen=True)
class ContentDelta:
    index: int
    text: str  # may be "" when the tokens show no text but have logprobs
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    position: int  # the call's place among the choice's calls
    call: ToolCall


@dataclass(frozen=True)
class ChoiceFinished:
    index: int
    reply: Reply  # the whole reply's calls (content already streamed)
    reason: FinishReason


ChatEvent = ReasoningDelta | ContentDelta | ToolCallDelta | ChoiceFinished


@dataclass(frozen=True)
class ChoiceResult:
    """One choice of a whole reply: the completion, its reasoning (None: no reasoning
    block) and its answer split into content and tool calls."""

    completion: Completion
    reasoning: str | None
    reply: Reply


@dataclass
class ChatRun:
    """A chat request submitted to the engine (not yet running: `generation_response`
    admits and starts its `streams`)."""

    request: ChatRequest
    streams: MultiStream
    thinking: Thinking
    prompt_tokens: int = 0  # the rendered conversation's, known before any token comes

    def results(self, completions: Sequence[Completion]) -> list[ChoiceResult]:
        """Each finished choice split into reasoning, content and tool calls."""
        parser = self.request.tool_parser
        out = []
        for c in completions:
            split = self.thinking.split(c.text)
            reply = (parser.reply(split.content, c.finish_reason is FinishReason.STOP)
                     if parser is not None else Reply(split.content))
            out.append(ChoiceResult(c, split.reasoning, reply))
        return out

    async def events(self) -> AsyncIterator[ChatEvent]:
        """Each choice's reasoning and content as they come; with tools, answer text that
        may be a call is held back (service/api/tool_calls.py), and the calls follow at
        the end, one event each, before the choice's `ChoiceFinished`. A failure raises
        its `EagerLMError` (the engine's, or the request's own)."""
        parser, n = self.request.tool_parser, self.request.n
        splitters = [parser.stream() if parser is not None else None for _ in range(n)]
        thoughts = [self.thinking.stream() for _ in range(n)]
        async for index, chunk in self.streams:
            splitter, thought = splitters[index], thoughts[index]
            reasoning, text = "", chunk.text
            if thought is not None:
                reasoning, text = thought.push(text)
                if chunk.finish_reason is not None:
                    more_reasoning, more_text = thought.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield ReasoningDelta(index, reasoning)
            text = text if splitter is None else splitter.push(text)
            if text or chunk.logprobs:  # tokens that show no text still have logprobs
                yield ContentDelta(index, text, chunk.logprobs)
            if chunk.finish_reason is None:
                continue
            rest = Reply(None)
            if splitter is not None:
                rest = splitter.finish(chunk.finish_reason is FinishReason.STOP)
            if rest.content:
                yield ContentDelta(index, rest.content)
            for k, call in enumerate(rest.tool_calls):
                yield ToolCallDelta(index, k, call)
            yield ChoiceFinished(index, rest, chunk.finish_reason)


def tool_parser_for(template: ChatTemplate, names: Sequence[str], *, parse_calls: bool,
                    parallel: bool) -> ToolCallParser | None:
    """The parser of a request's calls of the tools `names` from the model's text (None:
    the text is all content, as when the request asks for no calls: `parse_calls`
    false). A 400 when tools are given to a model whose chat template cannot show them,
    or whose call format this server cannot parse."""
    fmt = format_of_template(template)
    if fmt is None:
        raise bad_request(
            f"This model's chat template ({template.origin}) does not support tools: it "
            f"never reads the 'tools' variable, so the model would not see them.",
            param="tools", code="unsupported_parameter")
    if not parse_calls:
        return None
    if fmt is ToolCallFormat.UNKNOWN:
        raise bad_request(
            "This model's chat template shows tools, but its tool calls are written in "
            "a format this server does not parse (it parses Hermes/Qwen <tool_call> "
            "blocks, gpt-oss's harmony calls and Llama 3 JSON calls). Ask for no calls "
            "(tool_choice none) to show the tools without parsing calls.", param="tools",
            code="unsupported_parameter")
    return ToolCallParser(fmt, names, parallel=parallel)


async def start_chat(ctx: ServerContext, chat: ChatRequest) -> ChatRun:
    """Render and tokenize the conversation (on a worker thread), size the reply, and
    make its choices' requests (submitted once admitted)."""
    engine = ctx.engine
    prompt = await prepare(lambda: engine.prepare_chat(chat.messages, chat.tools,
                                                       chat.template_kwargs))
    thinking = Thinking(ctx.reasoning_format, prompt.chat_text)
    max_tokens = resolve_max_tokens(chat.max_tokens, len(prompt.ids), engine.context_length,
                                    None, "messages")
    constraint = chat.constraint
    if chat.forced_tools is not None and chat.tool_parser is not None:
        constraint = forced_call(chat.tool_parser.format, chat.forced_tools,
                                 _is_special_text(engine))
    streams = engine.generate_many(
        [(prompt, thinking.params(chat.sampling.sampling_params(max_tokens, i, constraint)))
         for i in range(chat.n)])
    return ChatRun(chat, streams, thinking, len(prompt.ids))


async def chat_response(ctx: ServerContext, request: Request, chat: ChatRequest, *,
                        stream: bool,
                        stream_events: Callable[[ChatRun], AsyncIterator[str]],
                        whole_body: Callable[[ChatRun, list[Completion]], Any],
                        error_ending: Callable[[OpenAIError], str]) -> Response:
    """A chat dialect's answer to `chat`: started (`start_chat`) on the way every
    generation request takes (`generation_response`), then rendered by the dialect, a
    stream (`stream_events` of the run) or a whole body (`whole_body`)."""
    async def submit() -> ChatRun:
        return await start_chat(ctx, chat)

    return await generation_response(ctx, request, stream=stream, submit=submit,
                                     stream_events=stream_events, whole_body=whole_body,
                                     error_ending=error_ending)


def _is_special_text(engine: Engine) -> Callable[[str], bool]:
    """Whether a text is one special token of the model's vocabulary as the grammar engine
    sees them (dispatch/grammar.py: a token that renders as nothing without special tokens,
    control or unknown): a forced call's markers are then written as that token, as the
    model learned them. A special token that renders as its text (user-defined, as
    harmony's `<|channel|>`) is matched as that text."""
    tok = engine.tokenizer

    def is_special(text: str) -> bool:
        tid = tok.token_id(text)
        return tid is not None and tok.is_special(tid) and not tok.piece(tid, special=False)
    return is_special


__all__ = ["MAX_TOOLS", "ChatEvent", "ChatRequest", "ChatRun", "ChoiceFinished", "ChoiceResult",
           "ChoiceSampling", "ContentDelta", "ReasoningDelta", "Thinking", "ToolCallDelta",
           "chat_response", "start_chat", "tool_parser_for"]

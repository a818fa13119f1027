"""Request bodies parsed strictly, with OpenAI's 400s: the machinery every route's body
model shares (service/http/openai_requests.py, openai_embeddings.py, vllm_tokenize.py).

Every request field is one of:
- supported: validated strictly (a string where a number belongs is a 400, not coerced);
- accepted only at its default (e.g. `echo: false`, `best_of: 1`): any other value is
  refused, because the engine cannot honour it and silently ignoring it would return
  something the client did not ask for;
- informational (`user`, and those in service/http/ignored_fields.py: `store`,
  `metadata`, `service_tier`, `prompt_cache_key`...): accepted, no effect on generation;
- anything else: refused with a 400 naming the field.
`null` counts as absent, as the OpenAI API treats it, in messages too (a client sending a
response message back whole includes `"refusal": null` and the like).

A body is a pydantic model (`RequestBody`), its nested objects `BodyPart`s; `parse_body`
refuses unknown and unsupported fields, maps pydantic's errors to OpenAI's 400s (the path
of the field at fault, `messages[0].content`) and runs the model's cross-field `check`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from eagerlm.service.http.ignored_fields import is_ignored
from eagerlm.service.http.openai_errors import OpenAIError, bad_request, brief


class StrictModel(BaseModel):
    """Fields checked strictly; a field the model does not know is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class BodyPart(StrictModel):
    """An object nested in a request body (a message, a tool, ...): an error names its
    fields in the path it reports."""


class RequestBody(StrictModel):
    """A request body: its fields checked one by one by pydantic, then `check`.
    `expected`: for a field of the wrong type, what it should be (the error's words)."""

    expected: ClassVar[dict[str, str] | None] = None  # None: OpenAI's chat fields

    def check(self) -> None:
        """Rules across fields, once the fields are valid (raises OpenAIError)."""


# Known OpenAI fields with no support at all.
KNOWN_UNSUPPORTED = frozenset({
    "audio", "function_call", "functions", "web_search_options", "verbosity",
    "prompt_cache_options", "moderation",
})

_M = TypeVar("_M", bound=RequestBody)


def parse_body(body: Any, model: type[_M],
               default_only: dict[str, tuple[Any, ...]] | None = None) -> _M:
    """`body` as `model`, or a 400 naming the field at fault. `default_only`: fields
    accepted only at these values (the engine cannot honour others)."""
    default_only = default_only or {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    fields = set(model.model_fields)
    kept: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        if key in fields:
            kept[key] = value
        elif is_ignored(key):  # cannot change the output (service/http/ignored_fields.py)
            continue
        elif key in default_only:
            if not any(_same(value, ok) for ok in default_only[key]):
                raise bad_request(f"'{key}' = {brief(value)} is not supported by this server; "
                                  f"only its default is.", param=key,
                                  code="unsupported_parameter")
        elif key in KNOWN_UNSUPPORTED:
            raise bad_request(f"'{key}' is not supported by this server.", param=key,
                              code="unsupported_parameter")
        else:
            raise bad_request(f"Unrecognized request argument supplied: {brief(key, 80)}.",
                              param=key,
                              code="unknown_parameter")
    try:
        request = model.model_validate(kept)
    except ValidationError as e:
        raise _validation_error(e, model.expected) from None
    request.check()
    return request


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not let True pass for 1 (or False for 0)."""
    if isinstance(value, bool) != isinstance(allowed, bool):
        return False
    return bool(value == allowed)


_EXPECTED = {
    "model": "a string", "messages": "a non-empty list of messages",
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of ids",
    "stop": "a string or a list of strings", "stream": "a boolean",
    "ignore_eos": "a boolean", "skip_special_tokens": "a boolean", "user": "a string",
    "logit_bias": "an object mapping token ids (decimal strings) to biases in [-100, 100]",
    "tools": 'a list of {"type": "function", "function": {"name": ...}} objects',
    "tool_choice": "'auto', 'none' or an object",
    "response_format": 'an object such as {"type": "json_object"}',
    "json_schema": "a JSON schema (an object)", "grammar": "a GBNF grammar (a string)",
}


def _most_specific(errors: list[Any], named: frozenset[str]) -> Any:
    """The error to report. pydantic lists one error per member of a union, the first
    member's first: when the first error is a union member's (its path ends in the
    member's name, such as `str`) and another member went inside an object of the body
    (its path names a field there), the deepest such error is the one that says what is
    wrong (the block inside the list that was sent, not "not a string")."""
    first = errors[0]
    loc = first["loc"]
    if len(loc) < 2 or not isinstance(loc[-1], str) or loc[-1] in named:
        return first
    base = loc[:-1]
    inside = [err for err in errors if err["loc"][:len(base)] == base
              and any(isinstance(p, str) and p in named for p in err["loc"][len(base) + 1:])]
    return max(inside, key=lambda err: len(err["loc"])) if inside else first


def _part_fields() -> frozenset[str]:
    """The field names of every nested part (how an error path names them)."""
    names: set[str] = set()
    todo = list(BodyPart.__subclasses__())
    while todo:
        part = todo.pop()
        names.update(part.model_fields)
        todo.extend(part.__subclasses__())
    return frozenset(names)


def _validation_error(e: ValidationError,
                      expected: dict[str, str] | None = None) -> OpenAIError:
    expected = _EXPECTED if expected is None else expected
    named = _part_fields()  # field names; an unknown one is named when it is the error
    first = _most_specific(e.errors(), named)
    loc = [str(x) for x in first["loc"]]
    field = loc[0] if loc else None
    path = field or ""
    if first["type"] == "extra_forbidden":
        named = named | {loc[-1]}
    for k, part in enumerate(loc[1:], 1):  # messages[0].role; skip union branch names
        tag = loc[k - 1].isdigit() and loc[k + 1:k + 2] == [part]  # a tagged union's
        if part.isdigit():
            path += f"[{part}]"
        elif part in named and not tag:  # ("text" the tag, then "text" the field)
            path += f".{part}"
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{path}'.", param=path)
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized argument: {brief(path, 80)}.", param=path,
                           code="unknown_parameter")
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    if field in expected and len(loc) <= 2 and code == "invalid_type":
        return bad_request(f"Invalid type for '{path}': expected {expected[field]}.",
                           param=path, code="invalid_type")
    kind = "type" if code == "invalid_type" else "value"
    return bad_request(f"Invalid {kind} for '{path}': {first['msg']}.", param=path, code=code)



__all__ = ["KNOWN_UNSUPPORTED", "BodyPart", "RequestBody", "StrictModel", "parse_body"]

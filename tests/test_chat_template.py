"""Chat templates: exact prompts for each built-in, real GGUF templates, and the sandbox.

The expected strings of the built-ins are written by hand from the official templates in
each model's HF `tokenizer_config.json` / model card (google/gemma-3-*-it,
Qwen/Qwen2.5-*-Instruct ChatML, Qwen/Qwen3-*, meta-llama/Meta-Llama-3-8B-Instruct,
meta-llama/Llama-2-7b-chat-hf), not produced by running our code.
"""

from __future__ import annotations

import json

import pytest

from eagerlm.loader.chat_template import CHAT_TEMPLATE_KEY, ChatTemplate, ChatTemplateError
from eagerlm.loader.errors import ModelFileError

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hi there"}
CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]

# The official Qwen2.5-Instruct template, verbatim as GGUF files carry it.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>"
    "<|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) "
    "or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# The Llama 3.1 Instruct template (meta-llama/Llama-3.1-8B-Instruct), written out after the
# official one, comments left out and long lines split (same output): tools go into the
# first user message by default,
# a call is written back as {"name": ..., "parameters": ...}, a tool's answer is an ipython
# turn, and built-in tools use <|python_tag|>.
LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond "
        + "with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument '
        + 'name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no "
                            + "first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument '
        + 'name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA3_VOCAB = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def builtin(arch: str, token_texts=()) -> ChatTemplate:
    """A built-in reached the way the loader reaches it: metadata without a template."""
    return ChatTemplate.from_metadata({"general.architecture": arch}, arch, token_texts)


# --- built-ins -------------------------------------------------------------------------


def test_gemma3_single_turn():
    got = builtin("gemma3").render([USER], bos_token="<bos>")
    assert got == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_system_folds_into_first_user_turn_multi_turn():
    got = builtin("gemma3").render(CONVERSATION, bos_token="<bos>")
    assert got == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma3_trims_turn_text_and_honours_add_generation_prompt():
    messages = [{"role": "user", "content": "  padded \n"}]
    got = builtin("gemma3").render(messages, add_generation_prompt=False)
    assert got == "<start_of_turn>user\npadded<end_of_turn>\n"


def test_gemma3_rejects_non_alternating_roles():
    messages = [USER, USER]
    with pytest.raises(ChatTemplateError, match="alternate"):
        builtin("gemma3").render(messages)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_chatml_multi_turn(arch):
    got = builtin(arch).render(CONVERSATION)
    assert got == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chatml_without_generation_prompt_and_no_bos():
    got = builtin("qwen2").render([USER], add_generation_prompt=False, bos_token="<B>")
    assert got == "<|im_start|>user\nHi there<|im_end|>\n"


def test_qwen3_drops_old_reasoning_and_can_disable_thinking():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nworking\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]
    got = builtin("qwen3").render(messages, enable_thinking=False)
    assert got == (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_llama3_header_style_when_vocab_has_header_tokens():
    got = builtin("llama", LLAMA3_VOCAB).render(CONVERSATION, bos_token="<|begin_of_text|>")
    assert got == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama2_inst_style_without_header_tokens():
    got = builtin("llama", ("<s>", "</s>")).render(CONVERSATION, bos_token="<s>",
                                                   eos_token="</s>")
    assert got == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4 </s>"
        "<s>[INST] And 3+3? [/INST]"
    )


def test_unknown_architecture_without_template_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="no built-in chat template") as info:
        builtin("mamba")
    assert info.value.field == CHAT_TEMPLATE_KEY


# --- templates from the file -----------------------------------------------------------


def test_gguf_template_wins_over_builtin():
    template = ChatTemplate.from_metadata({CHAT_TEMPLATE_KEY: QWEN25_TEMPLATE}, "gemma3")
    assert template.origin == f"gguf:{CHAT_TEMPLATE_KEY}"
    assert template.render([USER]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen25_template_multi_turn_with_system():
    template = ChatTemplate(QWEN25_TEMPLATE)
    assert template.render(CONVERSATION) == builtin("qwen2").render(CONVERSATION)


def test_qwen25_template_tools_use_plain_json():
    """Jinja's stock `tojson` would HTML-escape '<' and '&'; HF's (ours) does not."""
    tool = {"type": "function", "function": {"name": "f", "description": "a<b & c"}}
    got = ChatTemplate(QWEN25_TEMPLATE).render([SYSTEM, USER], tools=[tool])
    assert '\n{"type": "function", "function": {"name": "f", "description": "a<b & c"}}\n' in got
    assert got.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "call_1",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def test_qwen25_template_renders_tools_calls_and_tool_results():
    """The whole tool round trip in HF's message form: the schema in the system turn, the
    earlier call as a <tool_call> block (its content None, as clients send it), the
    tool's answer as a <tool_response> in a user turn."""
    got = ChatTemplate(QWEN25_TEMPLATE).render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert got == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> "
        "XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current '
        'weather", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string"}}}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama31_template_renders_tools_calls_and_tool_results():
    got = ChatTemplate(LLAMA31_TEMPLATE).render(TOOL_CONVERSATION, tools=[WEATHER_TOOL],
                                                bos_token="<|begin_of_text|>")
    assert got.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                          "Environment: ipython\n")
    assert ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions"
            in got)
    assert json.dumps(WEATHER_TOOL, indent=4) + "\n\nWeather in Paris?<|eot_id|>" in got
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>') in got
    assert got.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n"22 C"<|eot_id|>'
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_variables_are_what_a_template_reads_from_its_context():
    assert "tools" in ChatTemplate(QWEN25_TEMPLATE).variables
    assert "tools" in ChatTemplate(LLAMA31_TEMPLATE).variables  # set only if undefined
    for arch in ("gemma3", "qwen2", "qwen3", "llama"):
        assert "tools" not in builtin(arch, LLAMA3_VOCAB).variables, arch
    assert ChatTemplate("{% set tools = [] %}{{ tools }}{{ messages }}").variables == {
        "messages"}


def test_template_helpers_strftime_now_and_loop_controls():
    source = ("{{ strftime_now('%Y') | length }}|"
              "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
              "{{ m.content }}{% break %}{% endfor %}")
    assert ChatTemplate(source).render([USER, SYSTEM, USER]) == "4|You are terse."


# --- BOS handling ----------------------------------------------------------------------


def test_render_for_tokenizer_strips_only_the_leading_bos():
    llama2 = builtin("llama")
    messages = [USER, {"role": "assistant", "content": "Hello"}, USER]
    added = llama2.render_for_tokenizer(messages, tokenizer_adds_bos=True, bos_text="<s>",
                                        eos_text="</s>")
    assert added == "[INST] Hi there [/INST] Hello </s><s>[INST] Hi there [/INST]"
    kept = llama2.render_for_tokenizer(messages, tokenizer_adds_bos=False, bos_text="<s>",
                                       eos_text="</s>")
    assert kept == "<s>" + added


def test_render_for_tokenizer_leaves_templates_without_bos_alone():
    plain = builtin("qwen2").render([USER])
    got = builtin("qwen2").render_for_tokenizer([USER], tokenizer_adds_bos=True,
                                                bos_text="<|endoftext|>")
    assert got == plain  # ChatML writes no BOS, so there is nothing to strip


def test_gemma_prompt_for_a_bos_adding_tokenizer_has_no_bos_text():
    got = builtin("gemma3").render_for_tokenizer([USER], tokenizer_adds_bos=True,
                                                 bos_text="<bos>")
    assert got == "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"


# --- errors and the sandbox ------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(messages[0]) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ '{0.__class__}'.format(1) }}",
])
def test_sandbox_violations_raise(source):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate(source).render([USER])


def test_syntax_error_raises_at_load_with_field():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2") as info:
        ChatTemplate.from_metadata({CHAT_TEMPLATE_KEY: "ok\n{% for m in %}"}, "qwen2")
    assert info.value.field == f"gguf:{CHAT_TEMPLATE_KEY}"


def test_non_string_template_in_metadata_is_rejected():
    with pytest.raises(ChatTemplateError, match="must be a string"):
        ChatTemplate.from_metadata({CHAT_TEMPLATE_KEY: 42}, "qwen2")


def test_raise_exception_becomes_chat_template_error():
    template = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="rejected the conversation: System role"):
        template.render([USER])


def test_undefined_misuse_and_runtime_errors_are_wrapped():
    with pytest.raises(ChatTemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render([USER])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([USER])
    # HF semantics: a bare undefined name renders empty, so `{% if tools %}` works.
    assert ChatTemplate("{{ nothing }}x{% if tools %}T{% endif %}").render([USER]) == "x"


@pytest.mark.parametrize("messages, message", [
    ("hello", "must be a list"),
    ({"role": "user", "content": "x"}, "must be a list"),
    ([], "at least one"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([USER, {"role": "user", "content": None}], r"messages\[1\]\['content'\] must be a str"),
    ([{"role": 1, "content": "x"}], r"messages\[0\]\['role'\] must be a str"),
    ([{"role": "", "content": "x"}], "must not be empty"),
    ([USER, {"role": "assistant", "content": None}], r"messages\[1\]\['content'\] must be"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}],
     r"messages\[1\]\['content'\] must be"),
    ([USER, {"role": "user", "content": None, "tool_calls": [{}]}],
     r"messages\[1\]\['content'\] must be"),
])
def test_invalid_messages_raise_value_error(messages, message):
    with pytest.raises(ValueError, match=message):
        builtin("qwen2").render(messages)


def test_messages_are_not_mutated():
    messages = [dict(SYSTEM), dict(USER)]
    before = [dict(m) for m in messages]
    builtin("gemma3").render(messages)
    assert messages == before

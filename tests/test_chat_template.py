"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them.

Rules: every rendering is compared exactly with transformers on the same template, messages and
variables (a tokenizer whose only job is to carry the template and its bos/eos); every fault a
template can have (its own `raise_exception`, syntax, undefined names, sandbox escapes, type errors)
must end in ChatTemplateError with a one-line message. No files, no clock: templates that print the
date get it as a variable.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from lanes.text.chat import ChatTemplate, ChatTemplateError

CHATML_TOOLS = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

THINKING = """
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if loop.index0 > 3 %}{%- break %}{%- endif %}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_user %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- generation %}
        {{- '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
{%- if documents %}{{- documents | tojson }}{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> in a city, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CHATS = {
    "single": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "system": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi — ça va? 日本"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "And then?"},
    ],
    "turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Again."},
    ],
}


def transformers_render(source: str, messages, *, bos="<s>", eos="</s>", **kwargs) -> str:
    backend = Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    return reference.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


CASES = [
    ("chatml-tools", CHATML_TOOLS, "single", {"add_generation_prompt": True}),
    ("chatml-tools", CHATML_TOOLS, "system", {"add_generation_prompt": False}),
    ("chatml-tools", CHATML_TOOLS, "tool_call", {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("llama3", LLAMA3, "system", {"add_generation_prompt": True}),
    ("llama3", LLAMA3, "single", {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "date_string": "1 Nov 2026"}),
    ("alternating", ALTERNATING, "turns", {"add_generation_prompt": True}),
    ("thinking", THINKING, "reasoning", {"add_generation_prompt": True}),
    ("thinking", THINKING, "single", {"add_generation_prompt": True, "enable_thinking": False}),
    ("thinking", THINKING, "single", {"add_generation_prompt": False, "documents": [{"title": "T", "text": "ü<>"}]}),
]


@pytest.mark.parametrize("name, source, chat, variables", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_renders_exactly_as_transformers(name, source, chat, variables):
    bos, eos = ("<|begin_of_text|>", "<|eot_id|>") if name == "llama3" else ("<s>", "</s>")
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos)
    variables = dict(variables)
    generation = variables.pop("add_generation_prompt")
    expected = transformers_render(source, CHATS[chat], bos=bos, eos=eos, add_generation_prompt=generation, **variables)
    assert ours.render(CHATS[chat], add_generation_prompt=generation, **variables) == expected


def test_tools_reach_the_template_as_json_without_html_escaping():
    ours = ChatTemplate(CHATML_TOOLS, bos_token="<s>", eos_token="</s>")
    text = ours.render(CHATS["single"], tools=[WEATHER_TOOL])
    assert '{"name": "get_weather", "description": "Weather <now> in a city, e.g. Zürich"' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tojson_takes_transformers_arguments():
    source = "{{ x | tojson(indent=2, separators=(',', ': '), sort_keys=true) }}"
    ours = ChatTemplate(source, bos_token=None, eos_token=None)
    assert ours.render([], x={"b": "é", "a": [1]}) == '{\n  "a": [\n    1\n  ],\n  "b": "é"\n}'


def test_raise_exception_is_a_chat_template_error_with_the_templates_words():
    ours = ChatTemplate(ALTERNATING, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError) as raised:
        ours.render([{"role": "assistant", "content": "first"}])
    assert str(raised.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


@pytest.mark.parametrize(
    "source, fault",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError: access to attribute '__class__' of 'str' object is unsafe."),
        ("{{ messages.append({'role': 'x'}) }}", "SecurityError: access to attribute 'append' of 'list' object is unsafe."),
        ("{% set ns = namespace(_secret=1) %}{{ ns }}", "SecurityError: a namespace cannot hold the underscore name '_secret'"),
        ("{{ cycler.__init__.__globals__ }}", "SecurityError: access to attribute '__init__' of 'type' object is unsafe."),
        ("{{ nothing.here }}", "UndefinedError: 'nothing' is undefined"),
        ("{{ messages[0].content + 1 }}", 'TypeError: can only concatenate str (not "int") to str'),
        ("{{ 1 // 0 }}", "ZeroDivisionError: integer division or modulo by zero"),
        ("{{ messages[5] }}{{ messages[5].role.upper() }}", "UndefinedError: list object has no element 5"),
    ],
)
def test_template_faults_end_in_chat_template_error(source, fault):
    ours = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError) as raised:
        ours.render([{"role": "user", "content": "hi"}])
    assert str(raised.value) == f"chat template failed: {fault}"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_a_template_that_does_not_compile_is_refused_at_construction():
    with pytest.raises(ChatTemplateError) as raised:
        ChatTemplate("{% for m in messages %}{{ m.content }}", bos_token=None, eos_token=None)
    assert str(raised.value) == (
        "chat template does not compile: Unexpected end of template. Jinja was looking for the following tags:"
        " 'endfor' or 'else'. The innermost block that needs to be closed is 'for'. (line 1)"
    )


def test_messages_are_not_changed_and_none_values_are_dropped():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    ours = ChatTemplate("{{ messages[0] | tojson }}", bos_token=None, eos_token=None)
    assert ours.render(messages) == '{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}'
    assert messages[0]["content"] is None


def test_strftime_now_is_a_global():
    ours = ChatTemplate("{{ strftime_now('%Y') | length }}", bos_token=None, eos_token=None)
    assert ours.render([]) == "4"

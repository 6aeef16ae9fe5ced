"""Tool calls and results into the prompt, through each family's template: string arguments (quotes,
backslashes, newlines, non-ASCII, tags) come out of the rendered prompt encoded once, as the family's own
parser reads them back, whether the template renders the calls itself or they are written into the text.

Rules: templates are test_chat_template's (rendered as transformers renders them there); the reference for
the arguments is `json.loads` of what the rendered prompt holds.
"""

import json

import pytest

from lanes.text.chat import ChatTemplate
from lanes.tools import prompting
from lanes.tools.formats import HERMES, JSON, LLAMA3_JSON, choose
from lanes.tools.parser import parse
from test_chat_template import CHATML_TOOLS, LLAMA3, WEATHER_TOOL

PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
ARGS = [{"city": 'Z\u00fcrich "old town"'}, {"city": "a\\b\nc", "unit": "celsius"},
        {"city": "</tool_call> {\"name\": \"x\"}", "days": [1, 2]}, {}]


def conversation(arguments: dict) -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments, ensure_ascii=False)}}
    return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny \"21\""}]


def rendered(source: str, arguments: dict, fmt=None) -> tuple[str, object, prompting.TemplateTools]:
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    fmt = fmt or choose(source)
    renders = prompting.TemplateTools.probe(template)
    messages, tools = prompting.prepare(conversation(arguments), [WEATHER_TOOL], fmt, renders)
    return template.render(messages, add_generation_prompt=True, tools=tools), fmt, renders


@pytest.mark.parametrize("arguments", ARGS, ids=range(len(ARGS)))
def test_a_template_that_renders_calls_writes_string_arguments_once(arguments):
    prompt, fmt, renders = rendered(CHATML_TOOLS, arguments)
    assert fmt is HERMES and renders == prompting.TemplateTools(True, True, True)
    block = prompt[prompt.index("<|im_start|>assistant") :].split("<|im_end|>")[0]
    (call,) = parse(HERMES, block[block.index("<tool_call>") :]).calls
    assert call.name == "get_weather" and json.loads(call.arguments) == arguments
    assert 'sunny "21"' in prompt and "get_weather" in prompt[: prompt.index("<|im_start|>user")]


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, JSON], ids=["llama3_json", "json"])
@pytest.mark.parametrize("source", [LLAMA3, PLAIN], ids=["llama3", "plain"])
@pytest.mark.parametrize("arguments", ARGS, ids=range(len(ARGS)))
def test_a_template_that_drops_calls_gets_them_written_in_the_family_format(source, fmt, arguments):
    prompt, _, renders = rendered(source, arguments, fmt)
    assert not renders.calls
    if source is PLAIN:
        answer = prompt.split("<|assistant|>")[1].split("\n<|")[0]
    else:
        answer = prompt.split("assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    (call,) = parse(fmt, answer).calls
    assert call.name == "get_weather" and json.loads(call.arguments) == arguments
    assert 'sunny "21"' in prompt and (renders.results or "Result of the function call: " in prompt)
    assert renders.tools or "You can call these functions" in prompt

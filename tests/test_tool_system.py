"""`--tool-system` through the server: requests that carry tools get the tool system prompt in front (merged
with their own system message); a chat template without tool support gets the tool list written into that
system prompt, a template with tool support renders the tools itself; requests without tools get neither.

Rules: a live server on 127.0.0.1 port 0; a tiny random model built in the test; the prompt the lane core is
given is read back as token ids and must equal, exactly, a literal rendering written here, which transformers'
`apply_chat_template` and its tokenizer must also give; every test under `trio.fail_after`; the lane core's
integrity checked when the server stops.
"""

import json

import httpx
import pytest
import trio

import tiny
from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner, choose
from lanes.http.service import Service
from lanes.http.tool_system import ToolSystem
from lanes.loader import load_model
from lanes.text.tokenizer import Tokenizer
from server_helpers import serving

TOOLS_TEMPLATE = (  # a Qwen-style template: the tools in the system turn, after the system prompt
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n' }}{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TOOL_JSON = json.dumps(TOOLS[0], ensure_ascii=False)
RULES = "Use the tools when a fact is asked."
USER = {"role": "user", "content": "the cat"}
OWN = {"role": "system", "content": "Be brief."}
TAIL = "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"

EXPECTED = {  # (template, the request's own system message) -> (the prompt, the messages as rendered)
    ("plain", False): (f"<|im_start|>system\n{RULES}\n\nYou can call these tools:\n{TOOL_JSON}<|im_end|>\n" + TAIL,
                       [{"role": "system", "content": f"{RULES}\n\nYou can call these tools:\n{TOOL_JSON}"}, USER]),
    ("plain", True): (f"<|im_start|>system\n{RULES}\n\nYou can call these tools:\n{TOOL_JSON}\n\nBe brief.<|im_end|>\n" + TAIL,
                      [{"role": "system", "content": f"{RULES}\n\nYou can call these tools:\n{TOOL_JSON}\n\nBe brief."}, USER]),
    ("tools", False): (f"<|im_start|>system\n{RULES}\n\n# Tools\n{TOOL_JSON}\n<|im_end|>\n" + TAIL,
                       [{"role": "system", "content": RULES}, USER]),
    ("tools", True): (f"<|im_start|>system\n{RULES}\n\nBe brief.\n\n# Tools\n{TOOL_JSON}\n<|im_end|>\n" + TAIL,
                      [{"role": "system", "content": f"{RULES}\n\nBe brief."}, USER]),
}


class RecordingCore(LaneCore):
    """The lane core, keeping every prompt it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[tuple[int, ...]] = []

    async def submit(self, request):
        self.prompts.append(tuple(request.prompt))
        return await super().submit(request)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny model's folder (ChatML, no tool support) and a copy of its tokenizer with a tools template."""
    plain = tmp_path_factory.mktemp("plain")
    tiny.build("llama", plain)
    tools = tmp_path_factory.mktemp("tools")
    tiny.write_tokenizer(tools, chat_template=TOOLS_TEMPLATE)
    model = load_model(plain, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    return model, {"plain": plain, "tools": tools}


@pytest.mark.parametrize("own_system", [False, True], ids=["no-system", "own-system"])
@pytest.mark.parametrize("template", ["plain", "tools"])
async def test_the_tool_system_prompt_is_rendered_exactly(folders, template, own_system, tmp_path):
    from transformers import AutoTokenizer

    model, where = folders
    tokenizer = Tokenizer.from_folder(where[template], model.config.vocab_size)
    (tmp_path / "rules.txt").write_text(RULES)
    tool_system = ToolSystem.load(tmp_path / "rules.txt", tokenizer)
    assert tool_system.template_takes_tools == (template == "tools")
    backend = TorchBackend(model, CpuRunner(), lanes=2, max_model_len=256)
    core = RecordingCore(backend, text_factory(tokenizer), (), max_rows=256)
    service = Service(core, tokenizer, "tiny", "llama", 256, vocab_size=model.config.vocab_size, tool_system=tool_system)
    messages = ([OWN] if own_system else []) + [USER]
    with trio.fail_after(60):
        async with serving(service) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                for body in ({"messages": messages, "tools": TOOLS}, {"messages": messages}):
                    reply = await http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
                    assert reply.status_code == 200, reply.text
    with_tools, without = core.prompts
    expected, rendered_messages = EXPECTED[template, own_system]
    assert tokenizer.decode(list(with_tools), skip_special_tokens=False) == expected
    theirs = AutoTokenizer.from_pretrained(str(where[template]))
    assert theirs.apply_chat_template(rendered_messages, tools=TOOLS if template == "tools" else None,
                                      tokenize=False, add_generation_prompt=True) == expected
    assert list(with_tools) == theirs.encode(expected, add_special_tokens=False)
    plain = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert RULES not in plain and list(without) == theirs.encode(plain, add_special_tokens=False)  # no tools: nothing put in front

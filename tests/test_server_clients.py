"""Structured output and tool calls through real clients, on the default model (SmolLM2-135M-Instruct, whose
template has no tools section, so calls are plain JSON): the `openai` client's parse helper with a pydantic
model and tools streamed and not, langchain-openai's `with_structured_output` (all three methods) and
`bind_tools`, the OpenAI Agents SDK's tool-calling turn through /v1/responses and through chat completions,
and /v1/responses with `previous_response_id`.

Rules: a live server on 127.0.0.1 port 0 in the test's nursery; synchronous clients and the asyncio Agents
SDK run in worker threads (its tracing off: nothing leaves the machine); references are the clients' own
parsers, `jsonschema` and a strict JSON parser; every test under `trio.fail_after` (serving).
"""

import asyncio
import json
import time

import httpx
import jsonschema
import pytest
import trio
from pydantic import BaseModel

from lanes.gpu.device import choose
from lanes.loader import load_model
from lanes.models import resolve_model
from server_helpers import client, serving, torch_service
from test_grammar_torch import strict_json

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def smollm2():
    return load_model(resolve_model(None), choose("cpu", "fp32"), kv_blocks=512, quiet=True)


def service(model):
    return torch_service(model, lanes=4, max_model_len=2048, max_rows=256)


async def in_thread(fn):
    return await trio.to_thread.run_sync(fn)


async def test_openai_parse_helper_and_tools_streamed_and_not(smollm2):
    async with serving(service(smollm2)) as url:
        c = client(url)
        parsed = await in_thread(lambda: c.chat.completions.parse(
            model="default", messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
            temperature=0, max_tokens=200))
        assert isinstance(parsed.choices[0].message.parsed, City)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            whole = await in_thread(lambda: c.chat.completions.create(
                model="default", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.7, seed=3, max_tokens=200))
            call = whole.choices[0].message.tool_calls[0]
            assert whole.choices[0].finish_reason == "tool_calls"
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(strict_json(call.function.arguments), schema)
            chunks = await in_thread(lambda: list(c.chat.completions.create(
                model="default", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.7, seed=3, max_tokens=200,
                stream=True)))
            deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            assert [d.function.name for d in deltas if d.function.name] == [call.function.name]
            assert "".join(d.function.arguments or "" for d in deltas if d.index == 0) == call.function.arguments
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the call and its result back into the prompt: the template drops tool calls, so they go in as text
        follow = await in_thread(lambda: c.chat.completions.create(
            model="default", temperature=0, max_tokens=30, tools=TOOLS, tool_choice="none", messages=ASK + [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]))
        assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")


async def test_a_schema_keyword_that_cannot_be_enforced_is_refused_by_name_at_once(smollm2):
    async with serving(service(smollm2)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "strict": True, "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}
            took = []
            for _ in range(5):
                start = time.perf_counter()
                answer = await http.post("/v1/chat/completions", json=body)
                took.append(time.perf_counter() - start)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == ("response_format.json_schema.schema", "unsupported_schema")
            assert "'uniqueItems'" in error["message"]
            assert sorted(took)[2] < 0.05, took


async def test_langchain_structured_output_three_ways_and_bind_tools(smollm2):
    from langchain_openai import ChatOpenAI

    async with serving(service(smollm2)) as url:
        llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="default", temperature=0.6, seed=1, max_retries=0,
                         max_tokens=200)
        ask = "Name a large city, its country and its population."
        # strict: a schema without additionalProperties: false lets the model add properties, and a 135M
        # model may fill one until max_tokens (seen with function_calling once the CPU products changed)
        for method in ("json_schema", "function_calling"):
            city = await in_thread(lambda: llm.with_structured_output(City, method=method, strict=True).invoke(ask))
            assert isinstance(city, City), method
        loose = await in_thread(lambda: llm.with_structured_output(None, method="json_mode").invoke(
            ask + " Answer in JSON."))
        assert isinstance(loose, dict)
        bound = llm.bind_tools([TOOLS[0]], tool_choice="required")
        message = await in_thread(lambda: bound.invoke("What is the weather in Paris?"))
        assert message.tool_calls and {c["name"] for c in message.tool_calls} == {"get_weather"}
        for call in message.tool_calls:
            jsonschema.validate(call["args"], WEATHER)


def agents_turn(url: str, responses: bool):
    """One tool-calling turn of the Agents SDK: the model must call the tool, whose result is the final output."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run():
        openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                      model=kind(model="default", openai_client=openai),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=100),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        await openai.close()
        return result.final_output

    return asyncio.run(run()), calls


async def test_the_agents_sdk_runs_a_tool_turn_through_responses_and_chat(smollm2):
    async with serving(service(smollm2)) as url:
        for responses in (True, False):
            output, calls = await in_thread(lambda: agents_turn(url, responses))
            assert len(calls) == 1 and output == f"sunny in {calls[0]}", (responses, output, calls)


async def test_responses_streamed_and_not_with_previous_response_id(smollm2):
    async with serving(service(smollm2)) as url:
        c = client(url)
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        first = await in_thread(lambda: c.responses.create(model="default", input="What is the weather in Paris?",
                                                           tools=tools, tool_choice="required", temperature=0,
                                                           max_output_tokens=100))
        (call,) = [item for item in first.output if item.type == "function_call"]
        jsonschema.validate(strict_json(call.arguments), WEATHER)
        events = await in_thread(lambda: list(c.responses.create(
            model="default", input="What is the weather in Paris?", tools=tools, tool_choice="required",
            temperature=0, max_output_tokens=100, stream=True)))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = events[-1].response
        assert events[-1].type == "response.completed"
        streamed = [item for item in done.output if item.type == "function_call"]
        assert [(i.name, i.arguments) for i in streamed] == [(call.name, call.arguments)]
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == call.arguments
        second = await in_thread(lambda: c.responses.create(
            model="default", previous_response_id=first.id, temperature=0, max_output_tokens=20,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]))
        assert second.output[0].type == "message" and second.previous_response_id == first.id
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            missing = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
        assert json.loads(first.model_dump_json())["status"] == "completed"

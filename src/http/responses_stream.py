"""/v1/responses streamed: its events (response.created, output items added and done, text and function
call argument deltas, response.completed), each numbered, from the stream's text as the tool-call parser
reads it."""

from __future__ import annotations

import json
from typing import AsyncIterator

from ..core.stream import Failed, Finished, TokenEvent
from ..tools.parser import Arguments, CallOpened, Text
from . import errors
from .generation import close_all
from .generation import events as stream_events
from .responses_shapes import call_item, message_item, new_id, response_object, store, usage
from .tool_calls import new_parser


class _Output:
    """The output items as they are made, and the events each step makes."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            self.open = message_item(new_id("msg"), "", "in_progress")
            self.open["text"] = ""
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=_public(self.open)))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=len(self.items),
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.open["text"] += text
        out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                              content_index=0, delta=text, logprobs=[]))
        return out

    def call(self, name: str) -> list[str]:
        out = self.close()
        self.open = call_item(new_id("fc"), new_id("call"), name, "", "in_progress")
        out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.open))
        return out

    def arguments(self, text: str) -> list[str]:
        self.open["arguments"] += text
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=len(self.items), delta=text)]

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        out = []
        if item["type"] == "message":
            text = item.pop("text")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            item = message_item(item["id"], text, "completed")
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out


def _public(item: dict) -> dict:
    return {k: v for k, v in item.items() if k != "text"}


async def events(service, body, streams, tools, items, response_id, model, created, deadline, exchange
                 ) -> AsyncIterator[str]:
    output = _Output()
    parser = new_parser(service.tool_format, tools)
    start = response_object(body, response_id, model, created, [], "in_progress", None)
    try:
        yield output.event("response.created", response=start)
        yield output.event("response.in_progress", response=start)
        async for _, event in stream_events(streams, deadline, exchange.timing):
            if isinstance(event, TokenEvent):
                exchange.completion_tokens += 1
                text, end = event.text, False
            elif isinstance(event, Finished):
                text, end, finished = event.text, True, event
            elif isinstance(event, Failed):
                raise errors.from_engine(event.error, "input")
            else:
                continue
            deltas = ([Text(text)] if text else []) if parser is None else parser.push(text) + (parser.finish() if end else [])
            for delta in deltas:
                if isinstance(delta, Text):
                    for line in output.text(delta.text):
                        yield line
                elif isinstance(delta, CallOpened):
                    for line in output.call(delta.name):
                        yield line
                elif isinstance(delta, Arguments):
                    for line in output.arguments(delta.text):
                        yield line
        if output.open is None and not output.items:
            for line in output.text(""):
                yield line
        for line in output.close():
            yield line
        cut = finished.reason == "length"
        store(service, body, response_id, items, output.items)
        done = response_object(body, response_id, model, created, output.items, "incomplete" if cut else "completed",
                               usage(exchange.prompt_tokens, exchange.completion_tokens, finished.cached_tokens),
                               "max_output_tokens" if cut else None)
        yield output.event("response.incomplete" if cut else "response.completed", response=done)
    except errors.ApiError as error:
        exchange.status = error.status
        yield output.event("error", code=error.code, message=error.message, param=error.param)
    finally:
        await close_all(streams)

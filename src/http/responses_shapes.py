"""The Responses API's shapes: output items, the response object, its usage, and the store of finished ones."""

from __future__ import annotations

import secrets

from .response_store import StoredResponse
from .service import Service


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_object(body: dict, response_id: str, model: str, created: int, output: list[dict], status: str,
                    usage: dict | None, reason: str | None = None) -> dict:
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True), "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "usage": usage}


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def store(service: Service, body: dict, response_id: str, items: list[dict], output: list[dict]) -> None:
    if body.get("store", True) is not False:
        service.responses.put(StoredResponse(response_id, tuple(items) + tuple(output), body.get("instructions")))

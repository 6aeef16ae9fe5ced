"""The quart-trio application: routes, the API key, and every failure turned into OpenAI's error shape.

Nothing here holds state: handlers send commands to the lane core through `Service` and await replies.
"""

from __future__ import annotations

import hmac
import json

import trio

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge, RequestTimeout

from ..text.chat import ChatTemplateError
from . import decisions as decision_routes
from . import errors, parse
from .openai_api import Exchange, chat_completions, completions, with_media
from .service import Service

OPEN_PATHS = {"/health"}


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=status, headers=headers or {},
                    mimetype="application/json")


def error_response(error: errors.ApiError) -> Response:
    return json_response(error.body(), error.status, error.headers())


async def read_json(service: Service, field_status: int = 400) -> dict:
    """The body as a JSON object whose nesting and text every handler can take (`field_status` for a bad field)."""
    raw = await request.get_data(cache=False)
    if len(raw) > service.max_body:
        raise errors.body_too_large(service.max_body)
    try:
        body = json.loads(raw)
    except RecursionError:  # nested past the parser's stack, so past MAX_DEPTH too
        raise errors.nested_too_deeply(parse.MAX_DEPTH) from None
    except (ValueError, UnicodeDecodeError):
        raise errors.malformed_json() from None
    if not isinstance(body, dict):
        raise errors.not_an_object()
    parse.check_body(body, field_status)
    return body


def create_app(service: Service) -> QuartTrio:
    app = QuartTrio("lanes")
    app.config["RESPONSE_TIMEOUT"] = None  # long streams are ours to end, not Quart's
    app.config["BODY_TIMEOUT"] = service.body_timeout  # a client sending its body too slowly gets 408
    app.config["MAX_CONTENT_LENGTH"] = service.max_body

    @app.before_request
    async def authenticate():
        size = sum(len(k) + len(v) + 4 for k, v in request.headers.items())
        if size > service.max_headers:
            return error_response(errors.headers_too_large(service.max_headers))
        if service.api_key is None or request.path in OPEN_PATHS:
            return None
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {service.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return error_response(errors.unauthorized())
        return None

    async def generate(endpoint: str, handler):
        exchange = Exchange(service, endpoint)
        if not service.open_requests.try_enter():
            exchange.finish(429)
            return error_response(errors.too_many_open(service.max_open))
        streaming = False
        try:
            body = await read_json(service)
            result = await handler(service, body, exchange)
            if not isinstance(result, dict):
                streaming = True
                response = Response(held_open(result), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
                response.timeout = None
                return response
        except errors.ApiError as error:
            exchange.finish(error.status)
            return error_response(error)
        except HTTPException as error:  # a body too large or too slow: answered by the handlers below
            exchange.finish(error.code or 400)
            raise
        except BaseException:
            exchange.finish(499)  # the client went away (cancelled) or a bug (logged by the error handler)
            raise
        finally:
            if not streaming:
                service.open_requests.leave()
        exchange.finish(200)
        return json_response(result)

    async def held_open(events):
        """The SSE body; the request stays open (counted) until the stream ends or the client leaves."""
        try:
            async for chunk in events:
                yield chunk
        finally:
            service.open_requests.leave()

    @app.post("/v1/chat/completions")
    async def chat():
        return await generate("chat", chat_completions)

    @app.post("/v1/completions")
    async def complete():
        return await generate("completions", completions)

    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": 0, "owned_by": "lanes",
             "max_model_len": service.max_model_len}]})

    @app.get("/v1/info")
    async def info():
        return json_response(service.info())

    @app.get("/health")
    async def health():
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/v1/tokenize")
    async def tokenize():
        try:
            body = await read_json(service)
            parts = []
            ids = tokenize_body(service, body, parts)
            if parts:  # images and videos count as the rows they take
                ids = list((await with_media(service, ids, parts, trio.current_time() + service.request_timeout, "messages"))[0])
        except errors.ApiError as error:
            return error_response(error)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len})

    @app.post("/v1/detokenize")
    async def detokenize():
        try:
            body = await read_json(service)
            tokens = body.get("tokens")
            vocab = service.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise errors.wrong_type("tokens", "a list of token ids")
            if any(not 0 <= t < vocab for t in tokens):
                raise errors.out_of_range("tokens", f"token ids must be between 0 and {vocab - 1}")
        except errors.ApiError as error:
            return error_response(error)
        return json_response({"prompt": service.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def decide(endpoint: str, handler, field_status: int):
        if not service.decides:
            return error_response(errors.decisions_off())
        exchange = Exchange(service, endpoint)
        if not service.open_requests.try_enter():
            exchange.finish(429)
            return error_response(errors.too_many_open(service.max_open))
        try:
            body = await read_json(service, field_status)
            result = await handler(service, body)
        except errors.ApiError as error:
            exchange.finish(error.status)
            return error_response(error)
        except HTTPException as error:
            exchange.finish(error.code or 400)
            raise
        except BaseException:
            exchange.finish(499)
            raise
        finally:
            service.open_requests.leave()
        exchange.prompt_tokens = result["usage"]["input_tokens"]
        exchange.finish(200)
        return json_response(result)

    @app.post("/v1/decisions")
    async def decisions():
        return await decide("decisions", decision_routes.decisions, decision_routes.DECISIONS_STATUS)

    @app.post("/v1/systemone")
    async def systemone():
        return await decide("systemone", decision_routes.systemone, decision_routes.SYSTEMONE_STATUS)

    @app.errorhandler(errors.ApiError)
    async def api_error(error: errors.ApiError):
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        if isinstance(error, RequestEntityTooLarge):
            return error_response(errors.body_too_large(service.max_body))
        if isinstance(error, RequestTimeout):
            return error_response(errors.body_timeout(service.body_timeout))
        if isinstance(error, NotFound):
            return error_response(errors.not_found())
        if isinstance(error, MethodNotAllowed):
            return error_response(errors.method_not_allowed())
        return error_response(errors.ApiError(error.code or 400, error.description or "bad request", code="http_error"))

    @app.errorhandler(Exception)
    async def unexpected(error: Exception):
        service.log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(errors.internal())

    return app


def tokenize_body(service: Service, body: dict, parts: list | None = None) -> list[int]:
    tokenizer = service.tokenizer
    if "messages" in body:
        from .parse import messages

        try:
            text = tokenizer.render_chat(messages(body, service.vision, parts),
                                         add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        except ChatTemplateError as error:
            raise errors.chat_template(str(error)) from None
        return tokenizer.encode_prompt(text)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise errors.wrong_type("prompt", "a string")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise errors.wrong_type("add_special_tokens", "a boolean")
    return tokenizer.encode(prompt, add_special_tokens=special)

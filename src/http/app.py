"""The application the HTTP server runs: routes, the API key, and every failure in OpenAI's error shape.

Nothing here holds state: handlers send commands to the lane core through `Service` and await replies.
"""

from __future__ import annotations

import hmac
import json
from typing import AsyncIterator, Awaitable, Callable

from . import decisions as decision_routes
from . import errors, parse
from .exchange import Exchange
from .chat import chat_completions
from .openai_api import completions
from .responses import responses
from .protocol import HttpRequest, HttpResponse
from .service import Service
from .tokenizing import detokenize_body, tokenize_body, tokenizer_info

Handler = Callable[[HttpRequest, Exchange], Awaitable[HttpResponse]]
OPEN_PATHS = {"/health"}
MODEL_PREFIX = "/v1/models/"


def json_response(payload, status: int = 200, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    return HttpResponse(status, json.dumps(payload, ensure_ascii=False).encode(), headers=headers or [])


def error_response(error: errors.ApiError) -> HttpResponse:
    return json_response(error.body(), error.status, list(error.headers().items()))


def read_json(service: Service, request: HttpRequest, field_status: int = 400) -> dict:
    """The body as a JSON object whose nesting and text every handler can take (`field_status` for a bad field)."""
    try:
        body = json.loads(request.body)
    except RecursionError:  # nested past the parser's stack, so past MAX_DEPTH too
        raise errors.nested_too_deeply(parse.MAX_DEPTH) from None
    except (ValueError, UnicodeDecodeError):
        raise errors.malformed_json() from None
    if not isinstance(body, dict):
        raise errors.not_an_object()
    parse.check_body(body, field_status)
    return body


class LanesApp:
    """What `HttpServer` runs: a request's exchange opened at its head, its answer once its body is read."""

    def __init__(self, service: Service) -> None:
        self.service = service
        tokenize = ("tokenize", self.tokenize)
        detokenize = ("detokenize", self.detokenize)
        self.routes: dict[str, dict[str, tuple[str, Handler]]] = {
            "/v1/chat/completions": {"POST": ("chat", self.chat)},
            "/v1/completions": {"POST": ("completions", self.complete)},
            "/v1/responses": {"POST": ("responses", self.respond)},
            "/v1/models": {"GET": ("models", self.models)},
            "/v1/info": {"GET": ("info", self.info)},
            "/health": {"GET": ("health", self.health)},
            "/metrics": {"GET": ("metrics", self.metrics)},
            "/v1/tokenize": {"POST": tokenize}, "/tokenize": {"POST": tokenize},
            "/v1/detokenize": {"POST": detokenize}, "/detokenize": {"POST": detokenize},
            "/tokenizer_info": {"GET": ("tokenizer_info", self.tokenizer_info)},
            "/v1/decisions": {"POST": ("decisions", self.decisions)},
            "/v1/systemone": {"POST": ("systemone", self.systemone)},
        }
        self._model = {"GET": ("models", self.model)}

    # ---- the server's side (lanes.http.protocol.App) ----

    def _route(self, path: str) -> dict[str, tuple[str, Handler]] | None:
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            return self._model
        return self.routes.get(path)

    def open(self, request: HttpRequest) -> Exchange:
        route = self._route(request.path)
        method = "GET" if request.method == "HEAD" else request.method
        endpoint = route[method][0] if route is not None and method in route else "unrouted"
        return Exchange(self.service, endpoint, request.headers.get("x-request-id"))

    async def handle(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        route = self._route(request.path)
        try:
            if route is None:
                raise errors.not_found()
            method = "GET" if request.method == "HEAD" else request.method
            if method not in route:
                raise errors.method_not_allowed()
            if request.path not in OPEN_PATHS:
                self._authenticate(request)
            return await route[method][1](request, exchange)
        except errors.ApiError as error:
            return error_response(error)

    def refusal(self, status: int, exchange: Exchange | None) -> HttpResponse:
        limits = self.service.limits
        known = {408: lambda: errors.body_timeout(limits.body_timeout),
                 413: lambda: errors.body_too_large(limits.max_body),
                 431: lambda: errors.headers_too_large(limits.max_headers),
                 500: errors.internal, 503: errors.out_of_memory}
        return error_response(known[status]() if status in known else errors.malformed_request(status))

    def _authenticate(self, request: HttpRequest) -> None:
        key = self.service.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("latin-1"), f"Bearer {key}".encode()):
            raise errors.unauthorized()

    # ---- generation and decisions: counted against --max-open while they are answered ----

    async def _counted(self, request: HttpRequest, run: Callable[[dict], Awaitable], field_status: int = 400):
        """`run(body)` inside an open-request slot; a streamed answer keeps its slot until its stream ends."""
        service = self.service
        if not service.open_requests.try_enter():
            raise errors.too_many_open(service.max_open)
        streaming = False
        try:
            result = await run(read_json(service, request, field_status))
            if not isinstance(result, (dict, HttpResponse)):
                streaming = True
                return HttpResponse(200, self._held_open(result), "text/event-stream", [("cache-control", "no-cache")])
            return result if isinstance(result, HttpResponse) else json_response(result)
        finally:
            if not streaming:
                service.open_requests.leave()

    async def _held_open(self, events: AsyncIterator[str]) -> AsyncIterator[bytes]:
        """The SSE body; the request stays open (counted) until the stream ends or the client leaves."""
        try:
            async for chunk in events:
                yield chunk.encode()
        finally:
            self.service.open_requests.leave()

    async def chat(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._counted(request, lambda body: chat_completions(self.service, body, exchange))

    async def complete(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._counted(request, lambda body: completions(self.service, body, exchange))

    async def respond(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._counted(request, lambda body: responses(self.service, body, exchange))

    async def tokenize(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._counted(request, lambda body: tokenize_body(self.service, body))

    async def decisions(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._decide(request, exchange, decision_routes.decisions, decision_routes.DECISIONS_STATUS)

    async def systemone(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return await self._decide(request, exchange, decision_routes.systemone, decision_routes.SYSTEMONE_STATUS)

    async def _decide(self, request: HttpRequest, exchange: Exchange, handler, field_status: int) -> HttpResponse:
        if not self.service.decides:
            raise errors.decisions_off()

        async def run(body: dict) -> dict:
            result = await handler(self.service, body)
            exchange.prompt_tokens = result["usage"]["input_tokens"]
            return result

        return await self._counted(request, run, field_status)

    # ---- the rest ----

    async def models(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return json_response({"object": "list", "data": [self.service.model_card()]})

    async def model(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        name = request.path[len(MODEL_PREFIX):]
        if name != self.service.model_name:
            raise errors.unknown_model(name, self.service.model_name)
        return json_response(self.service.model_card())

    async def info(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return json_response(self.service.info())

    async def health(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return json_response({"status": "ok"})

    async def metrics(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return HttpResponse(200, self.service.metrics.render(), "text/plain; version=0.0.4")

    async def detokenize(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return json_response(detokenize_body(self.service, read_json(self.service, request)))

    async def tokenizer_info(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return json_response(tokenizer_info(self.service))

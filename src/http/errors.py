"""Every refusal the server gives, worded once, in OpenAI's error shape.

`{"error": {"message", "type", "param", "code"}}`. The words here are frozen: `tests/golden/` holds one
request and its exact answer for each, and a golden test diffs them against a live server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..core.sampling import InvalidParameter
from ..core.stream import BackendFailed, EmptyPrompt, EngineError, PromptTooLong, QueueFull, QueueTimeout, ShuttingDown

INVALID = "invalid_request_error"


@dataclass(frozen=True)
class ApiError(Exception):
    """A refusal: HTTP status, OpenAI error type, the parameter at fault and a stable code."""

    status: int
    message: str
    type: str = INVALID
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        return json.dumps(self.body())

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status in UNREAD_BODY:
            headers["Connection"] = "close"  # what is left of the request is unread: no next request can follow
        return headers


UNREAD_BODY = (408, 413, 431)  # refusals sent before the request has been read to its end


def malformed_json() -> ApiError:
    return ApiError(400, "the request body is not valid JSON", code="malformed_json")


def not_an_object() -> ApiError:
    return ApiError(400, "the request body must be a JSON object", code="malformed_json")


def nested_too_deeply(limit: int) -> ApiError:
    return ApiError(400, f"the request body is nested more than {limit} levels deep", code="malformed_json")


def not_unicode(param: str, status: int = 400) -> ApiError:
    return ApiError(status, f"'{param}' is not valid Unicode text", param=param, code="invalid_value")


def missing(param: str) -> ApiError:
    return ApiError(400, f"'{param}' is required", param=param, code="missing_parameter")


def wrong_type(param: str, expected: str) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}", param=param, code="invalid_type")


def out_of_range(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def unknown_parameter(param: str) -> ApiError:
    return ApiError(400, f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")


def unsupported(param: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported by this server", param=param, code="unsupported_parameter")


def unknown_role(param: str, roles: tuple[str, ...]) -> ApiError:
    return ApiError(400, f"'{param}' must be one of {', '.join(roles)}", param=param, code="invalid_value")


def empty_prompt(param: str) -> ApiError:
    """A prompt of no tokens (an empty string where the tokenizer adds no BOS): there is nothing to continue."""
    return ApiError(400, f"the prompt in '{param}' is empty: a prompt needs at least one token", param=param,
                    code="invalid_value")


def logit_bias_key() -> ApiError:
    return ApiError(400, "'logit_bias' keys must be token ids written as decimal integers", param="logit_bias",
                    code="invalid_value")


def max_tokens_zero() -> ApiError:
    return ApiError(400, "max_tokens may be 0 only with echo (the prompt and its logprobs, no completion)",
                    param="max_tokens", code="invalid_value")


def generation_prompt_and_continue() -> ApiError:
    return ApiError(400, "add_generation_prompt and continue_final_message cannot both be true; set "
                         "add_generation_prompt to false to continue the final message", param="continue_final_message",
                    code="invalid_value")


def reserved_template_variable(param: str, name: str) -> ApiError:
    return ApiError(400, f"'{param}' cannot be set: the request itself gives the template '{name}'", param=param,
                    code="invalid_value")


def schema_keyword(param: str, keyword: str, detail: str) -> ApiError:
    """A JSON schema with a keyword the grammar engine cannot enforce (it would be ignored, not honoured)."""
    return ApiError(400, f"'{param}' uses the JSON schema keyword '{keyword}', which this server cannot enforce "
                         f"({detail})", param=param, code="unsupported_schema")


def invalid_grammar(param: str, detail: str) -> ApiError:
    return ApiError(400, f"'{param}' is not a grammar this server can enforce: {detail}", param=param,
                    code="invalid_grammar")


def conflicting_constraints(param: str, other: str) -> ApiError:
    return ApiError(400, f"'{param}' cannot be given with '{other}': a request holds its answer to one of them",
                    param=param, code="invalid_value")


def tool_choice_without_tools(param: str = "tool_choice") -> ApiError:
    return ApiError(400, f"'{param}' asks for a tool call but the request gives no tools", param=param,
                    code="invalid_value")


def unknown_tool(param: str, name: str) -> ApiError:
    return ApiError(400, f"'{param}' names the function '{name}', which is not among the request's tools", param=param,
                    code="invalid_value")


def unknown_response(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response has the id '{response_id}' (responses are kept in memory, the newest "
                         "only)", param="previous_response_id", code="response_not_found")


def unknown_model(name: str, served: str) -> ApiError:
    return ApiError(404, f"the model '{name}' does not exist; this server serves '{served}'", param="model",
                    code="model_not_found")


def context_exceeded(tokens: int, limit: int, param: str = "messages", status: int = 400,
                     remedy: str = "shorten the prompt or lower max_tokens") -> ApiError:
    return ApiError(status, f"this request needs {tokens} tokens of context but the model's limit is {limit}; {remedy}",
                    param=param, code="context_length_exceeded")


def decision_too_long(tokens: int, limit: int, param: str, status: int = 400) -> ApiError:
    """context_exceeded for a decision, which has no max_tokens to lower."""
    return context_exceeded(tokens, limit, param, status, "shorten the input or the questions")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes", code="body_too_large")


def headers_too_large(limit: int) -> ApiError:
    return ApiError(431, f"the request headers are larger than the limit of {limit} bytes", code="headers_too_large")


def body_timeout(seconds: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {seconds:g} seconds", code="body_timeout")


def too_many_open(limit: int) -> ApiError:
    return ApiError(429, f"the server already holds {limit} open requests; retry shortly", type="rate_limit_error",
                    code="too_many_open_requests", retry_after=1)


def vision_off(param: str = "messages", status: int = 400) -> ApiError:
    return ApiError(status, "image and video inputs need a server started with --vision", param=param,
                    code="vision_disabled")


def image_outside_user(param: str) -> ApiError:
    """An `input_image` part of /v1/decisions in a system or developer message."""
    return ApiError(400, f"'{param}' is an image outside a user message; images go in user messages", param=param,
                    code="invalid_request")


def asset_not_in_state(key: str) -> ApiError:
    """A System One asset whose key the state never mentions: there is no place to put its image."""
    return ApiError(422, f"the asset key '{key}' does not appear in 'state'", param=f"assets.{key}",
                    code="invalid_request")


def asset_value(param: str, allowed: tuple[str, ...]) -> ApiError:
    """A System One asset's `type` or `format` that is not one the endpoint takes."""
    return ApiError(422, f"'{param}' must be {' or '.join(allowed)}", param=param, code="invalid_request")


# Images and videos refused: fetching (lanes.http.media_fetch's codes) and decoding (lanes.vision.errors' codes).
MEDIA_WORDS = {
    "media_urls_disabled": "image and video URLs need a server started with --vision-urls; send a data URL instead",
    "bad_url": "media URLs must be https URLs with a host and no user name or password",
    "address_not_allowed": "the media URL's host resolves to an address that is not public",
    "too_many_redirects": "the media URL redirected too many times",
    "media_too_large": "the image or video is larger than the server accepts",
    "media_timeout": "fetching the image or video took longer than the server allows",
    "bad_status": "the media URL did not answer with a success status",
    "bad_content_type": "the media URL's content type does not match the part (JPEG or PNG for images, MP4 for videos)",
    "bad_data_url": "data URLs must be base64 with a media type that matches the part (image/jpeg, image/png, video/mp4)",
    "fetch_failed": "the media URL could not be fetched (resolution, connection or TLS failed)",
    "image_unreadable": "the image could not be decoded as JPEG or PNG",
    "image_truncated": "the image data is truncated or corrupt",
    "image_format": "only JPEG and PNG images are accepted",
    "image_too_large": "the image has too many pixels",
    "image_aspect_ratio": "the image is too narrow: one side is over 200 times the other",
    "video_unreadable": "the video could not be decoded as mp4",
    "video_malformed": "the video's container declares counts or sizes that its data cannot hold or that exceed the server's limits",
    "video_codec": "the video's codec is not one the server decodes (H.264, HEVC, AV1, VP9 or MPEG-4 part 2)",
    "video_no_stream": "the file has no video stream",
    "video_too_short": "the video has too few frames",
    "video_too_long": "the video has too many frames",
    "video_too_large": "the video's frames have too many pixels",
    "video_aspect_ratio": "the video is too narrow: one side is over 200 times the other",
    "media_over_budget": "decoding the image or video would take more memory than the server allows one part",
}


def media_refused(code: str, param: str | None) -> ApiError:
    return ApiError(400, MEDIA_WORDS[code], param=param, code=code)


def too_many_media_parts(given: int, limit: int, param: str | None = None) -> ApiError:
    """More image and video parts than --max-media-parts, refused before any is fetched."""
    return ApiError(400, f"the request has {given} images and videos but the server takes at most {limit} a request",
                    param=param, code="too_many_media_parts")


def media_placeholders(images: int, videos: int, given_images: int, given_videos: int, param: str = "prompt") -> ApiError:
    return ApiError(400, f"the prompt holds {images} image and {videos} video placeholders but the request gives "
                         f"{given_images} images and {given_videos} videos", param=param, code="media_placeholders")


def not_found() -> ApiError:
    return ApiError(404, "no such endpoint", code="not_found")


def decisions_off() -> ApiError:
    return ApiError(404, "decisions need a server started with --decider", code="decider_disabled")


def method_not_allowed() -> ApiError:
    return ApiError(405, "this method is not allowed on this endpoint", code="method_not_allowed")


def unauthorized() -> ApiError:
    return ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", type="authentication_error",
                    code="invalid_api_key")


def queue_full() -> ApiError:
    return ApiError(429, "the server is busy: every lane is taken and the queue is full; retry shortly",
                    type="rate_limit_error", code="queue_full", retry_after=1)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


def deadline_exceeded() -> ApiError:
    return ApiError(504, "the request did not finish before its deadline", type="timeout_error", code="deadline_exceeded")


def chat_template(message: str) -> ApiError:
    return ApiError(400, f"the chat template refused these messages: {message}", param="messages", code="chat_template")


def no_chat_template() -> ApiError:
    return ApiError(400, "this model has no chat template; use /v1/completions", param="messages", code="chat_template")


def internal() -> ApiError:
    return ApiError(500, "the server failed to answer this request", type="server_error", code="internal_error")


def out_of_memory() -> ApiError:
    return ApiError(503, "the server ran out of memory answering this request; retry shortly", type="server_error",
                    code="out_of_memory", retry_after=1)


def malformed_request(status: int = 400) -> ApiError:
    """A request the HTTP/1.1 parser refused (a bad request line, header or framing)."""
    return ApiError(status, "the request is not valid HTTP/1.1", code="malformed_request")


def model_failed() -> ApiError:
    return ApiError(503, "the model failed and the server is stopping", type="server_error", code="model_failed")


def from_engine(error: Exception, prompt_param: str = "messages") -> ApiError:
    """The frozen answer for an error the lane core raised (`prompt_param` names where the prompt came from)."""
    if isinstance(error, InvalidParameter):
        return out_of_range(error.param, error.message)
    if isinstance(error, QueueFull):
        return queue_full()
    if isinstance(error, ShuttingDown):
        return shutting_down()
    if isinstance(error, EmptyPrompt):
        return empty_prompt(prompt_param)
    if isinstance(error, PromptTooLong):
        return context_exceeded(error.tokens, error.limit, prompt_param)
    if isinstance(error, QueueTimeout):
        return deadline_exceeded()
    if isinstance(error, BackendFailed):
        return model_failed()
    if isinstance(error, EngineError):
        return ApiError(400, str(error), code="engine_refused")
    return internal()

"""POST /v1/tokenize and /v1/detokenize, and vLLM's root /tokenize, /detokenize and /tokenizer_info (what
lm-evaluation-harness's `tokenizer_backend=remote` reads): the model's tokenizer over HTTP."""

from __future__ import annotations

import trio

from ..text.chat import ChatTemplateError
from . import errors, parse
from .openai_api import check_model, with_media
from .service import Service


async def tokenize_body(service: Service, body: dict) -> dict:
    """A prompt's or a chat's token ids (images and videos count as the rows they take)."""
    check_model(service, body)
    tokenizer = service.tokenizer
    return_strs = parse.boolean(body, "return_token_strs", False)
    if "messages" in body:
        parts: list = []
        messages = parse.messages(body, service.vision, parts)
        try:  # encoded as chat is, client text never as control tokens
            ids = tokenizer.encode_chat(messages, tools=parse.tools(body), **parse.template_options(body))
        except ChatTemplateError as error:
            raise errors.chat_template(str(error)) from None
        if parts:
            deadline = trio.current_time() + service.request_timeout
            ids = list((await with_media(service, ids, parts, deadline, "messages"))[0])
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise errors.wrong_type("prompt", "a string")
        ids = tokenizer.encode(prompt, add_special_tokens=parse.boolean(body, "add_special_tokens", True))
    answer = {"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len}
    if return_strs:
        answer["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return answer


def detokenize_body(service: Service, body: dict) -> dict:
    check_model(service, body)
    tokens = body.get("tokens")
    vocab = service.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise errors.wrong_type("tokens", "a list of token ids")
    if any(not 0 <= t < vocab for t in tokens):
        raise errors.out_of_range("tokens", f"token ids must be between 0 and {vocab - 1}")
    return {"prompt": service.tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(service: Service) -> dict:
    """The tokenizer's configuration as vLLM reports it (tokenizer_config.json's fields)."""
    tokenizer = service.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    template = tokenizer.chat_template
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id), "pad_token": text(tokenizer.pad_id),
            "chat_template": template.source if template is not None else None,
            "model_max_length": service.max_model_len, "vocab_size": service.vocab_size}

"""One model's tokenizer: text to ids and back, its special ids and its chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from ..checkpoint.errors import CheckpointError
from .chat import ChatTemplate, ChatTemplateError
from .chat_encoding import ChatEncoder, control_tokens
from .detok import ByteDetokenizer, IncrementalDetokenizer, byte_pieces, with_special_pieces
from .gguf_vocab import adds_bos, adds_eos, build_gguf_tokenizer

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")  # an AddedToken's options besides `special`

# Tokens llama.cpp ends generation on by their text, whatever the file's eos id says.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    }
)


class Tokenizer:
    """A `tokenizers.Tokenizer` with what a server needs around it.

    Promises: `encode` gives the ids transformers gives for the same files (BOS added once, by one
    post-processor); every id it gives is below the model's vocabulary size (checked at load);
    `decode` and `detokenizer()` agree; `render_chat` and `encode_chat` raise only ChatTemplateError.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        pad_id: int | None,
        chat_template: ChatTemplate | None,
        eos_id: int | None = None,
        chat_control_tokens: Iterable[str] | None = None,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._bos_id = bos_id
        self._eos_ids = frozenset(eos_ids)
        self._eos_id = eos_id if eos_id in self._eos_ids else min(self._eos_ids, default=None)
        self._pad_id = pad_id
        self._chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(index for index, token in added.items() if token.special)
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        # Built here, with the tokenizer (~0.15 s for 50k ids), so that no stream's first token waits for it.
        self._pieces = byte_pieces(backend, vocab, self._special_ids)
        self._pieces_with_special = with_special_pieces(backend, vocab, self._pieces, self._special_ids)
        literal = chat_template.literal_text if chat_template is not None else ""
        control = control_tokens(added, literal, chat_control_tokens)
        self._chat = ChatEncoder(backend, control, chat_template.source if chat_template is not None else "")

    @classmethod
    def from_folder(cls, folder: Path, vocab_size: int) -> Tokenizer:
        """A Hugging Face folder's tokenizer: tokenizer.json, tokenizer_config.json, chat_template.jinja
        and generation_config.json, read as transformers reads them. Raises CheckpointError naming the
        file at fault, or tokenizer.json when its ids do not fit `vocab_size` (the embedding rows)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(path, "no such file")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        # tokenizers reports every parse failure as a bare Exception.
        except Exception as error:
            raise CheckpointError(path, f"not a tokenizer file ({_one_line(error)})") from None
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        names = {name: _content(config.get(name)) for name in SPECIAL_NAMES}
        _add_named_specials(backend, config)
        # BOS and EOS come from tokenizer.json's post-processor alone: transformers (v5) drops the
        # config's add_bos_token/add_eos_token whenever a tokenizer.json is there.
        eos_ids = {backend.token_to_id(names["eos_token"])} if names["eos_token"] else set()
        eos_ids |= set(_ids(generation.get("eos_token_id")))
        pad_id = backend.token_to_id(names["pad_token"]) if names["pad_token"] else generation.get("pad_token_id")
        template = _folder_template(folder, config, names)
        listed = config.get("chat_control_tokens")
        tokenizer = cls(
            backend,
            bos_id=backend.token_to_id(names["bos_token"]) if names["bos_token"] else None,
            eos_ids=(index for index in eos_ids if index is not None),
            pad_id=pad_id if isinstance(pad_id, int) else None,
            chat_template=template,
            eos_id=backend.token_to_id(names["eos_token"]) if names["eos_token"] else None,
            chat_control_tokens=[t for t in listed if isinstance(t, str)] if isinstance(listed, list) else None,
        )
        tokenizer._check_fits(path, vocab_size)
        return tokenizer

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], path: Path, vocab_size: int) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes, with llama.cpp's BOS default and its
        end-of-generation set (eos, eot and eom ids, and tokens whose text llama.cpp ends on)."""
        path = Path(path)
        backend = build_gguf_tokenizer(metadata, path)
        tokens = metadata["tokenizer.ggml.tokens"]
        sentencepiece = metadata.get("tokenizer.ggml.model") == "llama"

        def token_id(key: str, default: int | None) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}_token_id", default)
            return value if isinstance(value, int) and 0 <= value < len(tokens) else default

        # llama.cpp's ids for a SentencePiece file that names none.
        bos_id = token_id("bos", 1 if sentencepiece else None)
        eos_id = token_id("eos", 2 if sentencepiece else None)
        bos = (tokens[bos_id], bos_id) if bos_id is not None and adds_bos(metadata) else None
        eos = (tokens[eos_id], eos_id) if eos_id is not None and adds_eos(metadata) else None
        backend.post_processor = _bos_eos_processor(bos, eos)
        eos_ids = {eos_id, token_id("eot", None), token_id("eom", None)}
        eos_ids |= {index for index, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS}
        source = metadata.get("tokenizer.chat_template")
        template = None
        if isinstance(source, str):
            try:
                template = ChatTemplate(
                    source,
                    bos_token=tokens[bos_id] if bos_id is not None else None,
                    eos_token=tokens[eos_id] if eos_id is not None else None,
                )
            except ChatTemplateError as error:
                raise CheckpointError(path, f"tokenizer.chat_template: {error}") from None
        tokenizer = cls(
            backend,
            bos_id=bos_id,
            eos_ids=(index for index in eos_ids if index is not None),
            pad_id=token_id("padding", None),
            chat_template=template,
            eos_id=eos_id,
        )
        tokenizer._check_fits(path, vocab_size)
        return tokenizer

    def _check_fits(self, path: Path, vocab_size: int) -> None:
        if self._vocab_size > vocab_size:
            fault = f"tokenizer has {self._vocab_size} tokens but the model's vocabulary is {vocab_size}"
            raise CheckpointError(path, fault)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; with `add_special_tokens`, BOS (and EOS) where the tokenizer adds them."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a rendered chat prompt: no tokens added, since the template writes any BOS itself
        (as transformers' `apply_chat_template(tokenize=True)` does)."""
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def same_as(self, other: "Tokenizer") -> bool:
        """Whether `other` gives every text the same ids (the same vocabulary, specials and end ids)."""
        return (self._backend.get_vocab(with_added_tokens=True) == other._backend.get_vocab(with_added_tokens=True)
                and self._special_ids == other._special_ids and self._eos_ids == other._eos_ids
                and self._backend.to_str() == other._backend.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id (its `eos_token`), one of `eos_ids`."""
        return self._eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end generation."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's own size: its largest id plus one (the model's may be larger, padded)."""
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens: `decode` leaves them out, and their text in a prompt is one token."""
        return self._special_ids

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._chat_template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a conversation; raises ChatTemplateError when it cannot be rendered."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tools=tools, **extra)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """The prompt ids for a conversation from a client: control tokens typed into its strings (messages,
        tools, template variables) are encoded as text, so only the template's own markup gives control
        tokens (transformers' `sanitize_control_tokens=True`). Without such text, `encode_prompt(render_chat(...))`.
        Raises ChatTemplateError."""
        chat = self._chat
        markers = chat.markers(messages, tools, extra)
        text = self.render_chat(chat.mark(messages, markers), add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                tools=chat.mark(tools, markers) if tools is not None else None, **chat.mark(extra, markers))
        return chat.encode(text, markers)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine reads its vocabulary from)."""
        return self._backend.to_str()

    def detokenizer(self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True) -> IncrementalDetokenizer | ByteDetokenizer:
        """A streaming decoder for one generation; `prompt_ids` set the first token's leading space; special
        tokens give their text unless skipped, as in `decode`. A byte-level BPE's gives the same text from a
        table of its ids' bytes, without decode calls."""
        pieces = self._pieces if skip_special_tokens else self._pieces_with_special
        if pieces is not None:
            return ByteDetokenizer(pieces, prompt_ids)
        if skip_special_tokens:
            return IncrementalDetokenizer(self.decode, prompt_ids)
        return IncrementalDetokenizer(lambda ids: self.decode(ids, skip_special_tokens=False), prompt_ids)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"unreadable JSON ({_one_line(error)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, "not a JSON object")
    return value


def _content(token: Any) -> str | None:
    """A special token's text, from a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _ids(value: Any) -> list[int]:
    """An id or a list of ids, as generation_config.json writes eos_token_id."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _add_named_specials(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """Make the config's named and extra special tokens special added tokens, as transformers does."""
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else extra  # transformers v5 also names them
    wanted = [config.get(name) for name in SPECIAL_NAMES] + (extra if isinstance(extra, list) else [])
    tokens = []
    for token in wanted:
        content = _content(token)
        if content is None or (content in added and added[content].special):
            continue
        if content in added:  # an added token the config names: keep its flags, make it special
            flags = {key: getattr(added[content], key) for key in TOKEN_FLAGS}
        else:
            flags = {key: token[key] for key in TOKEN_FLAGS if isinstance(token, dict) and key in token}
        tokens.append(AddedToken(content, special=True, **{"normalized": False, **flags}))
    backend.add_special_tokens(tokens)


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """`bos $A eos`, each only when given as (text, id), as transformers' `update_post_processor` builds it."""
    # Placeholder names in the template, since a token's own text may hold the template's ':' separator.
    first, last = ("bos:0 " if bos else ""), (" eos:0" if eos else "")
    single = f"{first}$A:0{last}"
    pair = f"{single} {first.replace(':0', ':1')}$B:1{last.replace(':0', ':1')}"
    named = (("bos", bos), ("eos", eos))
    specials = [{"id": name, "ids": [token[1]], "tokens": [token[0]]} for name, token in named if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _folder_template(folder: Path, config: Mapping[str, Any], names: Mapping[str, str | None]) -> ChatTemplate | None:
    """chat_template.jinja if present (it wins, as in transformers), else tokenizer_config's template
    (a string, or a list of named ones of which "default" is taken)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(path, f"unreadable ({_one_line(error)})") from None
    else:
        path = folder / "tokenizer_config.json"
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if not isinstance(source, str):
        return None
    try:
        return ChatTemplate(source, bos_token=names["bos_token"], eos_token=names["eos_token"])
    except ChatTemplateError as error:
        raise CheckpointError(path, str(error)) from None

"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer metadata, the way llama.cpp reads it.

Two vocabularies are understood (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE from `tokens` and `merges`, split first by the rules `tokenizer.ggml.pre` names;
- `llama`: SentencePiece BPE from `tokens` and `scores`, with `<0x..>` byte-fallback tokens.
Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens,
so either is one token wherever its text appears.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ..checkpoint.errors import CheckpointError

# llama.cpp's token types (llama_token_type); 5 is "unused" and 6 a byte token, neither added.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# The split rules of Llama 3's and Qwen2's tokenizer.json, which llama.cpp copies for these pre names.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def gpt2_rules() -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex, then its byte alphabet (`tokenizers` builds the regex into ByteLevel)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


def digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Every digit on its own first (llama.cpp's `\\p{N}` split), as SmolLM2's and StarCoder's tokenizer.json do."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_rules()])


@dataclass(frozen=True)
class PreTokenizerRule:
    build: Callable[[], pre_tokenizers.PreTokenizer]
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    ignore_merges: bool = False  # a whole word found in the vocabulary is one token (Llama 3)


GPT2 = PreTokenizerRule(gpt2_rules)
LLAMA3 = PreTokenizerRule(split_then_bytes(LLAMA3_SPLIT), add_bos=True, ignore_merges=True)
QWEN2 = PreTokenizerRule(split_then_bytes(QWEN2_SPLIT))
DIGITS = PreTokenizerRule(digits_then_gpt2)

# `tokenizer.ggml.pre` -> rules, as llama-vocab.cpp maps them; a missing pre is llama.cpp's "default".
PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "default": GPT2,
    "gpt2": GPT2,
    "gpt-2": GPT2,
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "llama-bpe": LLAMA3,
    "dbrx": PreTokenizerRule(split_then_bytes(LLAMA3_SPLIT)),
    "smaug-bpe": PreTokenizerRule(split_then_bytes(LLAMA3_SPLIT)),
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "smollm": DIGITS,
    "starcoder": DIGITS,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (spaces are `Ġ`, newlines `Ċ`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def _need(metadata: Mapping[str, Any], key: str, path: Path, kind: type) -> Any:
    value = metadata.get(key)
    if not isinstance(value, kind):
        raise CheckpointError(path, f"metadata has no {key} (or it is not a {kind.__name__})")
    return value


def adds_bos(metadata: Mapping[str, Any]) -> bool:
    """Whether encoding starts with BOS: `tokenizer.ggml.add_bos_token`, else llama.cpp's default
    (always for SentencePiece, for byte-level BPE only where the pre-tokenizer says so, e.g. Llama 3)."""
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if isinstance(flag, bool):
        return flag
    if metadata.get("tokenizer.ggml.model") == "llama":
        return True
    rule = PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre", "default"))
    return rule is not None and rule.add_bos


def adds_eos(metadata: Mapping[str, Any]) -> bool:
    return metadata.get("tokenizer.ggml.add_eos_token") is True


def build_gguf_tokenizer(metadata: Mapping[str, Any], path: Path) -> Tokenizer:
    """The tokenizer the metadata describes, with no post-processor (BOS is the caller's choice).

    Raises CheckpointError naming `path` for a vocabulary this cannot build: an unknown model or pre,
    missing tokens or merges, or merges that name tokens not in the vocabulary.
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens = _need(metadata, "tokenizer.ggml.tokens", path, list)
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if model == "gpt2":
        tokenizer = _byte_level(metadata, tokens, types, path)
    elif model == "llama":
        tokenizer = _sentencepiece(metadata, tokens, types, path)
    else:
        raise CheckpointError(path, f"tokenizer model {model!r} is not supported (gpt2, llama)")
    _add_marked_tokens(tokenizer, tokens, types)
    return tokenizer


def _byte_level(metadata: Mapping[str, Any], tokens: list[str], types: Sequence[int], path: Path) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    rule = PRE_TOKENIZERS.get(pre)
    if rule is None:
        raise CheckpointError(path, f"pre-tokenizer {pre!r} is not supported ({', '.join(sorted(PRE_TOKENIZERS))})")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        # Added tokens keep their text; a normal one written in plain UTF-8 is respelled in the byte alphabet.
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    merges = [_split_merge(merge, path) for merge in _need(metadata, "tokenizer.ggml.merges", path, list)]
    tokenizer = Tokenizer(_bpe(path, vocab=vocab, merges=merges, ignore_merges=rule.ignore_merges))
    tokenizer.pre_tokenizer = rule.build()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _split_merge(merge: Any, path: Path) -> tuple[str, str]:
    # llama.cpp looks for the separating space from the second character on.
    cut = merge.find(" ", 1) if isinstance(merge, str) else -1
    if cut < 0:
        raise CheckpointError(path, f"tokenizer.ggml.merges holds {merge!r}, which is not two tokens")
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: Sequence[int], path: Path) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [_split_merge(merge, path) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        scores = _need(metadata, "tokenizer.ggml.scores", path, list)
        if len(scores) != len(tokens):
            raise CheckpointError(path, f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        merges = merges_from_scores(tokens, scores, vocab)
    tokenizer = Tokenizer(_bpe(path, vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    # SentencePiece drops the one space it put before the text.
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return tokenizer


def _bpe(path: Path, **options: Any) -> models.BPE:
    try:
        return models.BPE(dropout=None, **options)
    # tokenizers reports a merge naming an unknown token as a bare Exception.
    except Exception as error:
        raise CheckpointError(path, f"tokenizer vocabulary does not build ({error})") from None


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, ranked by
    the whole token's score, then longer left and right parts first (transformers' `generate_merges`)."""
    found = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)

"""Streaming detokenization: characters split over tokens come out whole, and nothing is lost.

Rules: two tiny tokenizers built here, a byte-level BPE trained on ASCII text (so every non-ASCII
character is split over byte tokens) and a SentencePiece vocabulary with `<0x..>` byte-fallback tokens;
the reference is the tokenizer's own `decode` of all generated ids: pushes plus flush must equal it,
and no push may hold U+FFFD. The byte-level one streams from its table of bytes: push by push, that must
give exactly what the decoding window gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_vocab import spm_metadata
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from lanes.text.detok import ByteDetokenizer, IncrementalDetokenizer
from lanes.text.gguf_vocab import build_gguf_tokenizer
from lanes.text.tokenizer import Tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "print(x) # 1 2 3"] * 20
TEXTS = ["emoji 🤗👍🏽 end", "日本語のテキスト", "mixed é ü ß 🇫🇷 ok", "a\u200db\n\n c", "🤗", " lead and trail "]


def wrap(backend: Backend) -> Tokenizer:
    return Tokenizer(backend, bos_id=None, eos_ids=(), pad_id=None, chat_template=None)


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return wrap(backend)


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return wrap(build_gguf_tokenizer(spm_metadata(), Path("spm.gguf")))


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    detok = tokenizer.detokenizer(prompt_ids)
    return [detok.push(token_id) for token_id in ids] + [detok.flush()]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_pushes_are_whole_characters_and_join_to_the_decode(kind, text, request):
    tokenizer = request.getfixturevalue(kind)
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert pieces[-1] == ""
    if any(ord(c) > 127 for c in text):  # the split this is about really happens
        assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


def test_byte_level_cjk_comes_out_with_its_last_byte(byte_level):
    ids = byte_level.encode("日本")
    assert len(ids) == 6
    assert stream(byte_level, ids) == ["", "", "日", "", "", "本", ""]


def test_byte_fallback_emoji_comes_out_with_its_last_byte(sentencepiece):
    ids = sentencepiece.encode("a🤗")
    assert [sentencepiece.id_to_token(i) for i in ids] == ["▁a", "<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    assert stream(sentencepiece, ids) == ["a", "", "", "", "🤗", ""]


def test_an_unfinished_character_is_flushed_as_decode_gives_it(byte_level):
    ids = byte_level.encode("ok日")[:-1]
    pieces = stream(byte_level, ids)
    assert pieces[-1] == "\ufffd"
    assert "".join(pieces) == byte_level.decode(ids) == "ok\ufffd"


def test_special_tokens_give_no_text(byte_level):
    end = byte_level.token_to_id("<|im_end|>")
    ids = byte_level.encode("hello") + [end]
    assert stream(byte_level, ids)[-2:] == ["", ""]
    assert "".join(stream(byte_level, ids)) == "hello"


def test_prompt_ids_give_the_first_token_its_leading_space(sentencepiece):
    world = sentencepiece.encode("hello world")[-1]
    assert sentencepiece.id_to_token(world) == "▁world"
    assert stream(sentencepiece, [world]) == ["world", ""]
    assert stream(sentencepiece, [world], prompt_ids=sentencepiece.encode("hello")) == [" world", ""]


def test_every_ascii_token_is_given_out_as_it_comes(byte_level):
    detok = IncrementalDetokenizer(byte_level.decode)
    ids = byte_level.encode("the quick brown fox " * 50)
    pieces = [detok.push(token_id) for token_id in ids]
    assert pieces == [byte_level.decode([token_id]) for token_id in ids]
    assert detok.flush() == ""


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=24)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_any_text_streams_back_to_its_decode(byte_level, sentencepiece, text):
    for tokenizer in (byte_level, sentencepiece):
        ids = tokenizer.encode(text)
        pieces = stream(tokenizer, ids)
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == tokenizer.decode(ids)


def byte_tokens(tokenizer: Tokenizer) -> list[int]:
    """The ids of single bytes (the byte-level BPE's whole alphabet), to draw any byte sequence from."""
    return [i for i in range(tokenizer.vocab_size) if len(tokenizer._pieces[i]) == 1]


def test_a_byte_level_tokenizer_streams_from_its_table_and_sentencepiece_by_decoding(byte_level, sentencepiece):
    assert type(byte_level.detokenizer()) is ByteDetokenizer
    assert type(sentencepiece.detokenizer()) is IncrementalDetokenizer
    assert sentencepiece._pieces is None


def test_the_table_holds_each_ids_bytes(byte_level):
    end = byte_level.token_to_id("<|im_end|>")
    pieces = byte_level._pieces
    assert len(pieces) == byte_level.vocab_size
    assert pieces[end] == b""  # a special token's text is skipped, as decode skips it
    assert [pieces[i] for i in byte_level.encode("日本")] == [b"\xe6", b"\x97", b"\xa5", b"\xe6", b"\x9c", b"\xac"]


def test_a_prompt_that_ends_inside_a_character_is_read_as_the_window_reads_it(byte_level):
    prompt = byte_level.encode("ok日")[:-1]  # the prompt ends on two of 日's three bytes
    ids = byte_level.encode("日")[-1:] + byte_level.encode(" the")
    # The window counted the cut 日 as the prompt's (one U+FFFD, then one whole character), so it is not given out.
    assert stream(byte_level, ids, prompt) == ["", " the", ""]
    assert stream(byte_level, ids, prompt) == generic(byte_level, ids, prompt)


def generic(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer.decode, prompt_ids)
    return [detok.push(token_id) for token_id in ids] + [detok.flush()]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_table_gives_what_the_window_gives_push_by_push(byte_level, data):
    """Any bytes (cut characters, bad bytes, U+FFFD itself), specials and ids past the vocabulary, after any
    prompt (one ending inside a character too)."""
    ids = st.one_of(st.sampled_from(byte_tokens(byte_level)), st.integers(0, byte_level.vocab_size + 3))
    prompt = data.draw(st.lists(ids, max_size=9))
    generated = data.draw(st.lists(ids, max_size=14))
    assert stream(byte_level, generated, prompt) == generic(byte_level, generated, prompt)


@pytest.fixture(scope="module")
def odd_specials() -> Tokenizer:
    """The byte-level BPE with specials the byte alphabet does not spell: their text decodes as they are."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_end|>", "<｜end▁of▁sentence｜>", "Ġx<é>")])
    return wrap(backend)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_special_tokens_stream_their_text_when_not_skipped(odd_specials, data):
    tokenizer = odd_specials
    specials = sorted(tokenizer.special_ids)
    ids = st.one_of(st.sampled_from(byte_tokens(tokenizer)), st.sampled_from(specials), st.integers(0, tokenizer.vocab_size - 1))
    prompt, generated = data.draw(st.lists(ids, max_size=6)), data.draw(st.lists(ids, max_size=12))
    detok = tokenizer.detokenizer(prompt, skip_special_tokens=False)
    assert isinstance(detok, ByteDetokenizer)
    pushed = [detok.push(token) for token in generated] + [detok.flush()]
    window = IncrementalDetokenizer(lambda batch: tokenizer.decode(batch, skip_special_tokens=False), prompt)
    assert pushed == [window.push(token) for token in generated] + [window.flush()]
    if not prompt:
        assert "".join(pushed) == tokenizer.decode(generated, skip_special_tokens=False)


@pytest.mark.parametrize("kind", ["odd_specials", "sentencepiece"])
def test_a_special_token_gives_its_text_only_when_asked(kind, request):
    tokenizer = request.getfixturevalue(kind)
    special = max(tokenizer.special_ids)
    ids = tokenizer.encode("hello", add_special_tokens=False) + [special] + tokenizer.encode("there", add_special_tokens=False)
    skipped = tokenizer.detokenizer()
    shown = tokenizer.detokenizer(skip_special_tokens=False)
    texts = ["".join([d.push(t) for t in ids] + [d.flush()]) for d in (skipped, shown)]
    assert texts == [tokenizer.decode(ids), tokenizer.decode(ids, skip_special_tokens=False)]
    assert texts[0] != texts[1]

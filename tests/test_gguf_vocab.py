"""Tokenizers built from GGUF metadata, against transformers' GGUF tokenizer converter.

Rules: the references are transformers' `get_gguf_tokenizer` / `convert_gguf_tokenizer` run on the same
file (for SmolLM2 with `Digits(individual_digits=True)` put first in its pre-tokenizer sequence, which is
what SmolLM2's own tokenizer.json and llama.cpp's `smollm` rules do), transformers' `generate_merges`,
and the split rules transformers keeps per `tokenizer.ggml.pre`. The default model is read once per
module, through transformers' fast GGUF metadata reader; tiny SentencePiece GGUFs are written here
with `gguf.GGUFWriter`. Nothing outside the project is read except the default model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Regex, pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_PRE_TOKENIZER_SPLITS,
    convert_gguf_tokenizer,
    get_gguf_tokenizer,
)
from transformers.integrations.gguf.reader import read_gguf_metadata
from transformers.tokenization_utils_base import generate_merges

from lanes.checkpoint.errors import CheckpointError
from lanes.models import resolve_model
from lanes.text.gguf_vocab import adds_bos, build_gguf_tokenizer, bytes_to_unicode, merges_from_scores

TEXTS = [
    "Hello, world! 12345 and 3.14159",
    "  12ab",
    "x = 1000000; y=  42\n",
    "emoji 🤗👍🏽 and flags 🇫🇷, héllo 世界 日本語",
    "a   b\n\n\tc  \n  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # 100%\n\n\nclass A:  pass",
    "don't I'll WE'RE 1,000,000",
    "",
    " ",
]

SPM_PIECES = [
    "▁", "▁t", "he", "▁the", "▁h", "el", "lo", "▁hel", "▁hello", "▁w", "or", "ld", "▁world", "▁wor",
    "e", "h", "l", "o", "t", "w", "r", "d", "a", "n", "▁a", "an", "▁an", "1", "2", "é", "世",
]
SPM_TEXTS = ["hello world", " hello  world", "the 12 é世界🤗", "<s>hello</s>", "a<|user|>an",
             "hello\n\tworld", "", "  ", "▁x", "an an  an"]


def spm_vocab() -> list[tuple[str, float, int]]:
    """(token, score, type): unknown, two controls, the 256 byte tokens, pieces, one user-defined token."""
    tokens = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    tokens += [(f"<0x{byte:02X}>", 0.0, 6) for byte in range(256)]
    tokens += [(piece, -float(rank), 1) for rank, piece in enumerate(SPM_PIECES)]
    return tokens + [("<|user|>", 0.0, 4)]


def write_spm_gguf(path: Path, **flags: bool) -> Path:
    """A tiny llama GGUF with a SentencePiece vocabulary and two F32 tensors (transformers wants a model)."""
    tokens = spm_vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([token for token, _, _ in tokens])
    writer.add_token_scores([score for _, score, _ in tokens])
    writer.add_token_types([kind for _, _, kind in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, value in flags.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_metadata(path: Path) -> dict:
    metadata, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return metadata


def reference(path: Path):
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


@pytest.fixture(scope="module")
def smollm():
    """(metadata, ours, plain converter, converter with the digit split first) for the default model."""
    path = resolve_model(None)
    metadata = read_metadata(path)
    plain = reference(path)
    split = reference(path)
    split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split.pre_tokenizer])
    return metadata, build_gguf_tokenizer(metadata, path), plain, split


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_ids_equal_the_converter_with_digits_split_first(smollm, text):
    _, ours, _, split = smollm
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == split.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm_spaces_before_digits_differ_from_the_plain_converter(smollm):
    _, ours, plain, _ = smollm
    assert ours.encode("  12ab").tokens == ["ĠĠ", "1", "2", "ab"]
    assert plain.encode("  12ab").tokens == ["Ġ", "Ġ", "1", "2", "ab"]


def test_smollm_control_tokens_are_single_special_tokens(smollm):
    metadata, ours, _, _ = smollm
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert ours.encode("<|im_start|>user<|im_end|>").ids == [1, 4093, 2]
    controls = {i for i, kind in enumerate(metadata["tokenizer.ggml.token_type"]) if kind == 3}
    assert controls == set(range(17))
    assert {i for i, t in ours.get_added_tokens_decoder().items() if t.special} == controls
    assert ours.decode([1, 4093, 2]) == "user"


def spm_metadata(**extra) -> dict:
    tokens = spm_vocab()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [token for token, _, _ in tokens],
        "tokenizer.ggml.scores": [score for _, score, _ in tokens],
        "tokenizer.ggml.token_type": [kind for _, _, kind in tokens],
        **extra,
    }


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_and_text_equal_the_converter(spm_file, text):
    ours = build_gguf_tokenizer(read_metadata(spm_file), spm_file)
    theirs = reference(spm_file)
    ids = ours.encode(text).ids
    assert ids == theirs.encode(text).ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_falls_back_to_byte_tokens():
    ours = build_gguf_tokenizer(spm_metadata(), Path("spm.gguf"))
    # "界" is not a piece: its three UTF-8 bytes E7 95 8C become <0xE7> <0x95> <0x8C> (ids 3 + byte).
    assert ours.encode("界").tokens == ["▁", "<0xE7>", "<0x95>", "<0x8C>"]
    assert ours.encode("界").ids == [259, 3 + 0xE7, 3 + 0x95, 3 + 0x8C]
    assert ours.decode(ours.encode("界 a").ids) == "界 a"


def test_sentencepiece_without_space_prefix_follows_the_flag_as_llama_cpp_does(tmp_path):
    # transformers' converter ignores tokenizer.ggml.add_space_prefix; llama.cpp (and this) honour it.
    path = write_spm_gguf(tmp_path / "bare.gguf", add_space_prefix=False)
    ours = build_gguf_tokenizer(read_metadata(path), path)
    theirs = reference(path)
    assert theirs.encode("hello world").tokens == ["▁", "he", "l", "lo", "▁world"]
    assert ours.encode("hello world").tokens == ["he", "l", "lo", "▁world"]
    for text in ["hello world", " hello", "an an", "  x"]:
        assert ours.decode(ours.encode(text).ids) == text


def test_merges_from_scores_equal_transformers_generate_merges():
    tokens = [token for token, _, _ in spm_vocab()]
    scores = [score for _, score, _ in spm_vocab()]
    vocab = {token: index for index, token in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores)))
    assert merges_from_scores(tokens, scores, vocab) == expected
    assert expected[:4] == [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "h")]


def byte_level_metadata(pre: str | None, **extra) -> dict:
    """A byte-level vocabulary: the 256 byte characters, a few merges, two control tokens."""
    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ h", "e l", "Ġh el", "l o", "Ġhel lo", "1 2"]
    tokens = ["<|endoftext|>", "<|im_start|>", *alphabet, "Ġh", "el", "Ġhel", "lo", "Ġhello", "12", "Ġworld"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": merges,
        **extra,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return metadata


SPLIT_TEXTS = ["Hello world's 123456 ok", "  12ab\n\n  x", "I'M here!!! \t\r\n y", "héllo 世界 🤗🤗", "a.b,c;  d"]


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "dbrx", "qwen2", "deepseek-r1-qwen"])
def test_split_rules_equal_transformers_rules_for_the_pre(pre):
    ours = build_gguf_tokenizer(byte_level_metadata(pre), Path("bpe.gguf")).pre_tokenizer
    theirs = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    for text in SPLIT_TEXTS:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text)


@pytest.mark.parametrize("pre", ["default", "gpt2", None])
def test_gpt2_rules_equal_the_plain_byte_level_pre_tokenizer(pre):
    ours = build_gguf_tokenizer(byte_level_metadata(pre), Path("bpe.gguf")).pre_tokenizer
    theirs = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for text in SPLIT_TEXTS:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text)


def test_smollm_rules_split_every_digit_before_the_gpt2_rules():
    ours = build_gguf_tokenizer(byte_level_metadata("smollm"), Path("bpe.gguf"))
    pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("  12ab x1")]
    assert pieces == ["ĠĠ", "1", "2", "ab", "Ġx", "1"]
    assert ours.encode("12").tokens == ["1", "2"]
    assert build_gguf_tokenizer(byte_level_metadata("gpt2"), Path("bpe.gguf")).encode("12").tokens == ["12"]


def test_llama3_takes_a_whole_word_from_the_vocabulary_as_llama_cpp_does():
    # No merge builds "Ġworld"; Llama 3 (ignore_merges) still takes it whole, GPT-2's rules do not.
    llama3 = build_gguf_tokenizer(byte_level_metadata("llama-bpe"), Path("bpe.gguf"))
    gpt2 = build_gguf_tokenizer(byte_level_metadata("gpt2"), Path("bpe.gguf"))
    assert llama3.encode(" world hello").tokens == ["Ġworld", "Ġhello"]
    assert gpt2.encode(" world hello").tokens == ["Ġ", "w", "o", "r", "l", "d", "Ġhello"]


def test_control_tokens_keep_their_text_outside_the_byte_alphabet():
    metadata = byte_level_metadata("gpt2")
    metadata["tokenizer.ggml.tokens"] = ["<｜end▁of▁sentence｜>", *metadata["tokenizer.ggml.tokens"][1:]]
    ours = build_gguf_tokenizer(metadata, Path("bpe.gguf"))
    assert ours.encode("Ġhello<｜end▁of▁sentence｜>").ids[-1] == 0
    assert ours.decode([0], skip_special_tokens=False) == "<｜end▁of▁sentence｜>"
    assert ours.get_vocab_size() == len(metadata["tokenizer.ggml.tokens"])


def test_user_defined_tokens_are_whole_but_not_special():
    ours = build_gguf_tokenizer(spm_metadata(), Path("spm.gguf"))
    assert ours.encode("a<|user|>an").tokens == ["▁a", "<|user|>", "an"]
    assert ours.decode(ours.encode("a<|user|>an").ids) == "a<|user|>an"


@pytest.mark.parametrize(
    "metadata, fault",
    [
        (byte_level_metadata("tekken-2"), "pre-tokenizer 'tekken-2' is not supported"),
        ({**byte_level_metadata("gpt2"), "tokenizer.ggml.model": "rwkv"}, "tokenizer model 'rwkv' is not supported"),
        ({**byte_level_metadata("gpt2"), "tokenizer.ggml.merges": None}, "no tokenizer.ggml.merges"),
        ({**byte_level_metadata("gpt2"), "tokenizer.ggml.merges": ["Ġhel"]}, "holds 'Ġhel', which is not two tokens"),
        ({**byte_level_metadata("gpt2"), "tokenizer.ggml.merges": ["Ġ zz"]}, "tokenizer vocabulary does not build"),
        ({**byte_level_metadata("gpt2"), "tokenizer.ggml.token_type": [1]}, "token_type has 1 entries for 265 tokens"),
        ({"tokenizer.ggml.model": "gpt2"}, "metadata has no tokenizer.ggml.tokens"),
    ],
)
def test_vocabularies_that_cannot_be_built_raise_checkpoint_error(metadata, fault):
    with pytest.raises(CheckpointError) as raised:
        build_gguf_tokenizer(metadata, Path("model.gguf"))
    assert str(raised.value).startswith("model.gguf: ")
    assert fault in str(raised.value)


@pytest.mark.parametrize(
    "metadata, expected",
    [
        (spm_metadata(), True),
        (spm_metadata(**{"tokenizer.ggml.add_bos_token": False}), False),
        (byte_level_metadata("smollm"), False),
        (byte_level_metadata("gpt2"), False),
        (byte_level_metadata("llama-bpe"), True),
        (byte_level_metadata("llama-bpe", **{"tokenizer.ggml.add_bos_token": False}), False),
        (byte_level_metadata("qwen2", **{"tokenizer.ggml.add_bos_token": True}), True),
    ],
)
def test_bos_defaults_follow_llama_cpp(metadata, expected):
    assert adds_bos(metadata) is expected

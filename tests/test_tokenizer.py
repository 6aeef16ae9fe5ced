"""`Tokenizer` from Hugging Face folders and GGUF files, against transformers on the same files.

Rules: tiny tokenizers are trained or written here into tmp folders and loaded both ways (ours, and
transformers' `AutoTokenizer.from_pretrained(folder)` / `(folder, gguf_file=...)`); ids, BOS handling and
decoding must be equal. The default model (SmolLM2, through `resolve_model`) is read once per module
with the project's `GGUFFile`; its chat template must render as transformers' `apply_chat_template`
renders it. Every fault in a checkpoint's tokenizer files is a CheckpointError naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_gguf_vocab import spm_vocab, write_spm_gguf
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

from lanes.checkpoint.errors import CheckpointError
from lanes.checkpoint.gguf_file import GGUFFile
from lanes.models import resolve_model
from lanes.text.chat import ChatTemplateError
from lanes.text.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hello world, the quick brown fox", "jumps over the lazy dog 123", "<s> is not special here"] * 10
TEXTS = ["hello world", "<s>hello</s>", "", "  the fox\n\n", "héllo 🤗 <|im_start|>user"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BOS_CHATML = "{{ bos_token }}" + CHATML
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def trained() -> str:
    """A byte-level BPE trained here, with its specials at ids 0-4, as tokenizer.json text."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend.to_str()


def make_folder(
    folder: Path, trained: str, *, bos_processor: bool = False, config=None, generation=None, template=None
) -> Path:
    backend = Backend.from_str(trained)
    if bos_processor:  # Llama 3's tokenizer.json adds its BOS this way
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", **(config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize(
    "bos_processor, config, bos_count",
    [
        (False, {}, 0),
        (False, {"add_bos_token": True}, 0),  # transformers ignores the flag beside a tokenizer.json
        (True, {}, 1),
        (True, {"add_bos_token": True}, 1),
        (True, {"add_bos_token": False}, 1),
        (False, {"add_eos_token": True}, 0),
    ],
)
def test_bos_handling_equals_transformers(tmp_path, trained, bos_processor, config, bos_count):
    folder = make_folder(tmp_path, trained, bos_processor=bos_processor, config=config)
    ours = Tokenizer.from_folder(folder, 300)
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ids[:bos_count] == [0] * bos_count
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_a_rendered_prompt_that_starts_with_bos_gets_no_second_one(tmp_path, trained):
    folder = make_folder(tmp_path, trained, bos_processor=True, config={"chat_template": BOS_CHATML})
    ours = Tokenizer.from_folder(folder, 300)
    theirs = AutoTokenizer.from_pretrained(folder)
    prompt = ours.render_chat(FRANCE)
    assert prompt == theirs.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    ids = ours.encode_prompt(prompt)
    assert ids == theirs.apply_chat_template(FRANCE, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [0, 3]
    assert ours.encode(prompt)[:3] == [0, 0, 3]  # what encode would do, and why encode_prompt exists


def test_special_ids_eos_set_and_pad_come_from_the_configs(tmp_path, trained):
    pad = {"content": "<pad>", "special": True}
    folder = make_folder(tmp_path, trained, config={"pad_token": pad}, generation={"eos_token_id": [1, 4]})
    ours = Tokenizer.from_folder(folder, 300)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id) == (0, frozenset({1, 4}), 2)
    assert ours.special_ids == frozenset({0, 1, 2, 3, 4})
    assert ours.vocab_size == 300
    assert (ours.token_to_id("<|im_end|>"), ours.id_to_token(3), ours.token_to_id("nope")) == (4, "<|im_start|>", None)


def test_named_tokens_missing_from_the_vocabulary_are_added_as_transformers_adds_them(tmp_path, trained):
    bos = {"__type": "AddedToken", "content": "<|begin|>", "lstrip": False, "normalized": False, "special": True}
    folder = make_folder(tmp_path, trained, config={"bos_token": bos, "extra_special_tokens": ["<x>"]})
    ours = Tokenizer.from_folder(folder, 302)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_id, ours.token_to_id("<x>")) == (300, 301)
    assert (theirs.bos_token_id, theirs.convert_tokens_to_ids("<x>")) == (300, 301)
    text = "<|begin|>hello<x> fox"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == "hello fox"
    assert theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True) == "hello fox"
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_folder(folder, 301)
    assert raised.value.path == folder / "tokenizer.json"
    assert raised.value.fault == "tokenizer has 302 tokens but the model's vocabulary is 301"


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, trained):
    folder = make_folder(tmp_path, trained)
    assert Tokenizer.from_folder(folder, 512).vocab_size == 300
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_folder(folder, 299)
    assert raised.value.path == folder / "tokenizer.json"
    assert raised.value.fault == "tokenizer has 300 tokens but the model's vocabulary is 299"


def test_chat_template_jinja_wins_over_the_config(tmp_path, trained):
    folder = make_folder(tmp_path, trained, config={"chat_template": "config"}, template=BOS_CHATML)
    ours = Tokenizer.from_folder(folder, 300)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert ours.chat_template.source == BOS_CHATML
    assert ours.render_chat(FRANCE) == theirs.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)


def test_a_list_of_named_templates_gives_the_default_one(tmp_path, trained):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    folder = make_folder(tmp_path, trained, config={"chat_template": templates})
    ours = Tokenizer.from_folder(folder, 300)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert ours.render_chat(FRANCE, add_generation_prompt=False) == theirs.apply_chat_template(FRANCE, tokenize=False)


def test_no_template_is_a_chat_template_error(tmp_path, trained):
    ours = Tokenizer.from_folder(make_folder(tmp_path, trained), 300)
    assert ours.chat_template is None
    with pytest.raises(ChatTemplateError, match="^this model has no chat template$"):
        ours.render_chat(FRANCE)


@pytest.mark.parametrize(
    "name, content, fault",
    [
        ("tokenizer.json", None, "no such file"),
        ("tokenizer.json", '{"model": 3', "not a tokenizer file ("),
        ("tokenizer_config.json", "{bos", "unreadable JSON (Expecting property name enclosed in double quotes"),
        ("tokenizer_config.json", "[1]", "not a JSON object"),
        ("generation_config.json", "", "unreadable JSON (Expecting value: line 1 column 1 (char 0))"),
        ("chat_template.jinja", "{% if %}", "chat template does not compile: Expected an expression, got 'end of"),
    ],
)
def test_faulty_files_are_checkpoint_errors_naming_them(tmp_path, trained, name, content, fault):
    folder = make_folder(tmp_path, trained)
    if content is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(content)
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_folder(folder, 300)
    assert raised.value.path == folder / name
    assert raised.value.fault.startswith(fault)
    assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def smollm():
    """(path, metadata) of the default model, read with the project's GGUF reader."""
    path = resolve_model(None)
    return path, GGUFFile(path).metadata


def test_smollm_special_ids(smollm):
    path, metadata = smollm
    ours = Tokenizer.from_gguf(metadata, path, 49152)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.vocab_size) == (1, frozenset({0, 2}), 2, 49152)
    assert ours.special_ids == frozenset(range(17))
    assert ours.encode("Hello") == [19556]  # tokenizer.ggml.add_bos_token is false


def test_smollm_chat_prompt_equals_transformers(smollm):
    path, metadata = smollm
    ours = Tokenizer.from_gguf(metadata, path, 49152)
    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    digits = pre_tokenizers.Digits(individual_digits=True)
    backend.pre_tokenizer = pre_tokenizers.Sequence([digits, backend.pre_tokenizer])
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=config["bos_token"], eos_token=config["eos_token"])
    template = metadata["tokenizer.chat_template"]
    prompt = ours.render_chat(FRANCE)
    expected = theirs.apply_chat_template(FRANCE, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert prompt == expected
    assert prompt.endswith("Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n")
    ids = ours.encode_prompt(prompt)
    assert ids == theirs.apply_chat_template(FRANCE, chat_template=template, add_generation_prompt=True)["input_ids"]
    assert ids[:3] == [1, 9690, 198]


def test_smollm_answer_streams_back(smollm):
    path, metadata = smollm
    ours = Tokenizer.from_gguf(metadata, path, 49152)
    answer = ours.encode("The capital of France is Paris.") + [2]
    prompt = ours.encode_prompt(ours.render_chat(FRANCE))
    detok = ours.detokenizer(prompt)
    pieces = [detok.push(token_id) for token_id in answer] + [detok.flush()]
    assert "".join(pieces) == ours.decode(answer) == "The capital of France is Paris."
    assert pieces[-2:] == ["", ""]


def test_smollm_larger_than_the_model_is_refused(smollm):
    path, metadata = smollm
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_gguf(metadata, path, 49151)
    assert str(raised.value) == f"{path}: tokenizer has 49152 tokens but the model's vocabulary is 49151"


@pytest.mark.parametrize("flags, bos", [({}, [1]), ({"add_bos_token": False}, []), ({"add_eos_token": True}, [1])])
def test_sentencepiece_gguf_equals_transformers(tmp_path, flags, bos):
    path = write_spm_gguf(tmp_path / "spm.gguf", **flags)
    ours = Tokenizer.from_gguf(GGUFFile(path).metadata, path, len(spm_vocab()))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", " the 12 é世界🤗", "<s>hello</s>", "a<|user|>an", ""]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ids[: len(bos)] == bos
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert (ours.bos_id, ours.eos_ids, ours.special_ids) == (1, frozenset({2}), frozenset({0, 1, 2}))

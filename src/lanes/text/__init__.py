"""The tokenizer side: tokenizers from Hugging Face folders and GGUF files, chat templates, streaming detokenization."""

from .chat import ChatTemplate, ChatTemplateError
from .detok import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

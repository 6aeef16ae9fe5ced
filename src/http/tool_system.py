"""`--tool-system FILE`: the system prompt put in front of requests that carry tools, and warmed into the
prompt cache at start-up so every such request restores it instead of recomputing it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolSystem:
    text: str
    template_takes_tools: bool  # the chat template renders `tools` itself

    @classmethod
    def load(cls, path: Path, tokenizer: Tokenizer) -> "ToolSystem":
        template = tokenizer.chat_template
        takes = template is not None and "tools" in template.source
        return cls(path.read_text(), takes)

    def put_in_front(self, messages: list[dict], tools: list, tokenizer: Tokenizer) -> list[dict]:
        """The request's messages behind this system prompt (merged with its own system message, if any).

        A template without tool support gets the tool list written into the system prompt instead."""
        text = self.text
        if not self.template_takes_tools:
            text += "\n\nYou can call these tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}] + messages[1:]
        return [{"role": "system", "content": text}] + messages

    def warm_tokens(self, tokenizer: Tokenizer) -> list[int]:
        """The prefix every tools request starts with: the system prompt alone, rendered by the template."""
        # Encoded as requests encode it (control tokens in it as text), so that their prefix is this one.
        return tokenizer.encode_chat([{"role": "system", "content": self.text}], add_generation_prompt=False)

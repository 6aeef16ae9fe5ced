"""Each model family's native tool-call text, chosen from its chat template, and a call written in it.

- `hermes`: Qwen2.5, Qwen3 and SmolLM2-style templates, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
  after any text, one block a call;
- `llama3_json`: Llama 3.1 / 3.2's JSON, `{"name": ..., "parameters": ...}` as the whole answer, calls
  separated by "; " (vLLM's llama3_json parser reads them so);
- `json`: a template without tools: `{"name": ..., "arguments": ...}` as the whole answer, one a line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes a call: `open` + `{"name": NAME, "<args_key>": ARGS}` + `close`, `between` two
    calls; `anywhere`: a call may follow text (else the first call opens the answer)."""

    name: str
    open: str
    close: str
    between: str
    args_key: str
    anywhere: bool

    @property
    def trigger(self) -> str:
        """What starts a call in the answer's text."""
        return self.open.strip() or "{"

    def head(self) -> str:
        """A call's text up to its name."""
        return self.open + '{"name": "'

    def middle(self) -> str:
        """A call's text between its name and its arguments."""
        return f'", "{self.args_key}": '

    def tail(self) -> str:
        return "}" + self.close

    def write(self, name: str, arguments: str) -> str:
        """One call's text, its arguments given as JSON text."""
        return self.head() + json.dumps(name)[1:-1] + self.middle() + arguments + self.tail()

    def write_all(self, calls: list[tuple[str, str]]) -> str:
        return self.between.join(self.write(name, arguments) for name, arguments in calls)


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", True)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters", False)
JSON = ToolFormat("json", "", "", "\n", "arguments", False)


def choose(template_source: str | None) -> ToolFormat:
    """The format a chat template's own tool section writes calls in (`json` where it has none)."""
    source = template_source or ""
    if "<tool_call>" in source:
        return HERMES
    if '"parameters"' in source and ("ipython" in source or "<|python_tag|>" in source):
        return LLAMA3_JSON
    return JSON

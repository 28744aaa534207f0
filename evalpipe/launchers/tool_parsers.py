"""vLLM's tool-call parser for a model, read from the model folder's chat template.

vLLM answers `tool_choice: "auto"` only when started with `--enable-auto-tool-choice --tool-call-parser NAME`, and
the parser must match the text the model was taught to write for a call. The template (chat_template.jinja, else
tokenizer_config.json's chat_template) shows which format that is; the first row whose marker it holds decides:

| the chat template holds               | parser      | families                                    |
|---------------------------------------|-------------|---------------------------------------------|
| `<tool_call>`                         | hermes      | Qwen2.5, Qwen3, Hermes 2/3, SmolLM3         |
| `<|python_tag|>` or `<|start_header_id|>` | llama3_json | Llama 3.1, 3.2, 3.3                      |
| `[TOOL_CALLS]`                        | mistral     | Mistral, Mixtral (v0.3 templates)           |
| `<|im_start|>` (ChatML, no tool markup) | hermes    | SmolLM2 and other ChatML models             |

A template that holds none of them (or a model that is not a local folder) gets no parser: vLLM then refuses
`tool_choice: "auto"` with a 400 naming the flags, which `evalpipe qualify`'s structured gate reports whole.
"""

from __future__ import annotations

import json
from pathlib import Path

# (markers, parser): the first row with any of its markers in the template wins
TEMPLATE_PARSERS = (
    (("<tool_call>",), "hermes"),
    (("<|python_tag|>", "<|start_header_id|>"), "llama3_json"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|im_start|>",), "hermes"),
)
OFF = "off"  # --tool-call-parser off: pass no tool flags


def chat_template(model: str | None) -> str | None:
    """The chat template text of a local model folder, None when there is none to read."""
    if not model:
        return None
    folder = Path(model)
    if not folder.is_dir():
        return None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(errors="replace")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


def parser_for(model: str | None) -> str | None:
    """The parser the table above gives for `model`'s chat template, None when no row matches."""
    template = chat_template(model)
    if not template:
        return None
    for markers, parser in TEMPLATE_PARSERS:
        if any(marker in template for marker in markers):
            return parser
    return None

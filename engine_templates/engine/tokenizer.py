"""Text in and out: a model directory's tokenizer.json (HF `tokenizers`) and its chat template."""
from __future__ import annotations

import json
from pathlib import Path

from engine_templates.engine.config import ModelDirError

# Qwen's chat format, used when the directory has no chat_template.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelDirError(f"not a model directory: {model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise ModelDirError(f"{path}: not a readable tokenizer ({e})") from None
        settings = {}
        config = Path(model_dir) / "tokenizer_config.json"
        if config.is_file():
            try:
                settings = json.loads(config.read_text())
            except json.JSONDecodeError as e:
                raise ModelDirError(f"{config}: not valid JSON (line {e.lineno}: {e.msg})") from None
        template = settings.get("chat_template")
        jinja_file = Path(model_dir) / "chat_template.jinja"  # where newer transformers save it
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._template = _compile(template or CHATML)
        eos = settings.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, **kwargs)


def _compile(source: str):
    """The template in a sandboxed Jinja environment, with the helpers HF chat templates use."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)

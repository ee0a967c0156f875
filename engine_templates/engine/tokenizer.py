"""Text in and out: a model directory's tokenizer.json (HF `tokenizers`) and its chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass
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
        # A byte-level decoder (Qwen's, the random checkpoint's) turns every token into its bytes
        # and decodes their concatenation as UTF-8, an invalid or unfinished sequence becoming
        # U+FFFD; an added token is its own text, which cuts the bytes into runs decoded apart
        # (tokenizers 0.23; older versions pass it through the decoder, byte for byte). No
        # token's text depends on the tokens before it except through an unfinished UTF-8
        # character, so text can be decoded piece by piece (decode_more). Decoders that look at
        # neighbouring tokens (SentencePiece's leading space, WordPiece's "##", byte fallback)
        # are decoded whole every time.
        from tokenizers import decoders

        self.incremental = isinstance(self._tok.decoder, decoders.ByteLevel)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_more(self, ids: list[int], start: int, end: int, done: DecodedPrefix) -> str:
        """decode(ids[start:end]), the same string, decoding only what `done` (the text of
        ids[start:start + done.tokens], from the previous call on this growing list) leaves,
        and moving `done` forward to `end` where the text so far ends on a whole character.

        Byte-level: decode(x + y) == decode(x) + decode(y) whenever decode(x) does not end with
        U+FFFD, for then the bytes of x end on a whole character and UTF-8 decoding starts
        afresh at y (an added token ends a run of bytes anyway, and a skipped special token
        adds none). A text ending with U+FFFD may be a character still to be finished, so
        `done` stays until a later token finishes it."""
        assert start + done.tokens <= end, "decode_more follows one growing list"
        if not self.incremental:
            return self.decode(ids[start:end])
        text = done.text + self.decode(ids[start + done.tokens:end])
        if not text.endswith("\ufffd"):
            done.tokens, done.text = end - start, text
        return text

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, **kwargs)


@dataclass
class DecodedPrefix:
    """Tokens at the start of a growing list whose text is final, and that text."""
    tokens: int = 0
    text: str = ""


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

"""Reading an OpenAI request body: the prompt as token ids and the sampling settings, each
field checked, a bad one answered as a 400 naming it."""
from __future__ import annotations

from engine_templates.engine.sequence import SamplingParams
from engine_templates.engine.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4  # as OpenAI


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code


def _field(body: dict, name: str, kinds: tuple[type, ...], default):
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is not a number of tokens
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(f"{name} must be {names}, got {type(value).__name__}", param=name)
    return value


def completion_prompt(body: dict, tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return prompt
    raise APIError("prompt must be a non-empty string or list of token ids (one prompt per request)",
                   param="prompt")


def chat_prompt(body: dict, tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        plain.append({"role": m["role"], "content": content})
    extra = _field(body, "chat_template_kwargs", (dict,), {})
    try:
        text = tokenizer.apply_chat_template(plain, **extra)
    except Exception as e:  # a template's raise_exception or a Jinja error: the request's fault
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    return tokenizer.encode(text)


def requested_logprobs(body: dict, chat: bool, max_top: int) -> int | None:
    """How many alternatives per token a request asks log-probabilities for (OpenAI's legacy
    completions `logprobs`: the chosen token's always, plus the top N); None: not asked.
    Only whole (not streamed) completions carry them here."""
    if chat:
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs"):
            raise APIError("logprobs are supported on /v1/completions only", param="logprobs")
        return None
    n = _field(body, "logprobs", (int,), None) if body.get("logprobs") is not False else None
    if n is None:
        return None
    if not 0 <= n <= max_top:
        raise APIError(f"logprobs must be between 0 and {max_top} on this server", param="logprobs")
    if body.get("stream"):
        raise APIError("logprobs are returned on whole completions only, not streamed", param="logprobs")
    return n


def sampling_params(body: dict, chat: bool, default_max_tokens: int) -> SamplingParams:
    if _field(body, "n", (int,), 1) != 1:
        raise APIError("only n=1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise APIError("best_of is not supported", param="best_of")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise APIError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings",
                       param="stop")
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) for t in stop_ids):
        raise APIError("stop_token_ids must be a list of integers", param="stop_token_ids")
    values = dict(
        temperature=float(_field(body, "temperature", (int, float), 1.0)),
        top_p=float(_field(body, "top_p", (int, float), 1.0)),
        top_k=_field(body, "top_k", (int,), 0),
        seed=_field(body, "seed", (int,), None),
        max_tokens=_field(body, max_name, (int,), default_max_tokens),
        stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=_field(body, "ignore_eos", (bool,), False))
    if values["top_k"] == -1:
        values["top_k"] = 0  # vLLM's spelling of "no limit"
    try:
        return SamplingParams(**values)
    except ValueError as e:
        param = next((k for k in values if str(e).startswith(k)), None)
        raise APIError(str(e), param=max_name if param == "max_tokens" else param) from None

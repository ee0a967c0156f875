"""One request to the model through its provider's official SDK, and what it cost in tokens.

Retries are the SDK's own: `max_retries` with exponential backoff (and the server's Retry-After)
on connection errors, timeouts, 408, 409, 429 and 5xx. What is still failing after them is
`EndpointDown`, one line that never holds the key. The SDKs are imported on the first request:
an optimization with another proposer (and every command's start) does without them.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx

from proposers.llm.settings import LLMSettings, Price, SettingsError


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0  # prompt tokens not read from the provider's cache
    cached_input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total(self) -> int:
        return self.input_tokens + self.cached_input_tokens + self.output_tokens

    def usd(self, price: Price | None) -> float:
        if price is None:
            return 0.0
        return (self.input_tokens * price.input + self.cached_input_tokens * price.cached_input
                + self.output_tokens * price.output) / 1e6


@dataclass(frozen=True)
class Reply:
    text: str
    usage: Usage
    stop_reason: str  # the provider's: "stop", "length", "end_turn", "max_tokens", ...


class EndpointDown(Exception):
    """The endpoint did not give a reply, after the SDK's retries; the message is one line."""


def redact(text: str, key: str) -> str:
    return text.replace(key, "[redacted]") if key and key != "none" else text


def endpoint(settings: LLMSettings) -> str:
    if settings.base_url:
        return settings.base_url
    return "https://api.anthropic.com" if settings.provider == "anthropic" else "https://api.openai.com/v1"


def ask(settings: LLMSettings, system: str, cached: str, fresh: str) -> Reply:
    """The model's reply to `system` and a user message of two parts: `cached`, the same on every
    request of an optimization (the provider may serve it from its prompt cache), then `fresh`."""
    import anthropic
    import openai

    key = settings.api_key()
    try:
        if settings.provider == "anthropic":
            return _anthropic(settings, key, system, cached, fresh)
        return _openai(settings, key, system, cached + fresh)
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        if e.status_code in (401, 403):  # the body may quote the key, masked or not: not shown
            why = f"refused the API key in {settings.key_source} (HTTP {e.status_code})"
        else:
            why = f"answered HTTP {e.status_code}: {_message(e)}"
        raise EndpointDown(redact(f"the {settings.provider} endpoint {endpoint(settings)} {why}", key)) from None
    except (openai.APIConnectionError, anthropic.APIConnectionError) as e:  # timeouts are these too
        raise EndpointDown(redact(f"the {settings.provider} endpoint {endpoint(settings)} stopped answering after "
                                  f"{settings.max_retries} retries: {str(e).rstrip('.')}", key)) from None


def _message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"]).splitlines()[0][:300]
    return str(e).splitlines()[0][:300]


def _sampling(settings: LLMSettings) -> dict:
    return {} if settings.temperature is None else {"temperature": settings.temperature}


def _openai(settings: LLMSettings, key: str, system: str, user: str) -> Reply:
    import openai

    client = openai.OpenAI(api_key=key, base_url=settings.base_url, max_retries=settings.max_retries,
                           timeout=settings.timeout_s)
    r = client.chat.completions.create(
        model=settings.model, max_completion_tokens=settings.max_output_tokens, **_sampling(settings),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    choice = r.choices[0] if r.choices else None
    u = r.usage
    cached = (u.prompt_tokens_details.cached_tokens or 0) if u and u.prompt_tokens_details else 0
    usage = Usage(u.prompt_tokens - cached, cached, u.completion_tokens) if u else Usage()
    return Reply((choice.message.content or "") if choice else "", usage,
                 (choice.finish_reason or "") if choice else "no choice")


def _anthropic(settings: LLMSettings, key: str, system: str, cached: str, fresh: str) -> Reply:
    import anthropic

    client = anthropic.Anthropic(api_key=key, base_url=settings.base_url, max_retries=settings.max_retries,
                                 timeout=settings.timeout_s)
    content = [{"type": "text", "text": cached, "cache_control": {"type": "ephemeral"}}]
    content += [{"type": "text", "text": fresh}] if fresh else []
    # The SDK's signature has no temperature any more; the API takes it for the models that do.
    r = client.messages.create(model=settings.model, max_tokens=settings.max_output_tokens, system=system,
                               messages=[{"role": "user", "content": content}],
                               extra_body=_sampling(settings) or None)
    text = "".join(b.text for b in r.content if b.type == "text")
    u = r.usage
    # Writing the cache is billed above the input price; it is counted as input here.
    usage = Usage(u.input_tokens + (u.cache_creation_input_tokens or 0), u.cache_read_input_tokens or 0,
                  u.output_tokens)
    return Reply(text, usage, r.stop_reason or "")


def check_reachable(settings: LLMSettings, timeout_s: float = 10.0) -> None:
    """Raises SettingsError when nothing answers HTTP at the endpoint (any status is an answer:
    no key is sent)."""
    url = endpoint(settings).rstrip("/") + "/models"
    try:
        httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise SettingsError(f"the {settings.provider} endpoint {endpoint(settings)} is unreachable "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})") from None

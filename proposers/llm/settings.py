"""The LLM proposer's settings: provider, model, endpoint, the environment variable holding the
API key, sampling, the SDK's retries, and what tokens cost. Parsed at the edge (a YAML file, then
command-line options over it) into one validated model. The model holds the variable's name,
never the key: the key is read from the environment only when a client is made."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

Provider = Literal["anthropic", "openai"]
DEFAULT_MODEL = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-5"}
DEFAULT_KEY_ENV = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}
SHIPPED_PRICES = Path(__file__).with_name("prices.yaml")


class SettingsError(ValueError):
    """Settings that cannot be used; the message is one line naming the file or option."""


class Price(BaseModel):
    """US dollars per million tokens."""

    model_config = ConfigDict(extra="forbid")
    input: NonNegativeFloat
    cached_input: NonNegativeFloat
    output: NonNegativeFloat


class LLMSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    provider: Provider = Field("anthropic", description="anthropic, or openai for any OpenAI-compatible endpoint")
    model: str = Field("", description="the provider's model name; default per provider")
    base_url: str | None = Field(None, description="the endpoint; default the provider's own")
    api_key_env: str | None = Field("", description="the environment variable holding the API key; default per "
                                    "provider; null for an endpoint that takes no key")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default: the model's own (newer "
                                      "models take no other)")
    max_output_tokens: PositiveInt = 16384
    max_retries: NonNegativeInt = Field(4, description="the SDK's retries, with backoff, on 429, 5xx, timeouts")
    timeout_s: PositiveFloat = Field(600.0, description="seconds one request may take")
    prices: dict[str, Price] = Field(default_factory=dict, description="$ per million tokens, by model")

    @model_validator(mode="after")
    def _defaults(self) -> LLMSettings:
        self.model = self.model or DEFAULT_MODEL[self.provider]
        if self.api_key_env == "":
            self.api_key_env = DEFAULT_KEY_ENV[self.provider]
        return self

    @property
    def price(self) -> Price | None:
        return self.prices.get(self.model)

    @property
    def origin(self) -> str:
        """The proposer as tracking names it on every candidate."""
        return f"llm:{self.model}"

    def api_key(self) -> str:
        """The key, read now. An endpoint that takes none gets a placeholder: the SDKs need one."""
        if self.api_key_env is None:
            return "none"
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise SettingsError(f"the API key variable {self.api_key_env} is not set (set it, or name another "
                                "with --llm-api-key-env)")
        return key


def _yaml_mapping(path: Path, what: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SettingsError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"{what} {path}: not a text file (not UTF-8)") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"{what} {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{what} {path}: expected a mapping")
    return data


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"


def load_prices(path: Path | None) -> dict[str, Price]:
    """The shipped price table, with the models of the file at `path` (if any) over it."""
    table = {}
    for source, what in ((SHIPPED_PRICES, "shipped price table"), (path, "price file")):
        if source is None:
            continue
        for model, row in _yaml_mapping(Path(source), what).items():
            try:
                table[str(model)] = Price.model_validate(row)
            except ValidationError as e:
                raise SettingsError(f"{what} {source}: {model}.{_first_error(e)}") from None
    return table


def load_settings(config: str | None = None, prices: str | None = None, **options) -> LLMSettings:
    """Settings from a YAML file (if any), the options that are not None over it, and the price
    table (the shipped one, a price file's models over it)."""
    data = _yaml_mapping(Path(config), "LLM settings file") if config else {}
    data |= {k: v for k, v in options.items() if v is not None}
    data["prices"] = load_prices(Path(prices) if prices else None) | data.get("prices", {})
    try:
        return LLMSettings.model_validate(data)
    except ValidationError as e:
        raise SettingsError(f"bad LLM settings{f' in {config}' if config else ''}: {_first_error(e)}") from None

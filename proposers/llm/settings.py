"""The LLM proposer's settings: provider, model, endpoint, where the API key is, sampling, the
SDK's retries, and what tokens cost. Parsed at the edge (a YAML file, then command-line options
over it; a deployment's form) into one validated model. The model names where the key is — an
environment variable, or a Prefect Secret block for a run launched from the UI — never the key:
it is read only when a client is made. A base URL holding credentials is refused."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

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
    field_validator,
    model_validator,
)

Provider = Literal["anthropic", "openai"]
DEFAULT_MODEL = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-5"}
DEFAULT_KEY_ENV = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}
SHIPPED_PRICES = Path(__file__).with_name("prices.yaml")
# A query parameter whose name holds one of these words carries a credential (api_key, token, sig...).
CREDENTIAL_WORDS = ("key", "token", "secret", "passw", "auth", "sig", "credential")
CREDENTIAL = re.compile("|".join(CREDENTIAL_WORDS), re.I)
# The same refusal as a JSON-schema pattern of the deployment's form (a regex JavaScript reads too, so
# no inline flags): Prefect's server checks it when the run is created, so a URL holding a key is
# refused before a run, a log line or a tracking param could hold it.
NO_CREDENTIALS = (r"^(?![^/?#]*://[^/?#]*@)(?![^?#]*\?(?:[^#]*&)?[^=&#]*(?:"
                  + "|".join("".join(f"[{c}{c.upper()}]" for c in w) for w in CREDENTIAL_WORDS) + "))")
BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")  # Prefect's block document names


class SettingsError(ValueError):
    """Settings that cannot be used; the message is one line naming the file or option."""


class Price(BaseModel):
    """US dollars per million tokens."""

    model_config = ConfigDict(extra="forbid")
    input: NonNegativeFloat
    cached_input: NonNegativeFloat
    output: NonNegativeFloat


class LLMSettings(BaseModel):
    # An error never quotes a value: a base URL refused for holding a key would show the key.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    provider: Provider = Field("anthropic", description="anthropic, or openai for any OpenAI-compatible endpoint")
    model: str = Field("", description="the provider's model name; default per provider")
    base_url: str | None = Field(None, description="the endpoint; default the provider's own; never with a key in "
                                 "it", json_schema_extra={"pattern": NO_CREDENTIALS})
    api_key_env: str | None = Field("", description="the environment variable holding the API key; default per "
                                    "provider; null for an endpoint that takes no key")
    api_key_secret: str | None = Field(None, description="the name of a Prefect Secret block holding the API key, "
                                       "read by the worker at run time (over api_key_env); the key itself never "
                                       "goes in a form")
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

    @field_validator("base_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        if url is None:
            return url
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError("the URL holds credentials (user:password@): name the key's environment variable "
                             "(api_key_env) or Prefect Secret block (api_key_secret) instead")
        if any(CREDENTIAL.search(name) for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
            raise ValueError("the URL's query holds a key: name the key's environment variable (api_key_env) or "
                             "Prefect Secret block (api_key_secret) instead")
        return url

    @field_validator("api_key_secret")
    @classmethod
    def _block_name(cls, name: str | None) -> str | None:
        if name is not None and not BLOCK_NAME.match(name):
            raise ValueError("a Prefect block name: lowercase letters, digits and dashes")
        return name

    @property
    def key_source(self) -> str:
        """Where the key is read from, in words (never the key)."""
        if self.api_key_secret:
            return f"the Prefect Secret block {self.api_key_secret}"
        return f"the environment variable {self.api_key_env}"

    @property
    def price(self) -> Price | None:
        return self.prices.get(self.model)

    @property
    def origin(self) -> str:
        """The proposer as tracking names it on every candidate."""
        return f"llm:{self.model}"

    def api_key(self) -> str:
        """The key, read now: from the Prefect Secret block where one is named (on the worker that
        runs the flow), else from the environment. An endpoint that takes none gets a placeholder:
        the SDKs need one."""
        if self.api_key_secret:
            return _secret(self.api_key_secret)
        if self.api_key_env is None:
            return "none"
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise SettingsError(f"the API key variable {self.api_key_env} is not set (set it, or name another "
                                "with --llm-api-key-env)")
        return key


def _secret(name: str) -> str:
    import httpx
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name, _sync=True).get()
    except (ValueError, httpx.HTTPError) as e:  # no such block, not a Secret, no API: never a value in it
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SettingsError(f"the Prefect Secret block {name} cannot be read: {why}") from None
    if not isinstance(value, str) or not value:
        raise SettingsError(f"the Prefect Secret block {name} holds no key (an empty or non-text value)")
    return value


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

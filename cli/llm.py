"""The LLM proposer's options of `optimize`: settings from a file and options, checked before any
flow starts (the key's variable set, the price known where a $ budget needs it, the endpoint
answering), each problem one line."""
from __future__ import annotations

import argparse

from cli.args import UsageError


def add_llm_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LLM proposer (--proposer llm); options override --llm-config")
    g.add_argument("--llm-config", help="YAML file of LLM settings (provider, model, base_url, api_key_env, ...)")
    g.add_argument("--llm-provider", help="anthropic (default) or openai (any OpenAI-compatible endpoint)")
    g.add_argument("--llm-model", help="the provider's model name (default claude-sonnet-4-5 or gpt-5)")
    g.add_argument("--llm-base-url", help="the endpoint, e.g. http://host:8000/v1 (default: the provider's)")
    g.add_argument("--llm-api-key-env", help="environment variable holding the API key (default "
                                             "ANTHROPIC_API_KEY or OPENAI_API_KEY)")
    g.add_argument("--llm-temperature", type=float, help="sampling temperature (default: the model's)")
    g.add_argument("--llm-max-output-tokens", type=int, help="output tokens per reply (default 16384)")
    g.add_argument("--llm-max-retries", type=int, help="the SDK's retries on 429, 5xx and timeouts (default 4)")
    g.add_argument("--llm-timeout", type=float, help="seconds one request may take (default 600)")
    g.add_argument("--llm-prices", help="YAML price file: model -> {input, cached_input, output} $ per million "
                                        "tokens, over the shipped table")


def llm_settings(args, target):
    """The LLM proposer's settings, or a usage error."""
    from proposers.llm import SettingsError, check_reachable, load_settings

    try:
        settings = load_settings(args.llm_config, args.llm_prices, provider=args.llm_provider, model=args.llm_model,
                                 base_url=args.llm_base_url, api_key_env=args.llm_api_key_env,
                                 temperature=args.llm_temperature, max_output_tokens=args.llm_max_output_tokens,
                                 max_retries=args.llm_max_retries, timeout_s=args.llm_timeout)
        settings.api_key()
        if target.budget.max_usd is not None and settings.price is None:
            raise SettingsError(f"--max-usd needs a price for model {settings.model}, which the price table lacks "
                                "(add it with --llm-prices FILE)")
        check_reachable(settings)
    except SettingsError as e:
        raise UsageError(str(e)) from None
    return settings

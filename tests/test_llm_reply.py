"""The LLM proposer's pieces that need no endpoint: the module a reply holds, the settings and
price table as parsed at the edge, and what tokens cost."""
from __future__ import annotations

import pytest

from proposers.llm.client import Usage, redact
from proposers.llm.reply import extract_module
from proposers.llm.settings import LLMSettings, Price, SettingsError, load_prices, load_settings

MODULE = "import torch\n\n\ndef silu_mul(gate, up):\n    return torch.nn.functional.silu(gate) * up\n"


@pytest.mark.parametrize("reply, module", [
    (f"Fused it.\n\n```python\n{MODULE}```\nDone.", MODULE),
    (f"```py\n{MODULE}```", MODULE),
    (f"```\n{MODULE}```", MODULE),  # a bare fence
    (f"The old one:\n```python\ndef helper():\n    pass\n```\nThe new one:\n```python\n{MODULE}```", MODULE),
    (f"```python\n{MODULE}", MODULE),  # cut off at the output-token limit: the gates judge what came
    (MODULE, MODULE),  # bare code
    ("```python\ndef other(x):\n    return x\n```", "def other(x):\n    return x\n"),  # `signature` says no
    ("I would fuse the two loads, but here is no code.", None),
    ("```cuda\n__global__ void k() {}\n```", None),
    ("", None),
])
def test_the_module_a_reply_holds(reply, module):
    assert extract_module(reply, "silu_mul") == module


def test_settings_default_per_provider_and_name_the_key_variable_not_the_key(monkeypatch):
    s = LLMSettings(provider="openai")
    assert (s.model, s.api_key_env, s.temperature) == ("gpt-5", "OPENAI_API_KEY", None)
    assert LLMSettings().api_key_env == "ANTHROPIC_API_KEY"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SettingsError, match="OPENAI_API_KEY is not set"):
        s.api_key()
    assert LLMSettings(provider="openai", api_key_env=None).api_key() == "none"  # an endpoint without keys
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abc")
    assert s.api_key() == "sk-abc" and "sk-abc" not in s.model_dump_json()


def test_a_price_file_extends_the_shipped_table_and_a_bad_one_is_one_line(tmp_path):
    shipped = load_prices(None)
    assert shipped["claude-sonnet-4-5"] == Price(input=3.0, cached_input=0.3, output=15.0)
    mine = tmp_path / "prices.yaml"
    mine.write_text("my-model: {input: 0.5, cached_input: 0.05, output: 1.5}\nclaude-sonnet-4-5: "
                    "{input: 1, cached_input: 0, output: 1}\n")
    table = load_prices(mine)
    assert table["my-model"].output == 1.5 and table["claude-sonnet-4-5"].input == 1 and "gpt-5" in table
    for text, why in (("my-model: {input: 1}\n", "my-model.cached_input"), ("[1, 2]\n", "expected a mapping"),
                      ("a: [\n", "not valid YAML")):
        mine.write_text(text)
        with pytest.raises(SettingsError, match=why):
            load_prices(mine)
    config = tmp_path / "llm.yaml"
    config.write_text("provider: openai\nmodel: my-model\ntemperature: 3\n")
    with pytest.raises(SettingsError, match="temperature"):
        load_settings(str(config))
    config.write_text("provider: openai\nmodel: my-model\nbase_url: http://127.0.0.1:8000/v1\n")
    s = load_settings(str(config), model="gpt-5-mini", base_url=None)  # an option over the file; None: unset
    assert (s.model, s.base_url, s.price) == ("gpt-5-mini", "http://127.0.0.1:8000/v1", shipped["gpt-5-mini"])


def test_tokens_cost_by_kind_and_the_key_is_redacted():
    usage = Usage(input_tokens=1_000_000, cached_input_tokens=2_000_000, output_tokens=500_000)
    assert usage.total == 3_500_000
    assert usage.usd(Price(input=3.0, cached_input=0.3, output=15.0)) == pytest.approx(3.0 + 0.6 + 7.5)
    assert usage.usd(None) == 0.0
    assert redact("key sk-1 and sk-1 again", "sk-1") == "key [redacted] and [redacted] again"


def test_no_reply_is_asked_for_that_would_pass_the_token_budget():
    from flows.optimize_op import Progress
    from targets import Target
    from tracking.ledger import Charge

    progress = Progress(Target(model="tiny", budget={"candidates": 10, "max_tokens_total": 10_000}))
    assert progress.may_launch(0)  # nothing spent yet: the first reply is always asked for
    progress.spend(Charge(input_tokens=3000, cached_input_tokens=500, output_tokens=500))
    assert progress.may_launch(0)  # 4,000 spent, another at that size ends at 8,000
    assert not progress.may_launch(1, proposing=1)  # with one awaited: 12,000
    assert progress.stop_reason(1).startswith("token budget of 10,000: 4,000 spent")
    assert progress.metrics()["proposer_tokens"] == 4000 and progress.metrics()["proposer_input_tokens"] == 3000

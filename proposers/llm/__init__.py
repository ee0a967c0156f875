"""The LLM proposer (Anthropic's or any OpenAI-compatible endpoint, through the official SDKs)."""
from proposers.llm.client import EndpointDown, Usage, check_reachable
from proposers.llm.proposer import LLMProposer, Proposal
from proposers.llm.settings import LLMSettings, SettingsError, load_settings

__all__ = ["EndpointDown", "LLMProposer", "LLMSettings", "Proposal", "SettingsError", "Usage", "check_reachable",
           "load_settings"]

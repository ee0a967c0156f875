"""The reference path: the same checkpoint through HF transformers, for comparing greedy
tokens and log-probabilities with the engine's. The only engine module that imports
transformers (an optional dependency: `pip install infersmith[oracle]`)."""
from __future__ import annotations

from pathlib import Path

import torch

from engine_templates.engine.config import DTYPES


class HFOracle:
    def __init__(self, model_dir: Path, dtype: str = "fp32", device: str = "cpu", attention: str = "eager"):
        from transformers import AutoModelForCausalLM

        # Eager attention by default: the plainest of transformers' attention paths, no fused kernel.
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[dtype], attn_implementation=attention).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int,
               eos_token_ids: tuple[int, ...] = ()) -> list[int]:
        """transformers' own generate(), greedy; stops at an EOS id when given some."""
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens,
                                  min_new_tokens=0 if eos_token_ids else max_new_tokens,
                                  eos_token_id=list(eos_token_ids) or None, pad_token_id=0,
                                  temperature=None, top_p=None, top_k=None)
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """log p(completion_ids[i] | everything before it), from one forward pass, in float64."""
        ids = torch.tensor([prompt_ids + completion_ids], device=self.device)
        logits = self.model(ids).logits[0, len(prompt_ids) - 1:-1].double()
        chosen = torch.tensor(completion_ids, device=self.device)[:, None]
        return torch.log_softmax(logits, dim=-1).gather(1, chosen).squeeze(1).tolist()

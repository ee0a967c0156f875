"""Next tokens from logits on the device: greedy, temperature, top-k, top-p, per-request seeds.

No host sync: every per-request setting is a tensor built from host values, and a sampled
token is argmax(probs / E) with E ~ Exponential(1) drawn per row (the exponential race, which
picks index i with probability probs[i]), so seeded rows draw from their own generator and the
others from the engine's, in one argmax.
"""
from __future__ import annotations

import torch

from engine_templates.engine.sequence import Sequence


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values on the device without waiting: the copy goes up from pinned memory on a GPU
    (from pageable memory a copy may wait for the device to catch up, which would stall async
    decode, engine.py)."""
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


class Sampler:
    def __init__(self, device: str, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [batch], their log-probabilities under the model float32 [batch])."""
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        if not all(s.params.greedy for s in seqs):
            tokens = torch.where(self._tensor([s.params.greedy for s in seqs], torch.bool),
                                 tokens, self._sample(logits, seqs))
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[1]
        temps = self._tensor([s.params.temperature or 1.0 for s in seqs], torch.float32)
        top_ks = self._tensor([s.params.top_k or vocab for s in seqs], torch.int64)
        top_ps = self._tensor([s.params.top_p for s in seqs], torch.float32)
        ordered, order = (logits / temps[:, None]).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the ones ranked above it already hold top_p of the mass (the best
        # token always stays), or when it ranks below top_k.
        drop = (probs.cumsum(dim=-1) - probs > top_ps[:, None]) | (ranks >= top_ks[:, None])
        probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                race[i].exponential_(generator=seq.generator)
        choice = (probs / race).argmax(dim=-1)
        return order.gather(1, choice[:, None]).squeeze(1)

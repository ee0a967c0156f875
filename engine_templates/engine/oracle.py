"""The reference path: the same weights through HF transformers, for comparing greedy tokens
and log-probabilities with the engine's, and as the baseline the benchmark times. The only
engine module that imports transformers (an optional dependency: `pip install infersmith[oracle]`)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from engine_templates.engine.config import DTYPES, ModelConfig
from engine_templates.engine.loader import tensor_for
from engine_templates.engine.model import DecoderModel


def hf_config(cfg: ModelConfig, attn_implementation: str):
    """transformers' config of the model the engine's ModelConfig describes: the config.json a
    checkpoint of it has (random_checkpoint.config_json)."""
    from transformers import AutoConfig

    from engine_templates.engine.random_checkpoint import config_json

    raw = config_json(cfg, bos=0, eos=0)
    for key in ("architectures", "torch_dtype", "bos_token_id"):
        del raw[key]
    raw.update(eos_token_id=list(cfg.eos_token_ids) or None, pad_token_id=0)
    return AutoConfig.for_model(raw.pop("model_type"), attn_implementation=attn_implementation, **raw)


class HFOracle:
    def __init__(self, model):
        self.model = model.eval()
        self.device = model.device

    @classmethod
    def from_dir(cls, model_dir: Path, dtype: str = "fp32", device: str = "cpu",
                 attention: str = "eager") -> "HFOracle":
        from transformers import AutoModelForCausalLM

        # Eager attention by default: the plainest of transformers' attention paths, no fused kernel.
        # Straight onto a GPU (device_map) where accelerate is installed : no
        # host copy of the weights first, which for qwen3-30b-a3b (61 GB) beside its checkpoint in
        # /dev/shm would nearly fill the host's memory. Without accelerate (not a dependency of this
        # package) it loads on the host and then moves.
        direct = device != "cpu" and importlib.util.find_spec("accelerate") is not None
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], attn_implementation=attention,
                                                     **({"device_map": device} if direct else {}))
        return cls(model if direct else model.to(device))

    @classmethod
    def sharing(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                attn_implementation: str = "sdpa") -> "HFOracle":
        """transformers' model around the engine's weight tensors (as named by
        DecoderModel.weights()), sharing their storage: no second copy of the weights."""
        from transformers import AutoModelForCausalLM

        config = hf_config(cfg, attn_implementation)
        sample = next(iter(weights.values()))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        view = DecoderModel(cfg, None, None, sample.dtype, sample.device, weights)
        state = {}
        for name in model.state_dict():
            tensor = view.embed if name == "lm_head.weight" and cfg.tie_embeddings else tensor_for(view, name)
            if tensor is None:
                raise ValueError(f"transformers' parameter {name} has no engine weight")
            state[name] = tensor
        model.load_state_dict(state, strict=True, assign=True)
        # Rotary frequencies are a non-persistent buffer, still on the meta device: made anew.
        model.model.rotary_emb = type(model.model.rotary_emb)(config).to(sample.device)
        return cls(model)

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
        rows = self.logprob_rows(prompt_ids, completion_ids)
        return rows[torch.arange(len(completion_ids)), completion_ids].tolist()

    @torch.inference_mode()
    def logprob_rows(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        """Every token's log-probability [len(completion_ids), vocab] (float64, on the host) at
        each completion position, from one forward pass over prompt + completion."""
        ids = torch.tensor([prompt_ids + completion_ids], device=self.device)
        logits = self.model(ids).logits[0, len(prompt_ids) - 1:-1].double()
        return torch.log_softmax(logits, dim=-1).cpu()

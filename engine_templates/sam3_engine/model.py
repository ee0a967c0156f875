"""The SAM 3 engine: transformers' SAM 3 modules with the kernels of ops.py, in bf16 on a GPU;
images batched (one vision pass for every image that arrives together), text-prompt embeddings
cached per prompt (an LRU), the vision encoder as CUDA graphs at fixed batch sizes on a GPU.

One step takes the images waiting and answers every (image, prompt) pair of them: the vision
encoder runs once over the images, the text encoder only for prompts not in the cache, and the
DETR encoder, decoder and mask decoder once over all the pairs, each pair's image features
gathered from its image's."""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_templates.sam3_engine.images import PromptOutput, PromptTokenizer
from engine_templates.sam3_engine.ops import Sam3Kernels, install

log = logging.getLogger("infersmith.sam3")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(model_dir: Path, dtype: str, device: str, attention: str = "sdpa"):
    from transformers import Sam3Model

    model = Sam3Model.from_pretrained(str(model_dir), dtype=DTYPES[dtype], attn_implementation=attention)
    return model.to(device).eval()


@dataclass
class Image:
    """One request's image, ready for the model, and its prompts."""
    pixels: torch.Tensor  # (3, S, S) float32, normalized
    prompts: list[str]


class PromptCache:
    """Text-encoder outputs per prompt string, least recently used dropped past `size`:
    features (L, C) after the projection, and the attention mask (L,)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, prompt: str):
        entry = self.entries.get(prompt)
        if entry is not None:
            self.entries.move_to_end(prompt)
            self.hits += 1
        return entry

    def put(self, prompt: str, entry) -> None:
        self.misses += 1
        if self.size <= 0:
            return
        self.entries[prompt] = entry
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


class GraphedVision:
    """The vision encoder captured as one CUDA graph per batch size; a batch runs in the
    smallest graph that holds it, padded. Where capture fails the eager encoder runs, said once."""

    def __init__(self, encoder, batch_sizes: list[int], size: int, dtype, device):
        self.encoder, self.graphs = encoder, {}
        with torch.inference_mode():
            self._capture(encoder, batch_sizes, size, dtype, device)

    def _capture(self, encoder, batch_sizes, size, dtype, device) -> None:
        pool = None  # one memory pool for all: the largest captured first, the smaller reuse its memory
        try:
            for b in sorted(batch_sizes, reverse=True):
                x = torch.zeros(b, 3, size, size, dtype=dtype, device=device)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        encoder(x)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = encoder(x)
                pool = graph.pool()
                self.graphs[b] = (graph, x, out)
        except RuntimeError as e:  # capture of an op that cannot be captured: run eager
            log.warning("vision encoder: CUDA graph capture failed (%s); running eager", e)
            self.graphs = {}

    def __call__(self, x: torch.Tensor):
        fits = [b for b in self.graphs if b >= x.shape[0]]
        if not fits:
            return self.encoder(x)
        graph, static_x, out = self.graphs[min(fits)]
        static_x[: x.shape[0]].copy_(x)
        graph.replay()
        return out


class Sam3Engine:
    def __init__(self, model_dir: Path, dtype: str = "bf16", device: str = "cuda",
                 kernels: Sam3Kernels | None = None, prompt_cache: int = 1024,
                 graph_batch_sizes: list[int] | None = None):
        self.model = load_model(model_dir, dtype, device)
        self.kernels = kernels or Sam3Kernels()
        install(self.model, self.kernels)
        self.dtype, self.device = DTYPES[dtype], device
        config = self.model.config
        self.image_size = config.vision_config.backbone_config.image_size
        self.num_queries = config.detr_decoder_config.num_queries
        self.tokenizer = PromptTokenizer(model_dir, config.text_config.pad_token_id or 0)
        self.cache = PromptCache(prompt_cache)
        self.vision = self.model.vision_encoder
        self.largest_batch = 0
        if graph_batch_sizes and device.startswith("cuda"):
            self.vision = GraphedVision(self.model.vision_encoder, graph_batch_sizes, self.image_size,
                                        self.dtype, device)

    @property
    def graphed(self) -> list[int]:
        return sorted(self.vision.graphs) if isinstance(self.vision, GraphedVision) else []

    def _text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, L, C) features and (P, L) masks, the cache's where it has them."""
        found = {p: self.cache.get(p) for p in dict.fromkeys(prompts)}
        missing = [p for p, entry in found.items() if entry is None]
        if missing:
            ids, masks = zip(*(self.tokenizer(p) for p in missing))
            ids = torch.tensor(ids, device=self.device)
            masks = torch.tensor(masks, device=self.device)
            features = self.model.get_text_features(input_ids=ids, attention_mask=masks).pooler_output
            for p, f, m in zip(missing, features, masks):
                found[p] = (f, m)
                self.cache.put(p, (f, m))
        entries = [found[p] for p in prompts]
        return torch.stack([e[0] for e in entries]), torch.stack([e[1] for e in entries])

    @torch.inference_mode()
    def segment(self, images: list[Image]) -> list[list[PromptOutput]]:
        """Every image's prompts answered, in order: one PromptOutput per prompt per image."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        from transformers.models.sam3.modeling_sam3 import Sam3VisionEncoderOutput

        self.largest_batch = max(self.largest_batch, len(images))
        pixels = torch.stack([im.pixels for im in images]).to(self.device, self.dtype)
        vision = self.vision(pixels)
        rows = torch.tensor([i for i, im in enumerate(images) for _ in im.prompts], device=self.device)
        prompts = [p for im in images for p in im.prompts]
        features, mask = self._text(prompts)
        per_pair = Sam3VisionEncoderOutput(
            fpn_hidden_states=tuple(f.index_select(0, rows) for f in vision.fpn_hidden_states),
            fpn_position_encoding=tuple(p.index_select(0, rows) for p in vision.fpn_position_encoding))
        out = self.model(vision_embeds=per_pair, text_embeds=BaseModelOutputWithPooling(pooler_output=features),
                         attention_mask=mask)
        return split(out, [len(im.prompts) for im in images])


def split(out, counts: list[int]) -> list[list[PromptOutput]]:
    """The model's batched outputs, one PromptOutput per row, grouped by image."""
    scores = out.pred_logits.float().sigmoid() * out.presence_logits.float().sigmoid()
    boxes, masks = out.pred_boxes.float().cpu(), out.pred_masks.float().cpu()
    scores = scores.cpu()
    rows = iter(range(scores.shape[0]))
    return [[PromptOutput(scores[r], boxes[r], masks[r]) for r in (next(rows) for _ in range(n))] for n in counts]

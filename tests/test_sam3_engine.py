"""The SAM 3 engine on the sam3-tiny random checkpoint, on a CPU: its answers against
transformers' model, its batching and prompt cache, and the image accuracy gate that fails a
planted kernel error and passes the honest engine."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from contract.images import ImageAccuracyRules
from engine_templates.engine.config import KernelSpec
from engine_templates.sam3_engine.images import PromptTokenizer, decode_image, pixel_values, reply
from engine_templates.sam3_engine.model import Image, Sam3Engine, load_model, split
from engine_templates.sam3_engine.ops import Sam3Kernels
from engine_templates.vision import SAM3_PRESETS
from harness.serve.images import image_set, judge, mask_agreement

CANDIDATES = Path(__file__).parent / "sam3_candidates"
SIZE = SAM3_PRESETS["sam3-tiny"].image_size
RULES = ImageAccuracyRules(held_out=3, prompts_per_image=3)


@pytest.fixture(scope="module")
def reference(sam3_checkpoint):
    """transformers' model in float32, called as a user calls it: one image and prompt a forward."""
    model = load_model(sam3_checkpoint, "fp32", "cpu", attention="eager")
    tok = PromptTokenizer(sam3_checkpoint, 0)

    def answer(image: Image):
        outs = []
        with torch.inference_mode():
            for p in image.prompts:
                ids, mask = tok(p)
                outs += split(model(pixel_values=image.pixels[None], input_ids=torch.tensor([ids]),
                                    attention_mask=torch.tensor([mask])), [1])[0]
        return outs
    return answer


def _held_out(seed: int = 7):
    return image_set(RULES, random.Random(seed))


def _answers(answer_images, held_out, raw_queries=None) -> list[dict]:
    """Each image's answer as the HTTP API gives it, raw outputs included."""
    decoded = [decode_image(b64) for b64, _ in held_out]
    images = [Image(pixel_values(im, SIZE), prompts) for im, (_, prompts) in zip(decoded, held_out)]
    outs = answer_images(images)
    answers = []
    for k, (im, image, out) in enumerate(zip(decoded, images, outs)):
        queries = None if raw_queries is None else sorted({q for r in raw_queries[k]["results"]
                                                           for q in r["raw"]["queries"]})
        answers.append({"results": [reply(p, o, im.width, im.height, 0.3, raw=True, raw_queries=queries)
                                    for p, o in zip(image.prompts, out)]})
    return answers


def _engine(sam3_checkpoint, dtype="fp32", **kernels) -> Sam3Engine:
    specs = {op: KernelSpec(impl="free", path=str(CANDIDATES / f"{name}.py")) for op, name in kernels.items()}
    return Sam3Engine(sam3_checkpoint, dtype, "cpu", Sam3Kernels(specs))


def test_engine_masks_boxes_and_scores_match_transformers(sam3_checkpoint, reference):
    engine = _engine(sam3_checkpoint)
    held = _held_out()
    images = [Image(pixel_values(decode_image(b), SIZE), prompts) for b, prompts in held]
    got = engine.segment(images)  # every image and prompt in one batched step
    for image, outs in zip(images, got):
        for mine, theirs in zip(outs, reference(image)):
            assert torch.allclose(mine.scores, theirs.scores, atol=1e-5)
            assert torch.allclose(mine.boxes, theirs.boxes, atol=1e-5)
            assert torch.allclose(mine.mask_logits, theirs.mask_logits, atol=1e-4)
    assert engine.largest_batch == len(images)
    # the masks are not trivially 0: both confident and unconfident pixels occur
    logits = got[0][0].mask_logits
    assert 0.05 < (logits.abs() > RULES.mask_margin).float().mean() < 0.95


def test_the_registry_templates_match_transformers_and_pass_the_gate(sam3_checkpoint, reference):
    """templates.json: layernorm, gelu and vision_attention as the op registry's Triton templates
    (the interpreter on a CPU) at their default points; the engine's answers stay within the
    tolerance of the eager engine above, and the gate passes them."""
    from engine_templates.ops import OPS
    from engine_templates.sam3_engine.ops import TEMPLATES_FILE

    kernels = Sam3Kernels.from_file(TEMPLATES_FILE)
    assert {op: c["impl"] for op, c in kernels.choices.items()} == {
        "layernorm": "template", "gelu": "template", "vision_attention": "template", "vision_linear": "template",
        "attention": "eager"}
    for op, choice in kernels.choices.items():  # the file names each template's default point
        if choice["impl"] == "template":
            assert choice["point"] == OPS[op].templates[choice["template"]].default, op
    held = _held_out()
    images = [Image(pixel_values(decode_image(b), SIZE), prompts) for b, prompts in held]
    got = Sam3Engine(sam3_checkpoint, "fp32", "cpu", kernels).segment(images)
    for image, outs in zip(images, got):
        for mine, theirs in zip(outs, reference(image)):
            assert torch.allclose(mine.scores, theirs.scores, atol=1e-5)
            assert torch.allclose(mine.boxes, theirs.boxes, atol=1e-5)
            assert torch.allclose(mine.mask_logits, theirs.mask_logits, atol=1e-4)
    expected = _answers(lambda images: [reference(im) for im in images], held)
    passed, detail, _ = judge(_answers(Sam3Engine(sam3_checkpoint, "bf16", "cpu", kernels).segment, held, expected),
                              expected, RULES)
    assert passed, detail


def test_the_reference_ops_match_transformers(sam3_checkpoint, reference):
    specs = {op: KernelSpec(impl="reference") for op in ("layernorm", "gelu", "vision_attention", "vision_linear")}
    engine = Sam3Engine(sam3_checkpoint, "fp32", "cpu", Sam3Kernels(specs))
    image = Image(pixel_values(decode_image(_held_out()[0][0]), SIZE), ["a cat", "a red dog"])
    for mine, theirs in zip(engine.segment([image])[0], reference(image)):
        assert torch.allclose(mine.mask_logits, theirs.mask_logits, atol=1e-4)


def test_prompt_embeddings_are_cached_per_prompt(sam3_checkpoint):
    engine = _engine(sam3_checkpoint)
    pixels = pixel_values(decode_image(_held_out()[0][0]), SIZE)
    first = engine.segment([Image(pixels, ["a cat", "a dog"])])
    assert (engine.cache.hits, engine.cache.misses) == (0, 2)
    again = engine.segment([Image(pixels, ["a dog", "a cat"])])
    assert (engine.cache.hits, engine.cache.misses) == (2, 2)
    assert torch.equal(first[0][0].mask_logits, again[0][1].mask_logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gate_passes_the_honest_engine(sam3_checkpoint, reference, dtype):
    held = _held_out()
    expected = _answers(lambda images: [reference(im) for im in images], held)
    engine = _engine(sam3_checkpoint, dtype)
    got = _answers(engine.segment, held, expected)
    passed, detail, metrics = judge(got, expected, RULES)
    assert passed, detail
    assert metrics["accuracy/masks_compared"] == RULES.held_out * RULES.prompts_per_image * 4


@pytest.mark.parametrize("kernels, words", [({"vision_attention": "transposed_positions"}, "query"),
                                            ({"attention": "dropped_prompt"}, "prompt")])
def test_gate_fails_a_planted_kernel_error(sam3_checkpoint, reference, kernels, words):
    held = _held_out()
    expected = _answers(lambda images: [reference(im) for im in images], held)
    got = _answers(_engine(sam3_checkpoint, **kernels).segment, held, expected)
    passed, detail, _ = judge(got, expected, RULES)
    assert not passed and words in detail, detail


def test_dropped_prompt_is_right_with_one_prompt_so_the_gate_needs_several(sam3_checkpoint, reference):
    one = ImageAccuracyRules(held_out=1, prompts_per_image=1)
    held = image_set(one, random.Random(3))
    expected = _answers(lambda images: [reference(im) for im in images], held)
    got = _answers(_engine(sam3_checkpoint, attention="dropped_prompt").segment, held, expected)
    assert judge(got, expected, one)[0]


def test_mask_agreement_counts_confident_pixels_by_iou_and_the_rest_by_logit():
    ref = torch.tensor([[5.0, -5.0], [0.5, -0.5]]).numpy()
    assert mask_agreement(ref.copy(), ref, 2.0) == (1.0, 0.0)
    flipped = ref.copy()
    flipped[0, 1] = 3.0  # a confident negative made positive: IoU 1/2
    assert mask_agreement(flipped, ref, 2.0)[0] == 0.5
    near = ref.copy()
    near[1, 0] = -0.2  # an unconfident pixel's decision flips, its logit 0.7 away
    iou, diff = mask_agreement(near, ref, 2.0)
    assert iou == 1.0 and abs(diff - 0.7) < 1e-6


def _perturbed(answers: list[dict], change) -> list[dict]:
    """A copy of `answers` with change(raw of image 0's second prompt) applied."""
    import copy

    out = copy.deepcopy(answers)
    change(out[0]["results"][1]["raw"])
    return out


def _set_logits(raw: dict, fn) -> None:
    import base64

    import numpy as np

    logits = np.frombuffer(base64.b64decode(raw["mask_logits"]), dtype="<f4").reshape(raw["mask_shape"]).copy()
    fn(logits)
    raw["mask_logits"] = base64.b64encode(logits.astype("<f4").tobytes()).decode()


def test_every_check_of_the_gate_fails_its_own_error(sam3_checkpoint, reference):
    held = _held_out()
    expected = _answers(lambda images: [reference(im) for im in images], held)
    assert judge(expected, expected, RULES)[0]

    def score(raw):
        raw["scores"][3] += 0.05

    def box(raw):
        raw["boxes"][2][1] += 0.05

    def flip_confident(raw):  # every confident pixel of the first judged mask gets the other sign
        _set_logits(raw, lambda m: m.__setitem__((0, abs(m[0]) > RULES.mask_margin), -m[0][abs(m[0]) > RULES.mask_margin]))

    def nudge_unconfident(raw):  # the unconfident pixels moved by 10% of the largest |logit|
        _set_logits(raw, lambda m: m.__setitem__((0, abs(m[0]) <= RULES.mask_margin),
                                                 m[0][abs(m[0]) <= RULES.mask_margin] + 0.1 * abs(m[0]).max()))

    def nan(raw):
        _set_logits(raw, lambda m: m.__setitem__((0, 0, 0), float("nan")))

    for change, words in ((score, "score"), (box, "box"), (flip_confident, "mask IoU"),
                          (nudge_unconfident, "not confident"), (nan, "not finite")):
        passed, detail, _ = judge(_perturbed(expected, change), expected, RULES)
        assert not passed and words in detail and "prompt" in detail, (words, detail)
    swapped = _perturbed(expected, lambda raw: None)
    swapped[0]["results"][1]["prompt"] = "something else"
    assert "answered as prompt" in judge(swapped, expected, RULES)[1]
    assert "results for" in judge([{"results": expected[0]["results"][:1]}] + expected[1:], expected, RULES)[1]
    assert "answers to" in judge(expected[:1], expected, RULES)[1]


def _queued(batcher, images: list[Image]):
    """Every image submitted before the engine thread starts, so that one step may take them all."""
    import asyncio

    from engine_templates.sam3_engine.server import Pending

    async def go():
        loop = asyncio.get_running_loop()
        pendings = [Pending(im, loop, loop.create_future()) for im in images]
        for p in pendings:
            batcher.queue.put(p)
        batcher.start()
        try:
            return await asyncio.gather(*(p.future for p in pendings), return_exceptions=True)
        finally:
            batcher.stop()
    return asyncio.run(go())


def test_requests_that_arrive_together_are_one_step(sam3_checkpoint):
    from engine_templates.sam3_engine.server import Batcher

    engine = _engine(sam3_checkpoint)
    images = [Image(pixel_values(decode_image(b), SIZE), prompts) for b, prompts in _held_out()]
    batcher = Batcher(engine, max_images=2)
    outs = _queued(batcher, images)
    assert (batcher.steps, batcher.images, engine.largest_batch) == (2, 3, 2)  # 3 images, at most 2 a step
    alone = [_engine(sam3_checkpoint).segment([im])[0] for im in images]
    for got, want in zip(outs, alone):
        assert [torch.allclose(g.mask_logits, w.mask_logits, atol=1e-4) for g, w in zip(got, want)] == \
            [True] * len(want)


def test_a_failed_step_is_retried_request_by_request(sam3_checkpoint):
    from engine_templates.sam3_engine.server import Batcher

    engine = _engine(sam3_checkpoint, vision_attention="no_batches")
    images = [Image(pixel_values(decode_image(b), SIZE), prompts) for b, prompts in _held_out()]
    batcher = Batcher(engine, max_images=8)
    outs = _queued(batcher, images)
    assert not any(isinstance(o, Exception) for o in outs), outs
    assert [len(o) for o in outs] == [len(im.prompts) for im in images]
    assert (batcher.steps, engine.largest_batch) == (3, 3)  # the batch of 3 failed; each alone passed

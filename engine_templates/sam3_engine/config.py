"""What the SAM 3 engine fixes beyond a model's config.json. Its models' shapes are the vision
target's (engine_templates/vision.py: the `sam3` and `sam3-tiny` presets, or a SAM 3 config.json),
and their random checkpoints `engine random-checkpoint --preset sam3-tiny`'s
(engine/random_checkpoint.py)."""
from __future__ import annotations

CONTEXT_LENGTH = 32  # text tokens per prompt, as SAM 3's processor pads them (max_length=32)

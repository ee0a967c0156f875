"""Which model a target names: a preset, or a model's own config.json (engine_templates/hf_config.py;
a vision model's, engine_templates/vision.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from engine_templates.hf_config import ConfigError
from engine_templates.models import PRESETS
from engine_templates.vision import SAM3_PRESETS, target_dims

ALL_PRESETS = [*PRESETS, *SAM3_PRESETS]


def is_tiny(model: str) -> bool:
    """The tiny presets, which run under the CPU interpreter."""
    return model.startswith("tiny") or model == "sam3-tiny"


def model_name(model: str) -> str:
    """How runs name `model` (their `model` tag): a preset's name, or the absolute path of the
    config or directory given. ValueError (one line) for neither."""
    try:
        target_dims(model)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return model if model in ALL_PRESETS else str(Path(model).expanduser().resolve())


# In the Prefect UI's forms and its server's validation: a preset's name or an absolute path (where
# the flow runs); the command line resolves a relative path first (model_name).
ModelName = Annotated[str, AfterValidator(model_name), Field(
    description=f"model preset ({', '.join(ALL_PRESETS)}), or a model's config.json or the directory holding it (an "
                "absolute path where the flow runs)",
    json_schema_extra={"pattern": f"^(/.+|{'|'.join(p.replace('.', r'[.]') for p in ALL_PRESETS)})$",
                       "examples": ALL_PRESETS})]

"""The SAM 3 serving engine: text-prompted image segmentation (image + text prompts -> masks,
boxes, scores) over HTTP, with its reference server on the transformers model ([images.md])."""

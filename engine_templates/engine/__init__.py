"""A small LLM engine (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) whose hot ops come from the op registry.

The pipeline, one class each: `LLMEngine.step()` = `Scheduler.schedule()` (which sequences run:
prompt chunks, decodes, or both in a mixed step) -> `ModelRunner.run()` (the model on their
tokens, sampling on the device) -> `LLMEngine.postprocess` (append tokens, stop). The classes
share one plain object, `Sequence`. `server.py` puts an OpenAI-compatible HTTP API in front;
`oracle.py` runs the same checkpoint through HF transformers for comparison.
"""

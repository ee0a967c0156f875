"""The Prefect tasks of the pipeline, one module per stage: propose, compile, check,
microbench, serve (with the end-to-end stage's reference), and `evaluate`, which runs one
candidate's stages in order on a leased slot. Thin: the work is a call into gpu_pool."""

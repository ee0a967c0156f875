"""The end-to-end stage: serve a candidate engine and a baseline server, judge the candidate's
greedy tokens and log-probabilities against the HF transformers reference, load both with
AIPerf on every traffic pattern, and pass the candidate only if it beats the baseline on
every metric. Worker side: the standard library, the engine's tokenizer, AIPerf as a command."""

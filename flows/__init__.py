"""The Prefect flows: they only orchestrate (loop, budget, stop rules, fan-out) over tasks/."""

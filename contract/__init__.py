"""What the controller and a worker agree on: the candidate, its shapes and rules, one stage's
job, the verdict, and the end-to-end job and its results. Standard library only; shipped in the
worker bundle beside harness/ and engine_templates/."""

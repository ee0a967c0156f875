"""The `infersmith` command: arguments parsed at the edge into validated models, one module per
command group, each command a thin call into a flow. Exit codes: 0 success (a candidate
passed), 1 a candidate failed or crashed or a run failed, 2 a usage error."""

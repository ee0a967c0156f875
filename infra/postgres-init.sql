-- Run once, when the PostgreSQL volume is new (infra/compose.yaml): Prefect's database and
-- MLflow's, kept apart because each keeps its own schema version in a table of the same name.
CREATE DATABASE prefect OWNER infersmith;
CREATE DATABASE mlflow OWNER infersmith;

# MLflow's tracking server with what infra/compose.yaml asks of it: PostgreSQL (psycopg) and S3
# (boto3). The version is the one pyproject.toml allows, so that clients and server agree.
FROM ghcr.io/mlflow/mlflow:v3.17.2
RUN pip install --no-cache-dir "psycopg[binary]>=3.1" "boto3>=1.34"

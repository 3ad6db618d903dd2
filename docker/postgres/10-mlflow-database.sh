#!/usr/bin/env bash
# Runs once, when the postgres-db volume is first initialised (docker-entrypoint-initdb.d): a role and a
# database for MLflow beside Airflow's, on the same server. Changing MLFLOW_DB_PASSWORD later does not
# change the role; run ALTER ROLE by hand or recreate the volume.
set -euo pipefail
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  --set mlflow_password="${MLFLOW_DB_PASSWORD:?MLFLOW_DB_PASSWORD must be set}" <<'SQL'
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE mlflow OWNER mlflow;
SQL

#!/usr/bin/env bash
# Runs the MLflow tracking server behind MLflow's basic-auth app: every request needs a login. Its config
# (users in an SQLite DB on the mlflow-auth volume, default permission READ for users other than the admin)
# is written here from the environment at each start; the admin user is created on the first start with
# MLFLOW_AUTH_ADMIN_PASSWORD, which the environment passes and nothing writes to disk. Clients log in with
# MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. Extra arguments go to `mlflow server`.
set -euo pipefail

auth_dir="${MLFLOW_AUTH_DIR:-/var/lib/mlflow-auth}"
mkdir -p "$auth_dir"
umask 077
cat > "$auth_dir/basic_auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = sqlite:///$auth_dir/basic_auth.db
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
export MLFLOW_AUTH_CONFIG_PATH="$auth_dir/basic_auth.ini"

exec mlflow server --app-name basic-auth --host 0.0.0.0 --port 5000 --serve-artifacts "$@"

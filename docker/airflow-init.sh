#!/usr/bin/env bash
# One-shot initialisation shared by every Airflow service (the `airflow-init` service runs it):
#   1. writes $AIRFLOW_CONFIG (on the shared airflow-config volume) if it is missing, which generates the
#      fernet key, the JWT secret and the API secret key once, so all components sign and read alike;
#   2. migrates the metadata database (idempotent);
#   3. writes the simple auth manager's password file for the admin user.
set -euo pipefail

: "${AIRFLOW_CONFIG:?AIRFLOW_CONFIG must name the shared airflow.cfg, e.g. /opt/airflow/config/airflow.cfg}"
: "${_AIRFLOW_WWW_USER_USERNAME:?set _AIRFLOW_WWW_USER_USERNAME (the admin user name)}"
: "${_AIRFLOW_WWW_USER_PASSWORD:?set _AIRFLOW_WWW_USER_PASSWORD (the admin password)}"
passwords_file="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:?set AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE}"

echo "Airflow $(airflow version)"
airflow config list >/dev/null   # first import writes $AIRFLOW_CONFIG with generated secrets
echo "configuration: $AIRFLOW_CONFIG"

airflow db migrate

# The user list itself is AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS; this sets that user's password.
# Written to a temporary name and renamed, so the API server never reads half a file.
python - "$passwords_file" <<'PY'
import json, os, sys
path = sys.argv[1]
tmp = f"{path}.tmp"
with open(tmp, "w") as out:
    json.dump({os.environ["_AIRFLOW_WWW_USER_USERNAME"]: os.environ["_AIRFLOW_WWW_USER_PASSWORD"]}, out)
os.chmod(tmp, 0o600)
os.replace(tmp, path)
PY
echo "admin user: ${_AIRFLOW_WWW_USER_USERNAME} (password file $passwords_file)"

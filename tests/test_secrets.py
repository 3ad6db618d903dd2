"""No secret is committed: every tracked text file is scanned for keys, tokens, private keys and passwords
written as literals, and no file that holds secrets (an .env, a key, the stack's secrets file) is tracked.
Secrets come from the environment (`ctr stack` generates them outside the repository)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PATTERNS: dict[str, re.Pattern] = {
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "private key": re.compile(r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----"),
    "Slack webhook": re.compile(r"hooks\.slack\.com/services/T[A-Z0-9]+/"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36}\b"),
    "Fernet key": re.compile(r"FERNET_KEY\s*[=:]\s*['\"]?[A-Za-z0-9_-]{43}=", re.IGNORECASE),
    # A secret-named variable given a literal of 12+ characters (a placeholder from the environment, ${...}, or
    # an expression is fine).
    "literal secret": re.compile(r"(?i)\b[a-z_]*(?:secret|password|passwd|token|api_key|access_key)[a-z_]*\s*"
                                 r"[=:]\s*[\"'](?P<value>[^\"'\s$<{][^\"'\s]{11,})[\"']"),
}
# Literals that name a secret rather than hold one: an environment variable's name, a file name, a name that says
# what it is (psql's :'mlflow_password').
NOT_A_SECRET = re.compile(r"_?[A-Z][A-Z0-9_]*|.*\.(?:json|generated|ini|env|txt|ya?ml)"
                          r"|(?i:.*(?:password|secret|token).*)")
SECRET_FILES = re.compile(r"(^|/)(\.env(\..+)?|stack\.env|.*\.pem|.*\.key|id_rsa.*|.*\.p12)$")


def scan(text: str) -> list[str]:
    """The names of the patterns `text` matches."""
    found = []
    for name, pattern in PATTERNS.items():
        for match in pattern.finditer(text):
            if "value" in pattern.groupindex and NOT_A_SECRET.fullmatch(match["value"]):
                continue
            found.append(name)
            break
    return found


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.decode().split("\0") if name]


@pytest.mark.parametrize("text", [
    "aws_access_key_id = AKIAABCDEFGHIJKLMNOP",
    "-----BEGIN RSA PRIVATE KEY-----",
    "url = 'https://hooks.slack.com/services/T0123ABCD/B0123/xyz'",
    "token: ghp_" + "a" * 36,
    "AIRFLOW__CORE__FERNET_KEY=" + "b" * 43 + "=",
    'MLFLOW_TRACKING_PASSWORD = "correct-horse-battery"',
    "db_password: 'hunter2hunter2'",
])
def test_the_scan_finds_each_kind_of_secret(text):
    assert scan(text), text


@pytest.mark.parametrize("text", [
    'MLFLOW_TRACKING_PASSWORD: ${MLFLOW_TRACKING_PASSWORD:-mlflow-admin-password}',
    'password = environ["_AIRFLOW_WWW_USER_PASSWORD"]',
    'PASSWORD_VARIABLE = "_AIRFLOW_WWW_USER_PASSWORD"',
    "secret = secrets.token_urlsafe(32)",
    'PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"',
    '--set mlflow_password="${MLFLOW_DB_PASSWORD:?MLFLOW_DB_PASSWORD must be set}"',
    "CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';",
])
def test_references_to_the_environment_are_not_secrets(text):
    assert scan(text) == [], scan(text)


def test_no_secret_is_committed():
    found = []
    for name in tracked_files():
        if name == "tests/test_secrets.py":  # its samples of each kind are the point of it
            continue
        path = ROOT / name
        if SECRET_FILES.search(name):
            found.append(f"{name}: a file that holds secrets is tracked")
            continue
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images)
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            kinds = scan(line)
            if kinds and "secret-scan: allow" not in line:
                found.append(f"{name}:{number}: {', '.join(kinds)}")
    assert found == [], "secrets in the tree (move them to the environment):\n" + "\n".join(found)


def test_a_config_or_spec_file_cannot_run_code(tmp_path):
    """YAML is read as plain data: a tag that would build an object or call a function is refused, and nothing
    runs."""
    from components.config import ConfigError, load_config
    from components.feature_spec import FeatureSpecError, load_spec

    witness = tmp_path / "ran"
    payload = f"!!python/object/apply:os.system ['touch {witness}']"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"train:\n  epochs: {payload}\n")
    with pytest.raises(ConfigError, match="is not plain YAML data"):
        load_config(yaml_path=config_file, environ={})
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(f"name: {payload}\nfeatures: []\n")
    with pytest.raises(FeatureSpecError, match="is not valid YAML"):
        load_spec(str(spec_file))
    assert not witness.exists()

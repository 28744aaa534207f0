"""The one redaction rule: which names hold secrets, and how their values are hidden wherever evalpipe writes.

Every writer of server info, receipts, manifests, logs, ab.json and reports goes through this module, so there is
one definition of a secret:

- flags and settings (`--api-key`, `api_key`, `--hf-token`, `x-api-key`): a name whose last word is `key`, that
  contains `secret`, `password`, `passwd`, `apikey`, `credential(s)` or `authorization`, or whose last word is
  `token` after an owner word (`hf_token`, `auth_token`, `access_token`; not `bos_token` or `max_tokens`);
- environment variables: any name containing `KEY`, `TOKEN` (but not `TOKENIZER`), `SECRET`, `PASSWORD`, `PASSWD`,
  `CREDENTIAL` or `AUTHORIZATION`;
- free text (command lines, log lines, string settings): the value after such a flag or `name=`/`name:`, a
  `Bearer` credential, and the password of a `scheme://user:password@host` URL;
- and, belt and braces, every known secret value (the API key in use) wherever it appears.

Hidden values become `<redacted>`; a secret setting that is unset (None, empty) stays as it is, so a reader can
still tell "no key" from "a key".
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Iterable, Mapping

REDACTED = "<redacted>"

_SECRET_WORDS = {"secret", "secrets", "password", "passwd", "apikey", "credential", "credentials", "authorization"}
_TOKEN_OWNERS = {
    "hf",
    "auth",
    "access",
    "bearer",
    "hub",
    "refresh",
    "session",
    "github",
    "gh",
    "api",
    "id",
    "oauth",
    "jwt",
    "private",
    "personal",
    "wandb",
    "slack",
}
_ENV_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTHORIZATION")
_UNSET = {"", "none", "null", "false", "true", REDACTED.lower()}

_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
# `--api-key VALUE`, `--api-key=VALUE`, `-api-key VALUE` (a quoted value counts as one)
_FLAG_RE = re.compile(r"(?<![\w-])(--?" + _NAME + r")(=|[ \t]+)('[^']*'|\"[^\"]*\"|[^\s'\"]+)")
# `api_key=VALUE`, `api_key: VALUE`, `"api_key": "VALUE"`, `api_key='VALUE'` (Python reprs, JSON, YAML, logs)
_ASSIGN_RE = re.compile(r"(?<![\w-])(" + _NAME + r")(['\"]?[ \t]*[=:][ \t]*)('[^']*'|\"[^\"]*\"|[^\s,;)}\]'\"]+)")
_BEARER_RE = re.compile(r"(?i)\b(bearer)([ \t]+)([A-Za-z0-9._~+/=-]{4,})")
# `Authorization: Basic xyz` hides the whole header value, whatever its scheme
_AUTH_RE = re.compile(r"(?i)\b(authorization)(['\"]?[ \t]*[=:][ \t]*['\"]?)([^'\"\r\n,}]+)")
_URL_PASSWORD_RE = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(@)", re.IGNORECASE)


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def is_secret_name(name: str) -> bool:
    """A flag or setting name (`--api-key`, `api_key`, `hf_token`, `Authorization`) whose value is a secret."""
    words = _words(name)
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words) or words[-1] == "key":
        return True
    return words[-1] == "token" and (len(words) == 1 or words[-2] in _TOKEN_OWNERS)


def is_secret_env_name(name: str) -> bool:
    """An environment variable whose value is a secret (`OPENAI_API_KEY`, `HF_TOKEN`, `DB_PASSWORD`)."""
    upper = name.upper().replace("TOKENIZER", "")
    return any(marker in upper for marker in _ENV_MARKERS)


def _is_value(text: str) -> bool:
    return text.strip("'\"").lower() not in _UNSET


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Hide secret values in free text: secret flags and assignments, Bearer credentials, URL passwords, and
    every occurrence of the known `secrets`."""
    if not isinstance(text, str) or not text:
        return text

    def flag(m: re.Match) -> str:
        name, sep, value = m.groups()
        if is_secret_name(name) and _is_value(value):
            quote = value[0] if value[:1] in ("'", '"') else ""
            return f"{name}{sep}{quote}{REDACTED}{quote}"
        return m.group(0)

    text = _FLAG_RE.sub(flag, text)
    text = _ASSIGN_RE.sub(lambda m: flag(m) if not m.group(1).startswith("-") else m.group(0), text)
    text = _AUTH_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _URL_PASSWORD_RE.sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(3)}", text)
    return scrub_values(text, secrets)


def redact_argv(argv: Iterable[str], secrets: Iterable[str] = ()) -> list[str]:
    """An argv with the value of every secret flag hidden (`--api-key K`, `--hf-token=T`); an argument that is
    itself a command line (`evalpipe ab --a "--api-key K"`) is redacted as one."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        token = str(token)
        if hide_next:
            out.append(REDACTED if _is_value(token) else token)
            hide_next = False
            continue
        if token.startswith("-") and not any(c.isspace() for c in token):
            name, sep, value = token.partition("=")
            if is_secret_name(name):
                if sep:
                    out.append(f"{name}={REDACTED}" if _is_value(value) else token)
                else:
                    out.append(token)
                    hide_next = True
                continue
        out.append(redact_text(token))
    return [scrub_values(t, secrets) for t in out]


def redact_env(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """Environment variables, sorted, with the values of secret-named ones hidden."""
    return {
        name: (REDACTED if is_secret_env_name(name) and value else scrub_values(value, secrets))
        for name, value in sorted(env.items())
    }


def redact(value: Any, secrets: Iterable[str] = ()) -> Any:
    """A JSON-like value (server info, a manifest, a receipt, ab.json) with every secret hidden: secret-named
    fields, secret flags in argv lists and command strings, and the known `secrets` anywhere."""
    secrets = _known(secrets)
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_name(k) and _secret_set(v) else redact(v, secrets))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(value, secrets)  # an echoed command line, or plain strings (left as they are)
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def _secret_set(value: Any) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, str) and not _is_value(value))


def _known(secrets: Iterable[str]) -> list[str]:
    """Secret values worth searching for (very short strings would match everywhere)."""
    return sorted({s for s in secrets if isinstance(s, str) and len(s) >= 4}, key=len, reverse=True)


def scrub_values(value: Any, secrets: Iterable[str]) -> Any:
    """Every occurrence of the known secret strings replaced, anywhere in a JSON-like value."""
    secrets = _known(secrets)
    if not secrets:
        return value
    if isinstance(value, dict):
        return {k: scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_values(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
            quoted = shlex.quote(secret)
            if quoted != secret:
                value = value.replace(quoted, REDACTED)
    return value

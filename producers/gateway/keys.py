"""API key secrets: only their SHA-256 is ever stored (the key registry topic is keyed by it).

Keys are 256-bit random secrets, so one unsalted SHA-256 is the right hash (a slow password hash protects
low-entropy secrets; these are not). The secret is shown once, when it is created. The suspensions the abuse
detector imposes on keys are ``runtime/suspensions.py``.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "sk-kns-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)

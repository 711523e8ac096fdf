"""The redaction rule: secrets, e-mail addresses and the user's own patterns, removed before a trace is stored.

The rule runs on every string of a trace (request, response, tool calls, the task's payload, errors) in
the request handler, before the row reaches the writer's queue, so nothing unredacted is ever held for
writing, written, or logged by the writer.
"""

from __future__ import annotations

import re
from typing import Any

from evertrain.config import RedactionConfig

# each pattern's whole match is replaced, except the key-value one, which keeps its key ("password=[REDACTED]")
SECRET_PATTERNS = (
    r"\bsk-[A-Za-z0-9_-]{16,}",                     # OpenAI / Anthropic style API keys (sk-..., sk-proj-...)
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",                # GitHub tokens
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",               # AWS access key ids
    r"\bxox[abprs]-[A-Za-z0-9-]{10,}",              # Slack tokens
    r"\bAIza[0-9A-Za-z_-]{35}\b",                   # Google API keys
    r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}",       # Authorization headers
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
)
KEY_VALUE = (r"(?i)(\b(?:password|passwd|pwd|passphrase|api[_-]?key|apikey|secret(?:[_-]?key)?|access[_-]?token|"
             r"auth[_-]?token|token)\b[\"']?\s*[:=]\s*[\"']?)([^\s\"',;]+)")
EMAIL = r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"


class Redactor:
    """Applies one :class:`~evertrain.config.RedactionConfig` to strings and JSON-like values."""

    def __init__(self, config: RedactionConfig) -> None:
        self.replacement = config.replacement
        whole = list(SECRET_PATTERNS) if config.secrets else []
        if config.emails:
            whole.append(EMAIL)
        whole += config.patterns
        self._whole = [re.compile(p, re.DOTALL) for p in whole]
        self._key_value = re.compile(KEY_VALUE) if config.secrets else None

    def text(self, value: str) -> str:
        """``value`` with every match of the rule replaced."""
        if self._key_value is not None:
            value = self._key_value.sub(lambda m: m.group(1) + self.replacement, value)
        for pattern in self._whole:
            value = pattern.sub(self.replacement, value)
        return value

    def value(self, value: Any) -> Any:
        """A JSON-like value (dicts, lists, strings, numbers) with every string redacted, keys included."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

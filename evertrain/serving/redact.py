"""The redaction rule: secrets, e-mail addresses and the user's own patterns, removed before a trace is stored.

The rule runs on every string of a trace (request, response, tool calls, the task's payload, errors) in
the request handler, before the row reaches the writer's queue, so nothing unredacted is ever held for
writing, written, or logged by the writer.

The patterns run on the ``regex`` engine (the ``re`` syntax) rather than ``re``: it releases the GIL while
it matches (``concurrent=True``), so redacting a large trace in a worker thread does not stall the
endpoint's other requests, and it takes a time limit, so a user pattern that backtracks catastrophically
cannot hold a request for ever: a string a pattern cannot finish within ``timeout_seconds`` is replaced
whole (fail closed).
"""

from __future__ import annotations

import logging
from typing import Any

import regex

from evertrain.config import RedactionConfig

log = logging.getLogger("evertrain.serving")

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


SURROGATE = regex.compile(r"[\ud800-\udfff]")


def storable(text: str, *, json_text: bool = False) -> str:
    """``text`` as UTF-8 can encode it: each unpaired surrogate (``"\\ud800"`` in a JSON string decodes to one)
    becomes the six characters of its escape, ``\\ud800`` (in ``json_text``, JSON text, the escaped backslash
    ``\\\\ud800``, so the JSON still decodes to those six characters); any other text is unchanged."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        slash = "\\\\" if json_text else "\\"
        return SURROGATE.sub(lambda m: f"{slash}u{ord(m.group()):04x}", text)
    return text


class Redactor:
    """Applies one :class:`~evertrain.config.RedactionConfig` to strings and JSON-like values."""

    def __init__(self, config: RedactionConfig) -> None:
        self.replacement = config.replacement
        self.timeout = config.timeout_seconds
        self.timeouts = 0
        whole = list(SECRET_PATTERNS) if config.secrets else []
        if config.emails:
            whole.append(EMAIL)
        whole += config.patterns
        self._whole = []
        for pattern in whole:
            try:
                self._whole.append(regex.compile(pattern, regex.DOTALL | regex.VERSION0))
            except regex.error as error:
                raise ValueError(f"redaction pattern {pattern!r} is not a valid regular expression: {error}") from None
        self._key_value = regex.compile(KEY_VALUE, regex.VERSION0) if config.secrets else None

    def text(self, value: str) -> str:
        """``value`` with every match of the rule replaced (the whole of it when a pattern runs out of time), and
        an unpaired surrogate as its escape (:func:`storable`)."""
        value = storable(value)
        try:
            if self._key_value is not None:
                value = self._key_value.sub(lambda m: m.group(1) + self.replacement, value, concurrent=True,
                                            timeout=self.timeout)
            for pattern in self._whole:
                value = pattern.sub(self.replacement, value, concurrent=True, timeout=self.timeout)
        except TimeoutError:
            self.timeouts += 1
            log.warning("redaction: a pattern ran past %.1f s on a %d-character string; the string is replaced "
                        "whole", self.timeout, len(value))
            return self.replacement
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

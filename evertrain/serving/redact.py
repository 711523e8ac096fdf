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

import base64
import binascii
import logging
from typing import Any

import regex

from evertrain.config import RedactionConfig

log = logging.getLogger("evertrain.serving")

# each pattern's whole match is replaced, except where it names a group ``secret`` (only that group is: a URL's
# password keeps its scheme and host) and the key-value one, which keeps its key ("password=[REDACTED]")
# 13 to 19 digits, together or in the groups cards are printed in (4-4-4-4[-3], Amex 4-6-5), starting as a card
# number does (2 to 6); the Luhn check (CHECKS) then keeps the nine in ten other numbers
CARD = (r"(?<![\w.-])(?:[2-6]\d{12,18}|[2-6]\d{3}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,4})?|3\d{3}[ -]\d{6}[ -]\d{5})"
        r"(?![\w-]|\.\d)")
BASIC = r"(?i)\bbasic\s+(?P<secret>[A-Za-z0-9+/]{6,}={0,2})(?![A-Za-z0-9+/=])"
SECRET_PATTERNS = (
    r"\bsk-[A-Za-z0-9_-]{16,}",                     # OpenAI / Anthropic style API keys (sk-..., sk-proj-...)
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",                # GitHub tokens
    r"\bgithub_pat_[A-Za-z0-9_]{22,}",              # GitHub fine-grained tokens
    r"\bglpat-[A-Za-z0-9_-]{20,}",                  # GitLab personal access tokens
    r"\bhf_[A-Za-z0-9]{30,}",                       # Hugging Face tokens
    r"\bnpm_[A-Za-z0-9]{30,}",                      # npm tokens
    r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}",  # Stripe keys
    r"\bSG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}",  # SendGrid (Twilio) API keys
    r"\b(?:SK|AC)[0-9a-fA-F]{32}\b",                # Twilio API key and account SIDs
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",               # AWS access key ids
    r"\bxox[abprs]-[A-Za-z0-9-]{10,}",              # Slack tokens
    r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+",  # Slack webhooks
    r"\bAIza[0-9A-Za-z_-]{35}\b",                   # Google API keys
    r"\beyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*",  # JWTs (header.payload.signature)
    r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}",       # Authorization headers
    BASIC,                                          # Basic auth: when the base64 decodes to "user:password"
    r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]+:(?P<secret>[^\s/@]+)@",  # a URL's password (scheme://user:password@)
    CARD,                                           # card numbers: only those that pass the Luhn check
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
)
KEY_VALUE = (r"(?i)(\b(?:password|passwd|pwd|passphrase|api[_-]?key|apikey|secret(?:[_-]?key)?|access[_-]?token|"
             r"auth[_-]?token|token|client[_-]?secret|aws_secret_access_key|account[_-]?key|shared[_-]?access[_-]?key|"
             r"shared[_-]?access[_-]?signature|private[_-]?key)\b[\"']?\s*[:=]\s*[\"']?)([^\s\"',;]+)")
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


def luhn(digits: str) -> bool:
    """Whether ``digits`` pass the Luhn check (what every payment card number does, and 1 in 10 numbers)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char) * (2 if i % 2 else 1)
        total += value - 9 if value > 9 else value
    return total % 10 == 0


def _card(match: Any) -> bool:
    digits = "".join(c for c in match.group(0) if c.isdigit())
    return 13 <= len(digits) <= 19 and luhn(digits)


def _basic(match: Any) -> bool:
    try:
        decoded = base64.b64decode(match.group("secret"), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    return ":" in decoded


CHECKS = {CARD: _card, BASIC: _basic}  # a match of these is redacted only when its check passes


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
                self._whole.append((regex.compile(pattern, regex.DOTALL | regex.VERSION0), CHECKS.get(pattern)))
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
            for pattern, check in self._whole:
                if check is None and "secret" not in pattern.groupindex:
                    value = pattern.sub(self.replacement, value, concurrent=True, timeout=self.timeout)
                else:
                    value = pattern.sub(lambda m, check=check: self._replace(m, check), value, concurrent=True,
                                        timeout=self.timeout)
        except TimeoutError:
            self.timeouts += 1
            log.warning("redaction: a pattern ran past %.1f s on a %d-character string; the string is replaced "
                        "whole", self.timeout, len(value))
            return self.replacement
        return value

    def _replace(self, match: Any, check: Any) -> str:
        """A match's replacement: none when its check fails, only its ``secret`` group when it names one."""
        if check is not None and not check(match):
            return match.group(0)
        if "secret" not in match.re.groupindex:
            return self.replacement
        start, end = match.span("secret")
        text = match.group(0)
        return text[:start - match.start()] + self.replacement + text[end - match.start():]

    def value(self, value: Any) -> Any:
        """A JSON-like value (dicts, lists, strings, numbers) with every string redacted, keys included."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

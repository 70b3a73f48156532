"""URLs as shown to people: secrets replaced by ``***``.

:func:`redact_urls` is the one place a URL is made fit for a log line, an error message or a
command's output. Internally the full URL is kept: it is what is fetched and the cache's key.

What is replaced, in a URL alone or in any text that holds URLs (an exception's message, say):

- the user info, whole (up to the last ``@`` before the host): ``http://user:password@host/a.tar``
  is shown ``http://***@host/a.tar`` (a user name may be a token itself, as in ``https://TOKEN@host/``),
  and so is a password written with a ``/``, ``?`` or ``#`` as it is (``http://user:pa/ss@host/``:
  a "port" that is no number, then up to the last ``@``);
- the value of every query (or fragment) parameter whose name, in any case, contains ``sig``,
  ``token``, ``secret``, ``pass``, ``pwd``, ``credential``, ``auth``, ``key``, ``policy``,
  ``session``, ``hmac`` or ``hdnts`` (Akamai's tokens): ``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, Azure SAS ``sig``, CloudFront ``Signature``, ``Policy`` and ``Key-Pair-Id``, ``token``, ``access_token``,
  ``apikey``, ``api_key``, ``password``... A name is matched as the server reads it, its
  percent-escapes decoded (``%74oken`` is ``token``); its value runs to the next ``&``, ``#`` or space
  (``;`` and ``'`` are part of it). Other parameters (``X-Amz-Expires``, SAS ``se``,
  ``sp``, ``sv``) stay, as they help tell why a signed URL was refused.

And in any text, the credentials of an HTTP header as a verbose tool prints it (``curl -v``'s
``> Authorization: Bearer ...``) or a command line passes it (``-H 'Cookie: ...'``):

- the value of an ``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``Set-Cookie``,
  ``X-Amz-Security-Token`` or ``X-Api-Key`` header (its name in any case), to the end of its line
  or to a quote; of the first two, the scheme word stays (``Authorization: Bearer ***``);
- a ``Bearer`` token, and ``Basic`` credentials (base64 of ``user:password``), wherever they stand.

A ``pipe:`` command is text like any other: the URLs and headers in it are redacted, the rest is
shown as written (keep secrets of a command in its environment, not in the list).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import unquote_plus

__all__ = ["MASK", "redact_urls", "redacted"]

MASK = "***"
# A scheme, then the user info up to its last "@" before the host ends ("/", "?", "#" or a space).
# "'" and ";" are legal in user info and query values (RFC 3986 sub-delims), so they end neither;
# '"', "<" and ">" are not legal in a URL and end one quoted in a text (JSON, HTML).
_USER_INFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/?#\"<>]*@")
# A password written with a "/", "?" or "#" as it is (which a list refuses, but a text may quote):
# a "port" that is no number, then everything up to the last "@" before the URL ends; only where
# the user info is not whole before the host ("(?!...@)": then _USER_INFO masks it alone).
_BROKEN_USER_INFO = re.compile(
    r"\b([A-Za-z][A-Za-z0-9+.-]{0,31}://)(?![^\s/?#\"<>]*@)[^\s/?#\"<>@:\[]*:(?![0-9]*(?:[/?#\s\"<>]|$))[^\s\"<>]*@"
)
# A parameter after "?", "&", ";" or "#": anywhere in a text, since a message may quote a URL's
# path and query without its scheme (``Max retries exceeded with url: /a.tar?token=...``).
_PARAMETER = re.compile(r"([?&;#])([^=&;#?\s\"'<>]+)=([^&#\s\"<>]+)")
_SECRET_NAME = re.compile(r"sig|token|secret|pass|pwd|credential|auth|key|policy|session|hmac|hdnts", re.IGNORECASE)


# A header with credentials: its name (not inside a path or a word: "s3://b/cookie:jar" is a key),
# ":" (a quote after the name: JSON's), then a quote that opens its value, if any; an
# Authorization's scheme word stays. Where its value ends, see _value_end.
_HEADER = re.compile(
    r"(?<![\w/.-])((?:proxy-)?authorization|set-cookie|cookie|x-amz-security-token|x-api-key)"
    r"([\"']?)([ \t]*:[ \t]*)([\"']?)((?:bearer|basic|digest|negotiate|aws4-hmac-sha256|token)[ \t]+)?",
    re.IGNORECASE,
)
_VALUE_ENDS = {  # what ends a header's value that no quote opened
    "json": re.compile(r"[,}\]\s\"']"),  # a JSON literal (its name was quoted)
    "line": re.compile(r"[\r\n\"']"),  # "Name: value" as a tool prints it, or a quoted "-H 'Name: value'"
    "word": re.compile(r"[\s\"']"),  # "Name:value" in a command line
}
# Credentials of an Authorization scheme where no header name precedes them (token68, RFC 7235).
# Case-sensitive, as tools write them: "the bearer of" is prose.
_CREDENTIALS = re.compile(r"\b(Bearer|Basic)([ \t]+)([A-Za-z0-9._~+/-]+=*)")


def _headers(text: str) -> str:
    """``text`` with the values of credential headers in it masked (see the module docstring)."""
    out: list[str] = []
    at = 0
    for match in _HEADER.finditer(text):
        if match.start() < at:
            continue  # (within a value masked already)
        start = match.end()
        end = _value_end(text, start, match)
        if text[start:end].strip():
            out += (text[at:start], MASK)
            at = end
    return "".join(out) + text[at:] if out else text


def _value_end(text: str, start: int, match: re.Match[str]) -> int:
    """Where the value of the header ``match`` found, from ``start``, ends: at the quote that opened
    it; else at the end of a JSON literal (a quoted name), of its line ("Name: value"), or of its
    word ("Name:value", as a command line writes it)."""
    _, name_quote, colon, value_quote, _ = match.groups()
    if value_quote:
        stop = text.find(value_quote, start)
        return len(text) if stop < 0 else stop
    kind = "json" if name_quote else "line" if colon[-1] in " \t" else "word"
    found = _VALUE_ENDS[kind].search(text, start)
    return len(text) if found is None else found.start()


def _credentials(match: re.Match[str]) -> str:
    scheme, space, value = match.groups()
    if scheme == "Basic" and not _is_basic(value):
        return match.group(0)  # a word after "basic" in prose ("basic usage"), not credentials
    return f"{scheme}{space}{MASK}"


def _is_basic(value: str) -> bool:
    """Whether ``value`` reads as Basic credentials: base64 of ``user:password``."""
    try:
        return b":" in base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False


def _parameter(match: re.Match[str]) -> str:
    sep, name, value = match.groups()
    if not _SECRET_NAME.search(unquote_plus(name)):
        # Its value may hold more parameters after a ";" (``?a=1;token=x``).
        return f"{sep}{name}={_PARAMETER.sub(_parameter, value)}"
    # Punctuation after a URL in a sentence ("...?token=abc: HTTP 403") or a quote around it
    # ('...?token=abc') is the text's.
    after = value[len(value.rstrip(":,.)]}'")) :]
    return f"{sep}{name}={MASK}{after}"


def redact_urls(text: str) -> str:
    """``text`` (a URL, or any text with URLs in it) with user info, secret parameter values and
    header credentials replaced by ``***`` (see the module docstring); text without them is
    returned unchanged."""
    if "@" in text:
        text = _USER_INFO.sub(rf"\1{MASK}@", _BROKEN_USER_INFO.sub(rf"\1{MASK}@", text))
    if "=" in text:
        text = _PARAMETER.sub(_parameter, text)
    if ":" in text:
        lower = text.lower()  # (a check of each name, not a generator: this runs for every log line)
        if "authorization" in lower or "cookie" in lower or "x-amz-security-token" in lower or "x-api-key" in lower:
            text = _headers(text)
    if "Bearer" in text or "Basic" in text:
        text = _CREDENTIALS.sub(_credentials, text)
    return text


def redacted(obj: Any) -> Any:
    """``obj`` (a JSON-like object: dicts, lists, strings...) with every string in it, keys too,
    through :func:`redact_urls`; tuples become lists, other values stay."""
    if isinstance(obj, str):
        return redact_urls(obj)
    if isinstance(obj, dict):
        return {redacted(k): redacted(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redacted(v) for v in obj]
    return obj

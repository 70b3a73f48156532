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

- the value of an ``Authorization``, ``Proxy-Authorization``, ``WWW-Authenticate``,
  ``Proxy-Authenticate``, ``Cookie``, ``Set-Cookie``, ``X-Amz-Security-Token`` or ``X-Api-Key``
  header (its name in any case), to the end of its line or to a quote that is not one of its
  quoted strings (``Digest username="bob", ..., response="..."`` is masked whole, whatever
  follows the last one: ``")``, ``".`` or a word); of the first
  four, a known scheme word stays (``Authorization: Bearer ***``, ``Digest ***``, ``NTLM ***``,
  ``AWS4-HMAC-SHA256 ***``);
- a ``Bearer`` token, ``Basic`` credentials (base64 of ``user:password``), and the parameter list
  of ``Digest`` and ``AWS4-HMAC-SHA256`` credentials (``Credential=..., Signature=...``; those two
  scheme words in any case), wherever they stand;
- in a text with such a header, the user name of curl's ``-v`` note ``Server auth using Digest
  with user '...'``.

A ``pipe:`` command is text like any other: the URLs and headers in it are redacted, the rest is
shown as written (keep secrets of a command in its environment, not in the list).

Names that differ only by their secrets (two jobs named by URLs with different passwords) would
be one once redacted: :func:`shown_names` keeps them apart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote_plus

__all__ = ["MASK", "redact_urls", "redacted", "shown_names"]

MASK = "***"
# The key of the tags that tell apart names alike once redacted (shown_names): this process's own,
# so that a tag is the same for a name while the process runs and tells nothing of its secret.
_TAG_KEY = secrets.token_bytes(16)
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
# path and query without its scheme (``Max retries exceeded with url: /a.tar?token=...``): its
# name and "=" here, then its value (_VALUE, at least a character), scanned only where masked.
_PARAMETER = re.compile(r"[?&;#]([^=&;#?\s\"'<>]+)=")
_VALUE = re.compile(r"[^&#\s\"<>]+")
_SECRET_NAME = re.compile(r"sig|token|secret|pass|pwd|credential|auth|key|policy|session|hmac|hdnts", re.IGNORECASE)


# A header with credentials: its name (not inside a path or a word: "s3://b/cookie:jar" is a key),
# ":" (a quote after the name: JSON's), then a quote that opens its value, if any; the scheme word
# of credentials or a challenge stays (those of IANA's registry, AWS's and Azure's, as a word of its
# own: "tokenXYZ" is a token). Where its value ends, see _value_end.
_HEADER = re.compile(
    r"(?<![\w/.-])((?:proxy-)?authorization|(?:www|proxy)-authenticate|set-cookie|cookie|x-amz-security-token|x-api-key)"
    r"([\"']?)([ \t]*:[ \t]*)([\"']?)"
    r"((?:bearer|basic|digest|negotiate|ntlm|aws4-hmac-sha256|aws|token|oauth|hoba|mutual|scram-sha-1|scram-sha-256"
    r"|vapid|sharedkey|sharedkeylite|sharedaccesssignature)(?:[ \t]+|(?=[\r\n\"',]|$)))?",
    re.IGNORECASE,
)
_VALUE_ENDS = {  # what ends a header's value that no quote opened
    "json": re.compile(r"[,}\]\s\"']"),  # a JSON literal (its name was quoted)
    "line": re.compile(r"[\r\n\"']"),  # "Name: value" as a tool prints it, or a quoted "-H 'Name: value'"
    "word": re.compile(r"[\s\"']"),  # "Name:value" in a command line
}
# Schemes whose credentials are one token68 (RFC 7235), which may end with "=": after them a quote
# ends the value, even one after a "=" ("-H 'Authorization: Bearer abc=' -H 'X: y'").
_TOKEN68_SCHEMES = frozenset({"bearer", "basic", "negotiate", "ntlm", "token"})
# A quoted string (RFC 7230), or one whose quotes are escaped as they are within a quoted command
# line argument or a JSON string (-H "Authorization: Digest username=\"bob\"").
_QUOTED = r'"(?:[^"\\\r\n]|\\[^\r\n])*"|\\"(?:[^"\\\r\n]|\\[^"\r\n])*\\"'
# The value of a header "Name: value" up to its line's end, or to a quote that is no auth-param's
# quoted string (its name after a space, "," or ";", and after it what cannot go on with a token:
# a space, "," ";", a quote, a closing bracket, a sentence's "." or ":", the line's end): the quote
# that ends a quoted command line argument (-H "Cookie: a=" -H "X: y", where '" -H "' is followed
# by "X").
_PARAMS_LINE = re.compile(
    rf"(?:(?<![^\s,;])[A-Za-z][\w.-]*[ \t]*=[ \t]*(?:{_QUOTED})"
    rf"(?=[\s,;\"')\]}}]|[.:](?!\S)|$)|[^\r\n\"'])*"
)
# A value opened by a quote ends at the same quote, unless escaped ("Digest username=\"bob\"").
_UNESCAPED = {q: re.compile(rf"(?:[^{q}\\]|\\.)*{q}", re.DOTALL) for q in "\"'"}
# Credentials of an Authorization scheme where no header name precedes them (token68, RFC 7235).
# Case-sensitive, as tools write them: "the bearer of" is prose.
_CREDENTIALS = re.compile(r"\b(Bearer|Basic)([ \t]+)([A-Za-z0-9._~+/-]+=*)")
# Credentials of a scheme whose credentials are auth-params ("name=value, ..."), where no header
# name precedes them: the list is masked, the text after it stays. The scheme in any case, as a
# server reads it ("digest username=..."): a list of "name=value" after it is no prose.
# (A token's last ":", "." or ")" is the sentence's: "..., Signature=abc: refused".)
_AUTH_PARAM = rf"[A-Za-z][\w.-]*[ \t]*=[ \t]*(?:{_QUOTED}|[^\s,\"'\\]*[^\s,\"'\\:.)])"
_PARAM_CREDENTIALS = re.compile(
    rf"\b(Digest|AWS4-HMAC-SHA256)([ \t]+)({_AUTH_PARAM}(?:[ \t]*,[ \t]*{_AUTH_PARAM})*)", re.IGNORECASE
)
# curl -v's note of who it authenticates as ("* Server auth using Digest with user 'bob'"): a user
# name may be a token itself (-u TOKEN:x-oauth-basic).
_CURL_USER = re.compile(r"(auth using [\w-]+ with user ')[^'\r\n]*'")


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
    it; else at the end of a JSON literal (a quoted name), of its line ("Name: value", past the
    quoted strings of its auth-params or cookies), or of its word ("Name:value", as a command line
    writes it)."""
    name, name_quote, colon, value_quote, scheme = match.groups()
    if value_quote:
        closed = _UNESCAPED[value_quote].match(text, start)
        if closed is not None:
            return closed.end() - 1
        stop = text.find(value_quote, start)
        return len(text) if stop < 0 else stop
    kind = "json" if name_quote else "line" if colon[-1] in " \t" else "word"
    token68 = (scheme or "").strip().lower() in _TOKEN68_SCHEMES and "authenticate" not in name.lower()
    if kind == "line" and not token68:  # (a challenge's auth-params follow any scheme: Basic realm="r")
        params = _PARAMS_LINE.match(text, start)  # (never None: it matches "")
        return start if params is None else params.end()
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


def _parameters(text: str) -> str:
    """``text`` with the value of every parameter of a secret name masked. One pass, left to right
    (a line may hold thousands of parameters): after a parameter of another name the scan goes on
    within its value, which may hold more after a ";" (``?a=1;token=x``), and only a masked value
    is read to its end, once."""
    out: list[str] = []
    at = pos = 0
    while (match := _PARAMETER.search(text, pos)) is not None:
        pos = match.end()
        if not _SECRET_NAME.search(unquote_plus(match.group(1))):
            continue
        value = _VALUE.match(text, pos)
        if value is None:
            continue
        # Punctuation after a URL in a sentence ("...?token=abc: HTTP 403") or a quote around it
        # ('...?token=abc') is the text's.
        out += (text[at:pos], MASK)
        at, pos = pos + len(value.group().rstrip(":,.)]}'")), value.end()
    return "".join(out) + text[at:] if out else text


def redact_urls(text: str) -> str:
    """``text`` (a URL, or any text with URLs in it) with user info, secret parameter values and
    header credentials replaced by ``***`` (see the module docstring); text without them is
    returned unchanged."""
    if "@" in text:
        text = _USER_INFO.sub(rf"\1{MASK}@", _BROKEN_USER_INFO.sub(rf"\1{MASK}@", text))
    # Names in any case are looked for in one lower-case copy (this runs for every log line): of the
    # text before the masking below, which leaves no name that was not there.
    lower = text.lower() if "=" in text or ":" in text else ""
    if "=" in text:
        text = _parameters(text)
        if "digest" in lower or "aws4-hmac-sha256" in lower:  # (their credentials are "name=value" lists)
            text = _PARAM_CREDENTIALS.sub(rf"\1\2{MASK}", text)
    if ":" in text:
        # (a check of each name, not a generator; "auth": Authorization, WWW-Authenticate and
        # Proxy-Authenticate in one look)
        if "auth" in lower or "cookie" in lower or "x-amz-security-token" in lower or "x-api-key" in lower:
            text = _headers(text)
            if " with user '" in text:  # (curl -v notes the user before it sends the header)
                text = _CURL_USER.sub(rf"\1{MASK}'", text)
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


def shown_names(names: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` (job names, say) as shown: redacted (:func:`redact_urls`), and where
    names differ only by what that masks, each of them with a tag: a few hex digits of a hash
    keyed by this process's random key, so the tag tells nothing of the secret and stays the same
    for the name while this process runs. The tag follows the name (``train-http://***@h/x #3fa1``)
    or, where what is masked runs to the name's end (a header's value runs to its line's), comes
    first (``#3fa1 train Authorization: Bearer ***``): a name as shown is redacted again wherever
    it is shown (``redacted``, a command's output), which must leave its tag."""
    alike: dict[str, set[str]] = {}
    for name in names:
        alike.setdefault(redact_urls(name), set()).add(name)
    out: dict[str, str] = {}
    for shown, group in alike.items():
        if len(group) == 1:
            out[next(iter(group))] = shown
            continue
        tags = {name: hmac.new(_TAG_KEY, name.encode(), hashlib.sha256).hexdigest() for name in group}
        # 4 digits: 2 names of a group have the same ones once in 65,536; then as many as tell them apart.
        digits = next(n for n in (4, 8, 16, 64) if len({tag[:n] for tag in tags.values()}) == len(group))
        out.update({name: _tagged(shown, tag[:digits]) for name, tag in tags.items()})
    return out


def _tagged(shown: str, tag: str) -> str:
    """The name ``shown`` with its ``tag``: after it, unless a redaction would mask it there."""
    after = f"{shown} #{tag}"
    return after if redact_urls(after) == after else f"#{tag} {shown}"

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
  header (its name in any case), to the end of its line (a line ending with ``,`` goes on on the
  next one if that one is folded) or to a quote that is not one of its
  quoted strings (``Digest username="bob", ..., response="..."`` is masked whole, whatever
  follows the last one: ``")``, ``".`` or a word); a ``'`` ends it only where it closes a quoted
  argument or string (``-H 'Cookie: a=x' -H ...``), not followed by more of a word
  (``Cookie: a=x'y``, a cookie's octets may hold one); as Python shows headers too
  (``(b'Cookie', b'sid=...')``: the name first in a tuple or a list, ``{b'Cookie': b'...'}``,
  ``b'...\r\nCookie: ...\r\n'``); of the first
  four, a known scheme word stays (``Authorization: Bearer ***``, ``Digest ***``, ``NTLM ***``,
  ``AWS4-HMAC-SHA256 ***``);
- a ``Bearer`` token, ``Basic`` credentials (base64 of ``user:password``, its ``=`` padding written
  or not), and the parameter list of ``Digest`` and ``AWS4-HMAC-SHA256`` credentials
  (``Credential=..., Signature=...``; those two scheme words in any case; parameters parted by
  ``,``, also at a line's end, or by spaces up to one of those schemes' own parameters:
  ``username``, ``realm``, ``nonce``, ``uri``, ``response``, ``algorithm``, ``cnonce``, ``opaque``,
  ``qop``, ``nc``, ``userhash``, ``charset``, ``domain``, ``stale``, ``Credential``,
  ``SignedHeaders``, ``Signature``; values in double or single quotes), wherever they stand;
- the user name of curl's ``-v`` note ``Server auth using Digest with user '...'``.

Each rule reads the text as written (after the user info is masked) and all they find is masked
at once: a value that one rule masks to its end cannot hide the start of the next secret from
another (``X-Api-Key:NTLM abc}Bearer ...``).

A ``pipe:`` command is text like any other: the URLs and headers in it are redacted (a header's
word goes on past a space escaped by ``\\``: ``-H Authorization:Bearer\\ ...``), the rest is shown
as written (keep secrets of a command in its environment, not in the list).

Names that differ only by their secrets (two jobs named by URLs with different passwords) would
be one once redacted: :func:`shown_names` keeps them apart.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from typing import Any, NamedTuple
from urllib.parse import unquote_plus

__all__ = ["MASK", "redact_urls", "redacted", "shown_names"]

MASK = "***"
# The key of the tags that tell apart names alike once redacted (shown_names): this process's own,
# so that a tag is the same for a name while the process runs and tells nothing of its secret.
_TAG_KEY = secrets.token_bytes(16)
# A scheme, then the user info up to its last "@" before the host ends ("/", "?", "#" or a space).
# (An empty one is no secret: "ipc://@NAME", ZeroMQ's abstract socket, stays as it is.)
# "'" and ";" are legal in user info and query values (RFC 3986 sub-delims), so they end neither;
# '"', "<" and ">" are not legal in a URL and end one quoted in a text (JSON, HTML).
_USER_INFO = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/?#\"<>]+@")
# A password written with a "/", "?" or "#" as it is (which a list refuses, but a text may quote):
# a "port" that is no number, then everything up to the last "@" before the URL ends (a space, '"',
# "<" or ">"; _URL_END); only where the user info is not whole before the host ("(?!...@)": then
# _USER_INFO masks it alone). This pattern finds what comes before that "@": where the URL ends and
# its last "@" are looked for once per URL (_mask_broken_user_info), as a pattern that went on to the
# last "@" would read to the URL's end from each "scheme://a:x" in it: a time that grows as the
# square of the URL's length.
_BROKEN_USER_INFO = re.compile(
    r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}://)(?![^\s/?#\"<>]*@)[^\s/?#\"<>@:\[]*:(?![0-9]*(?:[/?#\s\"<>]|$))"
)
_URL_END = re.compile(r"[\s\"<>]")
# A parameter after "?", "&", ";" or "#": anywhere in a text, since a message may quote a URL's
# path and query without its scheme (``Max retries exceeded with url: /a.tar?token=...``): its
# name and "=" here, then its value (_VALUE, at least a character), scanned only where masked.
_PARAMETER = re.compile(r"[?&;#]([^=&;#?\s\"'<>]+)=")
_VALUE = re.compile(r"[^&#\s\"<>]+")
_SECRET_NAME = re.compile(r"sig|token|secret|pass|pwd|credential|auth|key|policy|session|hmac|hdnts", re.IGNORECASE)


# A header with credentials: its name (not inside a path or a word: "s3://b/cookie:jar" is a key;
# after a repr's or a JSON string's escaped line end: b'...\r\nCookie: ...'), ":" (a quote after the
# name: JSON's), or "," between quoted name and value (a tuple: ('Cookie', 'sid=...')), then a quote
# that opens its value, if any (a bytes repr's b'...' too); the scheme word of credentials or a
# challenge stays (those of IANA's registry, AWS's and Azure's, as a word of its own: "tokenXYZ" is a
# token). Where its value ends, see _value_end.
_HEADER = re.compile(
    r"(?:(?<![\w/.-])|(?<=\\[rn]))"
    r"((?:proxy-)?authorization|(?:www|proxy)-authenticate|set-cookie|cookie|x-amz-security-token|x-api-key)"
    r"([\"']?)([ \t]*:[ \t]*|(?<=[\"'])[ \t]*,\s*(?=b?[\"']))(?:b(?=[\"']))?([\"']?)"
    r"((?:bearer|basic|digest|negotiate|ntlm|aws4-hmac-sha256|aws|token|oauth|hoba|mutual|scram-sha-1|scram-sha-256"
    r"|vapid|sharedkey|sharedkeylite|sharedaccesssignature)(?:\\?[ \t]+|(?=[\r\n\"',]|$)))?",
    re.IGNORECASE,
)
# A word of each of their names, in lower case.
_NAME_WORDS = ("auth", "cookie", "x-amz-security-token", "x-api-key")
# A "'" that ends a value no quote opened: one that closes a quoted argument or string
# ("-H 'Cookie: a=x' -H ...", "('Cookie: a=x',)"), so followed by what cannot go on with the value.
# A "'" followed by more of a word is the value's own: a cookie's octets and an API key may hold one
# ("Cookie: a=x'SECRET"; a shell's "'\''" in "-H 'Cookie: a=x'\''SECRET'").
_CLOSES = r"[\s)\]},]|\\[rn]|$"
_CLOSING_QUOTE = rf"'(?={_CLOSES})"
_VALUE_ENDS = {  # what ends a header's value that no quote opened
    "json": re.compile(r"[,}\]\s\"']"),  # a JSON literal (its name was quoted)
    # "Name: value" as a tool prints it, or a quoted "-H 'Name: value'"
    "line": re.compile(rf"[\r\n\"]|{_CLOSING_QUOTE}|\\[rn]"),
    # "Name:value" in a command line (a "\ " is a shell's)
    "word": re.compile(rf"(?<!\\)\s|\"|{_CLOSING_QUOTE}|\\[rn]"),
}
# (An escaped line end, \r\n as a repr or a JSON string writes it, ends a value no quote opened:
# no cookie or token68 holds a backslash.)
# Schemes whose credentials are one token68 (RFC 7235), which may end with "=": after them a quote
# ends the value, even one after a "=" ("-H 'Authorization: Bearer abc=' -H 'X: y'").
_TOKEN68_SCHEMES = frozenset({"bearer", "basic", "negotiate", "ntlm", "token"})
# A quoted string (RFC 7230), or one whose quotes are escaped as they are within a quoted command
# line argument or a JSON string (-H "Authorization: Digest username=\"bob\"").
_QUOTED = r'"(?:[^"\\\r\n]|\\[^\r\n])*"|\\"(?:[^"\\\r\n]|\\[^"\r\n])*\\"'
# A value in single quotes, as some clients and logs write an auth-param (response='...'). (Not in a
# header's line, _PARAMS_LINE: there a closing "'" ends a quoted command line argument.)
_SQUOTED = r"'(?:[^'\\\r\n]|\\[^\r\n])*'"
# The value of a header "Name: value" up to its line's end, or to a quote that is no auth-param's
# quoted string (its name after a space, "," or ";", and after it what cannot go on with a token:
# a space, "," ";", a quote, a closing bracket, a sentence's "." or ":", the line's end): the quote
# that ends a quoted command line argument (-H "Cookie: a=" -H "X: y", where '" -H "' is followed
# by "X"). A list whose line ends with "," goes on on the next line if that one is folded (begins
# with a space, then "name="; after curl -v's "> " or "< "); an escaped line end (\r\n in a repr)
# ends it.
_PARAMS_LINE = re.compile(
    rf"(?:(?<![^\s,;])[A-Za-z][\w.-]*[ \t]*=[ \t]*(?:{_QUOTED})"
    rf"(?=[\s,;\"')\]}}]|[.:](?!\S)|$)"
    r"|,[ \t]*\r?\n(?:[<>] )?(?=[ \t]+[A-Za-z][\w.-]*[ \t]*=)"
    rf"|[^\r\n\"'\\]|'(?!{_CLOSES})|\\(?![rn]))*"
)
# A value opened by a quote ends at the same quote, unless escaped ("Digest username=\"bob\"").
_UNESCAPED = {q: re.compile(rf"(?:[^{q}\\]|\\.)*{q}", re.DOTALL) for q in "\"'"}
# Credentials of an Authorization scheme where no header name precedes them (token68, RFC 7235).
# Case-sensitive, as tools write them: "the bearer of" is prose. The credentials are looked ahead
# at, not taken: a word after "Basic" that is no credentials may hold the next "Bearer". (That the
# scheme is a word of its own, _WORD before it, is checked after: a pattern that begins with a
# word is searched for 5 times faster than one that begins with "\b".)
_CREDENTIALS = re.compile(r"(Bearer|Basic)\\?[ \t]+(?=([A-Za-z0-9._~+/-]+=*))")
_WORD = re.compile(r"\w")
# Credentials of a scheme whose credentials are auth-params ("name=value, ..."), where no header
# name precedes them: the list is masked, the text after it stays. The scheme in any case, as a
# server reads it ("digest username=..."): a list of "name=value" after it is no prose. Its
# auth-params are parted by "," (the list may go on on the next line after one, after curl -v's "> "
# too) or by spaces alone, as some clients write them: then only up to a parameter of those schemes
# (RFC 7616's names and AWS's, in any case; "username=bob x=1 response=..." is one list):
# "digest md5=abc size=10 url=..." is a checksum's, and the words after it are text.
# (A token's last ":", "." or ")" is the sentence's: "..., Signature=abc: refused".) At most
# _OTHER_PARAMS others stand between two of those: a search that read on through every "name=value"
# after each "digest" of a line would take a time that grows as the square of the line.
_OTHER_PARAMS = 8
_AUTH_VALUE = rf"[ \t]*=[ \t]*(?:{_QUOTED}|{_SQUOTED}|[^\s,\"'\\]*[^\s,\"'\\:.)])"
_SCHEME_PARAM = (
    r"(?:username|realm|nonce|uri|response|algorithm|cnonce|opaque|qop|nc|userhash|charset|domain|stale"
    r"|credential|signedheaders|signature)"
)
_PARAM_CREDENTIALS = re.compile(
    rf"\b(Digest|AWS4-HMAC-SHA256)([ \t]+)([A-Za-z][\w.-]*{_AUTH_VALUE}"
    rf"(?:[ \t]*,\s*(?:[<>][ \t]+)?[A-Za-z][\w.-]*{_AUTH_VALUE}"
    rf"|(?:[ \t]+[A-Za-z][\w.-]*{_AUTH_VALUE}){{0,{_OTHER_PARAMS}}}?[ \t]+{_SCHEME_PARAM}{_AUTH_VALUE})*)",
    re.IGNORECASE,
)
# curl -v's note of who it authenticates as ("* Server auth using Digest with user 'bob'"): a user
# name may be a token itself (-u TOKEN:x-oauth-basic).
_CURL_USER = re.compile(r"(auth using [\w-]+ with user ')[^'\r\n]*'")


Span = tuple[int, int]  # what to mask of a text: [start, end), an empty one marks where a value was


def _header_spans(text: str, lower: str, masked: list[Span]) -> list[Span]:
    """The values of credential headers in ``text`` (``lower``: in lower case; see the module
    docstring). What ends a value within a span of ``masked`` (merged, in order) ends none: a quote
    in a URL's masked query value (``...?token=a'b``) is the URL's, not one that closes a command
    line argument."""
    spans: list[Span] = []
    at = 0
    past: dict[tuple[_Ending, int], int] = {}
    reread = -1  # the end of a value that a name within it was read past (see below)
    # The search begins at the first name (str.find is many times faster than the pattern's search),
    # "proxy-" or "www-" before "auth", "set-" before "cookie"; at the start where "lower" is longer
    # than "text" (a character lower-cased to two, as "İ": its indexes are no longer those of "text").
    first = min(i for i in map(lower.find, _NAME_WORDS) if i >= 0) if len(lower) == len(text) else 0
    for match in _HEADER.finditer(text, max(0, first - len("proxy-"))):
        if "," in match.group(3) and not _starts_tuple(text, match.start(), match.group(2)):
            continue  # ("key='cookie', 'shards/a.tar'": a name and a value in quotes, but no header's)
        start = match.end()
        if start < at and not match.group(4):
            # A value that begins within one read already is not read again (each part of the text
            # is read once), but where that one ended at a '"' its auth-params may take as a quoted
            # string's ("X-Api-Key: NTLM a Authorization: response="SECRET""): then the first name
            # within it is read, once for each such end.
            if not (text[at : at + 1] == '"' and reread != at and _ending(match).params):
                continue
            reread = at
        # A name within the value read before is looked at if its own value begins after that one's
        # end (past a scheme word and its space: "X-Api-Key:NTLM a<Cookie:Token SECRET"), or if a quote
        # opens it: it ends at the next such quote, which may be past that one's end. ("end" is where
        # the reading ended, before a value that goes on past a masked span is read on.)
        ending = _ending(match)
        end = _value_end(text, start, ending)
        last = _past_masked(text, end, ending, masked, past)
        if last > end or text[start:end].strip():  # (not text[start:last]: many values may read on to one end)
            spans.append((start, last))
            at = max(at, end)
    return spans


def _starts_tuple(text: str, name: int, quote: str) -> bool:
    """Whether the name at ``name``, in ``quote`` quotes, is a tuple's or a list's first item, as
    Python shows a header: after "(", "[" or "{", and spaces and a bytes' "b" (``(b'Cookie', ...``),
    or at the text's start."""
    if text[name - 1 : name] != quote:
        return False
    at = name - 1
    if text[at - 1 : at] == "b":
        at -= 1
    while at and text[at - 1] in " \t":
        at -= 1
    return not at or text[at - 1] in "([{"


class _Ending(NamedTuple):
    """What ends a header's value: the quote that opened it (``quote``); else the end of a JSON
    literal, a line or a word (``kind``), and on a line, past the quoted strings of auth-params or
    cookies unless its credentials are a token68 (``params``)."""

    quote: str
    kind: str
    params: bool


def _ending(match: re.Match[str]) -> _Ending:
    """What ends the value of the header ``match`` found."""
    name, name_quote, colon, value_quote, scheme = match.groups()
    kind = "json" if name_quote else "line" if colon[-1] in " \t" else "word"
    token68 = (scheme or "").strip().lower() in _TOKEN68_SCHEMES and "authenticate" not in name.lower()
    # (a challenge's auth-params follow any scheme: Basic realm="r")
    return _Ending(value_quote, kind, kind == "line" and not token68)


def _value_end(text: str, start: int, ending: _Ending) -> int:
    """Where a header's value read from ``start`` ends: at the quote that opened it; else at the end
    of a JSON literal (a quoted name), of its line ("Name: value", past the quoted strings of its
    auth-params or cookies), or of its word ("Name:value", as a command line writes it)."""
    if ending.quote:
        closed = _UNESCAPED[ending.quote].match(text, start)
        if closed is not None:
            return closed.end() - 1
        stop = text.find(ending.quote, start)
        return len(text) if stop < 0 else stop
    if ending.params:
        params = _PARAMS_LINE.match(text, start)  # (never None: it matches "")
        return start if params is None else params.end()
    found = _VALUE_ENDS[ending.kind].search(text, start)
    return len(text) if found is None else found.start()


def _past_masked(text: str, end: int, ending: _Ending, masked: list[Span], past: dict[tuple[_Ending, int], int]) -> int:
    """Where a value ends that ``end`` would end but for the spans of ``masked``: read on from the
    end of the span ``end`` is in, until an end outside them. ``past`` keeps where a value read on
    from a span's end ends, so that many headers before one span read what follows it once."""
    resumed: list[int] = []
    while (i := bisect.bisect_right(masked, (end, len(text)))) and masked[i - 1][1] > end:
        resume = masked[i - 1][1]
        if (ending, resume) in past:
            end = past[ending, resume]
            break
        resumed.append(resume)
        end = _value_end(text, resume, ending)
    past.update(((ending, resume), end) for resume in resumed)
    return end


def _credential_spans(text: str) -> list[Span]:
    """The ``Bearer`` and ``Basic`` credentials in ``text``: after "Basic", only a word that reads as
    base64 of ``user:password`` (not "basic usage")."""
    return [
        m.span(2)
        for m in _CREDENTIALS.finditer(text)
        if not (m.start() and _WORD.match(text, m.start() - 1)) and (m.group(1) == "Bearer" or _is_basic(m.group(2)))
    ]


def _is_basic(value: str) -> bool:
    """Whether ``value`` reads as Basic credentials: base64 of ``user:password``."""
    try:
        return b":" in base64.b64decode(value + "=" * (-len(value) % 4), validate=True)  # (its padding may be left off)
    except (binascii.Error, ValueError):
        return False


def _parameter_spans(text: str) -> list[Span]:
    """The value of every parameter of a secret name in ``text``. One pass, left to right (a line
    may hold thousands of parameters): after a parameter of another name the scan goes on within its
    value, which may hold more after a ";" (``?a=1;token=x``), and only a secret value is read to
    its end, once."""
    spans: list[Span] = []
    pos = 0
    while (match := _PARAMETER.search(text, pos)) is not None:
        pos = match.end()
        if not _SECRET_NAME.search(unquote_plus(match.group(1))):
            continue
        value = _VALUE.match(text, pos)
        if value is None:
            continue
        # Punctuation after a URL in a sentence ("...?token=abc: HTTP 403") or a quote around it
        # ('...?token=abc') is the text's.
        spans.append((pos, pos + len(value.group().rstrip(":,.)]}'"))))
        pos = value.end()
    return spans


def _param_credential_spans(text: str, parameters: list[Span]) -> list[Span]:
    """The auth-param lists of Digest and AWS4-HMAC-SHA256 credentials in ``text``, and in it with
    the secret ``parameters`` of URLs in it masked: a list may hold a URL whose masked value held
    what would end a quoted string (``response="a\\" ...?token=b\\"``)."""
    spans = [m.span(3) for m in _PARAM_CREDENTIALS.finditer(text)]
    if not parameters:
        return spans
    masked = _masked(text, parameters)
    # Where each mask of "masked" begins, and the span of "text" it stands for.
    begins: list[int] = []
    shift = 0
    for start, end in parameters:
        begins.append(start + shift)
        shift += len(MASK) - (end - start)

    def within_text(at: int, end: bool) -> int:
        i = bisect.bisect_right(begins, at - 1 if end else at) - 1
        if i < 0:
            return at
        start, stop = parameters[i]
        return (stop if end else start) if at < begins[i] + len(MASK) + end else at - begins[i] - len(MASK) + stop

    return spans + [
        (within_text(m.start(3), False), within_text(m.end(3), True)) for m in _PARAM_CREDENTIALS.finditer(masked)
    ]


def _mask_broken_user_info(text: str) -> str:
    """``text`` with each user info that _BROKEN_USER_INFO begins masked up to the last "@" before
    its URL ends (where there is one), left to right as a pattern's ``sub`` masks: each URL's end
    and last "@" are looked for once, however many schemes it holds."""
    out: list[str] = []
    at = pos = 0
    end = last = -1  # where the URL read last ends, and its last "@" (-1: none)
    while (match := _BROKEN_USER_INFO.search(text, pos)) is not None:
        if match.end() >= end:  # (else it is within the URL read last: the same end, the same last "@")
            found = _URL_END.search(text, match.end())
            end = len(text) if found is None else found.start()
            last = text.rfind("@", match.end(), end)
        if last < match.end():
            pos = match.start() + 1  # no "@" after it: the next scheme may be its own URL's
            continue
        out += (text[at : match.start()], match.group(1), MASK, "@")
        at = pos = last + 1
    return "".join(out) + text[at:] if out else text


def _merged(spans: list[Span]) -> list[Span]:
    """``spans`` in order, those that overlap or touch made one."""
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _masked(text: str, spans: list[Span]) -> str:
    """``text`` with each of ``spans`` (merged, in order) replaced by ``***``."""
    out: list[str] = []
    at = 0
    for start, end in spans:
        out += (text[at:start], MASK)
        at = end
    return "".join(out) + text[at:] if out else text


def redact_urls(text: str) -> str:
    """``text`` (a URL, or any text with URLs in it) with user info, secret parameter values and
    header credentials replaced by ``***`` (see the module docstring); text without them is
    returned unchanged."""
    if "@" in text:
        text = _USER_INFO.sub(rf"\1{MASK}@", _mask_broken_user_info(text))
    # Every other rule reads the same text and what they find is masked at once: masked one after
    # another, a value masked to its end (a header's, to its word's) could take the start of the next
    # secret ("X-Api-Key:NTLM abc}Bearer SECRET") and leave the secret shown.
    spans: list[Span] = []
    # Names in any case are looked for in one lower-case copy (this runs for every log line).
    lower = text.lower() if "=" in text or ":" in text or "," in text else ""
    if "=" in text:
        spans += _parameter_spans(text)
        if "digest" in lower or "aws4-hmac-sha256" in lower:  # (their credentials are "name=value" lists)
            spans += _param_credential_spans(text, spans)
    # (a check of each name, not a generator; "auth": Authorization, WWW-Authenticate and
    # Proxy-Authenticate in one look)
    if "auth" in lower or "cookie" in lower or "x-amz-security-token" in lower or "x-api-key" in lower:
        spans += _header_spans(text, lower, _merged(spans))
    # (curl -v notes the user it sends credentials of, with or without a header; "'" first: a text
    # without quotes is told 2 times faster)
    if "'" in text and " with user '" in text:
        spans += [(m.end(1), m.end() - 1) for m in _CURL_USER.finditer(text)]
    if "Bearer" in text or "Basic" in text:
        spans += _credential_spans(text)
    return _masked(text, _merged(spans)) if spans else text


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

"""The one redaction of URL user info (`scheme://USER:PASSWORD@host` -> `scheme://***@host`) that every printed
config, command line, retriever message and error of the project goes through. A leaf module: it imports nothing of
the project.

Where the user info ends: at the last `@` before the host, so a password may hold unencoded `@`, `:`, `/`, `?`, `#`
and spaces. A URL's reach is its text up to the next `scheme://`, the end of the line or the end of the text (so
several URLs in one string, and comma-separated host lists, are each handled). Within it:

- the last `@` before the first `/`, `?`, `#` or whitespace ends the user info (the standard form, RFC 3986);
- when that first stretch is `USER:REST` and REST is not a port number, the user info may go on past such a
  character: it ends at the last `@` of the reach that is followed by a host (name, IPv4 or `[IPv6]`), an optional
  `:port` (any text without `@` or a delimiter) and then the end of the text or a delimiter
  (`/ ? # , ; ' " ( ) [ ] < > { } |` or whitespace).

So `https://host:9200/a@b` and `gs://bucket/model@v2` (no user info) are unchanged. The one ambiguous form left is a
password of digits only up to its first `/`, `?`, `#` or space (`https://u:1234/x@host` reads as host `u`, port
1234): percent-encode such a password.
"""
from __future__ import annotations

import re
import urllib.parse

REDACTED = "***"

# The start of a URL: its scheme and "//" (e.g. "https://", "gs://").
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FIRST_STRETCH_END = re.compile(r"[/?#\s]")
_PORT = re.compile(r"\d{1,5}")
# `@`, a host, an optional `:port` (not checked: digits or not), then a delimiter or the end (a lookahead: the
# match stops before it).
_DELIMITERS = r"/?#\s,;'\"()\[\]<>{}|"
_HOST_AFTER_AT = re.compile(rf"@(?:\[[0-9A-Fa-f:.]+\]|[\w.~%-]+)(?::[^{_DELIMITERS}@]*)?(?=[{_DELIMITERS}]|$)")


def _userinfo_end(reach: str) -> int | None:
    """The index in `reach` (the text after a `scheme://`, up to the URL's reach) of the `@` that ends the URL's
    user info, or None when the URL has none (rules in the module docstring)."""
    stretch_end = _FIRST_STRETCH_END.search(reach)
    first = reach[:stretch_end.start()] if stretch_end else reach
    end = first.rfind("@")
    _, colon, rest = first.partition(":")
    if colon and not _PORT.fullmatch(rest):  # USER:PASSWORD, not HOST:PORT: the password may go on
        for match in _HOST_AFTER_AT.finditer(reach):
            end = max(end, match.start())
    return end if end >= 0 else None


def _reach_end(text: str, start: int) -> int:
    """Where the reach of the URL whose authority starts at `text[start]` ends: the next `scheme://`, the end of
    the line or of the text."""
    ends = [len(text)]
    newline = text.find("\n", start)
    if newline >= 0:
        ends.append(newline)
    following = SCHEME.search(text, start)
    if following:
        ends.append(following.start())
    return min(ends)


def redact(text: str) -> str:
    """`text` with the user info of every `scheme://` URL in it replaced by `***` (`https://u:p@h:9200` ->
    `https://***@h:9200`); everything else, and a URL without user info, unchanged. Idempotent."""
    out, done = [], 0
    for scheme in SCHEME.finditer(text):
        start = scheme.end()
        if start < done:  # inside a user info already replaced
            continue
        end = _userinfo_end(text[start:_reach_end(text, start)])
        if end is not None:
            out.append(text[done:start] + REDACTED)
            done = start + end
    out.append(text[done:])
    return "".join(out)


def split_userinfo(url: str) -> tuple[str, str | None]:
    """(`url` without its user info, the user info as written or None), the user info found as `redact` finds it;
    e.g. `http://u:p/w@h:80/x` -> (`http://h:80/x`, `u:p/w`)."""
    scheme = SCHEME.match(url)
    if scheme is None:
        return url, None
    start = scheme.end()
    end = _userinfo_end(url[start:_reach_end(url, start)])
    if end is None:
        return url, None
    return url[:start] + url[start + end + 1:], url[start:start + end]


def credentials(url: str) -> tuple[str, str, str] | None:
    """(`url` without its user info, user, password) with user and password percent-decoded, or None when `url`
    has no user info (the password is "" when the user info has no `:`)."""
    bare, userinfo = split_userinfo(url)
    if userinfo is None:
        return None
    user, _, password = userinfo.partition(":")
    return bare, urllib.parse.unquote(user), urllib.parse.unquote(password)


def encoded_userinfo(url: str) -> str:
    """`url` with its user info percent-encoded (`/ # ? @ :` and spaces of a password escaped), as URL parsers
    (urllib3, yarl) need it; user and password are decoded first, so an encoded one stays as it is."""
    bare, userinfo = split_userinfo(url)
    if userinfo is None:
        return url
    quoted = ":".join(urllib.parse.quote(urllib.parse.unquote(part), safe="") for part in userinfo.split(":", 1))
    scheme_end = SCHEME.match(bare).end()
    return bare[:scheme_end] + quoted + "@" + bare[scheme_end:]

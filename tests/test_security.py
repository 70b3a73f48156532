"""The agent refuses a cache directory another user could tamper with, and a loader writes nothing into one;
a URL's secrets (user info, signatures, tokens) reach no log line, output, file name or error message."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import pytest

from tests.helpers.streaming import reference
from wdscache import CachedMultiLoader, ConfigError, FetchError, ShardClient
from wdscache.shared.layout import shard_name
from wdscache.shared.redact import redact_urls
from wdscache.shared.urls import parse_url_list

NOBODY = 65534


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_cache_dir_owned_by_another_user_is_refused(tmp_path, dataset, run_cli):
    data = dataset(1, samples=1, payload=100)
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, NOBODY, NOBODY)
    r = run_cli("agent", "--cache-dir", cache, "--urls", data.list_file, "--min-free", "1M")
    assert r.returncode == 2
    assert f"belongs to uid {NOBODY}" in r.stderr
    assert os.listdir(cache) == []  # nothing was created in it


def test_private_agent_writes_nothing_into_a_directory_others_can_write(tmp_path, dataset):
    data = dataset(1, samples=1, payload=100)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    # A planted link where the loader would write its list must not be followed.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (shared / "private-urls.txt").symlink_to(victim)
    with pytest.raises(ConfigError, match="chmod 700"):
        iter(CachedMultiLoader(data.urls, cache_dir=shared, rank=0, world_size=1, timeout=5))
    assert victim.read_text() == "keep me\n"


# -- secrets in URLs ------------------------------------------------------------------------------

SECRETS = ("USERSECRET", "PASSWORDSECRET", "SIGNATURESECRET", "TOKENSECRET")


def _with_secrets(url: str) -> str:
    """``url`` with user info and a signed URL's query (the real shard server ignores both)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://USERSECRET:PASSWORDSECRET@{rest}?X-Amz-Signature=SIGNATURESECRET&token=TOKENSECRET&v=1"


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://user:pass@h/a.tar", "http://***@h/a.tar"),
        ("https://TOKEN@h/a.tar", "https://***@h/a.tar"),
        (
            "https://h/a.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F1&X-Amz-Date=1&X-Amz-Expires=60"
            "&X-Amz-Security-Token=T&X-Amz-Signature=S",
            "https://h/a.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Date=1&X-Amz-Expires=60"
            "&X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        (
            "https://a.blob.core.windows.net/c/a.tar?sv=2022&se=2027&sp=r&SIG=abc%3D",
            "https://a.blob.core.windows.net/c/a.tar?sv=2022&se=2027&sp=r&SIG=***",
        ),
        (
            "https://d.cloudfront.net/a.tar?Expires=1&Signature=s&Key-Pair-Id=k&Policy=p",
            "https://d.cloudfront.net/a.tar?Expires=1&Signature=***&Key-Pair-Id=***&Policy=***",
        ),
        (
            "http://h/a.tar?access_token=a&apikey=b&api_key=c&key=d&password=e&secret=f&auth=g&page=2",
            "http://h/a.tar?access_token=***&apikey=***&api_key=***&key=***&password=***&secret=***&auth=***&page=2",
        ),
        (
            "Max retries exceeded with url: /a.tar?token=x (Caused by ...)",
            "Max retries exceeded with url: /a.tar?token=*** (Caused by ...)",
        ),
        ("s3://bucket/key with space.tar", "s3://bucket/key with space.tar"),
        # A server decodes a name's escapes before it reads it: so does the redaction.
        (
            "http://h/a.tar?%74oken=x&X%2DAmz%2DSignature=y&api+key=z&page=2",
            "http://h/a.tar?%74oken=***&X%2DAmz%2DSignature=***&api+key=***&page=2",
        ),
        # "'" and ";" are legal in user info and in a value: they end neither.
        ("http://oauth2:SEK'RET@h/a.tar", "http://***@h/a.tar"),
        ("http://u:p@ss;w'rd@h/a.tar?x", "http://***@h/a.tar?x"),
        ("http://h/a.tar?token=A;B&page=2", "http://h/a.tar?token=***&page=2"),
        ("http://h/a.tar?sig=A'B#f", "http://h/a.tar?sig=***#f"),
        ("http://h/a.tar?page=1;token=A;B", "http://h/a.tar?page=1;token=***"),
        # Quotes and sentence punctuation around a whole URL are the text's.
        ("fetch 'http://h/a.tar?token=A', then", "fetch 'http://h/a.tar?token=***', then"),
        ('{"url": "http://u:p@h/a.tar?sig=A"}', '{"url": "http://***@h/a.tar?sig=***"}'),
        # A password with "/" or "#" written as it is: its "port" is no number, up to the last "@".
        ("http://AKIA:wJalr/XUtn+K7@127.0.0.1:8000/x.tar", "http://***@127.0.0.1:8000/x.tar"),
        ("failed: 'http://bob:pa#SECRET@h/x.tar' (InvalidURL)", "failed: 'http://***@h/x.tar' (InvalidURL)"),
        ("http://h:8080/m@v2.tar http://[::1]:80/a@b.tar", "http://h:8080/m@v2.tar http://[::1]:80/a@b.tar"),
        # Whole user info before the host: masked alone, the host and path shown (an "@" after them too).
        ("http://u:pw@h:81/s@v2.tar?owner=ann@corp.example", "http://***@h:81/s@v2.tar?owner=ann@corp.example"),
        ("http://u:secret@h/a.tar,other=x@y", "http://***@h/a.tar,other=x@y"),
        # Signatures by other names: Akamai's token (whose value holds more "="), an hmac.
        ("http://h/a.tar?hdnts=exp=1~acl=/*~hmac=abc&page=2", "http://h/a.tar?hdnts=***&page=2"),
        ("http://h/z.tar?HMAC=S1", "http://h/z.tar?HMAC=***"),
    ],
)
def test_a_url_is_shown_without_user_info_or_secret_parameters(url: str, shown: str) -> None:
    assert redact_urls(url) == shown


@pytest.mark.parametrize("pieces", [5_000, 250_000])  # a 20 KB URL; a 1 MB one
def test_a_url_whose_value_holds_thousands_of_parameters_makes_its_error(pieces: int) -> None:
    # Each ";a=" within a value was redacted by one more nested call: a thousand of them raised
    # RecursionError in an error's constructor (and the log filter), and the time grew as their square.
    url = "http://h/x.tar?a=" + "x;a=" * pieces + "&token=SECRET"
    error = FetchError(url, f"GET {url}: HTTP 403")
    assert error.reason == "GET http://h/x.tar?a=" + "x;a=" * pieces + "&token=***: HTTP 403"


@pytest.mark.parametrize("head, unit", [("x@y ", "http://a:x/"), ("", "a=digest "), ("", "x=AWS4-HMAC-SHA256 ")])
def test_a_line_of_repeats_is_redacted_in_time_in_proportion_to_its_length(head: str, unit: str) -> None:
    # A password written with a "/" is masked up to its URL's last "@": the pattern that looked for it
    # read to the URL's end from each "scheme://a:x" in it, a time that grew as the square of the line
    # (4.5 s for 100 KB, for each log line with an "@" in it); so did a Digest list's search, from each
    # "digest", for its next parameter (25.8 s for 100 KB). Measured as how the time grows: 8 times
    # the line takes about 8 times as long (64 times before), in this thread's CPU time (a loaded
    # machine's other work does not count), the least of 5.
    def best(repeats: int) -> float:
        line = head + unit * repeats
        redact_urls(line)
        spent = []
        for _ in range(5):
            start = time.thread_time()
            redact_urls(line)
            spent.append(time.thread_time() - start)
        return min(spent)

    small, large = best(500), best(4_000)
    assert large < 20 * small, (small, large)

    line = "x@y " + "http://a:x/" * 500
    assert redact_urls(line) == line
    # (and what it masks is the same: up to the last "@" of the URL)
    assert redact_urls("http://a:x/" * 3 + "@h/a.tar http://a:x/") == "http://***@h/a.tar http://a:x/"


def test_a_url_not_in_a_list_is_named_redacted() -> None:
    listed = parse_url_list("http://h/a.tar")
    secret = "http://u:PASSWORD@h/x.tar?X-Amz-Signature=SIGNATURE"
    for where in (listed, listed.urls):  # the list, and its URLs as a sequence
        with pytest.raises(ValueError) as raised:
            where.index(secret)
        assert "'http://***@h/x.tar?X-Amz-Signature=***' is not in the" in str(raised.value), raised.value
        assert "PASSWORD" not in str(raised.value) and "SIGNATURE" not in str(raised.value)


def test_cache_file_names_hold_no_query_and_no_user_info() -> None:
    url = "http://u:p@h/data/shard-000011.tar?token=QTOKENSECRET"
    name = shard_name(url)
    assert name == hashlib.sha256(url.encode()).hexdigest()[:32] + "-shard-000011.tar"
    assert shard_name("http://u:p@h") == hashlib.sha256(b"http://u:p@h").hexdigest()[:32] + "-_h"
    assert shard_name("http://h/data/shard-000011.tar") != name  # the hash is of the whole URL


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_secrets_in_urls_reach_no_log_output_file_name_or_error(
    tmp_path, dataset, start_agent, shard_server, run_cli, caplog, log_format
) -> None:
    data = dataset(3, samples=4, payload=300)
    urls = [_with_secrets(u) for u in data.urls]
    missing = _with_secrets(shard_server.url("missing.tar"))
    data.list_file.write_text("\n".join([*urls, missing]) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "4", "--retries", "0", "--log-format", log_format)
    agent.wait_stats(
        lambda s: s["shards"]["cached"] == 3 and s["shards"]["failed"] == 1, 20, "three shards cached and one failed"
    )
    # Samples are served byte-identical, from the full URLs.
    with CachedMultiLoader(urls, cache_dir=cache, shuffle=False, timeout=30) as loader:
        got = list(loader)
    ref = reference(data.paths, urls)
    assert [(s["__url__"], s["__key__"]) for s in got] == list(ref)
    for s in got:
        assert {k: hashlib.sha256(v).hexdigest() for k, v in s.items() if not k.startswith("__")} == ref[
            (s["__url__"], s["__key__"])
        ]
    # No file name under the cache directory (shards' and their sample tables').
    names = [n for _, dirs, files in os.walk(cache) for n in dirs + files]
    shards = [n for _, _, files in os.walk(cache / "shards") for n in files]
    assert sum(n.endswith(("-shard-000000.tar", "-shard-000001.tar", "-shard-000002.tar")) for n in shards) == 3, names
    assert not [n for n in names if _leaks(n) or "token_" in n.lower()], names
    # A failing URL: the loader's error names it, without its secrets (and so does a skip's log line).
    with pytest.raises(FetchError) as info:
        with CachedMultiLoader([missing], cache_dir=cache, timeout=30) as loader:
            list(loader)
    assert "missing.tar" in str(info.value) and "***" in str(info.value) and not _leaks(str(info.value))
    with caplog.at_level(logging.WARNING, logger="wdscache"):
        with CachedMultiLoader(
            [urls[0], missing], cache_dir=cache, shuffle=False, timeout=30, on_error="skip"
        ) as loader:
            assert len(list(loader)) >= 4
    assert "skipping" in caplog.text and not _leaks(caplog.text), caplog.text
    # Every command's output, text and JSON.
    outputs = []
    for args in (
        ["ls"],
        ["ls", "--json"],
        ["stats"],
        ["stats", "--json"],
        ["verify"],
        ["verify", "--json"],
        ["prefetch", missing],
        ["prefetch", "--json", missing],
        ["evict", urls[0]],
        ["evict", "--json", redact_urls(urls[1])],
        ["clear", "--json"],
    ):
        r = run_cli(*args, "--cache-dir", cache)
        assert r.returncode in (0, 1), (args, r.stderr)
        outputs.append((args, r.stdout + r.stderr))
    shown = dict((args[0] + " ".join(args[1:2]), out) for args, out in outputs)
    assert "http://***@127.0.0.1" in shown["ls"] and "X-Amz-Signature=***&token=***&v=1" in shown["ls"]
    # evict takes a URL as ls shows it (it stands for one URL of the cache here).
    assert json.loads(shown["evict--json"])["evicted"] == [redact_urls(urls[1])], shown["evict--json"]
    assert json.loads(shown["clear--json"])["evicted"], shown["clear--json"]
    for args, out in outputs:
        assert not _leaks(out), (args, out)
    assert agent.stop() == 0
    logs = agent.stderr_text()
    assert "missing.tar" in logs and not _leaks(logs), logs
    if log_format == "json":
        events = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        cached = {e["url"] for e in events if e.get("event") == "cached"}
        assert cached >= {redact_urls(u) for u in urls[2:]}, cached


SECRET = "SeCrEtInUrl"


@pytest.mark.parametrize(
    "url, says",
    [
        # boto3 took the user info for the bucket's name, and quoted it in its errors (log, ls, stats)
        (f"s3://AKIAUSER:{SECRET}@bkt/train/a.tar", "an s3:// URL holds no credentials"),
        (f"s3://AKIAUSER:{SECRET}@bkt/train/", "an s3:// URL holds no credentials"),
        # an item the loader refuses was shown as given
        (f"http://user:{SECRET}@h/shard-{{000..003.tar", "unclosed"),
    ],
)
def test_a_refused_url_shows_no_credentials_from_the_agent_nor_the_loader(tmp_path, run_cli, url, says) -> None:
    (tmp_path / "urls.txt").write_text(url + "\n")
    r = run_cli("agent", "--cache-dir", tmp_path / "cache", "--urls", tmp_path / "urls.txt", timeout=20)
    assert r.returncode == 2 and says in r.stderr and SECRET not in r.stderr + r.stdout, r.stderr
    for urls in (url, ["http://h/a.tar", url]):
        with pytest.raises(ConfigError) as info:
            CachedMultiLoader(urls, cache_dir=tmp_path / "cache")
        assert says in str(info.value) and SECRET not in str(info.value) and SECRET not in repr(info.value.args)


JWT = "eyJhbGciOiJSUzI1NiJ9.JWTHEADSECRET" + "A" * 200 + ".JWTTAILSECRET"


@pytest.mark.slow
def test_a_redirect_to_a_url_with_a_long_token_as_user_info_shows_no_part_of_it(
    tmp_path, dataset, shard_server, start_agent, run_cli
) -> None:
    # The error is cut to 200 characters: after its URLs are redacted, or the cut drops the "@".
    data = dataset(1, samples=1, payload=100)
    shard_server.fail(
        data.paths[0].name,
        "status",
        status=302,
        headers={"Location": f"ftp://oauth2:{JWT}@files.example/a.tar"},
        times=9,
    )
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["failed"] == 1, 20, "the redirected shard failed")
    why = (
        "(InvalidSchema: No connection adapters were found for 'ftp://***@files.example/a.tar': "
        "check the URL and where its server redirects it)"
    )
    outputs = [run_cli(*args, "--cache-dir", cache) for args in (["ls"], ["ls", "--json"], ["stats", "--json"])]
    assert all(r.returncode in (0, 1) for r in outputs), outputs
    assert why in outputs[0].stdout, outputs[0].stdout
    with pytest.raises(FetchError) as info:
        with CachedMultiLoader(data.urls, cache_dir=cache, timeout=30) as loader:
            list(loader)
    assert agent.stop() == 0
    shown = [r.stdout + r.stderr for r in outputs] + [str(info.value), agent.stderr_text()]
    assert [t for t in shown if "SECRET" in t or "AAAAAAAA" in t] == []


PIPE_JWT = "eyJhbGciOiJIUzI1NiJ9.PIPEJWTSECRET.PIPEJWTSIG"


@pytest.mark.slow
def test_a_failed_pipe_commands_stderr_is_quoted_without_a_url_cut_before_its_user_info(
    tmp_path, dataset, start_agent, run_cli
) -> None:
    # The command's stderr is cut to its end for the error: after its URLs are redacted, or the cut
    # drops the "https://" and the token (from the agent's environment) shows.
    data = dataset(1, samples=1, payload=100)
    said = f'cat {data.paths[0]}; echo "GET https://oauth2:$PIPE_JWT@store.example/a.tar failed" >&2'
    lines = [
        f"pipe:{said}; head -c 440 /dev/zero | tr '\\0' . >&2; exit 3",
        f"pipe:{said}; head -c 65500 /dev/zero | tr '\\0' . >&2; exit 4",  # beyond what is kept of it
    ]
    urls_file = tmp_path / "pipes.txt"
    urls_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, urls_file, "--allow-pipe", "--retries", "0", env={"PIPE_JWT": PIPE_JWT})
    agent.wait_stats(lambda s: s["shards"]["failed"] == 2, 20, "both commands failed")
    errors = []
    with ShardClient(cache, timeout=30) as client:
        for line in lines:
            with pytest.raises(FetchError) as info:
                client.open(line, timeout=30)
            errors.append(str(info.value))
    assert errors[0].endswith(
        "command exited with status 3: GET https://***@store.example/a.tar failed\n" + "." * 440
    ), errors[0]
    assert errors[1].endswith("command exited with status 4: ..." + "." * 500), errors[1]
    ls = run_cli("ls", "--cache-dir", cache)
    assert agent.stop() == 0
    shown = [*errors, ls.stdout + ls.stderr, agent.stderr_text()]
    assert [t for t in shown if "PIPEJWT" in t or "eyJ" in t] == []


BEARER = "PIPEBEARERSECRET"


@pytest.mark.slow
def test_a_pipe_commands_words_after_its_url_reach_no_file_name(tmp_path, dataset, shard_server, start_agent) -> None:
    data = dataset(1, samples=4, payload=300)
    url = f"pipe:curl -s -f {data.urls[0]} -H 'Authorization: Bearer {BEARER}'"
    urls_file = tmp_path / "pipes.txt"
    urls_file.write_text(url + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, urls_file, "--allow-pipe")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the pipe: shard cached")
    with CachedMultiLoader(None, cache_dir=cache, shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 4  # its workers read it: its sample table is written too
    names = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    digest = hashlib.sha256(url.encode()).hexdigest()[:32]
    assert f"shards/{digest[:2]}/{digest}-shard-000000.tar" in names, names
    assert f"tables/{digest[:2]}/{digest}-shard-000000.tar" in names, names
    assert [n for n in names if BEARER in n or "Bearer" in n] == []
    assert (
        shard_name("pipe:cat /data/a.tar # Bearer X")
        == hashlib.sha256(b"pipe:cat /data/a.tar # Bearer X").hexdigest()[:32] + "-pipe"
    )

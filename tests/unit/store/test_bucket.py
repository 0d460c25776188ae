"""hooks/store/bucket.py against a real S3 server (SeaweedFS, tests/s3server.py): one server for the module."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from hooks.store.bucket import Bucket, BucketError, Conflict, NotFound, Object, Where, missing_client, parse_url
from tests.s3server import S3Server


def bucket_on(server: S3Server, **kwargs: str) -> Bucket:
    """A Bucket on a prefix of its own, so the tests share the server and not the names."""
    args = {"endpoint": server.endpoint, "access_key": server.access_key, "secret_key": server.secret_key,
            "region": "us-east-1"} | kwargs
    return Bucket(server.store(f"t-{uuid.uuid4().hex[:8]}/"), timeout_s=3, **args)


def test_parse_url() -> None:
    assert parse_url("s3://wrapper") == Where("wrapper", "")
    assert parse_url("s3://wrapper/") == Where("wrapper", "")
    assert parse_url("s3://my.bucket-1/conv") == Where("my.bucket-1", "conv/")
    assert parse_url("s3://wrapper/a/b/") == Where("wrapper", "a/b/")
    for bad in ["wrapper/x", "http://wrapper/x", "s3://", "s3:///x", "s3://Wrapper/x", "s3://ab/x", "s3://under_score",
                "s3://-lead", "s3://a..b", "s3://wrapper//x", "s3://wrapper/a/../b"]:
        with pytest.raises(ValueError, match="s3"):
            parse_url(bad)


def test_missing_client_is_none_here() -> None:
    assert missing_client() is None


def test_put_get_head_delete(server: S3Server, tmp_path: Path) -> None:
    b = bucket_on(server)
    etag = b.put("conv/a.json", b'{"a": 1}')
    assert etag.strip('"') and b.get("conv/a.json") == b'{"a": 1}'
    head = b.head("conv/a.json")
    assert head is not None and (head.name, head.size, head.etag) == ("conv/a.json", 8, etag)
    assert abs(head.modified - time.time()) < 120
    big = bytes(range(256)) * 20_000  # 5 MB: more than one of the filer's 4 MB chunks
    b.put("big.bin", big)
    assert b.get_to("big.bin", tmp_path / "big.bin") == len(big)
    assert (tmp_path / "big.bin").read_bytes() == big
    b.delete("conv/a.json")
    b.delete("conv/a.json")  # missing is fine
    assert b.head("conv/a.json") is None
    with pytest.raises(NotFound) as caught:
        b.get("conv/a.json")
    assert caught.value.status == 404 and not caught.value.transient
    assert str(caught.value) == f"{b.url}: GET conv/a.json: 404 NoSuchKey"
    with pytest.raises(NotFound):
        b.get_to("conv/a.json", tmp_path / "a.json")
    with pytest.raises(ValueError):
        b.put("", b"x")


def test_list_pages_and_names(server: S3Server) -> None:
    b = bucket_on(server)
    for i in range(23):
        b.put(f"many/{i:02}.json", str(i).encode())
    b.put("other/x.json", b"x")
    listed = b.list("many/", page_size=5)
    assert [o.name for o in listed] == [f"many/{i:02}.json" for i in range(23)]
    assert all(isinstance(o, Object) and o.size == len(str(int(o.name[5:7]))) for o in listed)
    assert listed[7].etag == b.put("many/07.json", b"7")  # the same bytes, the same ETag, in the same form
    assert len(b.list()) == 24 and b.list("nothing/") == []


def test_if_none_match(server: S3Server) -> None:
    b = bucket_on(server)
    first = b.put("claim.json", b"first", if_none_match=True)
    with pytest.raises(Conflict) as caught:
        b.put("claim.json", b"second", if_none_match=True)
    assert caught.value.status == 412 and not caught.value.transient
    assert b.get("claim.json") == b"first"
    head = b.head("claim.json")
    assert head is not None and head.etag == first


def test_if_match(server: S3Server) -> None:
    b = bucket_on(server)
    first = b.put("state.json", b"v1")
    second = b.put("state.json", b"v2", if_match=first)
    assert second != first
    with pytest.raises(Conflict) as caught:
        b.put("state.json", b"v3", if_match=first)  # stale
    assert caught.value.status == 412
    assert b.get("state.json") == b"v2"
    with pytest.raises(Conflict):
        b.put("never.json", b"x", if_match=second)  # nothing to match
    with pytest.raises(ValueError):
        b.put("state.json", b"x", if_none_match=True, if_match=second)


def test_refused_and_missing_bucket_are_not_transient(server: S3Server) -> None:
    wrong = bucket_on(server, secret_key="not-the-secret-5e1a")
    with pytest.raises(BucketError) as caught:
        wrong.put("x.json", b"x")
    assert caught.value.status == 403 and not caught.value.transient
    assert "not-the-secret-5e1a" not in str(caught.value)
    nobody = Bucket("s3://no-such-bucket/p", endpoint=server.endpoint, access_key=server.access_key,
                    secret_key=server.secret_key, region="us-east-1")
    with pytest.raises(BucketError) as caught:
        nobody.get("x.json")
    assert type(caught.value) is BucketError and caught.value.status == 404 and not caught.value.transient
    assert "NoSuchBucket" in str(caught.value)


def test_the_usual_chain(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    b = Bucket(server.store("chain"))
    assert b.describe() == f"s3://{server.bucket}/chain/ at {server.endpoint}"
    b.put("x.json", b"x")
    assert b.get("x.json") == b"x" and b.list()[0].name == "x.json"


def test_server_down_then_back(server: S3Server) -> None:
    b = bucket_on(server)
    b.put("kept.json", b"kept")
    server.stop()
    try:
        for call in (lambda: b.get("kept.json"), lambda: b.put("y.json", b"y"), lambda: b.list()):
            with pytest.raises(BucketError) as caught:
                call()
            assert caught.value.transient and caught.value.status is None
            assert type(caught.value) is BucketError
            assert str(caught.value).startswith(f"{b.describe()}: ") and "cannot connect" in str(caught.value)
            assert server.secret_key not in str(caught.value) and server.access_key not in str(caught.value)
    finally:
        started = time.monotonic()
        server.start()
        print(f"restarted in {time.monotonic() - started:.1f}s")
    with server.log_on_failure():
        assert b.get("kept.json") == b"kept"
        assert [o.name for o in b.list()] == ["kept.json"]


def test_a_silent_server_times_out_once() -> None:
    """No answer within timeout_s: one attempt (botocore's retries are off), a transient error."""
    accepted: list[socket.socket] = []

    def accept(listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                accepted.append(listener.accept()[0])

    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
        b = Bucket("s3://wrapper/p", endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}", access_key="k",
                   secret_key="silent-secret", region="us-east-1", timeout_s=0.3)
        with pytest.raises(BucketError) as caught:
            b.get("x.json")
    for connection in accepted:
        connection.close()
    assert caught.value.transient and "timed out" in str(caught.value) and "silent-secret" not in str(caught.value)
    assert len(accepted) == 1

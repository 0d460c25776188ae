"""One S3 bucket (and a prefix in it) as the object-store tier sees it: a few synchronous calls over boto3.

boto3 because it is the reference SDK: it finds endpoint and credentials the way every other S3 tool does
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_REGION, ~/.aws, instance roles), it signs
for any S3-compatible server, and it has the conditional writes (If-None-Match: *, If-Match) the tier's
compare-and-swap rests on. The few calls a turn makes are blocking; the caller runs them in asyncio.to_thread
(a client is safe to share between threads). botocore's own retries are off: the caller backs off itself, so
every failure comes back at once as a BucketError that says whether it is worth another try. ETags are kept as
the server gives them (quotes included), so one from put, head or list can go back as if_match. A server that
rejects boto3's default CRC checksums takes AWS_REQUEST_CHECKSUM_CALCULATION=when_required from the same chain.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
POOL = 24  # connections kept: 8 objects moved at once each way, and listings
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}


class BucketError(Exception):
    """A call that failed; the message names the store and the call, never a credential."""

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when there was an answer
        self.transient = transient  # worth another try later (no answer, a timeout, 5xx, throttling)


class NotFound(BucketError):
    """No object of that name (404 NoSuchKey)."""


class Conflict(BucketError):
    """A conditional write that lost (412 PreconditionFailed, 409 ConditionalRequestConflict)."""


@dataclass(frozen=True)
class Object:
    name: str  # relative to the prefix
    size: int
    etag: str
    modified: float  # seconds since the epoch


@dataclass(frozen=True)
class Where:
    bucket: str
    prefix: str  # "" or ending with "/"


def parse_url(url: str) -> Where:
    """`s3://BUCKET` or `s3://BUCKET/PREFIX`; a ValueError that says why for anything else."""
    if not url.startswith("s3://"):
        raise ValueError("not an s3:// URL (expected s3://BUCKET/PREFIX)")
    if any(c in url for c in "@?#"):  # never echoed: user:password@ would be a credential
        raise ValueError("an s3:// URL has no '@', '?' or '#': credentials go in store.access_key and store.secret_key "
                         "(or AWS_ACCESS_KEY_ID ...), the endpoint in store.endpoint")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"{url!r}: {bucket!r} is not a bucket name (3-63 of a-z, 0-9, '.', '-')")
    parts = prefix.removesuffix("/").split("/") if prefix else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return Where(bucket, "".join(part + "/" for part in parts))


def missing_client() -> str | None:
    """None when boto3 can be imported, else what to install (or why it does not import)."""
    if not importlib.util.find_spec("boto3"):
        return "pip install 'llama-wrapper[s3]'"
    try:
        import boto3  # noqa: F401
    except Exception as exc:  # installed and broken (a botocore of another version, ...)
        return f"boto3 is installed but does not import ({type(exc).__name__}: {exc}); reinstall it: " \
               "pip install --force-reinstall 'llama-wrapper[s3]'"
    return None


def check_endpoint(endpoint: str) -> str:
    """An endpoint URL as the store needs it (http(s)://host[:port][/path], no credentials); ValueError else."""
    split = urlsplit(endpoint)
    if split.scheme not in ("http", "https") or not split.hostname:
        raise ValueError("an endpoint is http://HOST[:PORT] or https://HOST[:PORT]")
    if split.username or split.password:
        raise ValueError("an endpoint has no user:password@: credentials go in store.access_key and store.secret_key "
                         "(or AWS_ACCESS_KEY_ID ...)")
    return endpoint


class Bucket:
    def __init__(self, url: str, *, endpoint: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.where = parse_url(url)
        self.url = f"s3://{self.where.bucket}/{self.where.prefix}"
        self._timeout_s = timeout_s
        if problem := missing_client():
            raise BucketError(f"{self.url}: no S3 client: {problem}")
        if endpoint is not None:
            try:
                check_endpoint(endpoint)
            except ValueError as exc:
                raise BucketError(f"{self.url}: store.endpoint: {exc}") from None
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        config = Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1, "mode": "standard"},
                        connect_timeout=timeout_s, read_timeout=timeout_s,
                        max_pool_connections=POOL)  # uploads, fetches and a listing at once
        try:
            session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                            region_name=region)
            self._s3: Any = session.client("s3", endpoint_url=endpoint, config=config)
        except (ValueError, BotoCoreError) as e:  # "Invalid endpoint: ...", partial credentials, no such profile
            raise BucketError(f"{self.url}: {e}") from None
        split = urlsplit(str(self._s3.meta.endpoint_url))
        self.endpoint = f"{split.scheme}://{split.netloc.rpartition('@')[2]}"  # never a user:password@

    def describe(self) -> str:
        return f"{self.url} at {self.endpoint}"

    def put(self, name: str, data: bytes | BinaryIO, *, if_none_match: bool = False,
            if_match: str | None = None) -> str:
        """Write `name` (bytes, or a file read as it is sent) and return its new ETag; Conflict when the condition
        does not hold."""
        if if_none_match and if_match is not None:
            raise ValueError("put: if_none_match and if_match exclude each other")
        condition = {"IfNoneMatch": "*"} if if_none_match else {} if if_match is None else {"IfMatch": if_match}
        reply = self._call("PUT", name, "put_object", Body=data, **condition)
        return str(reply["ETag"])

    def get(self, name: str) -> bytes:
        reply = self._call("GET", name, "get_object")
        try:
            return bytes(reply["Body"].read())
        except Exception as e:
            raise self._failure("GET", name, e) from None

    def get_to(self, name: str, path: Path) -> int:
        """Stream `name` into the file `path` (made or truncated); the bytes written."""
        body = self._call("GET", name, "get_object")["Body"]
        written = 0
        try:
            with path.open("wb") as out:
                for chunk in body.iter_chunks(1 << 20):
                    written += out.write(chunk)
        except Exception as e:  # a local OSError comes back as it is
            raise self._failure("GET", name, e) from None
        finally:
            body.close()
        return written

    def head(self, name: str) -> Object | None:
        try:
            reply = self._call("HEAD", name, "head_object")
        except NotFound:
            return None
        return Object(name, int(reply["ContentLength"]), str(reply["ETag"]), reply["LastModified"].timestamp())

    def list(self, under: str = "", *, page_size: int = 1000) -> list[Object]:
        """Every object whose name starts with `under`, all pages."""
        prefix = self.where.prefix + under
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.where.bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size})
        try:
            return [Object(item["Key"][len(self.where.prefix):], int(item["Size"]), str(item["ETag"]),
                           item["LastModified"].timestamp())
                    for page in pages for item in page.get("Contents", [])]
        except Exception as e:
            raise self._failure("LIST", under or "(all)", e) from None

    def folders(self) -> builtins.list[str]:
        """The names of the folders at the top of the prefix (one per model id), all pages."""
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.where.bucket, Prefix=self.where.prefix, Delimiter="/")
        try:
            return sorted(item["Prefix"][len(self.where.prefix):].rstrip("/")
                          for page in pages for item in page.get("CommonPrefixes", []))
        except Exception as e:
            raise self._failure("LIST", "(folders)", e) from None

    def delete(self, name: str) -> None:
        with contextlib.suppress(NotFound):  # S3 itself answers 204 for a missing name; some servers 404
            self._call("DELETE", name, "delete_object")

    def _call(self, op: str, name: str, method: str, **args: Any) -> Any:
        if not name or name.startswith("/"):
            raise ValueError(f"{op}: {name!r} is not an object name")
        try:
            return getattr(self._s3, method)(Bucket=self.where.bucket, Key=self.where.prefix + name, **args)
        except Exception as e:
            raise self._failure(op, name, e) from None

    def _failure(self, op: str, name: str, e: Exception) -> Exception:
        from botocore import exceptions as bx

        if isinstance(e, bx.ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(e.response.get("Error", {}).get("Code") or status)
            message = f"{self.url}: {op} {name}: {status} {code}"
            if status == 404 and code in ("NoSuchKey", "404", "NotFound"):
                return NotFound(message, status=status)
            if status == 412 or code == "ConditionalRequestConflict":
                return Conflict(message, status=status)
            transient = status is None or status >= 500 or status in (408, 429) or code in _THROTTLED
            return BucketError(message, status=status, transient=transient)
        at = f"{self.describe()}: {op} {name}"
        if isinstance(e, bx.SSLError):
            return BucketError(f"{at}: TLS failed ({_reason(e)})")
        if isinstance(e, bx.ConnectTimeoutError | bx.ReadTimeoutError):
            return BucketError(f"{at}: timed out ({self._timeout_s:g} s)", transient=True)
        if isinstance(e, bx.ConnectionError):
            return BucketError(f"{at}: cannot connect ({_reason(e)})", transient=True)
        if isinstance(e, bx.HTTPClientError | bx.IncompleteReadError):
            return BucketError(f"{at}: connection lost ({_reason(e)})", transient=True)
        if isinstance(e, bx.BotoCoreError):
            return BucketError(f"{at}: {type(e).__name__}: {' '.join(str(e).split())}")
        return e


def _reason(e: Any) -> str:
    """The last words of the underlying error ("[Errno 111] Connection refused"), without the URL."""
    return str(e.kwargs.get("error") or type(e).__name__).rsplit(": ", 1)[-1]

"""What `llama-wrapper check` says of the object store a config names: the endpoint and where the credentials
come from (never a credential), and with `--probe` whether one listing of the bucket succeeds."""

from __future__ import annotations

import os
from typing import Any

from hooks.store.bucket import BucketError
from hooks.store.settings import STORE, bucket_for
from wrapper.configuration.config import Config


def credential_source(access_key: str | None) -> str:
    """Where boto3 takes the credentials from, as it would at the start (no request is made)."""
    if access_key:
        return "store.access_key and store.secret_key of the config"
    try:
        import botocore.session
    except ImportError:
        return "none: boto3 is not installed (pip install 'llama-wrapper[store]')"
    credentials = botocore.session.Session().get_credentials()
    if credentials is None:
        return ("none found: set store.access_key/secret_key, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "~/.aws/credentials or a role")
    method = str(getattr(credentials, "method", "") or "found")
    return {"env": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY", "shared-credentials-file": "~/.aws/credentials",
            "config-file": "~/.aws/config", "iam-role": "the instance's role", "assume-role": "an assumed role",
            "container-role": "the container's role"}.get(method, method)


def checked(config: Config, probe: bool) -> dict[str, Any] | None:
    """`check`'s lines for the store; None without `store.url`."""
    settings = STORE.of(config)
    if not settings.url:
        return None
    endpoint = settings.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    found: dict[str, Any] = {
        "url": settings.url,
        "endpoint": endpoint or "AWS (no store.endpoint, no AWS_ENDPOINT_URL)",
        "endpoint_from": "store.endpoint" if settings.endpoint else "AWS_ENDPOINT_URL" if endpoint else "boto3",
        "region": settings.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        or "boto3's default",
        "credentials": credential_source(settings.access_key),
    }
    if probe:
        try:
            folders = bucket_for(settings).folders()
        except (BucketError, ValueError) as exc:
            found["probe"] = f"failed: {exc}"
        else:
            found["probe"] = f"ok: listed, {len(folders)} model folder(s) there"
    return found

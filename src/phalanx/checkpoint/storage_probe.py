"""Probe a checkpoint URL once before training: write, read back, list and delete a small object.

A bucket that does not exist, credentials the store refuses, a prefix that may be read but not
written, or an endpoint that does not answer are found here, in `Phalanx()` and in `phalanx run`
before launch, with the URL, the cause and the fix, rather than at the first save hours later.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from phalanx.checkpoint.object_path import ObjectPath

_DENIED = {"AccessDenied", "AllAccessDisabled", "Forbidden", "403"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidClientTokenId",
    "InvalidToken",
    "ExpiredToken",
    "AuthFailure",
    "UnrecognizedClientException",
}


def _error_code(error: BaseException) -> str | None:
    """The store's error code (botocore's `response['Error']['Code']`) anywhere in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            return str(response["Error"].get("Code"))
        seen = seen.__cause__ or seen.__context__
    return None


_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError")


def _chain(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and the per-rank errors a DCP CheckpointException holds."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        seen = todo.pop()
        if seen is None or any(seen is known for known in found):
            continue
        found.append(seen)
        todo += [seen.__cause__, seen.__context__]  # type: ignore[list-item]
        failures = getattr(seen, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [value for value in failures.values() if isinstance(value, BaseException)]
    return found


def unreachable(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that says the store's endpoint did not answer, or None."""
    for seen in _chain(error):
        if type(seen).__name__ in _UNREACHABLE or isinstance(seen, (ConnectionError, socket.timeout, TimeoutError)):
            return seen
    return None


def diagnose(root: ObjectPath, error: BaseException) -> tuple[str, str]:
    """(cause, fix) for a failed probe (or save) of `root`."""
    code, name = _error_code(error), type(error).__name__
    if code == "NoSuchBucket" or (isinstance(error, FileNotFoundError) and "bucket" in str(error).lower()):
        return (
            f"the bucket {root.bucket!r} does not exist",
            f"create it first (e.g. aws s3 mb {root.protocol}://{root.bucket}) or correct the bucket name",
        )
    if code in _BAD_CREDENTIALS:
        return (
            f"the store refused the credentials ({code}: {error})",
            "set valid keys (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)",
        )
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return (
            f"no credentials were found ({error})",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials",
        )
    if code in _DENIED or isinstance(error, PermissionError):
        return (
            f"writing under {root} is not allowed ({code or name}: {error}): a read-only prefix or bucket",
            "grant write access to this prefix (s3:PutObject, s3:GetObject, s3:ListBucket, s3:DeleteObject) "
            "or choose a prefix you may write",
        )
    if unreachable(error) is not None:
        error = unreachable(error)  # type: ignore[assignment]
        return (
            f"the storage endpoint cannot be reached ({type(error).__name__}: {error})",
            "check AWS_ENDPOINT_URL (for S3-compatible stores) and the network, or that the store is running",
        )
    return (f"{name}: {error}", "check the URL, the credentials and the endpoint")


def probe(root: ObjectPath) -> str | None:
    """None if `root` can be written, read, listed and cleaned; else 'cause. HINT: fix'."""
    probe_object = root / f".phalanx-write-check-{socket.gethostname()}-{os.getpid()}"
    written = False
    try:
        with probe_object.open("wb") as f:
            f.write(b"phalanx")
        written = True
        if probe_object.read_bytes() != b"phalanx":
            return f"an object written to {root} read back different. HINT: check the store's consistency settings"
        list(root.iterdir())
        probe_object.unlink()
        written = False
    except ImportError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - diagnosed by type and store error code, then reported
        cause, fix = diagnose(root, error)
        return f"{cause}. HINT: {fix}"
    finally:
        if written:
            _remove_quietly(probe_object)
    return None


def _remove_quietly(target: Any) -> None:
    try:
        target.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - the probe already failed with its own message; this is cleanup
        pass

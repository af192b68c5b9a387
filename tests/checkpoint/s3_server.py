"""moto's S3 server on loopback, spoken to over HTTP exactly as to S3 (AWS_ENDPOINT_URL).

It starts with authentication on: the first three requests (unauthenticated) create an IAM user,
its access key and its policy (everything on S3, except writing under `BUCKET/readonly/`); every
request after that must be signed with that key, so wrong credentials and a read-only prefix are
refused as S3 refuses them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.server_process import stop

BUCKET = "phalanx-ckpt"
READ_ONLY_PREFIX = "readonly"


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]  # AWS_* for the server's user; add to a subprocess's environment
    pid: int = 0  # the server's process

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def client(self):  # boto3, for the tests' own listings
        import boto3

        return boto3.session.Session(
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        ).client("s3", endpoint_url=self.endpoint)

    def keys(self, prefix: str) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix.rstrip("/") + "/")
        return sorted(item["Key"][len(prefix.rstrip("/")) + 1 :] for item in listed.get("Contents", []))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def aws_env(endpoint: str, key: str, secret: str) -> dict[str, str]:
    """Credentials and endpoint for botocore, with the machine's own AWS config files out of the way."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def s3_server(workdir: Path) -> Iterator[S3Server]:
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(workdir / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3"),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, (workdir / "moto.log").read_text()
            time.sleep(0.2)
        admin = boto3.session.Session(
            aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap", region_name="us-east-1"
        )
        iam = admin.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="phalanx")
        key = iam.create_access_key(UserName="phalanx")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                {
                    "Effect": "Deny",
                    "Action": ["s3:PutObject", "s3:DeleteObject"],
                    "Resource": f"arn:aws:s3:::{BUCKET}/{READ_ONLY_PREFIX}/*",
                },
            ],
        }
        iam.put_user_policy(UserName="phalanx", PolicyName="s3", PolicyDocument=json.dumps(policy))
        server = S3Server(endpoint, aws_env(endpoint, key["AccessKeyId"], key["SecretAccessKey"]), proc.pid)
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        stop(proc)
        log.close()

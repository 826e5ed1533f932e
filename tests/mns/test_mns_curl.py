"""The README's curl session, run by bash and curl in a
subprocess against a live gateway in open auth mode."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from polymq.gateway.config import AuthConfig
from tests.mns.harness import start

README = Path(__file__).resolve().parents[2] / "README.md"


def session_script() -> str:
    text = README.read_text()
    block = text.split("<!-- curl-session -->", 1)[1].split("<!-- /curl-session -->", 1)[0]
    match = re.search(r"```sh\n(.*?)```", block, re.S)
    assert match is not None, "README.md lost its curl session"
    return match.group(1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_session(tmp_path: Path) -> None:
    with start(tmp_path, AuthConfig(mode="open")) as server:
        host, port = server.address("http")
        script = session_script().replace("localhost:8080", f"{host}:{port}")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "201"
        assert '"MessageBodyMD5"' in lines[1]
        assert '"MessageBody": "hello from curl"' in lines[2]
        assert '"DequeueCount": 1' in lines[2]
        assert lines[3] == "204"
        # The delete took: the queue is empty now.
        again = subprocess.run(
            [
                "curl",
                "-s",
                "-H",
                "Accept: application/json",
                f"http://{host}:{port}/queues/demo/messages",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert '"Code": "MessageNotExist"' in again.stdout


def test_json_api_batches_and_errors(tmp_path: Path) -> None:
    json_headers = {"accept": "application/json", "content-type": "application/json"}
    with start(tmp_path, AuthConfig(mode="open")) as server:
        host, port = server.address("http")
        with httpx.Client(base_url=f"http://{host}:{port}", headers=json_headers) as client:
            body = {"DelaySeconds": 0, "VisibilityTimeout": 5}
            assert client.put("/queues/jobs", json=body).status_code == 201
            batch = {"Messages": [{"MessageBody": f"job {i}", "Priority": 2} for i in range(3)]}
            sent = client.post("/queues/jobs/messages", json=batch)
            assert sent.status_code == 201 and len(sent.json()["Messages"]) == 3
            got = client.get("/queues/jobs/messages?numOfMessages=16&waitseconds=1").json()
            messages = got["Messages"]
            assert sorted(m["MessageBody"] for m in messages) == ["job 0", "job 1", "job 2"]
            assert all(m["Priority"] == 2 and m["DequeueCount"] == 1 for m in messages)
            handles = {"ReceiptHandles": [m["ReceiptHandle"] for m in messages]}
            assert (
                client.request("DELETE", "/queues/jobs/messages", json=handles).status_code == 204
            )
            attrs = client.get("/queues/jobs").json()
            assert attrs["VisibilityTimeout"] == 5 and attrs["ActiveMessages"] == 0
            listed = client.get("/queues").json()
            assert [q["QueueURL"].rsplit("/", 1)[1] for q in listed["Queues"]] == ["jobs"]
            error = client.get("/queues/nope/messages")
            assert error.status_code == 404
            assert error.json()["Code"] == "QueueNotExist" and error.json()["RequestId"]
            bad = client.post("/queues/jobs/messages", content=b"{broken")
            assert bad.status_code == 400 and bad.json()["Code"] == "MalformedXML"

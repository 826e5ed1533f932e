"""A stateful property test: random sequences of MNS calls against a live gateway,
checked against a model of one queue (what is visible, what is received, what the
counters say)."""

from __future__ import annotations

from pathlib import Path

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from polymq.gateway.config import AuthConfig
from tests.mns.harness import endpoint, start

JSON = {"accept": "application/json", "content-type": "application/json"}


def test_queue_behaves_like_its_model(tmp_path: Path) -> None:
    with (
        start(tmp_path, AuthConfig(mode="open"), {"storage.durability": "async"}) as server,
        httpx.Client(base_url=endpoint(server), headers=JSON, timeout=30) as client,
    ):
        counter = iter(range(1_000_000))

        class QueueMachine(RuleBasedStateMachine):
            """Visibility timeouts are long (1 h), so nothing comes back by itself."""

            def __init__(self) -> None:
                super().__init__()
                self.name = f"model-{next(counter)}"
                body = {"VisibilityTimeout": 3600}
                assert client.put(f"/queues/{self.name}", json=body).status_code == 201
                self.visible: list[str] = []  # bodies in send order
                self.received: dict[str, str] = {}  # receipt handle -> body
                self.stale: list[str] = []  # handles deleted or replaced
                self.sent = 0

            @property
            def path(self) -> str:
                return f"/queues/{self.name}/messages"

            @rule(count=st.integers(1, 4))
            def send(self, count: int) -> None:
                bodies = [f"m{self.sent + i}" for i in range(count)]
                self.sent += count
                docs = {"Messages": [{"MessageBody": b} for b in bodies]}
                assert client.post(self.path, json=docs).status_code == 201
                self.visible.extend(bodies)

            @rule(count=st.integers(1, 4))
            def receive(self, count: int) -> None:
                got = client.get(f"{self.path}?numOfMessages={count}")
                if not self.visible:
                    assert got.status_code == 404 and got.json()["Code"] == "MessageNotExist"
                    return
                assert got.status_code == 200, got.text
                messages = got.json()["Messages"]
                expected = self.visible[: len(messages)]
                assert [m["MessageBody"] for m in messages] == expected  # oldest first
                assert 1 <= len(messages) <= count
                del self.visible[: len(messages)]
                for m in messages:
                    self.received[m["ReceiptHandle"]] = m["MessageBody"]

            @precondition(lambda self: bool(self.received))
            @rule(data=st.data())
            def delete(self, data: st.DataObject) -> None:
                handle = data.draw(st.sampled_from(sorted(self.received)))
                response = client.delete(self.path, params={"ReceiptHandle": handle})
                assert response.status_code == 204, response.text
                del self.received[handle]
                self.stale.append(handle)

            @precondition(lambda self: bool(self.received))
            @rule(data=st.data())
            def extend(self, data: st.DataObject) -> None:
                """ChangeMessageVisibility: a new handle, the old one stale, the
                message still in flight."""
                handle = data.draw(st.sampled_from(sorted(self.received)))
                response = client.put(
                    self.path, params={"ReceiptHandle": handle, "VisibilityTimeout": 3600}
                )
                assert response.status_code == 200, response.text
                new = response.json()["ReceiptHandle"]
                assert new != handle
                self.received[new] = self.received.pop(handle)
                self.stale.append(handle)

            @precondition(lambda self: bool(self.stale))
            @rule(data=st.data())
            def delete_stale(self, data: st.DataObject) -> None:
                handle = data.draw(st.sampled_from(self.stale))
                response = client.delete(self.path, params={"ReceiptHandle": handle})
                assert response.status_code == 400
                assert response.json()["Code"] == "ReceiptHandleError"

            @invariant()
            def counters_match(self) -> None:
                attrs = client.get(f"/queues/{self.name}").json()
                assert attrs["ActiveMessages"] == len(self.visible)
                assert attrs["InactiveMessages"] == len(self.received)

        run_state_machine_as_test(
            QueueMachine,
            settings=settings(
                max_examples=30,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )

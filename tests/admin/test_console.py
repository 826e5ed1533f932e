"""The web console (/console) in headless Chromium from Debian's packages (make
chromium), driven by Selenium through the system's chromedriver, against a live
gateway in accounts mode with traffic, in both forms. Each page is loaded after an
admin login and checked against the admin API and what pika did (AMQP queues beside
MNS ones, their consumers as group members); the console's actions (create a topic,
publish, peek, purge and delete a queue, delete a topic, reset a group's offsets,
close a connection, add and delete a permission rule) are checked through real
clients (kafka-python, the MNS SDK, pika). A screenshot of every page is written to
build/console-screenshots/<form>/ for a person to look at."""

from __future__ import annotations

import base64
import dataclasses
import io
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pika
import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message as MnsMessage
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from polymq.gateway.admin_cli import run
from tests.admin.test_admin_cli import ACCOUNTS, NS, PASSWORD, kafka, produce, url
from tests.live_server import LiveServer, live_server, server_config

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_S = 30.0
ADMIN = ("ops", PASSWORD)
LISTENERS = ("http", "kafka", "amqp")
LAB = "lab"
HOUR_MS = 3_600_000

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no chromium/chromedriver: `make chromium` installs them (make test does)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("console")
    config = dataclasses.replace(server_config(data, LISTENERS), auth=ACCOUNTS)
    with live_server(data, LISTENERS, config=config) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    )
    try:
        yield driver
    finally:
        driver.quit()


def api(server: LiveServer, path: str) -> Any:
    return httpx.get(url(server) + path, auth=ADMIN, timeout=WAIT_S).json()


def until(browser: WebDriver, check: Callable[[WebDriver], Any]) -> Any:
    """Wait for ``check``; a table the page redrew while it was read is read again."""
    wait = WebDriverWait(
        browser, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(check)


def goto(browser: WebDriver, page: str) -> None:
    """Show ``page`` and wait until it has been drawn afresh."""
    before = browser.execute_script("return document.getElementById('main').dataset.loaded")
    browser.execute_script(
        "if (location.hash === arguments[0])"
        " window.dispatchEvent(new HashChangeEvent('hashchange'));"
        " else location.hash = arguments[0];",
        f"#{page}",
    )
    until(
        browser,
        lambda d: d.execute_script(
            "const m = document.getElementById('main');"
            "return m.dataset.page === arguments[0] && m.dataset.loaded !== arguments[1];",
            page,
            before,
        ),
    )


def row(browser: WebDriver, table: str, name: str) -> Any:
    return browser.find_element(By.CSS_SELECTOR, f"#{table} tr[data-name='{name}']")


def cells(browser: WebDriver, table: str, name: str) -> list[str]:
    return [td.text for td in row(browser, table, name).find_elements(By.TAG_NAME, "td")]


def shoot(browser: WebDriver, form: str, page: str) -> None:
    folder = ROOT / "build" / "console-screenshots" / form
    folder.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(folder / f"{page}.png"))


def drawn(browser: WebDriver) -> Any:
    """When the page was last drawn (the console's ``main.dataset.loaded``)."""
    return browser.execute_script("return document.getElementById('main').dataset.loaded")


def redrawn(browser: WebDriver, before: Any) -> None:
    """Wait until an action's redraw replaced the page drawn at ``before``: its rows
    found earlier are stale after it."""
    until(browser, lambda d: drawn(d) != before)


def status_says(browser: WebDriver, text: str) -> None:
    until(
        browser,
        lambda d: text in d.execute_script("return document.getElementById('status').textContent"),
    )


def confirm(browser: WebDriver) -> None:
    """Answer the page's ``confirm()`` (a delete asks first) with OK."""
    WebDriverWait(browser, WAIT_S).until(expected_conditions.alert_is_present())
    browser.switch_to.alert.accept()


def amqp_consumer(server: LiveServer) -> tuple[pika.BlockingConnection, str]:
    """A pika connection to vhost ``NS`` consuming queue ``tasks`` (durable, bound to
    amq.direct), holding one of its two messages unacked; and its local address."""
    host, port = server.address("amqp")
    credentials = pika.PlainCredentials("guest", PASSWORD)
    connection = pika.BlockingConnection(
        pika.ConnectionParameters(host, port, NS, credentials, connection_attempts=1)
    )
    channel = connection.channel()
    channel.queue_declare("tasks", durable=True)
    channel.queue_bind("tasks", "amq.direct", routing_key="t")
    channel.confirm_delivery()
    for body in (b"t1", b"t2"):
        channel.basic_publish("amq.direct", "t", body)
    channel.basic_qos(prefetch_count=1)
    held: list[bytes] = []
    channel.basic_consume(
        "tasks", lambda ch, method, props, body: held.append(body), consumer_tag="worker-1"
    )
    deadline = time.monotonic() + WAIT_S
    while not held:
        assert time.monotonic() < deadline
        connection.process_data_events(time_limit=0.2)
    local = connection._impl._transport._sock.getsockname()
    return connection, "{}:{}".format(*local)


def read_committing(server: LiveServer, topic: str, group: str, count: int) -> list[bytes]:
    """``count`` records of ``topic`` from its start through a new group ``group``,
    committed, and the consumer gone."""
    consumer = KafkaConsumer(topic, group_id=group, auto_offset_reset="earliest", **kafka(server))
    got: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(r.value for r in records)
    consumer.commit()
    consumer.close()
    return got


def tasks_of(server: LiveServer) -> dict[str, Any]:
    queues: list[dict[str, Any]] = api(server, "/admin/queues?kind=amqp")["queues"]
    [tasks] = [q for q in queues if q["name"] == "tasks"]
    return tasks


def closed_by_server(connection: pika.BlockingConnection) -> bool:
    """Whether pika saw its connection end, reading until it does (or the time is up)."""
    deadline = time.monotonic() + WAIT_S
    try:
        while time.monotonic() < deadline and connection.is_open:
            connection.process_data_events(time_limit=0.2)
    except pika.exceptions.AMQPError:
        return True
    return bool(connection.is_closed)


def test_every_page_and_action(server: LiveServer, browser: WebDriver, server_form: str) -> None:
    env = {"POLYMQ_ADMIN_USER": "ops", "POLYMQ_ADMIN_PASSWORD": PASSWORD}
    for argv in (["topics", "create", "orders", "-n", NS], ["queues", "create", "jobs", "-n", NS]):
        assert run(["--url", url(server), *argv], env, io.StringIO()) == 0
    produce(server, "orders", [b"o1", b"o2", b"o3"])
    consumer = KafkaConsumer(
        "orders", group_id="billing", auto_offset_reset="earliest", **kafka(server)
    )
    got = 0
    deadline = time.monotonic() + WAIT_S
    while got < 3 and time.monotonic() < deadline:
        got += sum(len(r) for r in consumer.poll(timeout_ms=500).values())
    consumer.commit()
    consumer.close()
    created = httpx.post(
        url(server) + f"/admin/topics/{NS}",
        json={"name": "metered", "retention_ms": HOUR_MS},
        auth=ADMIN,
        timeout=WAIT_S,
    )
    assert created.status_code == 201, created.text
    queue = Account(url(server), "guest-ak", "guest-sk").get_queue("jobs")
    for i in range(2):
        queue.send_message(MnsMessage(f"job {i}"))
    amqp, amqp_peer = amqp_consumer(server)

    # Sign in: the console asks for credentials in accounts mode.
    browser.get(url(server) + "/console/")
    until(browser, lambda d: d.find_element(By.ID, "login").is_displayed())
    browser.find_element(By.ID, "login-user").send_keys("ops")
    browser.find_element(By.ID, "login-password").send_keys(PASSWORD)
    browser.find_element(By.ID, "login-submit").click()
    until(browser, lambda d: d.find_element(By.ID, "main").get_attribute("data-page"))
    goto(browser, "overview")
    assert cells(browser, "overview-protocols", "kafka")[0] == "kafka"
    # Storage: the nodes' free disk in the separated form; the merged engine reports none.
    cards = browser.find_element(By.ID, "overview-cards").text
    assert ("disk free" in cards) == (api(server, "/admin/nodes")["form"] == "separated")
    shoot(browser, server_form, "overview")

    # Namespaces: counts as the API says; create one from the page.
    goto(browser, "namespaces")
    [shop] = [n for n in api(server, "/admin/namespaces")["namespaces"] if n["name"] == NS]
    assert shop["queues"] == 2  # jobs (MNS) and tasks (AMQP)
    assert cells(browser, "namespaces-table", NS) == [NS, str(shop["topics"]), "2"]
    form = browser.find_element(By.ID, "namespace-create")
    form.find_element(By.NAME, "name").send_keys(LAB)
    form.find_element(By.TAG_NAME, "button").click()
    status_says(browser, f"create namespace {LAB}: done")
    until(browser, lambda d: cells(d, "namespaces-table", LAB) == [LAB, "0", "0"])
    assert LAB in [n["name"] for n in api(server, "/admin/namespaces")["namespaces"]]
    shoot(browser, server_form, "namespaces")
    # An admin may use every namespace; the guest, limited to its own, is refused it.
    refused = httpx.get(
        url(server) + f"/admin/topics?namespace={LAB}", auth=("guest", PASSWORD), timeout=WAIT_S
    )
    assert refused.status_code == 404

    # Topics: what the API says; create, publish and peek through the page.
    goto(browser, "topics")
    listed = {t["name"]: t for t in api(server, "/admin/topics")["topics"]}
    orders, metered = listed["orders"], listed["metered"]
    shown = cells(browser, "topics-table", "orders")
    assert shown[4] == str(orders["queues"][0]["latest"]) == "3"
    # Groups reading it (the API's /admin/groups) and its retention (the engine's default).
    assert orders["config"]["retention_ms"] is None and shown[9:11] == ["billing", "default"]
    assert metered["config"]["retention_ms"] == HOUR_MS
    assert cells(browser, "topics-table", "metered")[5:11] == ["\N{EN DASH}"] * 4 + ["", "1 h"]
    # In and out since the previous look: two messages produced, both committed by a group.
    produce(server, "metered", [b"m1", b"m2"])
    assert read_committing(server, "metered", "meterers", 2) == [b"m1", b"m2"]
    goto(browser, "topics")
    shown = cells(browser, "topics-table", "metered")
    assert (shown[5], shown[7], shown[9]) == ("2", "2", "meterers")
    assert float(shown[6]) > 0 and float(shown[8]) > 0
    form = browser.find_element(By.ID, "topic-create")
    form.find_element(By.NAME, "namespace").clear()
    form.find_element(By.NAME, "namespace").send_keys(NS)
    form.find_element(By.NAME, "name").send_keys("from-browser")
    form.find_element(By.TAG_NAME, "button").click()
    until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-name='from-browser']"))
    publish = row(browser, "topics-table", "from-browser").find_element(By.CSS_SELECTOR, ".publish")
    publish.find_element(By.NAME, "body").send_keys("hello from the browser")
    before = drawn(browser)
    publish.find_element(By.TAG_NAME, "button").click()
    status_says(browser, "publish to from-browser: done")
    redrawn(browser, before)
    reader = KafkaConsumer(
        "from-browser", auto_offset_reset="earliest", consumer_timeout_ms=5000, **kafka(server)
    )
    assert [r.value for r in reader] == [b"hello from the browser"]
    reader.close()
    row(browser, "topics-table", "orders").find_element(By.CSS_SELECTOR, ".peek").click()
    until(browser, lambda d: "o3" in d.find_element(By.ID, "messages-table").text)
    shoot(browser, server_form, "topics")
    # Delete: kafka-python's metadata no longer lists the topic.
    row(browser, "topics-table", "from-browser").find_element(By.CSS_SELECTOR, ".delete").click()
    confirm(browser)
    status_says(browser, "delete from-browser: done")
    until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, "tr[data-name='from-browser']"))
    lister = KafkaConsumer(**kafka(server))
    topics_now = lister.topics()
    lister.close()
    assert "orders" in topics_now and "from-browser" not in topics_now

    # Queues: depth as the API says; purge leaves the SDK nothing.
    goto(browser, "queues")
    assert cells(browser, "queues-table", "jobs")[:4] == ["mns", NS, "jobs", "2"]
    # The AMQP queue beside it, as pika left it: one ready, one unacked, its consumer.
    tasks = tasks_of(server)
    assert (tasks["messages_ready"], tasks["messages_unacked"]) == (1, 1)
    shown = cells(browser, "queues-table", "tasks")
    assert shown[:8] == ["amqp", NS, "tasks", "1", "1", "", "1", "D"]
    assert shown[8].startswith("worker-1") and shown[9] == "amq.direct → t"
    row(browser, "queues-table", "jobs").find_element(By.CSS_SELECTOR, ".peek").click()
    body = base64.b64encode(b"job 0").decode()  # the SDK's bodies are base64 text
    until(browser, lambda d: body in d.find_element(By.ID, "messages-table").text)
    shoot(browser, server_form, "queues")
    before = drawn(browser)
    row(browser, "queues-table", "jobs").find_element(By.CSS_SELECTOR, ".purge").click()
    status_says(browser, "purged 2 messages from jobs")
    redrawn(browser, before)
    with pytest.raises(MNSServerException):
        queue.receive_message(0)
    # Delete: the MNS SDK is told the queue does not exist.
    row(browser, "queues-table", "jobs").find_element(By.CSS_SELECTOR, ".delete").click()
    confirm(browser)
    status_says(browser, "delete jobs: done")
    with pytest.raises(MNSServerException) as gone:
        queue.get_attributes()
    assert gone.value.type == "QueueNotExist"

    # Groups: reset to earliest, and the group reads everything again.
    goto(browser, "groups")
    assert cells(browser, "groups-table", "billing")[2] == "0"
    reset = row(browser, "groups-table", "billing").find_element(By.CSS_SELECTOR, ".reset")
    Select(reset.find_element(By.NAME, "to")).select_by_value("earliest")
    reset.find_element(By.TAG_NAME, "button").click()
    status_says(browser, "reset billing: done")
    until(browser, lambda d: cells(d, "groups-table", "billing")[2] == "3")
    # The AMQP group's members: pika's consumer, at pika's address, and its queue's lag.
    assert cells(browser, "groups-table", "amqp")[2:4] == ["2", "tasks: 2 (1 in flight)"]
    row(browser, "groups-table", "amqp").find_element(By.CSS_SELECTOR, ".members").click()
    until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#members-table tr[data-name]"))
    assert cells(browser, "members-table", "worker-1")[2:5] == ["worker-1", amqp_peer, "tasks"]
    assert cells(browser, "pop-queues-table", "tasks")[2:5] == ["1", "1", "2"]
    shoot(browser, server_form, "groups")
    again = KafkaConsumer("orders", group_id="billing", auto_offset_reset="latest", **kafka(server))
    values: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(values) < 3 and time.monotonic() < deadline:
        for records in again.poll(timeout_ms=500).values():
            values.extend(r.value for r in records)
    again.close()
    assert values == [b"o1", b"o2", b"o3"]

    # Connections: close pika's connection from the page; pika sees it end, and its
    # consumer is gone from the queue.
    [mine] = [c for c in api(server, "/admin/connections")["connections"] if c["peer"] == amqp_peer]
    assert mine["protocol"] == "amqp"
    # A plaintext connection; its counts are what metering counted for AMQP in its
    # namespace (pika's is the only AMQP connection: its publishes, and the one
    # delivery it holds).
    assert (mine["tls"], mine["certificate"]) == (False, None)
    [amqp_usage] = [
        u
        for u in api(server, "/admin/usage")["usage"]
        if (u["protocol"], u["namespace"]) == ("amqp", NS)
    ]
    counted = [mine[k] for k in ("messages_in", "messages_out", "bytes_in", "bytes_out")]
    assert counted == [
        amqp_usage[k] for k in ("messages_in", "messages_out", "bytes_in", "bytes_out")
    ]
    assert counted[0] >= 2 and counted[1] == 1
    goto(browser, "connections")
    shown = [
        td.text for td in browser.find_elements(By.CSS_SELECTOR, f"tr[data-id='{mine['id']}'] td")
    ]
    assert shown[6] == "no" and shown[7].endswith(" s ago")
    assert shown[8:10] == [str(counted[0]), "1"]
    assert shown[10:12] == [f"{counted[2]} B", f"{counted[3]} B"]  # under a KiB each
    assert float(shown[12]) > 0 and float(shown[13]) > 0
    shoot(browser, server_form, "connections")
    browser.find_element(By.CSS_SELECTOR, f"tr[data-id='{mine['id']}'] .close").click()
    status_says(browser, f"close {mine['id']}: done")
    assert closed_by_server(amqp)
    deadline = time.monotonic() + WAIT_S
    while tasks_of(server)["consumer_count"]:  # unregistered by the gateway as pika goes
        assert time.monotonic() < deadline
        time.sleep(0.05)
    goto(browser, "queues")
    # Nobody consumes; both messages are still there. (The one pika held is ready
    # again but storage counts it unacked until it is delivered again: docs/admin.md.)
    shown = cells(browser, "queues-table", "tasks")
    assert shown[6] == "0" and int(shown[3]) + int(shown[4]) == 2

    # Cluster and accounts: what the API says.
    goto(browser, "cluster")
    nodes = api(server, "/admin/nodes")
    if nodes["form"] == "merged":
        assert "Merged form" in browser.find_element(By.ID, "storage-form").text
    else:
        for node in nodes["nodes"]:
            assert cells(browser, "nodes-table", node["node_id"])[2] == "up"
    gateways = api(server, "/admin/gateways")["gateways"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#gateways-table tbody tr")) == len(gateways)
    shoot(browser, server_form, "cluster")
    goto(browser, "accounts")
    assert cells(browser, "accounts-table", "ops")[1] == "yes"
    assert PASSWORD not in browser.page_source

    # Permissions: a deny rule added on the page refuses the guest's Kafka writes to
    # "orders"; deleted on the page, they are allowed again.
    form = browser.find_element(By.ID, "permission-add")
    for name, value in (("principal", "guest"), ("pattern", "orders"), ("operations", "write")):
        form.find_element(By.NAME, name).send_keys(value)
    form.find_element(By.NAME, "namespace").clear()
    form.find_element(By.NAME, "namespace").send_keys(NS)
    Select(form.find_element(By.NAME, "effect")).select_by_value("deny")
    form.find_element(By.TAG_NAME, "button").click()
    status_says(browser, "added rule ")
    [rule] = [r for r in api(server, "/admin/permissions")["rules"] if r["principal"] == "guest"]
    assert (rule["pattern"], rule["operations"], rule["effect"]) == ("orders", ["write"], "deny")
    until(browser, lambda d: cells(d, "permissions-table", rule["key"])[:2] == ["guest", NS])
    shoot(browser, server_form, "accounts")
    producer = KafkaProducer(acks="all", max_block_ms=10_000, **kafka(server))
    with pytest.raises(KafkaError):
        producer.send("orders", b"refused", partition=0).get(WAIT_S)
    producer.close()
    row(browser, "permissions-table", rule["key"]).find_element(By.CSS_SELECTOR, ".delete").click()
    confirm(browser)
    status_says(browser, f"delete rule {rule['key']}: done")
    assert all(r["key"] != rule["key"] for r in api(server, "/admin/permissions")["rules"])
    produce(server, "orders", [b"allowed"])

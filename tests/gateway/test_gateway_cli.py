from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from polymq.gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("storage", "nameserver", "navigation", "gateway", "cluster", "conformance")
FREE_PORTS = [
    f"--{name}-port=0" for name in ("kafka", "amqp", "mqtt", "mqtt-ws", "rocketmq", "http")
]
STARTUP_TIMEOUT = 30


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", *COMMANDS):
        assert f"\n    {command}" in out
    assert "POLYMQ_STORAGE__DATA_DIR" in out
    assert "docs/configuration.md" in out


def test_run_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--data-dir", "--durability", "--host", "--log-level", *FREE_PORTS):
        assert flag.split("=")[0] in out
    assert "[9092]" in out


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("storage", ("--data-dir", "--port", "--node-id", "--nameserver", "--durability")),
        ("nameserver", ("--port", "--host")),
        ("navigation", ("--port", "--host")),
        (
            "gateway",
            ("--nameserver", "--navigation", "--zone", "--advertised-host", "--kafka-port"),
        ),
    ],
)
def test_separated_form_commands_list_their_flags(
    command: str, flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (*flags, "--config", "--log-level"):
        assert flag in out


def test_gateway_without_nameservers_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway"], env={}) == 2
    assert "--nameserver" in capsys.readouterr().err


def test_gateway_flags_reach_the_cluster_config() -> None:
    from polymq.gateway.cli import _overrides, build_parser
    from polymq.gateway.config import load_config

    args = build_parser().parse_args(
        ["gateway", "--nameserver", "a:1,b:2", "--navigation", "http://n:8090", "--zone", "z1"]
    )
    config = load_config(None, {}, _overrides(args))
    assert config.cluster.nameservers == ("a:1", "b:2")
    assert (config.cluster.navigation, config.cluster.zone) == ("http://n:8090", "z1")
    args = build_parser().parse_args(["storage", "--port", "0", "--node-id", "n7"])
    config = load_config(None, {}, _overrides(args))
    assert (config.node.port, config.node.node_id) == (0, "n7")


def test_configuration_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "polymq.toml"
    path.write_text("[storage]\ndat_dir = 'x'\n")
    assert main(["run", "--config", str(path)], env={}) == 2
    assert "unknown key 'storage.dat_dir'" in capsys.readouterr().err
    assert main(["--data-dir", "x"], env={"POLYMQ_CONFIG": str(path)}) == 2
    assert main(["run"], env={"POLYMQ_LISTENERS__KAFKA__PORT": "many"}) == 2


async def run_until_ready(
    args: list[str], tmp_path: Path
) -> tuple[asyncio.subprocess.Process, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYMQ_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "polymq.gateway",
        *args,
        cwd=ROOT,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []

    async def until_ready() -> None:
        assert process.stdout is not None
        while line := (await process.stdout.readline()).decode():
            lines.append(line)
            if " ready " in line:
                return
        raise AssertionError("server exited before it was ready:\n" + "".join(lines))

    try:
        await asyncio.wait_for(until_ready(), STARTUP_TIMEOUT)
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return process, lines


@pytest.mark.parametrize(("subcommand", "signum"), [(["run"], signal.SIGINT), ([], signal.SIGTERM)])
async def test_server_starts_and_stops_cleanly_on_a_signal(
    tmp_path: Path, subcommand: list[str], signum: signal.Signals
) -> None:
    data_dir = tmp_path / "data"
    process, lines = await run_until_ready(
        [*subcommand, "--data-dir", str(data_dir), "--durability", "async", *FREE_PORTS],
        tmp_path,
    )
    startup = "".join(lines)
    assert str(data_dir) in startup
    assert "durability async" in startup
    assert "listener kafka (port 0): not built yet" in startup or "listener kafka: " in startup

    process.send_signal(signum)
    assert process.stdout is not None
    rest, _ = await asyncio.wait_for(process.communicate(), STARTUP_TIMEOUT)
    output = startup + rest.decode()
    assert process.returncode == 0, output
    assert output.rstrip().endswith("stopped"), output
    assert "Traceback" not in output
    assert data_dir.is_dir()

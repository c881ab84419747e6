"""The settings table (tokenfan_settings/__init__.py) is the one truth: flags, environment, defaults, configs,
the engine child's argv, `--help` and docs/settings.md agree with it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from engine_worker.config import EngineConfig, engine_argv, engine_config
from gateway.config import GatewayConfig, gateway_config
from tests.procs import ROOT
from tokenfan import cli
from tokenfan_settings import (
    ADVANCED,
    BOOL,
    BY_NAME,
    COMMANDS,
    FLOAT,
    GROUP_OF,
    HELP_GROUPS,
    INT,
    PATH,
    REPLICAS,
    SETTINGS,
    SETTINGS_DOC,
    TABLE_END,
    TABLE_START,
    TRANSPORT_DELAY,
    Setting,
    SettingError,
    add_arguments,
    for_command,
    group_of,
    markdown,
    read,
    resolve,
)

LEGACY_ENV = {"backend": "TOKENFAN_ENGINE", "broker_url": "TOKENFAN_BROKER"}  # kept for existing deployments


def parse(command: str, argv: list[str], environ: dict[str, str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser, command)
    return resolve(parser.parse_args(argv), command, environ or {})


def sample(s: Setting) -> Any:
    """A valid value that differs from the default."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.kind is TRANSPORT_DELAY:
        return {"sse": 0.002, "ws": 0.5}
    if s.kind is REPLICAS:
        return 2
    if s.repeat:
        return "ipc:///tmp/a.sock,ipc:///tmp/b.sock" if s.name == "engine_address" else ("one", "two")
    if s.kind is BOOL:
        return not s.default
    if s.kind is INT:
        return (s.default or 0) + 7
    if s.kind is FLOAT:
        return (s.default or 0.0) + 2.5
    if s.kind is PATH:
        return Path("/tmp/tokenfan-settings-test") / s.name
    return f"value-of-{s.name}"


CASES = [pytest.param(c, s, id=f"{c}:{s.name}") for c in COMMANDS for s in for_command(c)]


def test_settings_reference_is_generated_from_the_settings_table() -> None:
    page = (ROOT / SETTINGS_DOC).read_text()
    current = page.partition(TABLE_START)[2].partition(TABLE_END)[0].strip()
    assert current == markdown(), f"stale tables: run `python -m tokenfan_settings --write {SETTINGS_DOC}`"


@pytest.mark.parametrize(("command", "setting"), CASES)
def test_flag_and_environment_variable_give_the_same_value(command: str, setting: Setting) -> None:
    value = sample(setting)
    raws = setting.raw(value)
    argv = [x for raw in raws for x in (setting.option, raw)]
    assert parse(command, argv)[setting.name] == value
    assert parse(command, [], {setting.env_var: ",".join(raws)})[setting.name] == value


@pytest.mark.parametrize(("command", "setting"), CASES)
def test_flag_wins_over_environment_and_environment_over_default(command: str, setting: Setting) -> None:
    value = sample(setting)
    env = {setting.env_var: ",".join(setting.raw(setting.default_value())) or "x"}
    if setting.kind is TRANSPORT_DELAY:
        env = {setting.env_var: "ws:9"}
    if setting.kind is REPLICAS:
        env = {setting.env_var: "1"}
    argv = [x for raw in setting.raw(value) for x in (setting.option, raw)]
    assert parse(command, argv, env)[setting.name] == value
    assert parse(command, [])[setting.name] == setting.default_value()


def test_defaults_of_the_table_are_the_defaults_of_the_configs() -> None:
    assert gateway_config(parse("gateway", [])) == GatewayConfig()
    assert engine_config(parse("engine", [])) == EngineConfig()
    # serve builds both from one set of values
    values = parse("serve", [])
    assert (gateway_config(values), engine_config(values)) == (GatewayConfig(), EngineConfig())


def test_every_config_field_is_a_setting_and_every_setting_a_config_field() -> None:
    not_settings = {"limits", "retention", "policy", "broker", "ws_send_queue"}  # nested (filled by dotted fields) / internal
    for cls, command in ((GatewayConfig, "gateway"), (EngineConfig, "engine")):
        tops = {s.path.partition(".")[0] for s in for_command(command)}
        assert {f.name for f in dataclasses.fields(cls)} - not_settings == tops - not_settings
        default = cls()
        for s in for_command(command):
            read(default, s)  # AttributeError if a dotted field does not exist


def test_names_flags_and_commands_follow_one_convention() -> None:
    for s in SETTINGS:
        assert s.env_var == LEGACY_ENV.get(s.name, "TOKENFAN_" + s.name.upper())
        assert s.commands <= set(COMMANDS) and "serve" in s.commands, s.name  # serve takes every setting
        if s.default_value() is not None:  # the default survives a trip through its own flag
            assert s.parse(s.raw(s.default_value()), s.option) == s.default_value(), s.name
    for command in COMMANDS:
        parser = argparse.ArgumentParser()
        add_arguments(parser, command)  # argparse raises on a flag declared twice
        envs = [s.env_var for s in for_command(command)]
        assert len(envs) == len(set(envs))


def test_engine_argv_rebuilds_the_engine_config() -> None:
    changed = {s.path: sample(s) for s in for_command("engine") if s.name != "engine_address"}
    config = dataclasses.replace(EngineConfig(), engine_address="ipc:///tmp/child.sock", **changed)
    assert engine_config(parse("engine", engine_argv(config))) == config


def test_new_settings_reach_the_configs() -> None:
    values = parse("serve", ["--ssl-certfile", "/c.pem", "--ssl-keyfile", "/k.pem", "--http-header-timeout", "2",
                             "--http-body-timeout", "3", "--workers", "4", "--stream-interval", "5"])
    g, e = gateway_config(values), engine_config(values)
    assert (g.ssl_certfile, g.ssl_keyfile, g.http_header_timeout, g.http_body_timeout, g.workers) == \
        (Path("/c.pem"), Path("/k.pem"), 2.0, 3.0, 4)
    assert e.stream_interval == 5
    assert (GatewayConfig().http_header_timeout, GatewayConfig().http_body_timeout, GatewayConfig().workers,
            GatewayConfig().ssl_certfile, EngineConfig().stream_interval) == (10.0, 30.0, 1, None, 1)


def test_nested_gateway_settings_fill_limits_retention_and_policy() -> None:
    g = gateway_config(parse("gateway", ["--max-tokens-cap", "9", "--stream-ttl", "0.5", "--send-timeout", "2",
                                         "--coalesce-after", "3", "--max-subscribers", "4"]))
    assert (g.limits.max_tokens_cap, g.retention.finished_ttl, g.policy.send_timeout, g.policy.coalesce_after,
            g.retention.max_subscribers) == (9, 0.5, 2.0, 3, 4)


def test_broker_clocks_are_settings_and_checked_together(capsys: pytest.CaptureFixture[str]) -> None:
    g = gateway_config(parse("gateway", ["--broker-op-timeout", "0.7", "--broker-lease-interval", "0.2",
                                         "--broker-lease-ttl", "0.9", "--broker-max-pending", "16"],
                             {"TOKENFAN_BROKER_CANCEL_TIMEOUT": "5"}))
    assert (g.broker.op_timeout, g.broker.lease_interval, g.broker.lease_ttl, g.broker.max_pending,
            g.broker.cancel_timeout, g.broker.block) == (0.7, 0.2, 0.9, 16, 5.0, 2.0)
    with pytest.raises(SystemExit) as exc:
        cli.main(["gateway", "--broker-lease-ttl", "0.4"])  # the lease would expire between refreshes
    assert exc.value.code == 2
    assert "--broker-lease-interval (0.5) must be shorter than --broker-lease-ttl (0.4)" in capsys.readouterr().err


def test_gateway_engine_flag_is_a_deprecated_spelling_of_engine_address(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        values = parse("gateway", ["--engine-address", "ipc:///a", "--engine", "ipc:///b,ipc:///c"])
    assert values["engine_address"] == "ipc:///a,ipc:///b,ipc:///c"
    assert "deprecated" in caplog.text and "--engine-address" in caplog.text


def test_engine_flag_is_the_backend_in_serve_and_engine() -> None:
    for command in ("serve", "engine"):
        assert parse(command, ["--engine", "synthetic"])["backend"] == "synthetic"
    assert parse("engine", ["--address", "ipc:///x"])["engine_address"] == "ipc:///x"


def test_curve_dir_is_one_setting_for_gateway_and_engine() -> None:
    values = parse("serve", ["--curve-dir", "/keys"])
    assert gateway_config(values).curve_dir == engine_config(values).curve_dir == Path("/keys")
    assert "--curve-dir" in engine_argv(engine_config(values))


def test_bad_values_name_their_source() -> None:
    with pytest.raises(SettingError, match="TOKENFAN_PORT"):
        parse("gateway", [], {"TOKENFAN_PORT": "eighty"})
    with pytest.raises(SettingError, match="--workers.*minimum"):
        parse("gateway", ["--workers", "0"])
    with pytest.raises(SettingError, match="TOKENFAN_ENFORCE_EAGER"):
        parse("engine", [], {"TOKENFAN_ENFORCE_EAGER": "maybe"})
    with pytest.raises(SettingError, match="--inject-delay"):
        parse("gateway", ["--inject-delay", "grpc:1"])


def test_bool_flag_alone_means_true_and_takes_a_value() -> None:
    assert parse("gateway", ["--ws-per-message-deflate"])["ws_per_message_deflate"] is True
    assert parse("engine", ["--enforce-eager", "false"])["enforce_eager"] is False


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, set[str]]:
    """What ``tokenfan ARGV`` prints, and the flags it lists (an option line starts two spaces in)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    return out, set(re.findall(r"^  (--[\w-]+)", out, re.MULTILINE))


def test_help_groups_name_settings_a_user_sets() -> None:
    names = [name for names in HELP_GROUPS.values() for name in names]
    assert len(names) == len(set(names)) and set(names) <= set(BY_NAME)
    assert 15 <= len(names) <= 25  # the ones a user sets; the rest would bury them
    assert ADVANCED not in HELP_GROUPS and set(GROUP_OF) == set(names)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_grouped_settings_and_help_all_every_one(command: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out, shown = help_of([command, "--help"], capsys)
    grouped = {s.option for s in for_command(command) if group_of(s) != ADVANCED}
    assert shown == grouped | {"--help-all"}
    assert "[TOKENFAN_ENGINE_ADDRESS]" in out
    for title in {group_of(s) for s in for_command(command)}:
        assert f"\n{title}:" in out, title
    advanced = sum(group_of(s) == ADVANCED for s in for_command(command))
    assert f"{advanced} more settings" in out and "--help-all" in out

    out, shown = help_of([command, "--help-all"], capsys)
    assert shown == {s.option for s in for_command(command)} | {"--help-all"}
    assert all(f"[{s.env_var}]" in out for s in for_command(command))


def test_advanced_settings_parse_like_the_grouped_ones() -> None:
    assert group_of(BY_NAME["inject_delay"]) == group_of(BY_NAME["broker_lease_ttl"]) == ADVANCED
    values = parse("serve", ["--inject-delay", "ws:1", "--broker-lease-ttl", "4", "--port", "9"])
    assert (values["inject_delay"], values["broker_lease_ttl"], values["port"]) == ({"ws": 0.001}, 4.0, 9)


def test_serve_gives_its_engine_a_private_socket_per_port_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def cmd_serve(values: dict[str, Any], gconf: GatewayConfig) -> int:
        seen.append(values)
        return 0

    monkeypatch.setattr(cli, "cmd_serve", cmd_serve)
    monkeypatch.delenv("TOKENFAN_ENGINE_ADDRESS", raising=False)
    cli.main(["serve", "--port", "8123"])
    cli.main(["serve", "--engine-address", "ipc:///tmp/mine.sock"])
    assert seen[0]["engine_address"].endswith("/engine-8123.sock")
    assert seen[1]["engine_address"] == "ipc:///tmp/mine.sock"


def test_broker_replicas_is_auto_or_a_count() -> None:
    assert parse("gateway", [])["broker_replicas"] is None
    assert parse("gateway", ["--broker-replicas", "auto"])["broker_replicas"] is None
    assert parse("gateway", ["--broker-replicas", "0"])["broker_replicas"] == 0
    assert parse("gateway", [], {"TOKENFAN_BROKER_REPLICAS": "2"})["broker_replicas"] == 2
    for bad in ("-1", "some"):
        with pytest.raises(SettingError):
            parse("gateway", ["--broker-replicas", bad])

"""The command-line flags and the configs they build (`service/flags.py`): every field
has a flag or is left out on purpose, no flag given means every default, each flag sets
its own field and nothing else, --help groups them by config, and the docs' configuration
tables name real flags of the settings they say. Cheap: no model, no Redis."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from service.cli import main
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.flags import (
    API_KEYS_ENV,
    DISAGG,
    ENGINE,
    FAIR_QUEUE,
    GATEWAY,
    GATEWAY_LOGGING,
    LOGGING,
    METRICS,
    MIB,
    REDIS,
    Flag,
    FlagGroup,
    add_engine_arguments,
    add_gateway_arguments,
    add_worker_arguments,
    default_queue_url,
    engine_config_from_args,
    gateway_config_from_args,
    read_api_keys,
    worker_config_from_args,
)
from workers.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
# Each table, under the setting it builds in its command's config.
WORKER_TABLES = {
    "redis": REDIS,
    **ENGINE,
    "metrics": METRICS,
    "logging": LOGGING,
    "disagg": DISAGG,
    "fair_queue": FAIR_QUEUE,
}
GATEWAY_TABLES = {"": GATEWAY, "logging": GATEWAY_LOGGING}
TABLES = [*WORKER_TABLES.values(), *GATEWAY_TABLES.values()]
FLAGS = [(table, flag) for table in TABLES for flag in table.flags]
# Strings a config checks: a value of their own for the flag-by-flag test.
EXAMPLES = {"--device": "cuda:1", "--model": "random:tiny-llama", "--redis-url": "redis://elsewhere:6379"}


def parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("table", TABLES, ids=lambda table: f"{table.config.__name__}-{table.title}")
def test_every_field_has_a_flag_or_is_left_out_on_purpose(table):
    flagged = [flag.field for flag in table.flags]
    assert sorted(flagged + list(table.unflagged)) == sorted(field.name for field in fields(table.config))


def test_the_engine_tables_cover_every_part_of_the_engine_config():
    assert list(ENGINE) == [field.name for field in fields(EngineConfig)]
    assert {name: table.config for name, table in ENGINE.items()} == {
        field.name: type(getattr(EngineConfig(), field.name)) for field in fields(EngineConfig)
    }


def test_a_flag_is_named_after_its_field_unless_its_table_names_it():
    assert REDIS.options()["--claim-idle-ms"] == "claim_idle_ms"
    assert REDIS.options()["--redis-url"] == "url"
    assert ENGINE["model"].options()["--no-cuda-graphs"] == "cuda_graphs"  # defaults to True: a flag turns it off
    assert LOGGING.options()["--log-prompts"] == "log_prompts"  # defaults to False: a flag turns it on
    assert ENGINE["cache"].options()["--kv-memory-mb"] == "kv_memory_bytes"


def test_with_no_flags_every_config_is_its_defaults(monkeypatch):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert engine_config_from_args(parse(add_engine_arguments, [])) == EngineConfig()
    assert worker_config_from_args(parse(add_worker_arguments, []), RedisConfig().url) == WorkerConfig()
    assert gateway_config_from_args(parse(add_gateway_arguments, [])) == GatewayConfig(redis_url=default_queue_url())


def example(flag: Flag, table: FlagGroup, tmp_path: Path) -> tuple[list[str], object]:
    """Arguments that give `flag` a value other than its default, and the field's value then."""
    default = getattr(table.config(), flag.field)
    option = flag.option(default)
    if isinstance(default, bool):
        return [option], not default
    if isinstance(default, tuple):
        return [option, "app:", option, "other:"], ("app:", "other:")
    if isinstance(default, Path):
        return [option, str(tmp_path)], tmp_path
    if default is None:  # an optional path
        return [option, str(tmp_path / "file")], tmp_path / "file"
    if flag.choices:
        other = next(choice for choice in flag.choices if choice != default)
        return [option, other], other
    if isinstance(default, str):
        value = EXAMPLES.get(option, f"{default}:other")
        return [option, value], value
    if isinstance(default, float):
        return [option, str(default / 2)], default / 2
    in_units = default // flag.unit + 1
    return [option, str(in_units)], in_units * flag.unit


@pytest.mark.parametrize("table, flag", FLAGS, ids=lambda x: getattr(x, "field", getattr(x, "title", "")))
def test_each_flag_sets_its_own_field_and_nothing_else(table, flag, tmp_path):
    argv, value = example(flag, table, tmp_path)
    unflagged = table.build(parse(table.add_to, []))
    assert table.build(parse(table.add_to, argv)) == replace(unflagged, **{flag.field: value})


def test_memory_flags_count_mib_and_a_repeated_flag_gives_each_value():
    args = parse(
        add_worker_arguments,
        ["--kv-memory-mb", "128", "--swap-memory-mb", "0", "--reply-prefix", "a:", "--reply-prefix", "b:"],
    )
    config = worker_config_from_args(args, "redis://127.0.0.1:6379")
    assert (config.engine.cache.kv_memory_bytes, config.engine.cache.swap_memory_bytes) == (128 * MIB, 0)
    assert config.redis.reply_prefixes == ("a:", "b:")
    assert config.redis.url == "redis://127.0.0.1:6379"  # the resolved server, not the flag's ""
    assert worker_config_from_args(parse(add_worker_arguments, []), "").redis.reply_prefixes == ("inflight:out:",)


def test_the_gateway_reads_api_keys_from_its_file_and_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# one a line, a tenant after a key binds it\nsk-file-1\n\n  sk-file-2  \nsk-acme\tacme\n")
    monkeypatch.setenv(API_KEYS_ENV, "sk-env-1, sk-env-2, sk-acme,")
    args = parse(add_gateway_arguments, ["--api-keys-file", str(keys), "--log-level", "warning"])
    config = gateway_config_from_args(args)
    assert config.api_keys == {
        "sk-file-1": None,
        "sk-file-2": None,
        "sk-env-1": None,
        "sk-env-2": None,
        "sk-acme": "acme",
    }
    assert config.logging.level == "warning" and not config.logging.log_prompts
    assert read_api_keys(None, None) == {}
    assert GatewayConfig(api_keys={"sk-1"}).api_keys == {"sk-1": None}  # a set of keys binds none
    assert "sk-" not in repr(config)


@pytest.mark.parametrize(
    "lines, why",
    [
        ("sk-1 acme extra\n", "expected `KEY` or `KEY TENANT`"),
        ("sk-1 acme\nsk-1 globex\n", "bound to two tenants"),
        ("sk-1 not/a/name\n", "not 1-64 letters"),
    ],
)
def test_a_malformed_keys_file_line_is_refused_without_showing_the_key(tmp_path, lines, why):
    keys = tmp_path / "keys"
    keys.write_text(lines)
    with pytest.raises(ValueError, match=why) as refused:
        GatewayConfig(api_keys=read_api_keys(keys, None))
    assert "sk-1" not in str(refused.value)  # a key is never shown


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command, tables", [("worker", WORKER_TABLES), ("gateway", GATEWAY_TABLES)])
def test_help_lists_the_flags_grouped_by_config(command, tables, capsys):
    text = help_of(command, capsys)
    shown = [table for table in tables.values() if table.flags]
    headings = [text.index(f"\n{table.title}:\n  sets {table.config.__name__} (") for table in shown]
    assert headings == sorted(headings)  # in the order of the config
    for table, start, end in zip(shown, headings, [*headings[1:], len(text)]):
        for option in table.options():
            assert re.search(rf"^  {option}\b", text[start:end], re.M), option


def documented_settings() -> dict[str, list[tuple[str, object]]]:
    """Each flag of the worker and the gateway: the settings it sets (`redis.url`, `host`)
    and its default as --help shows it (None where that comes from the environment)."""
    settings: dict[str, list[tuple[str, object]]] = {"--api-keys-file": [("api_keys", None)]}
    for add_arguments, tables in ((add_worker_arguments, WORKER_TABLES), (add_gateway_arguments, GATEWAY_TABLES)):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        for prefix, table in tables.items():
            for flag in table.flags:
                default = getattr(table.config(), flag.field)
                if flag.default or not flag.show_default:
                    shown = None
                elif isinstance(default, tuple):  # a repeated flag: its field's default when not given
                    shown = default
                else:
                    shown = parser.get_default(flag.dest(default))
                setting = f"{prefix}.{flag.field}" if prefix else flag.field
                settings.setdefault(flag.option(default), []).append((setting, shown))
    return settings


def configuration_rows(path: Path) -> list[list[str]]:
    """The rows of the file's `| setting | flag | default | meaning |` tables."""
    rows, inside = [], False
    for line in path.read_text().splitlines():
        if re.match(r"\|\s*setting\s*\|\s*flag\s*\|\s*default\s*\|", line):
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif not line.startswith("|"):
            inside = False
    return rows


def shown_as(default: object, text: str) -> bool:
    if isinstance(default, bool | Path) or default is None:
        return True  # said in words: on, off, the host name
    if isinstance(default, tuple):
        return text == " ".join(default)
    if isinstance(default, int | float):
        return re.fullmatch(r"[\d.]+", text) is not None and float(text) == default
    return text == default


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_docs_configuration_tables_name_the_flag_of_each_setting_and_its_default(path):
    settings, wrong = documented_settings(), []
    for setting_cell, flag_cell, default_cell, *_ in configuration_rows(path):
        named = re.findall(r"`([\w.]+)`", setting_cell)
        options = re.findall(r"`(--[\w-]+)`", flag_cell)
        defaults = re.findall(r"`([^`]+)`", default_cell)
        for option in options:
            if option not in settings:
                wrong.append(f"{option}: no such flag")
        if len(named) != len(options):
            continue
        for setting, option, shown in zip(named, options, defaults + [None] * len(options)):
            found = dict(settings.get(option, []))
            if setting not in found:
                wrong.append(f"{option} does not set {setting} (it sets {', '.join(found) or 'nothing'})")
            elif shown is not None and not shown_as(found[setting], shown):
                wrong.append(f"{option}: the table says {shown}, the flag's default is {found[setting]}")
    assert wrong == []

"""The command line's flags, read from the parser itself (no subprocess, no Ray).

Every flag says what it does; a flag is offered only by the commands it acts on; sizes
need a unit; a default the user did not give is recorded so tables can print it. The
subprocess behaviour (exit 2, the message) is in tests/integration/test_cli.py.
"""

from __future__ import annotations

import argparse

import pytest
from mxload.orchestrator.cli import flags as cli
from mxload.orchestrator.cli.commands import COMMANDS
from mxload.orchestrator.errors import UsageError


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_every_command_is_listed_and_every_flag_has_help() -> None:
    subs = subparsers()
    assert sorted(subs) == sorted(COMMANDS) == sorted(cli.ALL)
    missing = [
        f"{name} {a.dest}"
        for name, p in subs.items()
        for a in p._actions
        if a.dest != "help" and not (a.help and a.help.strip())
    ]
    assert missing == []


# Flags that mean nothing on a command must not be offered there (argparse then refuses
# them as unknown: exit 2 naming the flag).
ABSENT = {
    "--max-restarts": [
        "demo",
        "make-checkpoint",
        "inspect",
        "plan",
        "reload",
        "status",
        "release",
        "convert",
    ],
    "--allow-nonfinite": ["demo", "make-checkpoint", "inspect", "plan", "status", "release"],
    "--storage-options": ["demo", "status", "release"],
    "--tp": ["demo", "inspect", "reload", "status", "release", "convert", "make-checkpoint"],
    "--detach": ["plan", "reload", "status", "release", "demo"],
    "--address": ["demo", "make-checkpoint", "inspect", "plan", "convert"],
    "--device-memory": ["inspect", "reload", "status", "release", "convert", "demo"],
    "--overwrite": ["demo", "inspect", "plan", "reload", "release"],
}
PRESENT = {
    "--max-restarts": ["load"],
    "--allow-nonfinite": ["load", "convert"],
    "--storage-options": ["inspect", "plan", "load", "reload", "convert", "make-checkpoint"],
    "--tp": ["plan", "load"],
    "--speculative-config": ["plan", "load"],
    "--mm-encoder-tp-mode": ["plan", "load"],
    "--address": ["load", "reload", "status", "release"],
    "--json": list(COMMANDS),
    "--debug": list(COMMANDS),
    "--verbose": list(COMMANDS),
    "-v": list(COMMANDS),
    "--overwrite": ["load", "status", "convert", "make-checkpoint"],
}


@pytest.mark.parametrize("flag", sorted(set(ABSENT) | set(PRESENT)))
def test_flags_appear_only_where_they_act(flag: str) -> None:
    subs = subparsers()
    offered = sorted(name for name, p in subs.items() if flag in options(p))
    for name in ABSENT.get(flag, []):
        assert name not in offered, f"{flag} offered by {name}"
    for name in PRESENT.get(flag, []):
        assert name in offered, f"{flag} missing from {name}"


def test_flag_table_names_only_real_commands() -> None:
    for flag in cli.FLAGS:
        assert flag.help.strip(), flag.names
        assert set(flag.commands) <= set(COMMANDS), (flag.names, flag.commands)


def parse(*argv: str) -> argparse.Namespace:
    return cli.parse_args(argv)


def test_defaults_used_are_recorded() -> None:
    args = parse("plan", "--config", "c.json", "--tp", "4")
    assert args.tp == 4 and args.dp == 1 and args.pp == 1
    assert "--dp 1" in args.defaults_used and "--pp 1" in args.defaults_used
    assert not any(d.startswith("--tp") for d in args.defaults_used)
    assert args.enable_expert_parallel is False


def test_a_session_name_defaults_only_for_a_detached_load() -> None:
    assert "--session default" not in parse("load", "ck", "--device", "cpu").defaults_used
    detached = parse("load", "ck", "--device", "cpu", "--detach")
    assert detached.session == "default" and "--session default" in detached.defaults_used
    assert parse("status").session == "default"


def test_no_parser_takes_an_abbreviation() -> None:
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in subparsers().values())


def test_sizes_need_a_unit() -> None:
    assert parse("plan", "--device-memory", "64GiB").device_memory == 64 * 2**30
    assert parse("plan", "--device-memory", "2GB").device_memory == 2 * 10**9
    assert parse("plan", "--staging-budget", "4096B").staging_budget == 4096
    for bad in ("64", "lots", "12XB", "-1GiB", "64G", "64m", "1T", "2 K"):
        with pytest.raises(UsageError, match="--device-memory"):
            parse("plan", "--device-memory", bad)


def test_presets_named_in_help_are_the_writers_presets() -> None:
    from mxload.orchestrator.tools.synth import PRESETS

    assert cli.preset_names() == sorted(PRESETS)


def test_a_flag_and_the_same_storage_option_that_agree_are_one_setting() -> None:
    import argparse

    from mxload.orchestrator.cli.flags import storage_options

    args = argparse.Namespace(
        storage_options='{"mxload_min_read_rate": 2097152, "mxload_read_timeout_s": 5}',
        min_read_rate=2097152,
        read_timeout=5.0,
        connect_timeout=None,
        allow_outside_links=True,
    )
    assert storage_options(args) == {
        "mxload_min_read_rate": 2097152,
        "mxload_read_timeout_s": 5.0,
        "mxload_allow_outside_links": True,
    }

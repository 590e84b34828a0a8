"""Settings are declared once, on the components' frozen dataclasses (schemas/settings.py):
every command's flags and config-file keys are derived from those fields, nothing kept by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from agentarium.cli import build_parser, command_modules
from agentarium.commands.produce_cmd import ProduceCommand
from agentarium.config import (
    ConfigKeys,
    add_config_arguments,
    add_settings,
    resolve,
)
from agentarium.consumers import ConsumerProcess, ConsumerSettings
from agentarium.producers import JobOptions
from agentarium.schemas import SettingError, check_settings, section, setting, settings


def _subparsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every (command words, parser) below ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _subparsers(sub, (*prefix, name))


def _keyed_commands():
    """(command words, parser, ConfigKeys) for every command that takes --config."""
    keys_by_command = {}
    for module in command_modules():
        for value in vars(module).values():
            if isinstance(value, ConfigKeys):
                keys_by_command[value.command] = value
    for words, parser in _subparsers(build_parser()):
        if any(a.dest == "config" for a in parser._actions):
            yield words, parser, keys_by_command[" ".join(words)]


def test_every_flag_is_a_key_and_every_key_a_flag_or_flagless_with_a_reason():
    found = list(_keyed_commands())
    assert {"consumer", "trainer", "produce"} <= {" ".join(w) for w, _, _ in found}
    for words, parser, keys in found:
        dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
        dests -= {"config", "resume"} | set(keys.keyless)
        assert dests <= set(keys.types), (words, sorted(dests - set(keys.types)))
        for key in keys.types:
            if key in keys.flagless:
                assert keys.flagless[key].strip(), (words, key)
                assert key not in dests, (words, f"{key} is flagless but has a flag")
            else:
                assert key in dests, (words, f"key {key} has no flag and no reason")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grown(ConsumerSettings):
    """The consumer's settings with one more field (module level: the hints are strings)."""

    prefetch_depth: int = setting(4, ge=1, help="jobs buffered ahead of the free slots")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command(ConsumerProcess):
    consumer: Grown = section(Grown)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrownJobs(JobOptions):
    """What the jobs of a batch share, with one more field."""

    priority: int = setting(4, ge=1, help="the jobs' priority, 1 first")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Produce(ProduceCommand):
    jobs: GrownJobs = section(GrownJobs)


GROWN = {  # command: (its settings grown by one field, the lines a file needs, the new value)
    "consumer": (Command, "agent: a=m:f\nllm: [http://x:1]\n", lambda c: c.consumer.prefetch_depth),
    "produce": (Produce, "agent: toy\n", lambda c: c.jobs.priority),
}


@pytest.mark.parametrize("command", GROWN)
def test_a_field_added_to_a_settings_dataclass_is_a_flag_and_a_key_at_once(command, tmp_path):
    """The command's code is not touched: a new setting on the component's own dataclass
    (the consumer's settings, the produced jobs' options) shows up in --help, in a config
    file and as an override."""
    klass, required, value_of = GROWN[command]
    known = {key.name for key in settings.keys(klass.__mro__[1])}  # the command's own class
    (added,) = [key for key in settings.keys(klass) if key.name not in known]
    flag = added.flag
    keys = ConfigKeys.of(command, klass)
    parser = argparse.ArgumentParser()
    add_settings(parser, klass)
    add_config_arguments(parser, keys)
    assert f"{added.meta.help} (default 4)" in " ".join(parser.format_help().split())
    path = tmp_path / "c.yaml"
    path.write_text(f"{required}{added.name}: 6\n")
    built = resolve(parser.parse_args(["--config", str(path)]), keys).build(klass)
    assert value_of(built) == 6
    by_flag = resolve(parser.parse_args(["--config", str(path), flag, "9"]), keys)
    assert value_of(by_flag.build(klass)) == 9
    over = resolve(parser.parse_args(["--config", str(path), f"{added.name}=2"]), keys)
    assert value_of(over.build(klass)) == 2
    with pytest.raises(SettingError, match=f"{flag} must be >= 1, got 0"):
        resolve(parser.parse_args(["--config", str(path), f"{added.name}=0"]), keys).build(klass)


def test_sections_flatten_with_their_prefix_and_renames():
    names = [k.name for k in settings.keys(ConsumerSettings)]
    assert {"fleet_outage_limit_s", "retry_delay_s", "attempts", "concurrency"} <= set(names)
    assert "base_delay_s" not in names and "outage_limit_s" not in names
    built = ConsumerSettings.of(retry_delay_s=2.0, fleet_outage_limit_s=0.0)
    assert built.delivery.base_delay_s == 2.0 and built.fleet.outage_limit_s == 0.0
    assert settings.flatten(built)["retry_delay_s"] == 2.0
    with pytest.raises(TypeError, match="unknown consumer setting"):
        ConsumerSettings.of(base_delay_s=2.0)


def test_one_default_per_setting_across_the_consumer_the_orchestrator_and_eval():
    from agentarium import OrchestratorConfig

    # the consumer's own defaults apply: the orchestrator holds a ConsumerSettings section
    assert OrchestratorConfig().consumer.concurrency == 32
    assert ConsumerSettings().concurrency == 32


def test_bounds_and_choices_name_the_flag():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Knobs:
        mode: str = setting("a", choices=("a", "b"), help="m")
        wait_s: float = setting(1.0, gt=0, help="w")
        guard: float = setting(0.1, ge=0, flagless="a numerical guard")

        def __post_init__(self) -> None:
            check_settings(self)

    with pytest.raises(SettingError, match="--mode must be one of a, b, got 'c'"):
        Knobs(mode="c")
    with pytest.raises(SettingError, match="--wait must be > 0, got 0"):
        Knobs(wait_s=0.0)
    with pytest.raises(SettingError, match="guard must be >= 0"):
        Knobs(guard=-1.0)
    with pytest.raises(TypeError, match="needs its help text"):
        setting(1)

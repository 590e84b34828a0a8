"""Config files for `agentarium trainer`, `agentarium consumer` and `agentarium produce`: defaults < --config file <
flags < KEY=VALUE overrides, unknown keys refused with a suggestion, every flag a key and
every key a flag (or a stated reason), and the resolved settings logged once and written next
to the checkpoints."""

from __future__ import annotations

import argparse

import pytest
import yaml
from structlog.testing import capture_logs

from agentarium.broker import NatsSettings
from agentarium.cli import build_parser
from agentarium.commands import consumer_cmd, env_cmd, produce_cmd, trainer_cmd
from agentarium.config import ConfigError, read_config_file
from agentarium.consumers import ConsumerProcess
from agentarium.schemas import settings


def subparser(name: str) -> argparse.ArgumentParser:
    """The parser of ``name``, a command or a command group's command (``env serve``)."""
    parser = build_parser()
    for word in name.split():
        parser = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        ).choices[word]
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def write(path, text: str):
    path.write_text(text)
    return str(path)


TRAINER_YAML = """\
run: r1
agent: toy
model_dir: tiny
lr: 3e-4          # YAML 1.1 reads this as a string: it is still a number here
max_staleness: 7
group_size: 4
adam_betas: [0.9, 0.95]
"""


def test_file_then_flags_then_overrides(tmp_path):
    path = write(tmp_path / "t.yaml", TRAINER_YAML)
    config, process, resolved = trainer_cmd.resolve_args(
        # overrides on both sides of the flags: argparse alone would refuse the second one
        parse("trainer", "seed=5", "--config", path, "--lr", "1e-3", "--group-size", "6",
              "max_staleness=2", "group_size=3", "--no-publish", "max_steps=9")
    )  # fmt: skip
    assert config.lr == 1e-3  # flag over file
    assert config.max_staleness == 2  # override over file
    assert config.group_size == 3  # override over flag over file
    assert config.adam_betas == (0.9, 0.95)  # a key without a flag, from the file
    assert config.seed == 5 and config.clip_low == 0.2  # override; untouched default
    assert (process.publish, process.max_steps) == (False, 9)
    assert resolved.sources == {
        "run": "file",
        "agent": "file",
        "model_dir": "file",
        "lr": "flag",
        "max_staleness": "override",
        "group_size": "override",
        "adam_betas": "file",
        "seed": "override",
        "publish": "flag",
        "max_steps": "override",
    }
    # the file alone: "3e-4" is the number 0.0003; flags at their defaults do not override it
    alone, _, _ = trainer_cmd.resolve_args(parse("trainer", "--config", path))
    assert (alone.lr, alone.max_staleness, alone.group_size) == (3e-4, 7, 4)
    # override values are YAML: null turns dual-clip off, lists are tuples
    cfg, _, _ = trainer_cmd.resolve_args(
        parse("trainer", "--config", path, "dual_clip=null", "adam_betas=[0.8, 0.9]")
    )
    assert (cfg.dual_clip, cfg.adam_betas) == (None, (0.8, 0.9))


def test_flags_alone_still_work_and_missing_keys_say_how_to_set_them(tmp_path):
    config = trainer_cmd.config_from_args(
        parse("trainer", "--run", "r", "--agent", "a", "--model", "tiny", "--stale-policy", "tis")
    )
    assert (config.run, config.stale_policy, config.max_staleness) == ("r", "tis", 4)
    with pytest.raises(ConfigError) as err:
        trainer_cmd.resolve_args(parse("trainer", "--agent", "a"))
    assert "needs --run (or run: VALUE in --config, or run=VALUE)" in str(err.value)
    assert "--model (or model_dir: VALUE" in str(err.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("max_stalenes: 2", "unknown trainer key 'max_stalenes'; did you mean max_staleness"),
        ("max-staleness: 2", "did you mean max_staleness?"),
        ("bf16: true", "the flag --bf16 sets key bf16_autocast"),
        ("no_std_norm: true", "the flag --no-std-norm sets key std_norm"),
        ("trainer:\n  lr: 1.0", "keys are flat"),
        ("lr: fast", "lr must be a number, got 'fast'"),
        ("adam_betas: [0.9]", "adam_betas must be a list of 2 values"),
        ("- lr", "a config file is a mapping of key: value lines"),
        ("lr: [1, 2", "not valid YAML"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_key(tmp_path, text, expected):
    path = write(tmp_path / "bad.yaml", text + "\n")
    with pytest.raises(ConfigError) as err:
        trainer_cmd.resolve_args(parse("trainer", "--config", path))
    assert str(err.value).startswith(path) and expected in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("max_stalenes=2", "did you mean max_staleness"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "did you mean lr?"),
        ("metrics=m.csv", "the flag --metrics sets key metrics_path"),
        ("max_staleness", "write KEY=VALUE"),
        ("group_size=many", "group_size must be an integer"),
    ],
)
def test_a_bad_override_is_refused_with_a_suggestion(override, expected):
    args = parse("trainer", "--run", "r", "--agent", "a", "--model", "tiny")
    args.overrides = [override]  # argparse would take a lone word as an unknown argument
    with pytest.raises(ConfigError) as err:
        trainer_cmd.resolve_args(args)
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize("command", ["trainer", "consumer", "produce", "env serve", "env bridge"])
def test_every_flag_has_a_key_and_every_key_a_flag(command):
    keys = {
        "trainer": trainer_cmd.KEYS,
        "consumer": consumer_cmd.KEYS,
        "produce": produce_cmd.KEYS,
        "env serve": env_cmd.KEYS,
        "env bridge": env_cmd.BRIDGE_KEYS,
    }[command]
    flagged = {
        a.dest: a
        for a in subparser(command)._actions
        if a.option_strings and a.dest not in ("help", "config")
    }
    no_key = sorted(set(flagged) - set(keys.types) - set(keys.keyless))
    assert not no_key, (
        f"flags of `agentarium {command}` with no config key: {no_key}; add a field to the "
        "command's config dataclass (its name is the flag's dest), or list it in keyless with why"
    )
    no_flag = sorted(set(keys.types) - set(flagged) - set(keys.flagless))
    assert not no_flag, (
        f"config keys of `agentarium {command}` with no flag: {no_flag}; add one (dest = key) "
        "or list the key in flagless with why"
    )
    assert not set(keys.flagless) & set(flagged), "a flagless key has a flag after all"
    assert not set(keys.keyless) & set(keys.types), "a keyless flag has a key after all"
    assert all(reason.strip() for reason in {**keys.flagless, **keys.keyless}.values())
    # a flag's default is its key's default, so --help tells the truth about the file too
    for key, action in flagged.items():
        if key in keys.defaults:
            assert str(action.default) == str(keys.defaults[key]), (key, action.default)


def test_the_consumer_takes_a_config_file_and_overrides(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        "agent: toy=agentarium.examples.toy:rollout\nllm: [http://a:1, http://b:2]\nconcurrency: 8\n"
        "ack_wait_s: 90\n",
    )
    args = parse("consumer", "--config", path, "--concurrency", "16", "attempts=5")
    config, source = consumer_cmd.config_from_args(args)
    assert config.llm == ("http://a:1", "http://b:2")
    c = config.consumer
    assert (c.concurrency, c.delivery.attempts, c.ack_wait_s) == (16, 5, 90.0)
    assert config.consumer.worker_id  # a default made per process
    assert source == {
        "config_file": path,
        "set_by": {
            "agent": "file",
            "llm": "file",
            "concurrency": "flag",
            "ack_wait_s": "file",
            "attempts": "override",
        },
    }
    # a flag replaces the file's list rather than adding to it
    config, _ = consumer_cmd.config_from_args(
        parse("consumer", "--config", path, "--llm", "http://c:3")
    )
    assert config.llm == ("http://c:3",)
    with pytest.raises(ConfigError, match="did you mean concurrency"):
        consumer_cmd.config_from_args(parse("consumer", "--config", path, "concurency=4"))


def test_produce_takes_a_config_file_of_job_options(tmp_path):
    """The jobs' options (JobOptions, its Sampling section) are keys like any other: flat."""
    path = write(
        tmp_path / "p.yaml", "agent: toy\nrun: r1\ngroup_size: 8\ntemperature: 0.7\nstop: [END]\n"
    )
    args = parse("produce", "--file", "t.jsonl", "--config", path, "--eval", "max_new_tokens=32")
    command = produce_cmd.command_from_args(args)
    jobs = command.jobs
    assert (command.agent, command.run, jobs.group_size, jobs.is_train) == ("toy", "r1", 8, False)
    assert (jobs.sampling.temperature, jobs.sampling.max_new_tokens) == (0.7, 32)
    assert jobs.sampling.stop == ("END",) and jobs.deadline_s == 600.0
    # the flag's spelling is not the key's: the file says which key it means
    write(tmp_path / "p.yaml", "agent: toy\neval: true\n")
    with pytest.raises(ConfigError, match="the flag --eval sets key is_train"):
        produce_cmd.command_from_args(parse("produce", "--file", "t.jsonl", "--config", path))
    # bounds are the fields': the wire's for Sampling, the settings' for the rest
    with pytest.raises(ValueError, match="--max-new-tokens must be >= 1"):  # the flag given
        produce_cmd.check_produce(parse("produce", "--agent", "toy", "--file", "t.jsonl",
                                        "--max-new-tokens", "0"))  # fmt: skip
    with pytest.raises(ValueError, match="--max-in-flight must be >= 1, got 0"):
        produce_cmd.check_produce(parse("produce", "--agent", "toy", "--file", "t.jsonl",
                                        "--max-in-flight", "0"))  # fmt: skip


async def test_resolved_trainer_config_is_logged_once_and_written_next_to_checkpoints(
    nats_url, tmp_path
):
    path = write(tmp_path / "t.yaml", TRAINER_YAML)
    ckpt = tmp_path / "ckpt"
    args = parse(
        "trainer", "--config", path, "--checkpoint-dir", str(ckpt), "--max-steps", "0",
        "--torch-threads", "1", "lr=1e-4", "--nats-url", nats_url,
    )  # fmt: skip
    with capture_logs() as logs:
        assert await trainer_cmd.train(args, NatsSettings(url=nats_url)) == 0
    events = [e for e in logs if e["event"] == "trainer config"]
    assert len(events) == 1
    event = events[0]
    assert (event["lr"], event["max_staleness"], event["adam_betas"]) == (1e-4, 7, (0.9, 0.95))
    assert event["config_file"] == path
    assert event["set_by"]["lr"] == "override" and event["set_by"]["max_staleness"] == "file"

    written = ckpt / "config.yaml"
    assert written.is_file()
    # the file is a config file the trainer reads back: the same settings, key for key
    again = read_config_file(written, trainer_cmd.KEYS)
    _, _, resolved = trainer_cmd.resolve_args(args)
    assert again == resolved.values
    assert set(again) == set(trainer_cmd.KEYS.types)
    assert yaml.safe_load(written.read_text())["adam_betas"] == [0.9, 0.95]

    # starting again from that file (and --resume) runs the same settings, nothing changed
    rerun = parse(
        "trainer", "--config", str(written), "--resume", "--torch-threads", "1",
        "--nats-url", nats_url,
    )  # fmt: skip
    with capture_logs() as logs:
        assert await trainer_cmd.train(rerun, NatsSettings(url=nats_url)) == 0
    assert not [e for e in logs if e["event"] == "settings changed since the last start"]
    assert read_config_file(written, trainer_cmd.KEYS) == again


async def test_resolved_consumer_config_is_logged_once(nats_url, tmp_path):
    path = write(
        tmp_path / "c.yaml",
        "agent: toy=agentarium.examples.toy:rollout\nllm: http://127.0.0.1:9\nburst: true\n",
    )
    args = parse("consumer", "--config", path, "concurrency=3", "--nats-url", nats_url)
    config, source = consumer_cmd.config_from_args(args)
    with capture_logs() as logs:
        # burst on an empty queue: starts, finds nothing to do, exits
        assert await consumer_cmd.consume(args, config, source) == 0
    events = [e for e in logs if e["event"] == "consumer config"]
    assert len(events) == 1
    event = events[0]
    assert (event["agent"], event["llm"], event["concurrency"]) == (
        "toy=agentarium.examples.toy:rollout",
        ["http://127.0.0.1:9"],
        3,
    )
    assert event["set_by"] == {
        "agent": "file",
        "llm": "file",
        "burst": "file",
        "concurrency": "override",
    }
    assert {k.name for k in settings.keys(ConsumerProcess)} <= set(event)


def test_a_duration_key_may_be_spelled_as_its_flag(tmp_path):
    """--help says a flag's key is its name with _ for -: ``ack_wait`` (the flag --ack-wait)
    sets ack_wait_s, in a file and as an override; both spellings at once are refused."""
    keys = consumer_cmd.KEYS
    from agentarium.config.files import parse_override

    assert parse_override("ack_wait=90", keys) == ("ack_wait_s", 90.0)
    path = write(tmp_path / "c.yaml", "ack_wait: 90\n")
    assert read_config_file(path, keys) == {"ack_wait_s": 90.0}
    both = write(tmp_path / "both.yaml", "ack_wait: 90\nack_wait_s: 60\n")
    with pytest.raises(ConfigError, match="ack_wait_s is set twice"):
        read_config_file(both, keys)

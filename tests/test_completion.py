"""`agentarium completion`: the script a shell sources completes commands, flags and choices."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from agentarium.cli import build_parser, main

COMMANDS = ("broker", "completion", "consumer", "demo", "produce", "trainer", "trajectories")


def script(shell: str, capsys) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def complete(bash_script: str, *words: str) -> list[str]:
    """What bash offers for the last of ``words``, as pressing TAB after them would."""
    line = " ".join(words)
    program = (
        f"{bash_script}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}\n"
        f"_shtab_agentarium agentarium {words[-1]!r} {words[-2]!r}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_flags_and_choices(capsys):
    bash = script("bash", capsys)
    subprocess.run(["bash", "-n"], input=bash, text=True, check=True)  # valid bash
    for command in COMMANDS:
        assert command in bash
    assert complete(bash, "agentarium", "tr") == ["trainer", "trajectories"]
    assert complete(bash, "agentarium", "trainer", "--report") == ["--report-to"]
    assert complete(bash, "agentarium", "trainer", "--loss-agg", "") == [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ]
    assert complete(bash, "agentarium", "broker", "") == ["up", "init", "status", "sweep"]


def test_zsh_script_names_every_command(capsys):
    zsh = script("zsh", capsys)
    assert zsh.startswith("#compdef agentarium")
    for command in COMMANDS:
        assert command in zsh


def test_an_unknown_shell_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["completion", "fish"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fish'" in err and all(s in err for s in ("bash", "zsh", "tcsh"))

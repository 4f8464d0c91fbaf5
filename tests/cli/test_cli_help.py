"""Every ``kvnotes`` subcommand's ``--help`` is plain text (no reStructuredText markup from the
docstrings it shows) with a help line for each flag."""

from __future__ import annotations

import argparse

import pytest

from kvnotes.cli import BENCHES, COMMANDS, main

MARKUP = ("``", ":func:`", ":mod:`", ":class:`", ":data:`", "**")
COMMANDS_WITH_FLAGS = [[c] for c in COMMANDS if c != "run"] + [["bench", b] for b in BENCHES]


@pytest.mark.parametrize("argv", COMMANDS_WITH_FLAGS, ids=" ".join)
def test_help_is_plain_with_a_line_for_every_flag(argv, monkeypatch, capsys):
    flags: list[tuple[str, str | None]] = []
    add = argparse._ActionsContainer.add_argument

    def recording(self, *args, **kwargs):
        action = add(self, *args, **kwargs)
        if action.option_strings and action.dest != "help":
            flags.append(("/".join(action.option_strings), action.help))
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", recording)
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith("usage:")
    assert not [m for m in MARKUP if m in out], out
    assert flags, "no flags recorded"
    missing = [f for f, h in flags if not h or not h.strip()]
    assert not missing, f"flags without a help line: {missing}"

"""kvnotes.records.presentation: which presentation a record gets when its module cannot be imported."""

import sys

from kvnotes.records.presentation import DEFAULT, presentation


def _record(module: str) -> dict:
    return {"probe": "mine", "config": {"probe": {"_target_": f"{module}.run"}}}


def test_a_record_of_a_module_not_installed_here_gets_the_default_quietly(capsys):
    assert presentation(_record("nosuch_project_kvn.probes.mine")) is DEFAULT
    assert capsys.readouterr().err == ""


def test_a_module_that_fails_to_import_gets_the_default_and_says_so(tmp_path, monkeypatch, capsys):
    """A probe module that is here but broken (it imports something missing) used to be shown with
    the default presentation silently."""
    (tmp_path / "broken_probe_kvn.py").write_text("import nosuch_dependency_kvn\nPRESENTATION = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert presentation(_record("broken_probe_kvn")) is DEFAULT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvnotes: warning: broken_probe_kvn") and "nosuch_dependency_kvn" in err
    sys.modules.pop("broken_probe_kvn", None)

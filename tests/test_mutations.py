"""tests/mutations.py, which removes each listed defence in a copy of the repository and runs the
tests that must catch it: the list still fits the source, an entry that no longer does is refused
with one line, and a removal that no named test notices is reported SURVIVED and fails the command."""
from __future__ import annotations

import mutations

SOL = "        if t.fastest_us < t.roofline_us / job.rules.sol_margin:"
SOL_TEST = "tests/test_gates.py::test_speed_of_light_rejects_a_time_under_the_roofline"
OTHER_TEST = "tests/test_gates.py::test_reference_fallback_scores_no_speed_up"


def entry(defence: str, old: str, tests: list[str], file: str = "harness/judging.py", new: str = "        if False:") -> str:
    quoted = ", ".join(f'"{t}"' for t in tests)
    return f"[[mutation]]\ndefence = \"{defence}\"\nfile = \"{file}\"\nold = '''{old}'''\nnew = '''{new}'''\ntests = [{quoted}]\n\n"


def test_every_listed_mutation_still_fits_the_source_and_names_tests_that_exist():
    listed = mutations.load(mutations.LIST)
    mutations.check_texts(listed, mutations.ROOT, mutations.LIST.name)
    mutations.check_tests(listed, mutations.ROOT, mutations.LIST.name)
    assert len({m.defence for m in listed}) == len(listed), "a defence listed twice"


def test_a_stale_entry_is_refused_with_one_line_before_anything_runs(tmp_path, capsys):
    gone, missing_test, twice = tmp_path / "gone.toml", tmp_path / "missing_test.toml", tmp_path / "twice.toml"
    gone.write_text(entry("speed of light", SOL, [SOL_TEST]) + entry("renamed away", "    if roofline_is_met:", [SOL_TEST]))
    missing_test.write_text(entry("speed of light", SOL, [f"{SOL_TEST}_renamed"]))
    twice.write_text(entry("a line found twice", "            return\n", [SOL_TEST]))
    for path, line in [
        (gone, "mutations: gone.toml entry 2 (renamed away): harness/judging.py: its old text is no longer in the file"),
        (missing_test, f"mutations: missing_test.toml entry 1 (speed of light): no test {SOL_TEST}_renamed"),
        (twice, "mutations: twice.toml entry 1 (a line found twice): harness/judging.py: its old text is in the file"),
    ]:
        assert mutations.main(["--list", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(line) and err.count("\n") == 1, err


def test_a_removal_no_named_test_notices_survives_and_fails_the_command(tmp_path, capsys):
    """The same removal twice: named with the test that covers it, caught; named with one that
    does not, SURVIVED. Each in a copy: the checkout's file is left as it was."""
    judging = (mutations.ROOT / "harness" / "judging.py").read_text()
    listed = tmp_path / "two.toml"
    listed.write_text(entry("speed of light, its test", SOL, [SOL_TEST])
                      + entry("speed of light, another test", SOL, [OTHER_TEST]))
    assert mutations.main(["--list", str(listed), "--jobs", "2"]) == 1
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("| speed of light")]
    assert len(rows) == 2, out
    caught, survived = rows
    assert caught.startswith("| speed of light, its test | harness/judging.py:")
    assert f"| `{SOL_TEST}` |" in caught and caught.rsplit("|", 2)[1].strip()  # what the test said
    assert "`if False:`" in caught and "| **SURVIVED** |" in survived
    assert "1 of 2 removals caught; 1 not: the command fails" in out
    assert "caught: speed of light, its test" in err and "SURVIVED: speed of light, another test" in err
    assert (mutations.ROOT / "harness" / "judging.py").read_text() == judging

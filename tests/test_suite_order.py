"""The suite's own scheduling (tests/conftest.py): the files expected to take longest are handed to the
xdist workers first, so no long end-to-end file starts last while the other worker has nothing to do."""

from pathlib import Path

import conftest
import pytest


class _Item:
    def __init__(self, file, name, *markers):
        self.path, self.name, self.originalname = Path("tests") / file, name, name.split("[")[0]
        self.markers = set(markers)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_the_longest_files_go_first_and_each_file_keeps_its_order(monkeypatch):
    monkeypatch.setattr(conftest, "RUNS_LONG_S", {"test_b.py::test_long": 90.0, "test_c.py::test_p": 60.0})
    items = [
        _Item("test_a.py", "test_1"),
        _Item("test_a.py", "test_2"),
        *[_Item("test_a.py", f"test_x{i}") for i in range(30)],  # many short tests: 6.4 s in all
        _Item("test_b.py", "test_short"),
        _Item("test_b.py", "test_long"),  # 90 s, measured
        _Item("test_c.py", "test_p[1]"),  # 60 s shared by its two parametrizations
        _Item("test_c.py", "test_p[2]"),
        _Item("test_d.py", "test_launch", "procs"),  # unmeasured, starts processes: a guess of 30 s
        _Item("test_d.py", "test_small"),
    ]
    conftest._longest_files_first(items)
    files = list(dict.fromkeys(i.path.name for i in items))
    assert files == ["test_b.py", "test_c.py", "test_d.py", "test_a.py"]
    assert [i.name for i in items if i.path.name == "test_b.py"] == ["test_short", "test_long"]
    assert [i.name for i in items if i.path.name == "test_a.py"][:2] == ["test_1", "test_2"]


@pytest.mark.parametrize("target", ["test", "test-quick"])
def test_make_keeps_the_collected_order_of_files(target):
    # without --no-loadscope-reorder xdist re-sorts files by their number of tests, long files last
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    assert "--dist loadfile --no-loadscope-reorder" in recipe

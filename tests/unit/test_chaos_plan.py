"""tools/chaos.py's plan: the default drill's 20 kills cover every point, each group's kills go to its successive
starts and leave it time to come back, checkpoint kills land on checkpoint steps of the group that writes them,
and the plan reads back as base/faults.py's faults. (The drill itself runs for minutes: docs/PERFORMANCE.md.)"""

import pytest

from disttrain_core.base import faults

from ..conftest import REPO


@pytest.fixture
def chaos(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import chaos

    return chaos


def test_the_default_plan(chaos):
    planned = chaos.plan(dict(chaos.OPTIONS))
    assert len(planned) == 20
    assert {k["point"] for k in planned} == {"step", "forward", "backward", "allreduce", "save"}
    for group in range(4):
        mine = [k for k in planned if k["group"] == group]
        assert [k["start"] for k in mine] == list(range(len(mine))) == list(range(5))
        gaps = [b["step"] - a["step"] for a, b in zip(mine, mine[1:], strict=False)]
        assert min(gaps) >= 28, f"group {group} is killed again {min(gaps)} steps after its last kill"
    saves = [k for k in planned if k["point"] == "save"]
    assert saves and all(k["group"] == 0 and k["step"] % 10 == 0 for k in saves)
    assert all(10 <= k["step"] <= 180 for k in planned)
    parsed = faults.parse(chaos.fault_text(planned))
    assert [(f.kind, f.point, f.rank, f.step, f.restart) for f in parsed] == [
        ("kill", k["point"], k["group"], k["step"], k["start"]) for k in planned
    ]


def test_too_many_kills_for_the_steps_is_one_line(chaos):
    from disttrain_core.validation import ConfigError

    with pytest.raises(ConfigError, match="kills=50 do not fit in steps=40"):
        chaos.plan({**chaos.OPTIONS, "steps": "40", "kills": "50"})

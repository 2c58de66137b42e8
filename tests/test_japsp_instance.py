"""JAPSP instances: the JSON form, its errors, and the benchmark generator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance, generate
from adaptipe.serial import load_json_file


def _data() -> dict[str, Any]:
    return {
        "stages": 2,
        "jobs": [
            {"name": "a", "forward": [1, 2], "backward": [2, 4]},
            {
                "name": "b",
                "forward": [1.5, 1],
                "backward": [3, 2],
                "comm": [0.5, 0],
                "switch": [0.1, 0.2],
                "update": [0.3, 0.3],
                "recompute": [1, 1],
            },
        ],
    }


def test_json_round_trip_keeps_every_field() -> None:
    inst = JapspInstance.from_json(_data(), source="x.json")
    assert inst.num_jobs == 2 and inst.num_stages == 2
    assert inst.names == ("a", "b")
    assert inst.comm[0] == (0.0, 0.0) and inst.comm[1] == (0.5, 0.0)
    again = JapspInstance.from_json(json.loads(json.dumps(inst.to_json())))
    assert again == inst
    assert "comm" not in inst.to_json()["jobs"][0]  # all-zero optional fields are omitted


def test_comm_may_omit_the_unused_last_entry() -> None:
    data = _data()
    data["jobs"][1]["comm"] = [0.5]
    assert JapspInstance.from_json(data).comm[1] == (0.5, 0.0)


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = _data()
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


class _Delete:
    """Marks a field to remove; its repr keeps test ids the same in every process (xdist)."""

    def __repr__(self) -> str:
        return "<delete>"


_DELETE = _Delete()

BAD = [
    # (path, value, words every message must contain)
    (("stages",), _DELETE, ["stages", "missing"]),
    (("stages",), 0, ["stages", ">= 1"]),
    (("stages",), "2", ["stages", "integer"]),
    (("jobs",), [], ["jobs", "non-empty"]),
    (("jobs",), "many", ["jobs", "non-empty"]),
    (("jobs", 1), 7, ["jobs[1]", "object"]),
    (("jobs", 1, "forward"), _DELETE, ["jobs[1]", "'b'", "forward", "missing"]),
    (("jobs", 1, "backward"), [3], ["jobs[1]", "'b'", "backward", "2 entries", "got 1"]),
    (("jobs", 1, "forward"), [1, -1], ["jobs[1]", "'b'", "forward[1]", ">= 0", "-1"]),
    (("jobs", 1, "update"), [1, math.inf], ["jobs[1]", "'b'", "update[1]", "finite"]),
    (("jobs", 1, "switch"), [1, math.nan], ["jobs[1]", "'b'", "switch[1]", "finite"]),
    (("jobs", 1, "recompute"), [1, "x"], ["jobs[1]", "'b'", "recompute[1]", "number"]),
    (("jobs", 1, "comm"), 3, ["jobs[1]", "'b'", "comm", "list"]),
    (("jobs", 1, "name"), "a", ["jobs[1]", "'a'", "duplicates jobs[0]"]),
    (("jobs", 1, "name"), "", ["jobs[1].name", "non-empty"]),
    (("jobs", 1, "speed"), 1, ["jobs[1]", "'b'", "unknown field 'speed'"]),
    (("stage",), 2, ["unknown field 'stage'", "allowed: stages, jobs"]),
]


@pytest.mark.parametrize(
    ("path", "value", "words"), BAD, ids=[f"{p}-{v!r}"[:40] for p, v, _ in BAD]
)
def test_bad_input_names_file_job_and_field(
    tmp_path: Path, path: tuple[Any, ...], value: Any, words: list[str]
) -> None:
    file = tmp_path / "array.json"
    file.write_text(json.dumps(_set(path, value)))
    with pytest.raises(PlanError) as info:
        load_json_file(file, JapspInstance.from_json)
    message = str(info.value)
    assert message.startswith(f"{file}: "), message
    for word in words:
        assert word in message, (word, message)


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(PlanError, match=r"x\.json: top level must be an object"):
        JapspInstance.from_json([1, 2], source="x.json")


def test_build_without_jobs_says_so() -> None:
    with pytest.raises(PlanError, match="jobs must be a non-empty list"):
        JapspInstance.build([], [])


def test_build_checks_its_tables_too() -> None:
    with pytest.raises(PlanError, match=r"jobs\[0\] \('job0'\): backward\[1\] must be >= 0"):
        JapspInstance.build([[1.0, 1.0]], [[1.0, -2.0]])


def test_generator_is_deterministic_for_a_seed() -> None:
    assert generate(8, 4, seed=3) == generate(8, 4, seed=3)
    assert generate(8, 4, seed=3) != generate(8, 4, seed=4)


def test_generator_backward_is_about_twice_forward() -> None:
    inst = generate(40, 6, seed=1)
    ratios = [
        b / f
        for fs, bs in zip(inst.forward, inst.backward, strict=True)
        for f, b in zip(fs, bs, strict=True)
    ]
    assert all(1.6 <= r <= 2.4 for r in ratios)
    assert 1.9 <= sum(ratios) / len(ratios) <= 2.1


def test_generator_draws_jobs_from_a_few_profiles() -> None:
    inst = generate(30, 4, seed=2, profiles=3, jitter=0.0)
    assert len(set(inst.forward)) <= 3  # without jitter, jobs of one profile are identical
    assert len({name.split("-")[1] for name in inst.names}) <= 3
    assert len(set(inst.names)) == 30
    jittered = generate(30, 4, seed=2, profiles=3)
    for a, b in zip(inst.forward, jittered.forward, strict=True):
        assert all(abs(x - y) <= 0.03 * x + 1 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", range(5))
def test_generator_without_jitter_makes_jobs_of_one_batch_size_identical(seed: int) -> None:
    inst = generate(12, 4, seed=seed, jitter=0.0, comm=0.1, switch=0.05)
    by_size: dict[str, set[tuple[Any, ...]]] = {}
    for j, name in enumerate(inst.names):
        costs = (inst.forward[j], inst.backward[j], inst.comm[j], inst.switch[j])
        by_size.setdefault(name.split("-")[1], set()).add(costs)
    assert all(len(costs) == 1 for costs in by_size.values())  # the paper's workload


def test_generator_jitter_keeps_the_batch_sizes_and_perturbs_each_job() -> None:
    plain = generate(12, 4, seed=7, jitter=0.0)
    jittered = generate(12, 4, seed=7, jitter=0.02)
    assert plain.names == jittered.names  # the same profiles whatever the jitter
    assert len(set(jittered.forward)) > len(set(plain.forward))  # only nearly identical
    for a, b in zip(plain.backward, jittered.backward, strict=True):
        assert all(abs(x - y) <= 0.05 * x + 1 for x, y in zip(a, b, strict=True))


def test_generator_optional_costs_are_fractions_of_forward() -> None:
    inst = generate(5, 3, seed=0, comm=0.1, switch=0.05, update=0.2, recompute=0.5)
    for j in range(5):
        f = inst.forward[j]
        assert inst.comm[j][-1] == 0.0
        assert all(abs(c - 0.1 * x) <= 0.5 for c, x in zip(inst.comm[j][:-1], f[:-1], strict=True))
        assert all(abs(u - 0.2 * x) <= 0.5 for u, x in zip(inst.update[j], f, strict=True))
        assert all(abs(r - 0.5 * x) <= 0.5 for r, x in zip(inst.recompute[j], f, strict=True))
        assert all(abs(w - 0.05 * x) <= 0.5 for w, x in zip(inst.switch[j], f, strict=True))
    assert JapspInstance.from_json(inst.to_json()) == inst

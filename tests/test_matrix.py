"""Matrix expansion: GitHub's documented examples, include-only and exclude-all."""

from __future__ import annotations

from typing import Any

import pytest

from preloop.workflow.matrix import (
    MatrixError,
    expand_legs,
    expand_matrix,
    leg_suffix,
    matrix_from_data,
)


def expand(data: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    return expand_matrix(matrix_from_data(data), **kw)


def test_product_first_vector_slowest() -> None:
    assert expand({"os": ["ubuntu", "windows"], "version": [10, 12, 14]}) == [
        {"os": "ubuntu", "version": 10},
        {"os": "ubuntu", "version": 12},
        {"os": "ubuntu", "version": 14},
        {"os": "windows", "version": 10},
        {"os": "windows", "version": 12},
        {"os": "windows", "version": 14},
    ]


def test_docs_example_expanding_configurations() -> None:
    # docs: "Example: Expanding configurations" (fruit / animal / include).
    legs = expand(
        {
            "fruit": ["apple", "pear"],
            "animal": ["cat", "dog"],
            "include": [
                {"color": "green"},
                {"color": "pink", "animal": "cat"},
                {"fruit": "apple", "shape": "circle"},
                {"fruit": "banana"},
                {"fruit": "banana", "animal": "cat"},
            ],
        }
    )
    assert legs == [
        {"fruit": "apple", "animal": "cat", "color": "pink", "shape": "circle"},
        {"fruit": "apple", "animal": "dog", "color": "green", "shape": "circle"},
        {"fruit": "pear", "animal": "cat", "color": "pink"},
        {"fruit": "pear", "animal": "dog", "color": "green"},
        {"fruit": "banana"},
        {"fruit": "banana", "animal": "cat"},
    ]


def test_docs_example_adding_configurations() -> None:
    # docs: "Example: Adding configurations" (os / node, include a new combination).
    legs = expand(
        {
            "os": ["windows-latest", "ubuntu-latest"],
            "node": [14, 16],
            "include": [{"os": "windows-latest", "node": 16, "npm": 6}],
        }
    )
    assert legs == [
        {"os": "windows-latest", "node": 14},
        {"os": "windows-latest", "node": 16, "npm": 6},
        {"os": "ubuntu-latest", "node": 14},
        {"os": "ubuntu-latest", "node": 16},
    ]


def test_docs_example_excluding() -> None:
    # docs: "Excluding matrix configurations": partial matches.
    legs = expand(
        {
            "os": ["macos-latest", "windows-latest"],
            "version": [12, 14, 16],
            "environment": ["staging", "production"],
            "exclude": [
                {"os": "macos-latest", "version": 12, "environment": "production"},
                {"os": "windows-latest", "version": 16},
            ],
        }
    )
    assert len(legs) == 12 - 1 - 2
    assert {"os": "windows-latest", "version": 16, "environment": "staging"} not in legs


def test_include_only_matrix() -> None:
    legs = expand({"include": [{"site": "prod", "url": "a"}, {"site": "dev"}]})
    assert legs == [{"site": "prod", "url": "a"}, {"site": "dev"}]


def test_exclude_then_include() -> None:
    # Include runs after exclude: an excluded combination can be added back.
    legs = expand(
        {
            "os": ["a", "b"],
            "exclude": [{"os": "b"}],
            "include": [{"os": "b", "extra": 1}],
        }
    )
    assert legs == [{"os": "a"}, {"os": "b", "extra": 1}]


def test_exclude_all() -> None:
    data = {"os": ["a", "b"], "exclude": [{"os": "a"}, {"os": "b"}]}
    with pytest.raises(MatrixError, match="no combinations left"):
        expand(data)
    assert expand(data, allow_empty=True) == []


def test_exclude_all_then_include_only() -> None:
    legs = expand({"os": ["a"], "exclude": [{"os": "a"}], "include": [{"os": "z"}]})
    assert legs == [{"os": "z"}]


def test_object_values_match_whole() -> None:
    legs = expand(
        {
            "cfg": [{"cc": "gcc", "v": 12}, {"cc": "clang", "v": 17}],
            "exclude": [{"cfg": {"cc": "gcc", "v": 12}}],
        }
    )
    assert legs == [{"cfg": {"cc": "clang", "v": 17}}]


# GitHub's MatrixFilter turns each leaf of an include/exclude entry into an
# expression, `matrix['cfg']['node'] == 12`, so its `==` decides: numbers and
# strings coerce, strings compare ignoring case, mappings match leaf by leaf.
@pytest.mark.parametrize(
    ("vector", "entry", "left"),
    [
        # YAML's `py: 3.10` is the number 3.1; `matrix['py'] == 3.1` holds for '3.10'
        (["3.9", "3.10"], 3.1, ["3.9"]),
        ([3.9, 3.1], "3.10", [3.9]),
        (["1", "2"], 1, ["2"]),
        (["ubuntu-latest", "windows-latest"], "Ubuntu-Latest", ["windows-latest"]),
        # 'true' is NaN as a number, so it is not the boolean true
        ([True, "TRUE", "x"], "true", [True, "x"]),
        ([0, 1, "0"], False, [1]),
        ([{"node": 12, "npm": 6}, {"node": 14}], {"node": 12}, [{"node": 14}]),
        ([{"Node": "A"}, {"node": "b"}], {"node": "a"}, [{"node": "b"}]),
        ([["x", "y"], ["x"]], ["X", "y"], [["x"]]),
        ([{"a": 1}, "s"], {}, []),  # no leaves, no constraint: every leg goes
    ],
)
def test_exclude_compares_with_the_expression_equality(
    vector: list[Any], entry: Any, left: list[Any]
) -> None:
    legs = expand({"v": vector, "exclude": [{"v": entry}]}, allow_empty=True)
    assert [leg["v"] for leg in legs] == left


def test_include_matches_with_the_expression_equality() -> None:
    legs = expand(
        {
            "os": ["ubuntu-latest"],
            "py": ["3.10"],
            "cfg": [{"node": 12, "npm": 6}],
            "include": [{"os": "Ubuntu-Latest", "py": 3.1, "cfg": {"node": "12"}, "x": 1}],
        }
    )
    assert legs == [{"os": "ubuntu-latest", "py": "3.10", "cfg": {"node": 12, "npm": 6}, "x": 1}]


def test_unmatched_include_lists_its_vector_keys_first() -> None:
    # GetUnmatchedVectors: the entry's filter (vector keys, in the entry's
    # order), then its other keys; both the name and `matrix` follow it.
    data = {
        "os": ["ubuntu"],
        "py": ["3.12"],
        "include": [{"label": "arm", "py": "3.13", "extra": 1, "os": "macos"}],
    }
    new = expand_legs(matrix_from_data(data))[1]
    assert list(new.values) == ["py", "os", "label", "extra"]
    assert "b" + leg_suffix(new.named) == "b (3.13, macos, arm, 1)"


@pytest.mark.parametrize(
    ("data", "where", "message"),
    [
        ({"os": []}, ("vector", "os"), "matrix vector 'os' has no values"),
        ({"os": ["a"], "exclude": [{"os": "b"}, {"oss": "a"}]}, ("exclude", 1), "key 'oss'"),
        ({"os": ["a"], "exclude": [{}]}, ("exclude", 0), "must not be empty"),
        ({"x": list(range(16)), "y": list(range(17))}, ("matrix",), "272 legs"),
        ({}, ("matrix",), "at least one vector"),
    ],
)
def test_errors(data: dict[str, Any], where: tuple[Any, ...], message: str) -> None:
    with pytest.raises(MatrixError, match=message) as info:
        expand(data)
    assert info.value.where == where


@pytest.mark.parametrize(
    "data",
    ["linux", {"os": "linux"}, {"include": [1]}, {"exclude": {"os": "a"}}],
)
def test_invalid_data(data: Any) -> None:
    with pytest.raises(MatrixError):
        matrix_from_data(data)


def test_exactly_256_legs_is_allowed() -> None:
    assert len(expand({"x": list(range(16)), "y": list(range(16))})) == 256


def test_leg_suffix() -> None:
    """GitHub's JobNameBuilder: scalars depth first, objects and lists
    flattened, nulls and empty strings left out."""
    assert leg_suffix({"os": "linux", "py": 3.1, "ok": True, "cfg": {"a": 1}}) == (
        " (linux, 3.1, true, 1)"
    )
    assert leg_suffix({"a": None, "b": "", "c": [["x", {"k": False}], 0]}) == " (x, false, 0)"
    assert leg_suffix({"a": None, "b": ""}) == ""

"""The object graph: tags, argument forms, sharing and building."""

from __future__ import annotations

import functools
import operator

import pytest

from forge.config import ConfigError, load_config, parse_config


def config_of(config_project, text: str):
    return load_config(config_project(text), "train")


def test_argument_forms(config_project):
    config = config_of(
        config_project,
        """\
        positional: !singleton:./helpers.py:collect [1, two]
        keywords: !singleton:./helpers.py:collect {a: 1, b: 2}
        both: !singleton:./helpers.py:collect
          _args: [1, 2]
          c: 3
        empty: !singleton:./helpers.py:collect
        one: !singleton:./helpers.py:collect 5
        quoted: !singleton:./helpers.py:collect '5'
        """,
    )
    assert config.check() == []
    built = config.build(config.public_targets)
    assert built["positional"] == ((1, "two"), {})
    assert built["keywords"] == ((), {"a": 1, "b": 2})
    assert built["both"] == ((1, 2), {"c": 3})
    assert built["empty"] == ((), {})
    assert built["one"] == ((5,), {})
    assert built["quoted"] == (("5",), {})


def test_call_tags(config_project):
    config = config_of(
        config_project,
        """\
        single: !singleton:math:sqrt 16
        called: !call:operator:add [1, 2]
        factory: !factory:operator:mul [3, 4]
        partial: !partial:operator:add [10]
        builtin: !call:builtins:dict {a: 1}
        bare_builtin: !call:tuple [[1, 2]]
        """,
    )
    built = config.build(["single", "called", "factory", "partial", "builtin", "bare_builtin"])
    assert built["single"] == 4.0
    assert built["called"] == 3
    assert built["factory"] == 12
    assert isinstance(built["partial"], functools.partial)
    assert built["partial"].func is operator.add and built["partial"](5) == 15
    assert built["builtin"] == {"a": 1}
    assert built["bare_builtin"] == (1, 2)


def test_dunder_attributes_are_refused(config_project):
    config = config_of(config_project, "nested: !call:./helpers.py:Thing.__init__\n")
    (problem,) = config.check()
    assert problem.key_path == "nested" and "dunder" in problem.message


def test_attribute_chain_and_project_file(make_project):
    project = make_project(
        {
            "models.py": "class Outer:\n    class Inner:\n        def __init__(self, x):\n            self.x = x\n",
            "templates/configs/train.yaml": "obj: !singleton:./models.py:Outer.Inner {x: 3}\n",
        }
    )
    config = load_config(project, "train")
    obj = config.build("obj")
    assert type(obj).__qualname__ == "Outer.Inner" and obj.x == 3


def test_containers_and_untagged_values(config_project):
    config = config_of(
        config_project,
        """\
        lst: !list [1, 2]
        tup: !tuple [1, [2, 3]]
        dct: !dict {a: 1}
        named: !list:@layers [a]
        plain_map: {a: [1, 2], b: {c: null}}
        plain_seq: [1, 2.5, x, true]
        scalar: 7
        lr: 1e-3
        """,
    )
    built = config.build(config.public_targets)
    assert built["lst"] == [1, 2]
    assert built["tup"] == (1, [2, 3])
    assert built["dct"] == {"a": 1}
    assert built["named"] == ["a"]
    assert built["plain_map"] == {"a": [1, 2], "b": {"c": None}}
    assert built["plain_seq"] == [1, 2.5, "x", True]
    assert built["scalar"] == 7
    assert built["lr"] == 0.001
    assert "named: list@layers" in config.describe_graph()


def test_singleton_shared_by_three_aliases(config_project):
    config = config_of(
        config_project,
        """\
        .thing: &thing !singleton:./helpers.py:Thing {size: 1}
        a: *thing
        b: !singleton:./helpers.py:Pair [*thing, *thing]
        """,
    )
    built = config.build(["a", "b"])
    assert built["a"] is built["b"].left is built["b"].right


def test_factory_gives_a_new_object_at_each_place(config_project):
    config = config_of(
        config_project,
        """\
        .thing: &thing !factory:./helpers.py:Thing {size: 1}
        a: *thing
        b: !singleton:./helpers.py:Pair [*thing, *thing]
        """,
    )
    built = config.build(["a", "b"])
    objects = [built["a"], built["b"].left, built["b"].right]
    assert len({id(o) for o in objects}) == 3
    assert all(o.size == 1 for o in objects)


def test_containers_are_shared_by_aliases(config_project):
    config = config_of(
        config_project,
        """\
        .items: &items [1, 2]
        a: *items
        b: *items
        """,
    )
    built = config.build(["a", "b"])
    assert built["a"] is built["b"]


def test_each_build_gives_fresh_objects(config_project):
    config = config_of(config_project, "a: !singleton:./helpers.py:Thing {size: 1}\n")
    first, second = config.build("a"), config.build("a")
    assert first is not second
    assert type(first) is type(second)


def test_hidden_keys_are_targets_but_not_public(config_project):
    config = config_of(
        config_project,
        """\
        .defaults: &defaults {size: 2}
        thing: !singleton:./helpers.py:Thing
          <<: *defaults
        """,
    )
    assert list(config.targets) == [".defaults", "thing"]
    assert config.public_targets == ["thing"]
    assert config.build("thing").size == 2
    assert config.build(".defaults") == {"size": 2}


def test_merge_keys_later_keys_win(config_project):
    config = config_of(
        config_project,
        """\
        .base: &base {size: 1, name: base}
        thing: !singleton:./helpers.py:Thing
          <<: *base
          name: mine
          size: 2
          size: 3
        """,
    )
    thing = config.build("thing")
    assert (thing.size, thing.name) == (3, "mine")


def test_var_with_and_without_default(config_project):
    config = config_of(
        config_project,
        """\
        a: !var run_dir
        b: !var {name: rank, default: 0}
        c: !singleton:./helpers.py:Thing {size: !var size}
        """,
    )
    assert config.variables_used() == {"run_dir", "rank", "size"}
    built = config.build(["a", "b"], variables={"run_dir": "/r"})
    assert built == {"a": "/r", "b": 0}
    assert config.build("b", variables={"rank": 3}) == 3
    with pytest.raises(ConfigError) as info:
        config.build("c")
    (problem,) = info.value.problems
    assert problem.key_path == "c.size"
    assert "!var size has no value" in problem.message
    assert problem.line == 3


def test_unknown_target_suggests(config_project):
    config = config_of(config_project, "model: 1\noptimizer: 2\n")
    with pytest.raises(ConfigError) as info:
        config.build("modle")
    (problem,) = info.value.problems
    assert problem.key_path == "modle"
    assert "did you mean 'model'" in problem.message


def test_build_list_returns_dict(config_project):
    config = config_of(config_project, "a: 1\nb: 2\n")
    assert config.build(["b", "a"]) == {"b": 2, "a": 1}


def test_describe_graph(config_project):
    config = config_of(
        config_project,
        """\
        .t: &t !singleton:./helpers.py:Thing@small {size: 1}
        pair: !singleton:./helpers.py:Pair
          - *t
          - !singleton:math:nothing
        run: !var {name: run_dir, default: out}
        """,
    )
    graph = config.describe_graph()
    assert ".t: singleton ./helpers.py:Thing@small -> <class '" in graph
    assert "train.yaml:1" in graph
    assert "    0: *.t (shared)" not in graph  # children are indented one level
    assert "  0: *.t (shared)" in graph
    assert "1: singleton math:nothing -> unresolved: 'math' has no attribute 'nothing'" in graph
    assert "run: var run_dir (default: 'out')" in graph


def test_parse_config_locates_by_its_own_lines():
    config = parse_config("a: 1\nb: !singleton:math:nope\n", origin="run/config.yaml")
    (problem,) = config.check()
    assert (problem.file, problem.line, problem.key_path) == ("run/config.yaml", 2, "b")
    assert config.chain == []
    assert config.text == "a: 1\nb: !singleton:math:nope\n"


def test_self_reference_is_reported_at_build(config_project):
    config = config_of(config_project, "a: &a !singleton:./helpers.py:Pair [1, *a]\n")
    assert config.check() == []
    with pytest.raises(ConfigError, match="a depends on itself"):
        config.build("a")


def test_describe_graph_marks_factory_aliases(config_project):
    config = config_of(
        config_project,
        """\
        .f: &f !factory:./helpers.py:Thing {size: 1}
        pair: !singleton:./helpers.py:Pair [*f, *f]
        run: !var {name: out, default: !singleton:./helpers.py:Thing {size: 2}}
        """,
    )
    graph = config.describe_graph().splitlines()
    assert any(line.startswith("  0: *.f (a new object here)  [") for line in graph)
    assert graph[-3].startswith("run: var out  [")
    assert graph[-2].startswith("  default: singleton ./helpers.py:Thing -> <class '")

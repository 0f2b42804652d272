"""Pins ``unirl_lightning.envs.spec``: the class-path resolver, its error messages, and picklable specs."""

from __future__ import annotations

import pickle
import re
import textwrap

import pytest

from unirl_lightning.envs import (
    CalculatorEnv,
    Environment,
    EnvSpec,
    GuessingGameEnv,
    StepResult,
    import_environment_class,
    resolve_environment,
)


class ModuleLevelEnv(Environment):
    def __init__(self, max_turns: int = 2, target: str = "7") -> None:
        super().__init__(max_turns)
        self.target = target

    def on_reset(self, record):
        return record["prompt"]

    def on_step(self, assistant_text):
        return StepResult(None, float(assistant_text == self.target), done=True)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's package on the path: ``my_envs`` (good and bad classes) and ``my_broken_envs`` (fails on import)."""
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            from unirl_lightning.envs import Environment, StepResult

            class ReverseEnv(Environment):
                def __init__(self, max_turns: int = 2, word: str = "abc") -> None:
                    super().__init__(max_turns)
                    if not word:
                        raise ValueError("word must not be empty")
                    self.word = word

                def on_reset(self, record):
                    return record["prompt"]

                def on_step(self, assistant_text):
                    return StepResult(None, float(assistant_text == self.word[::-1]), done=True)

                class Nested(Environment):
                    def on_reset(self, record):
                        return "nested"

            class NotAnEnv:
                pass

            NOT_A_CLASS = 3
            """
        )
    )
    (tmp_path / "my_broken_envs.py").write_text("import a_dependency_that_is_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_a_good_class_path_resolves_to_a_spec_whose_build_makes_independent_environments(user_module):
    spec = resolve_environment("my_envs:ReverseEnv", {"word": "xyz"})
    assert spec == EnvSpec("my_envs:ReverseEnv", {"word": "xyz"})
    first, second = spec.build(), spec.build()
    assert type(first).__name__ == "ReverseEnv" and first is not second and first.word == "xyz"
    first.reset({"prompt": "reverse xyz"})
    assert first.step("zyx").reward == 1.0 and not second.done


@pytest.mark.parametrize(
    "value",
    [
        "my_envs.ReverseEnv",
        {"class_path": "my_envs:ReverseEnv"},
        {"class_path": "my_envs.ReverseEnv", "init_args": {"max_turns": 3}},
        {"class_path": "my_envs:ReverseEnv", "init_args": None},
        EnvSpec("my_envs:ReverseEnv"),
    ],
)
def test_dotted_paths_yaml_mappings_and_specs_all_resolve(user_module, value):
    spec = resolve_environment(value)
    assert spec.environment_class().__name__ == "ReverseEnv"


def test_a_nested_class_resolves_by_its_qualified_name(user_module):
    assert (
        resolve_environment("my_envs:ReverseEnv.Nested").environment_class().__qualname__
        == "ReverseEnv.Nested"
    )
    assert resolve_environment("my_envs.ReverseEnv.Nested").class_path == "my_envs.ReverseEnv.Nested"


def test_builtin_environments_resolve_from_the_package_path():
    spec = resolve_environment("unirl_lightning.envs.GuessingGameEnv", {"max_turns": 4, "syntax": "compact"})
    assert isinstance(spec.build(), GuessingGameEnv)
    assert isinstance(resolve_environment("unirl_lightning.envs:CalculatorEnv").build(), CalculatorEnv)


def test_a_class_resolves_to_its_module_path():
    spec = resolve_environment(ModuleLevelEnv, {"target": "9"})
    assert spec == EnvSpec(f"{__name__}:ModuleLevelEnv", {"target": "9"})
    assert spec.build().target == "9"


def test_a_missing_module_names_the_key_the_path_and_what_was_expected():
    with pytest.raises(ImportError) as caught:
        resolve_environment("no_such_pkg.envs:MyEnv", key="model.env")
    assert str(caught.value) == (
        "model.env='no_such_pkg.envs:MyEnv': no module named 'no_such_pkg.envs'; expected "
        "'package.module:ClassName' (or 'package.module.ClassName') importable on the driver and on every "
        "rollout worker (installed, or on PYTHONPATH)."
    )


def test_a_module_that_fails_to_import_reports_its_own_missing_dependency(user_module):
    with pytest.raises(
        ImportError,
        match="env='my_broken_envs:Env': importing module 'my_broken_envs' failed: No "
        "module named 'a_dependency_that_is_not_installed_xyz'",
    ):
        resolve_environment("my_broken_envs:Env")


def test_a_missing_attribute_is_named(user_module):
    with pytest.raises(
        ImportError, match="env='my_envs:Missing': module 'my_envs' has no attribute 'Missing'"
    ):
        resolve_environment("my_envs:Missing")


def test_a_class_that_is_not_an_environment_is_rejected_naming_the_path_and_the_base_class(user_module):
    with pytest.raises(TypeError) as caught:
        resolve_environment("my_envs:NotAnEnv", key="env")
    assert str(caught.value) == (
        "env='my_envs:NotAnEnv' resolves to class my_envs.NotAnEnv, which is not a subclass of "
        "unirl_lightning.envs.Environment; subclass Environment and implement on_reset(record) and "
        "on_step(assistant_text)."
    )


def test_an_attribute_that_is_not_a_class_is_rejected(user_module):
    with pytest.raises(TypeError, match="env='my_envs:NOT_A_CLASS' resolves to 3, which is not a class"):
        resolve_environment("my_envs:NOT_A_CLASS")


@pytest.mark.parametrize(
    "path", ["", "ReverseEnv", "my_envs:", ":ReverseEnv", "my_envs..ReverseEnv", "a:b..c"]
)
def test_a_malformed_path_is_rejected_with_the_expected_forms(path):
    with pytest.raises(
        ValueError, match=re.escape(f"env={path!r} is not a class path; expected 'package.module:")
    ):
        resolve_environment(path)


def test_init_args_the_constructor_does_not_take_are_rejected_listing_its_parameters(user_module):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "env='my_envs:ReverseEnv': init_args ['colour'] do not fit ReverseEnv(max_turns, word): got an unexpected "
            "keyword argument 'colour'"
        ),
    ):
        resolve_environment("my_envs:ReverseEnv", {"colour": "red"})


def test_init_args_the_constructor_refuses_are_reported_at_parse_time(user_module):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "env='my_envs:ReverseEnv': ReverseEnv(**{'word': ''}) raised ValueError: word must not be empty"
        ),
    ):
        resolve_environment("my_envs:ReverseEnv", {"word": ""})
    with pytest.raises(ValueError, match="CalculatorEnv\\(\\*\\*\\{'syntax': 'json'\\}\\) raised ValueError"):
        resolve_environment("unirl_lightning.envs:CalculatorEnv", {"syntax": "json"})


def test_unpicklable_init_args_are_rejected_because_the_spec_ships_to_workers(user_module):
    class Local:
        pass

    with pytest.raises(ValueError, match="do not pickle .*use plain data"):
        resolve_environment("my_envs:ReverseEnv", {"word": Local()})


@pytest.mark.parametrize(
    "value, error, message",
    [
        ({"init_args": {}}, ValueError, "class_path is missing"),
        ({"class_path": "my_envs:ReverseEnv", "args": {}}, ValueError, "unknown keys \\['args'\\]"),
        (
            {"class_path": "my_envs:ReverseEnv", "init_args": [1]},
            ValueError,
            "env.init_args=\\[1\\] is invalid",
        ),
        (42, TypeError, "env=42 is invalid; expected a class path"),
        (dict, TypeError, "class builtins.dict is not a subclass of unirl_lightning.envs.Environment"),
        (
            GuessingGameEnv(),
            TypeError,
            "got an Environment instance .*the worker builds one environment per episode",
        ),
    ],
)
def test_other_config_values_are_rejected_saying_what_was_expected(user_module, value, error, message):
    with pytest.raises(error, match=message):
        resolve_environment(value)


def test_a_class_defined_inside_a_function_is_rejected():
    class LocalEnv(ModuleLevelEnv):
        pass

    with pytest.raises(ValueError, match="defined inside a function; define it at module level"):
        resolve_environment(LocalEnv)


def test_init_args_given_twice_are_rejected(user_module):
    with pytest.raises(ValueError, match="give init_args inside the EnvSpec, not both"):
        resolve_environment(EnvSpec("my_envs:ReverseEnv"), {"word": "x"})


def test_specs_pickle_as_plain_data_and_build_after_the_round_trip():
    spec = resolve_environment("unirl_lightning.envs:CalculatorEnv", {"max_turns": 3, "syntax": "compact"})
    restored = pickle.loads(pickle.dumps(spec))
    assert restored == spec
    env = restored.build()
    assert (env.max_turns, env.syntax) == (3, "compact")


def test_import_environment_class_returns_the_class():
    assert import_environment_class("unirl_lightning.envs.calculator:CalculatorEnv") is CalculatorEnv

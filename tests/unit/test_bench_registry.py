"""The benchmark suite stays runnable: every registry entry names a module that imports without running
and whose parser accepts the entry's full and smoke arguments; every results file carries the envelope;
``write_result`` adds it; no benchmark module grows past 300 lines. Nothing here runs a benchmark
(``make bench-smoke`` does)."""

from __future__ import annotations

import datetime
import importlib
import json
from pathlib import Path

import pytest

from benchmarks.harness import common, envelope, registry

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
ENTRIES = {entry.name: entry for entry in registry.ENTRIES}


class Parsed(Exception):
    """Raised by the stand-in ``parse_config`` once the script's parser accepted the arguments."""

    def __init__(self, config: dict) -> None:
        super().__init__("parsed")
        self.config = config


def parse_with_script(monkeypatch, entry: registry.Entry, args: tuple[str, ...]) -> dict:
    """``args`` through the entry's own parser: its ``main()`` runs until ``common.parse_config``, which
    parses and stops (nothing is measured)."""
    module = importlib.import_module(entry.module)

    def parse_only(parser, argv=None, child=None):
        raise Parsed(vars(parser.parse_args(list(args))))

    monkeypatch.setattr(common, "parse_config", parse_only)
    monkeypatch.setattr("sys.argv", [entry.module, *args])
    with pytest.raises(Parsed) as parsed:
        module.main()
    return parsed.value.config


def test_entry_names_are_unique_and_kinds_costs_and_files_are_known():
    names = [entry.name for entry in registry.ENTRIES]
    assert len(names) == len(set(names))
    for entry in registry.ENTRIES:
        assert entry.kind in ("performance", "peers", "simulation", "gpu", "harness"), entry
        assert entry.cost in registry.COSTS, entry
        assert (BENCHMARKS / entry.kind / f"{entry.name}.py").is_file(), entry
    assert registry.ENTRIES[-1].name == "plot"  # the figures are drawn from what ran before
    assert [e.name for e in registry.ENTRIES if e.bench] == [
        "controller_overhead",
        "async_vs_sync",
        "flow_grpo_throughput",
        "plot",
    ]


def test_every_benchmark_module_is_in_the_registry_or_a_helper():
    scripts = {
        p.stem
        for kind in ("performance", "peers", "simulation", "gpu")
        for p in (BENCHMARKS / kind).glob("*.py")
    }
    helpers = {p for p in scripts if p not in ENTRIES and p != "__init__"}
    assert helpers == {
        "trl_side",
        "vs_trl_report",
        "time_to_accuracy_report",
        "time_to_accuracy_sides",
        "smollm2_trl",
        "sim",
        "gpu_checks_engine",
        "gpu_checks_fit",
        "gpu_checks_memory",
        "gpu_checks_train",
    }


@pytest.mark.parametrize("name", list(ENTRIES))
def test_the_module_imports_without_running_and_parses_its_full_and_smoke_arguments(monkeypatch, name):
    entry = ENTRIES[name]
    module = importlib.import_module(entry.module)
    assert callable(getattr(module, "main", None)), f"{entry.module} has no main()"
    parse_with_script(monkeypatch, entry, entry.args)
    if entry.smoke is not None:
        parse_with_script(monkeypatch, entry, entry.smoke)
        assert "--output" not in entry.smoke  # the registry gives the results folder


def test_an_entry_whose_needs_are_missing_is_skipped_with_the_reason():
    entry = registry.Entry("x", "performance", "seconds", "", needs=("no_such_module_here",))
    assert "no_such_module_here" in registry.skip_reason(entry, smoke=False)
    assert registry.skip_reason(registry.Entry("x", "performance", "seconds", "", smoke=None), smoke=True)
    assert registry.skip_reason(ENTRIES["controller_overhead"], smoke=True) is None


def test_the_registry_lists_every_entry(capsys):
    assert registry.main(["--list"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == set(ENTRIES)


@pytest.mark.parametrize(
    "argv", [["--bench", "--jobs", "2"], ["--run", "plot", "--only", "plot"], ["--", "x"]]
)
def test_measurements_run_alone_and_extra_arguments_go_with_run(argv):
    with pytest.raises(SystemExit) as exited:
        registry.main(argv)
    assert exited.value.code == 2


def test_no_benchmark_module_is_over_300_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in BENCHMARKS.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 300
    }
    assert long == {}


# -- the envelope ------------------------------------------------------------------------------------
def check_envelope(env: dict) -> None:
    assert set(envelope.KEYS) <= set(env)
    assert isinstance(env["commit"], str) and len(env["commit"]) == 40
    assert {"torch", "lightning", "transformers", "vllm"} <= set(env["packages"])
    assert {"cpu", "cores", "memory_gib", "gpu"} <= set(env["machine"])
    assert env["config"] is None or isinstance(env["config"], dict)
    datetime.datetime.fromisoformat(env["date"])


@pytest.mark.parametrize("path", sorted((BENCHMARKS / "results").glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_has_the_envelope_first(path):
    record = json.loads(path.read_text())
    assert next(iter(record)) == "envelope"
    check_envelope(record["envelope"])


def test_write_result_adds_the_envelope_with_the_config(tmp_path):
    path = envelope.write_result("x", {"figure": 1.5}, {"steps": 3, "out": tmp_path}, tmp_path)
    assert path == tmp_path / "x.json"
    record = json.loads(path.read_text())
    assert list(record) == ["envelope", "figure"] and record["figure"] == 1.5
    check_envelope(record["envelope"])
    assert record["envelope"]["config"] == {"steps": 3, "out": str(tmp_path)}
    assert record["envelope"]["machine"]["cores"] >= 1
    # a record that has one gets this run's instead; only dicts are records
    again = envelope.with_envelope({"envelope": {"commit": "old"}, "figure": 2}, None)
    assert again["envelope"]["commit"] != "old" and again["figure"] == 2
    with pytest.raises(TypeError):
        envelope.with_envelope([1, 2], None)


def test_the_results_folder_follows_output_and_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(envelope.RESULTS_ENV, "")  # recorded, so --output's setting is undone after the test
    monkeypatch.delenv(envelope.RESULTS_ENV)
    assert envelope.results_path("vs_trl") == BENCHMARKS / "results" / "vs_trl.json"
    assert envelope.results_path(tmp_path / "a.json") == tmp_path / "a.json"
    parser = common.script_parser("doc")
    parser.add_argument("--steps", type=int, default=2)
    config = common.parse_config(parser, ["--output", str(tmp_path)])
    assert config == {"steps": 2}
    assert envelope.results_path("vs_trl") == tmp_path / "vs_trl.json"
    path = common.write_results({"a": 1}, "vs_trl", config=config)
    assert path == tmp_path / "vs_trl.json" and json.loads(path.read_text())["envelope"]["config"] == config


def test_a_smoke_run_of_one_entry_never_writes_over_the_committed_results(monkeypatch):
    monkeypatch.delenv(envelope.RESULTS_ENV, raising=False)  # an --output of another test may linger
    results = BENCHMARKS / "results" / "controller_overhead.json"
    before = results.read_bytes()
    assert registry.main(["--run", "controller_overhead", "--smoke"]) == 0
    assert results.read_bytes() == before

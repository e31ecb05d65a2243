"""Apps as packages: the framework imports none; an app's sections are validated, suggested and
documented like the framework's; a user's app outside the package works the same way."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from test_cli import assert_user_error

from rlinf_hpc.config import load_config
from rlinf_hpc.config.apps import App, config_class, registered_apps, resolve_app
from rlinf_hpc.errors import UserError

from conftest import REPO, TESTS_DIR, mpiexec, rlinf

FRAMEWORK = ["config", "cluster", "comm", "channel", "scheduler", "workers", "engines", "algorithms",
             "runtime", "runners", "cli"]  # fmt: skip


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_framework_packages_import_no_app() -> None:
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for package in FRAMEWORK
        for path in sorted((REPO / "rlinf_hpc" / package).rglob("*.py"))
        for name in _imports(path)
        if name.startswith("rlinf_hpc.apps")
    ]
    assert not offenders, offenders
    text = "".join(p.read_text() for pkg in FRAMEWORK for p in (REPO / "rlinf_hpc" / pkg).rglob("*.py"))
    assert "rlinf_hpc.apps." not in text.replace('"rlinf_hpc.apps"', "")  # nor names one in a string


def test_apps_import_the_framework_only_one_way() -> None:
    for path in sorted((REPO / "rlinf_hpc" / "apps").rglob("*.py")):
        app = path.relative_to(REPO / "rlinf_hpc" / "apps").parts[0]
        others = [n for n in _imports(path) if n.startswith("rlinf_hpc.apps.") and n.split(".")[2] != app]
        assert not others, f"{path}: {others}"  # an app may reuse the framework, not another app


@pytest.mark.parametrize(
    "config", ["math_grpo_tiny.toml", "embodied_ppo_cartpole.toml", "emulated_grpo_7b.toml"]
)
def test_builtin_apps_are_registered_and_light_to_check(config: str) -> None:
    """Loading a config and running its app's input checks (what `rlinf-hpc run` does before it
    launches) imports no torch and no transformers: seconds on every launch otherwise."""
    assert {"hello", "toy_pipeline", "math_grpo", "embodied_ppo", "emulated_rl"} <= set(registered_apps())
    code = (
        "import sys; from rlinf_hpc.config import load_config; from rlinf_hpc.config.apps import app_of; "
        "c = load_config(sys.argv[1]); app_of(c).validate_function()(c); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "configs" / config)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def _user_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "counter.toml"
    path.write_text(
        '[components.counters]\nworker = "user_app:CounterWorker"\nnum_ranks = 2\n'
        f'[flow]\nrunner = "user_app:APP"\n[counter]\nstart = 10\n{extra}'
    )
    return path


@pytest.fixture
def user_app_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def test_user_app_sections_are_validated_like_the_framework(
    tmp_path: Path, user_app_importable: None
) -> None:
    config = load_config(_user_config(tmp_path))
    assert config.counter.start == 10 and config.counter.count == 4
    assert type(config) is config_class(resolve_app("user_app:APP"))
    with pytest.raises(UserError, match=r"unknown key `counter.cont`.*Did you mean `count`\?"):
        load_config(_user_config(tmp_path, "cont = 3\n"))
    with pytest.raises(UserError, match=r"`counter.count`: Input should be greater than or equal to 1"):
        load_config(_user_config(tmp_path, "count = 0\n"))
    path = tmp_path / "other.toml"
    path.write_text('[components.x]\nworker = "user_app:CounterWorker"\n[flow]\nrunner = "user_app:APP"\n')
    with pytest.raises(UserError, match=r"needs a \[components.counters\] table"):
        load_config(path)  # the app's own check across sections
    path.write_text('[components.x]\nworker = "m:C"\n[counter]\nstart = 1\n')
    with pytest.raises(UserError, match=r"unknown key `counter`"):
        load_config(path)  # the default app (hello) has no [counter]


def test_sections_of_another_registered_app_say_which(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[components.a]\nworker = "m:C"\n[grpo]\nsteps = 3\n')
    with pytest.raises(
        UserError, match=r"\[grpo\] belongs to the app 'math_grpo'.*flow.runner = \"math_grpo\""
    ):
        load_config(path)


def test_app_section_clashing_with_the_framework_is_refused() -> None:
    from rlinf_hpc.config.schema import JobConfig

    clash = App(name="clash", flow="m:f", sections={"job": JobConfig})
    sys.modules["clash_app"] = type(sys)("clash_app")
    sys.modules["clash_app"].APP = clash  # type: ignore[attr-defined]
    try:
        with pytest.raises(UserError, match=r"declares a config section \[job\], which the framework"):
            resolve_app("clash_app:APP")
    finally:
        del sys.modules["clash_app"]


def test_unknown_runner_lists_the_registered_apps(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[components.a]\nworker = "m:C"\n[flow]\nrunner = "math_grop"\n')
    assert_user_error(rlinf("config", "show", str(path)), "is neither a registered app (")


def test_schema_lists_each_app_under_its_name() -> None:
    result = rlinf("config", "schema")
    assert result.returncode == 0, result.output
    out = result.stdout
    assert out.index("# the framework") < out.index("# app 'math_grpo'") < out.index("grpo.steps")
    assert "# app 'hello'" in out and "hello.num_items" in out
    from conftest import job_env

    user = rlinf("config", "schema", "--app", "user_app:APP", env=job_env())
    assert user.returncode == 0, user.output
    assert "# app 'user_app:APP'" in user.stdout and "counter.count" in user.stdout
    assert "job.num_ranks" not in user.stdout


@pytest.mark.mpi
def test_user_app_runs_as_a_job(tmp_path: Path) -> None:
    result = mpiexec(3, "run", str(_user_config(tmp_path)), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.output
    assert "COUNTED [[10, 11, 12, 13], [14, 15, 16, 17]]" in result.stdout
    assert "[counter]\nstart = 10\ncount = 4" in (tmp_path / "run" / "config.toml").read_text()

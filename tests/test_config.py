"""Config loading: typed values, overrides, and the messages users see for their mistakes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlinf_hpc.config import Config, config_to_toml, load_config, parse_override
from rlinf_hpc.config.apps import resolve_app
from rlinf_hpc.config.describe import schema_keys
from rlinf_hpc.errors import UserError

from conftest import CONFIGS

MINIMAL = '[components.a]\nworker = "pkg.mod:Cls"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_hello_config_loads_with_defaults() -> None:
    config = load_config(CONFIGS / "hello.toml")
    assert config.job.num_ranks == 4
    assert list(config.components) == ["doubler", "squarer"]
    assert config.components["doubler"].options == {"operation": "double"}
    assert config.job.call_timeout_s == 600.0
    assert config.num_worker_ranks_needed == 3


def test_unknown_key_suggests_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "num_rank = 2\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    text = str(err.value)
    assert "unknown key `components.a.num_rank`" in text
    assert "Did you mean `num_ranks`?" in text
    assert str(path) in text


def test_unknown_top_level_table(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"unknown key `jbo`.*Did you mean `job`"):
        load_config(write(tmp_path, MINIMAL + "[jbo]\nname = 'x'\n"))


def test_wrong_type_and_range_name_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[job]\nnum_ranks = 0\nseed = 'abc'\n" + MINIMAL)
    with pytest.raises(UserError) as err:
        load_config(path)
    text = str(err.value)
    assert "`job.num_ranks`" in text and "greater than or equal to 1" in text and "got 0" in text
    assert "`job.seed`" in text and "'abc'" in text
    assert str(path) in text


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(UserError, match="is a directory"):
        load_config(tmp_path)


def test_toml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"not valid TOML.*line 2, column"):
        load_config(write(tmp_path, "[job]\nname = \n"))


def test_missing_required_worker(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"`components.a.worker` is required"):
        load_config(write(tmp_path, "[components.a]\nnum_ranks = 1\n"))


def test_bad_worker_path_and_component_name(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not an import path"):
        load_config(write(tmp_path, '[components.a]\nworker = "no_colon_here"\n'))
    with pytest.raises(UserError, match="must start with a letter"):
        load_config(write(tmp_path, '[components."1x"]\nworker = "a:B"\n'))


def test_no_components(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="components"):
        load_config(write(tmp_path, "[job]\nname = 'x'\n"))


def test_overrides_apply_in_order_and_parse_toml_values(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    config = load_config(
        path,
        [
            "job.num_ranks=8",
            "job.num_ranks=6",
            "components.a.device=gpu",
            "components.a.options.scale=0.5",
            "components.a.ranks=[2, 3]",
        ],
    )
    assert config.job.num_ranks == 6
    assert config.components["a"].device == "gpu"
    assert config.components["a"].options == {"scale": 0.5}
    assert config.components["a"].ranks == [2, 3] and config.components["a"].num_ranks == 2


def test_override_errors_mention_set(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(UserError, match=r"unknown key `job.nme` \(set with --set\).*`name`"):
        load_config(path, ["job.nme=x"])
    with pytest.raises(UserError, match="not of the form KEY=VALUE"):
        load_config(path, ["job.name"])
    with pytest.raises(UserError, match=r"`job.name` \(set with --set\): .*valid string"):
        load_config(path, ["job.name.first=x"])
    named = write(tmp_path, '[job]\nname = "x"\n' + MINIMAL)
    with pytest.raises(UserError, match="is a value, not a table"):
        load_config(named, ["job.name.first=x"])
    with pytest.raises(UserError, match=r"`job.num_ranks` \(set with --set\)"):
        load_config(path, ["job.num_ranks=-2"])


def test_parse_override_falls_back_to_string() -> None:
    assert parse_override("a.b=hello world") == (["a", "b"], "hello world")
    assert parse_override("a=true") == (["a"], True)


def test_explicit_ranks_checks(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="rank 0 is the coordinator"):
        load_config(write(tmp_path, MINIMAL + "ranks = [0, 1]\n"))
    with pytest.raises(UserError, match="lists a rank twice"):
        load_config(write(tmp_path, MINIMAL + "ranks = [1, 1]\n"))
    with pytest.raises(UserError, match="num_ranks = 3 but ranks lists 2"):
        load_config(write(tmp_path, MINIMAL + "num_ranks = 3\nranks = [1, 2]\n"))


def test_num_worker_ranks_needed_counts_shared_and_explicit() -> None:
    shared = Config.model_validate(
        {
            "placement": {"mode": "hybrid"},
            "components": {
                "a": {"worker": "m:C", "ranks": [1, 2]},
                "b": {"worker": "m:C", "ranks": [2, 3]},
                "c": {"worker": "m:C", "num_ranks": 2},
            },
        }
    )
    assert shared.num_worker_ranks_needed == 5
    sparse = Config.model_validate({"components": {"a": {"worker": "m:C", "ranks": [7]}}})
    assert sparse.num_worker_ranks_needed == 7


def test_resolved_toml_round_trips(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "hello.toml", ["hello.num_items=3"])
    again = load_config(write(tmp_path, config_to_toml(config)))
    assert again == config


def test_schema_documents_every_key() -> None:
    keys = {k.key: k for k in schema_keys()}
    for name in [
        "job.name",
        "job.num_ranks",
        "components.<name>.worker",
        "components.<name>.device",
        "flow.runner",
    ]:
        assert name in keys and keys[name].doc, name
    assert keys["components.<name>.worker"].default == "(required)"
    assert keys["job.num_ranks"].default == "4"
    assert not any(k.startswith(("hello.", "grpo.", "model.")) for k in keys)  # apps' keys: their own
    math = {k.key: k for k in schema_keys(resolve_app("math_grpo"))}
    assert math["grpo.steps"].doc and math["model.path"].default == "''"
    assert [k.key for k in schema_keys(resolve_app("hello"))] == ["hello.num_items"]


def test_placement_modes_size_the_job() -> None:
    components = {
        "a": {"worker": "m:C", "num_ranks": 2},
        "b": {"worker": "m:C", "num_ranks": 3},
        "c": {"worker": "m:C"},
    }
    modes = {
        "disaggregated": {},
        "collocated": {"mode": "collocated"},
        "hybrid": {"mode": "hybrid", "groups": [["a", "b"]]},
    }
    needed = {
        mode: Config.model_validate({"components": components, "placement": extra}).num_worker_ranks_needed
        for mode, extra in modes.items()
    }
    assert needed == {"disaggregated": 6, "collocated": 3, "hybrid": 4}


def test_placement_mistakes(tmp_path: Path) -> None:
    base = MINIMAL + '[components.b]\nworker = "pkg.mod:Cls"\n'
    cases = {
        '[placement]\nmode = "hybrid"\ngroups = [["a", "nope"]]\n': "unknown component 'nope'",
        '[placement]\nmode = "hybrid"\ngroups = [["a"], ["a", "b"]]\n': "lists component 'a' twice",
        '[placement]\ngroups = [["a", "b"]]\n': 'only used with placement.mode = "hybrid"',
        '[placement]\nmode = "auto-ish"\n': "`placement.mode`",
    }
    for extra, message in cases.items():
        with pytest.raises(UserError, match=re.escape(message)):
            load_config(write(tmp_path, base + extra))
    overlap = MINIMAL + "ranks = [1, 2]\n" + '[components.b]\nworker = "pkg.mod:Cls"\nranks = [2]\n'
    with pytest.raises(
        UserError, match=r"components 'a' and 'b' both list rank 2.*\"collocated\" or \"hybrid\""
    ):
        load_config(write(tmp_path, overlap))
    load_config(write(tmp_path, overlap + '[placement]\nmode = "collocated"\n'))  # fine there


def test_micro_batch_bounds_and_auto_mistakes(tmp_path: Path) -> None:
    pinned = '[placement]\nmode = "auto"\n[components.b]\nworker = "pkg.mod:Cls"\nranks = [2]\n'
    cases = {
        "[pipeline]\nmin_micro_batch = 64\nmax_micro_batch = 16\n": "min_micro_batch (64) is larger than "
        "max_micro_batch (16)",
        "[pipeline]\nmicro_batch = 2\n": "micro_batch (2) must lie between min_micro_batch (8) and "
        "max_micro_batch (256)",
        "[pipeline]\nmemory_threshold = 1.5\n": "pipeline.memory_threshold",
        pinned: "components ['b'] list explicit ranks",
    }
    for extra, message in cases.items():
        with pytest.raises(UserError, match=re.escape(message)):
            load_config(write(tmp_path, MINIMAL + extra))
    config = load_config(write(tmp_path, MINIMAL + '[placement]\nmode = "auto"\n'))
    assert config.placement_units() == [["a"]] and config.pipeline.micro_batch == 32


def test_every_bundled_config_validates_offline() -> None:
    """GPU configs name model and data paths of a cluster; they must still load here."""
    paths = sorted(CONFIGS.glob("*.toml"))
    assert len(paths) >= 5
    for path in paths:
        config = load_config(path)
        assert (
            config.job.num_ranks >= config.num_worker_ranks_needed + 1 or config.placement.mode == "auto"
        ), path

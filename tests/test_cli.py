"""The `rlinf-hpc` command without starting ranks: help, config inspection, bad input."""

from __future__ import annotations

from pathlib import Path

from conftest import CONFIGS, rlinf


def assert_user_error(result, *fragments: str) -> None:
    """Exit code 2, one `rlinf-hpc: error:` paragraph, no traceback."""
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.count("rlinf-hpc: error:") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_help_lists_commands() -> None:
    result = rlinf("--help")
    assert result.returncode == 0
    for command in ("run", "info", "config"):
        assert command in result.stdout
    assert rlinf("run", "--help").returncode == 0


def test_config_show_prints_resolved_config_with_overrides() -> None:
    result = rlinf("config", "show", str(CONFIGS / "hello.toml"), "--set", "hello.num_items=3")
    assert result.returncode == 0, result.output
    assert "num_items = 3" in result.stdout
    assert "call_timeout_s = 600.0" in result.stdout  # defaults filled in


def test_config_schema_lists_keys_with_docs() -> None:
    result = rlinf("config", "schema")
    assert result.returncode == 0
    assert "components.<name>.worker" in result.stdout
    assert "job.num_ranks" in result.stdout and "(default: 4)" in result.stdout


def test_missing_config_file() -> None:
    assert_user_error(rlinf("run", "no/such/file.toml"), "does not exist")


def test_toml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[job\nname = 1\n")
    assert_user_error(rlinf("run", str(path)), "line 1, column")


def test_unknown_key_suggests_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(CONFIGS.joinpath("hello.toml").read_text().replace("num_items", "num_itmes"))
    assert_user_error(rlinf("run", str(path)), "unknown key `hello.num_itmes`", "`num_items`")


def test_wrong_type_via_set() -> None:
    result = rlinf("run", str(CONFIGS / "hello.toml"), "--set", "job.call_timeout_s=-1")
    assert_user_error(result, "`job.call_timeout_s` (set with --set)", "greater than 0")


def test_too_few_ranks_rejected_before_launch() -> None:
    assert_user_error(rlinf("run", str(CONFIGS / "hello.toml"), "--np", "1"), "single rank", "--np 4")
    assert_user_error(
        rlinf("run", str(CONFIGS / "hello.toml"), "--np", "3"),
        "component 'squarer' needs 1 worker rank(s) but only 0 remain",
    )


def test_gpu_component_without_gpu_rejected_before_launch() -> None:
    result = rlinf("run", str(CONFIGS / "hello.toml"), "--set", "components.squarer.device=gpu")
    assert_user_error(result, "with a GPU", "--gpus-per-task")


def test_inconsistent_slurm_environment() -> None:
    from conftest import job_env

    result = rlinf("run", str(CONFIGS / "hello.toml"), env=job_env({"SLURM_PROCID": "1"}))
    assert_user_error(result, "SLURM_PROCID=1 is set but SLURM_NTASKS is not")


def test_debug_shows_traceback() -> None:
    result = rlinf("--debug", "run", "no/such/file.toml")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "UserError" in result.stderr


def test_bad_np_flag() -> None:
    result = rlinf("run", str(CONFIGS / "hello.toml"), "--np", "0")
    assert result.returncode == 2 and "must be >= 1" in result.stderr


def test_trace_of_a_directory_without_timeline(tmp_path: Path) -> None:
    assert_user_error(rlinf("trace", str(tmp_path)), "timeline.jsonl' does not exist", "--run-dir")
    (tmp_path / "timeline.jsonl").write_text("not json\n")
    assert_user_error(rlinf("trace", str(tmp_path)), "is not a timeline written by rlinf-hpc")


def test_a_wide_table_in_a_file_keeps_every_cell_whole(capsys) -> None:
    """Rank 0's tables go to job output files at 120 columns; one wider than that (bench_scale's
    11 columns) is printed at its own width, not with cut cells that read alike; a narrow one
    stays as it was."""
    from rlinf_hpc.runtime.console import print_table

    modes = ["off_policy_auto", "off_policy_fixed", "off_policy_partial"]
    columns = ["profile", "ranks", "mode", "placement", "step s", "wall s", "predicted s", "idle",
               "coordinator", "lag", "micro-batch"]  # fmt: skip
    rows = [["rev-tight", "24", m, "auto:disaggregated", "6.078", "6.091", "6.014", "57%", "1.6%", "1",
             "rollout:32 reward:1.92 inference:2.5 actor:2.98"] for m in modes]  # fmt: skip
    print_table("EMULATED", columns, rows)
    wide = capsys.readouterr().out
    assert "…" not in wide and all(m in wide for m in modes) and "auto:disaggregated" in wide
    assert max(len(line) for line in wide.splitlines()) > 120
    print_table("short", ["a", "b"], [["1", "2"]])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) < 40

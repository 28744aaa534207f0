"""benchmarks/model/default_model_targets.py: the commands it shows (keys never among them), its table's cells, and
its flags' refusals and modes. The whole script runs in tests/benchmarks/test_smoke.py."""

from __future__ import annotations

import secrets

import pytest

from benchmarks.model import default_model_targets as dmt


def test_shown_names_keys_by_placeholder_and_brief_drops_the_plumbing():
    keys = (secrets.token_urlsafe(16), secrets.token_urlsafe(16))
    argv = [*dmt.EVALPIPE, "qualify", "--base-url", "http://127.0.0.1:5/v1", "--out", "/tmp/x y", "--no-progress"]
    argv += ["--api-key", keys[0], "--api-key", keys[1], "--gates", "auth"]
    full, brief = dmt.shown(argv, keys), dmt.shown(argv, keys, brief=True)
    for text in (full, brief):
        assert not any(k in text for k in keys)
        assert "--api-key $KEY1 --api-key $KEY2" in text and text.startswith("evalpipe qualify ")
    assert "--out '/tmp/x y'" in full and "--base-url http://127.0.0.1:5/v1" in full
    assert brief == "evalpipe qualify --api-key $KEY1 --api-key $KEY2 --gates auth"
    assert dmt.shown([dmt.SGL_EVAL, "run", "gsm8k", "--out-dir", "o"], brief=True) == "sgl-eval run gsm8k"


def test_table_marks_each_outcome_and_keeps_pipes_out_of_the_cells():
    rows = [
        dmt.Row("copy", "copy >= 99%", "98.9% | of 300", False, [], "`evalpipe run copy`", "x", 1.0),
        dmt.Row("oracle", "oracle", "pytest exit 0", True, [], "`pytest a|b`", "y", 2.0),
        dmt.Row("repeat", "repeat", "exited 1", None, [], "`evalpipe repeat`", "z", 0.0),
    ]
    lines = dmt.table(rows).splitlines()
    assert lines[:2] == ["| target | measured | pass | command |", "|---|---|---|---|"]
    assert [line.count("|") for line in lines] == [5] * 5
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["**FAIL**", "pass", "not measured"]


def test_flags_refuse_unknown_rows_and_need_an_out_folder(capsys):
    with pytest.raises(SystemExit) as exc:
        dmt.parse_args(["--out", "o", "--skip", "t1,bogus"])
    assert exc.value.code == 2 and "unknown --skip row(s) bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        dmt.parse_args([])
    assert exc.value.code == 2 and "--out is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        dmt.parse_args(["--out", "o", "--arith-examples", "0"])
    assert exc.value.code == 2 and "--arith-examples must be at least 1" in capsys.readouterr().err


def test_modes_set_their_defaults_and_keep_what_is_given(tmp_path):
    full = dmt.parse_args(["--out", str(tmp_path)])
    assert (full.qualify_args, full.repeat_args, full.skip, full.model) == ("", "", [], "evalpipe-skills-dsv4")
    quick = dmt.parse_args(["--out", str(tmp_path), "--quick", "--repeat-args", "--repeats 3", "--skip", " lossy,"])
    assert (quick.qualify_args, quick.repeat_args, quick.skip) == ("--soak-duration 10", "--repeats 3", ["lossy"])
    smoke = dmt.parse_args(["--smoke", "--skip", "oracle"])
    assert (
        smoke.model == "evalpipe-tiny-dsv4"
        and smoke.skip == ["oracle", "arith", "think", "qualify", "spec", "t1", "lossy"]
        and smoke.out.is_dir()
    )
    assert "--gates auth" in smoke.qualify_args and "--max-tokens 8" in smoke.run_args
    assert set(smoke.skip) <= set(dmt.ROWS) and set(dmt.LANE_ROWS) < set(dmt.ROWS)

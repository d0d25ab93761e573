"""The ``pagedkv-engine`` CLI on the tiny model folder (fast), its input readers and its errors."""

from __future__ import annotations

import json
import sys

import pytest

from pagedkv.engine import PromptFileError
from pagedkv.engine.cli import main, parse_size
from pagedkv.engine.inputs import read_prompts, read_trace, synthetic_prompt


def _run(tiny, tmp_path, *extra: str) -> tuple[int, list[dict]]:
    out = tmp_path / "results.jsonl"
    rc = main(
        [
            "--model",
            str(tiny.path),
            "--block-size",
            "4",
            "--kv-blocks",
            "128",
            "--no-progress",
            "--output",
            str(out),
            *extra,
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return rc, rows


def test_cli_txt_prompts_write_results(tiny, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10 w11 w12\n\nw13 w14\nw10 w11 w12 w15 w16\n")
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--max-tokens", "5", "--no-chat-template")
    assert rc == 0
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    for r in rows:
        assert set(r) >= {
            "id",
            "prompt",
            "output_text",
            "output_token_ids",
            "finish_reason",
            "cached_prompt_tokens",
            "preemptions",
        }
        assert len(r["output_token_ids"]) == 5 and r["finish_reason"] == "length"
        assert r["output_text"] == tiny.tokenizer.decode(r["output_token_ids"], skip_special_tokens=True)
    assert rows[2]["cached_prompt_tokens"] in (0, 4)  # may share a block with prompt 0
    shown = capsys.readouterr().out
    assert "output tokens/s" in shown and "preemptions" in shown and "prefix hit rate" in shown


def test_cli_jsonl_with_ids_chat_template_and_sampling(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"id": "a", "prompt": "w20 w21", "max_tokens": 3})
        + "\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "w22"}]})
        + "\n"
    )
    rc, rows = _run(
        tiny,
        tmp_path,
        "--prompts",
        str(f),
        "--max-tokens",
        "6",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "4",
        "--n",
        "2",
    )
    assert rc == 0 and [r["id"] for r in rows] == ["a", "b"]
    assert len(rows[0]["output_token_ids"]) == 3 and len(rows[1]["output_token_ids"]) == 6
    assert len(rows[1]["outputs"]) == 2
    rc2, rows2 = _run(
        tiny,
        tmp_path,
        "--prompts",
        str(f),
        "--max-tokens",
        "6",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "4",
        "--n",
        "2",
    )
    assert [r["outputs"] for r in rows2] == [r["outputs"] for r in rows]  # seeded: reproducible


def test_cli_trace_mode_and_rejection(tiny, tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nx,40,8\nx,12,5\nx,4000,10\n")
    rc, rows = _run(
        tiny,
        tmp_path,
        "--trace",
        str(f),
        "--trace-limit",
        "3",
        "--kv-blocks",
        "33",
        "--preemption",
        "swap",
        "--beam-width",
        "1",
    )
    assert rc == 0
    assert [len(r.get("output_token_ids", [])) for r in rows] == [8, 5, 0]
    assert "error" in rows[2] and "4000 tokens does not fit the model context" in rows[2]["error"]


@pytest.mark.parametrize(
    "content,suffix,needle",
    [
        ("{not json\n", ".jsonl", "p.jsonl:1: not valid JSON"),
        ('{"prompt": ""}\n', ".jsonl", "p.jsonl:1: needs a non-empty string 'prompt'"),
        ('["a"]\n', ".jsonl", "expected a JSON object"),
        ('{"prompt": "x", "max_tokens": 0}\n', ".jsonl", "max_tokens=0"),
        ("\n\n", ".txt", "holds no prompt"),
        ("x\n", ".csv", "must end in .txt or .jsonl"),
    ],
)
def test_malformed_prompt_files(tmp_path, content, suffix, needle):
    f = tmp_path / f"p{suffix}"
    f.write_text(content)
    with pytest.raises(PromptFileError, match=needle.replace("[", r"\[")) as info:
        read_prompts(f)
    assert isinstance(info.value, ValueError)


def test_unreadable_prompt_files(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PromptFileError, match="cannot read prompts file"):
        read_prompts(bad)
    t = tmp_path / "t.csv"
    t.write_text("a,b\n1,2\n")
    with pytest.raises(PromptFileError, match="none of the known length pairs"):
        read_trace(t)
    t.write_text("ContextTokens,GeneratedTokens\nten,2\n")
    with pytest.raises(PromptFileError, match=r"t.csv:2: lengths 'ten', '2' are not integers"):
        read_trace(t)


def test_cli_errors_exit_2_with_message(tiny, tmp_path, capsys):
    assert main(["--prompts", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    f = tmp_path / "p.txt"
    f.write_text("w5\n")
    assert main(["--prompts", str(f), "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "model path" in capsys.readouterr().err
    assert main(["--prompts", str(f), "--model", str(tiny.path), "--top-p", "1.5"]) == 2
    assert "top_p=1.5" in capsys.readouterr().err


def test_trace_reader_scales_and_clamps(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text('{"input_length": 100, "output_length": 40}\n{"input_length": 3, "output_length": 1}\n')
    reqs = read_trace(t, scale=0.5, max_prompt_tokens=30)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(30, 20), (2, 1)]
    assert read_trace(t, limit=1)[0].prompt_tokens == 100
    assert synthetic_prompt(5, 512, 1) == synthetic_prompt(5, 512, 1) != synthetic_prompt(5, 512, 2)


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("512M") == 512 << 20
    assert parse_size("2GiB") == 2 << 30
    with pytest.raises(Exception, match="invalid size '-3'"):
        parse_size("-3")


def test_example_prompts_file_is_valid():
    from pathlib import Path

    prompts = read_prompts(Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl")
    assert len(prompts) >= 50
    shared = [p for p in prompts if isinstance(p, dict) and p.get("system")]
    assert len(shared) >= 5 and len({p["system"] for p in shared}) == 1


def test_cli_kv_pool_larger_than_memory_is_a_clean_error(tiny, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10 w11\n")
    # The largest pool pagedkv allows, in the largest blocks: hundreds of TiB.
    import pagedkv

    rc, rows = _run(
        tiny,
        tmp_path,
        "--prompts",
        str(f),
        "--limit",
        "1",
        "--kv-blocks",
        str(pagedkv.MAX_BLOCKS),
        "--block-size",
        str(pagedkv.MAX_BLOCK_SIZE),
    )
    assert rc == 2 and rows == []
    err = capsys.readouterr().err
    assert f"KV cache of {pagedkv.MAX_BLOCKS} blocks x " in err and "does not fit" in err
    rc = main(["--model", str(tiny.path), "--prompts", str(f), "--kv-bytes", "500T", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"= {500 << 40} bytes (512000.00 GiB) does not fit" in err and "blocks x" in err


def test_guard_allocation_turns_oom_into_typed_error():
    from pagedkv.engine import KVCacheTooLargeError
    from pagedkv.engine.resources import guard_allocation

    def boom():
        raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory\nmore")

    with pytest.raises(KVCacheTooLargeError, match=r"KV cache of 7 blocks x 1024 bytes = 7168 bytes .*can't allocate"):
        guard_allocation("KV cache", 7, 1024, boom)
    assert guard_allocation("KV cache", 1, 1, lambda: 5) == 5


def test_cli_cuda_without_gpu_exits_2(tiny, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    assert main(["--model", str(tiny.path), "--prompts", str(f), "--device", "cuda", "--no-progress"]) == 2
    assert "device='cuda' requested but CUDA is not available" in capsys.readouterr().err


def test_cli_all_requests_rejected_exits_1(tiny, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10 w11 w12 w13 w14 w15\nw16 w17 w18 w19 w20\n")
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--kv-blocks", "2", "--no-chat-template", "--max-tokens", "8")
    assert rc == 1
    assert [r["id"] for r in rows] == ["0", "1"] and all("error" in r for r in rows)
    assert "all 2 request(s) were rejected; none could be served" in capsys.readouterr().err


def test_cli_help_documents_every_option_once():
    from pagedkv.engine.cli import build_parser

    ap = build_parser()
    for action in ap._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
    text = ap.format_help()
    assert "(default: None)" not in text
    assert "falls back to recompute" in " ".join(text.split())
    # The help says what the cache identity is made of: every part, by name.
    from pagedkv.engine.models.identity import IDENTITY_PARTS

    section = text.split("cache identity (printed at startup")[1]
    assert [p for p in IDENTITY_PARTS if f"\n  {p} " not in section] == []


# ---- bad input found before the model loads, bad output paths, documented formats ----------


def _missing_model(tmp_path) -> str:
    # A model path that does not exist: a test passing it proves its error came before the load.
    return str(tmp_path / "no-model.gguf")


def test_cli_unwritable_output_paths_fail_before_the_model_loads(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    blocker = tmp_path / "x.txt"
    blocker.write_text("a regular file\n")
    for flag in ("--output", "--metrics-json"):
        rc = main(["--prompts", str(f), "--model", _missing_model(tmp_path), flag, str(blocker / "out.jsonl")])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"error: {flag} {str(blocker / 'out.jsonl')!r}: {str(blocker)!r} is a file, not a folder" in err
        assert "model path" not in err and "Traceback" not in err
    rc = main(["--prompts", str(f), "--model", _missing_model(tmp_path), "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: --output {str(tmp_path)!r}: is a folder, not a file" in err
    same = tmp_path / "same.json"
    rc = main(
        ["--prompts", str(f), "--model", _missing_model(tmp_path), "--output", str(same), "--metrics-json", str(same)]
    )
    assert rc == 2 and "--output and --metrics-json name the same file" in capsys.readouterr().err


def test_cli_output_check_creates_folders_but_leaves_no_file_when_the_run_fails(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    out = tmp_path / "new" / "dir" / "r.jsonl"
    assert main(["--prompts", str(f), "--model", _missing_model(tmp_path), "--output", str(out)]) == 2
    assert "model path" in capsys.readouterr().err
    assert out.parent.is_dir() and not out.exists()


def test_cli_refused_output_paths_leave_no_folder_behind(tmp_path, capsys):
    # --output's folders are fine and get created by the check, then --metrics-json is refused:
    # the command fails and removes the folders it made (only those: tmp_path stays).
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    blocker = tmp_path / "x.txt"
    blocker.write_text("a regular file\n")
    out = tmp_path / "new" / "dir" / "r.jsonl"
    args = ["--prompts", str(f), "--model", _missing_model(tmp_path), "--output", str(out)]
    rc = main([*args, "--metrics-json", str(blocker / "m.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--metrics-json" in err and "is a file, not a folder" in err
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "x.txt"]
    # A folder that existed before stays even when the check fails.
    (tmp_path / "kept").mkdir()
    rc = main([*args[:-1], str(tmp_path / "kept" / "a" / "r.jsonl"), "--metrics-json", str(blocker / "m.json")])
    assert rc == 2
    capsys.readouterr()
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "a").exists()


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_cli_write_failure_at_the_end_prints_stats_then_a_clean_error(tiny, tmp_path, capsys):
    # /dev/full opens fine (the early check passes) and fails every write with ENOSPC, like a
    # disk that fills up during the run.
    f = tmp_path / "p.txt"
    f.write_text("w10 w11\n")
    rc = main(
        [
            "--model",
            str(tiny.path),
            "--block-size",
            "4",
            "--kv-blocks",
            "32",
            "--no-progress",
            "--prompts",
            str(f),
            "--no-chat-template",
            "--max-tokens",
            "2",
            "--output",
            "/dev/full",
            "--metrics-json",
            str(tmp_path / "m.json"),
        ]
    )
    cap = capsys.readouterr()
    assert rc == 2
    assert "output tokens/s" in cap.out  # the stats table was printed
    assert "error: --output '/dev/full': cannot write the results: No space left on device" in cap.err
    assert "Traceback" not in cap.err
    metrics = json.loads((tmp_path / "m.json").read_text())  # the other output was still written
    # The cache identity is printed at startup, shown in the table and recorded with the metrics.
    from pagedkv.engine.models.identity import IDENTITY_PARTS

    ident = metrics["cache_identity"]
    assert tuple(ident["parts"]) == IDENTITY_PARTS and len(ident["digest"]) == 64
    assert ident["parts"]["kv_dtype"] == "float32"
    assert f"pagedkv-engine: cache identity {ident['digest'][:16]} (weights=" in cap.err
    assert ident["digest"][:16] in cap.out


def test_cli_duplicate_ids_rejected_before_the_model_loads(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt":"What is 2 plus 2?","id":"a"}\n{"prompt":"hi","id":"a"}\n')
    assert main(["--prompts", str(f), "--model", _missing_model(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {f}:2: duplicate request id 'a' (already used on line 1)" in err
    assert "model path" not in err


def test_cli_non_string_cache_salt_is_a_clean_error(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt":"hi","cache_salt":5}\n')
    assert main(["--prompts", str(f), "--model", _missing_model(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {f}:1: 'cache_salt' must be a string, got int 5" in err and "Traceback" not in err


def test_cli_served_and_rejected_rows_with_jsonl_ids(tiny, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt":"w10 w11","id":"a","cache_salt":"s1"}\n'
        '{"prompt":"' + " ".join(f"w{i}" for i in range(10, 60)) + '","id":"big"}\n'
    )
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--no-chat-template", "--max-tokens", "3", "--kv-blocks", "8")
    assert rc == 0 and [r["id"] for r in rows] == ["a", "big"]
    assert rows[0]["prompt"] == "w10 w11" and len(rows[0]["output_token_ids"]) == 3
    assert set(rows[1]) == {"id", "prompt", "error"} and rows[1]["prompt"].startswith("w10 w11 w12")
    assert capsys.readouterr().out.count("#a ") == 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--show", "-1"], "--show: -1 must be >= 0"),
        (["--trace-scale", "0"], "--trace-scale: 0.0 must be > 0"),
        (["--trace-scale", "nan"], "--trace-scale: nan must be > 0"),
        (["--slo-ttft", "0"], "--slo-ttft: 0.0 must be > 0 and finite"),
        (["--slo-ttft", "-2"], "--slo-ttft: -2.0 must be > 0 and finite"),
        (["--slo-tpot", "nan"], "--slo-tpot: nan must be > 0 and finite"),
        (["--slo-tpot", "inf"], "--slo-tpot: inf must be > 0 and finite"),
        (["--slo-tpot", "fast"], "--slo-tpot: invalid number 'fast'"),
    ],
)
def test_cli_argparse_rejects_out_of_range_numbers(tmp_path, capsys, argv, needle):
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    with pytest.raises(SystemExit) as info:
        main(["--prompts", str(f), *argv])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_cli_missing_trace_is_called_a_trace_file(tmp_path, capsys):
    assert main(["--trace", str(tmp_path / "nonexistent.csv"), "--model", _missing_model(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: trace file {str(tmp_path / 'nonexistent.csv')!r} does not exist" in err


def test_cli_pool_arguments_are_checked_against_pagedkv_limits_before_the_load(tmp_path, capsys):
    import pagedkv

    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    cases = [
        (["--block-size", "5000"], f"--block-size 5000: must be in 1..={pagedkv.MAX_BLOCK_SIZE} tokens"),
        (["--kv-blocks", "1"], "--kv-blocks 1: need at least 2 blocks (block 0 is the null block)"),
        (
            ["--kv-blocks", str(pagedkv.MAX_BLOCKS + 1)],
            f"--kv-blocks {pagedkv.MAX_BLOCKS + 1}: at most {pagedkv.MAX_BLOCKS} blocks",
        ),
        (
            ["--kv-blocks", "100000000000"],
            f"--kv-blocks 100000000000: expected an int in 2..={pagedkv.MAX_BLOCKS} blocks",
        ),
        (["--cpu-blocks", "-1"], "--cpu-blocks -1: expected an int in 0..="),
    ]
    for extra, needle in cases:
        assert main(["--prompts", str(f), "--model", _missing_model(tmp_path), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert f"pagedkv-engine: error: {needle}" in err, err
        assert "model path" not in err and "does not fit" not in err


def test_cli_help_documents_prompt_and_result_formats(tiny, tmp_path):
    from pagedkv.engine.cli import build_parser
    from pagedkv.engine.inputs import PROMPT_FIELDS

    text = build_parser().format_help()
    for field in PROMPT_FIELDS:
        assert f"{field}:" in text or f"{field} " in text, field
    # Every key the CLI really writes, served and rejected rows alike, is described.
    f = tmp_path / "p.txt"
    f.write_text("w10 w11\n" + " ".join(f"w{i}" for i in range(10, 60)) + "\n")
    rc, rows = _run(
        tiny,
        tmp_path,
        "--prompts",
        str(f),
        "--no-chat-template",
        "--max-tokens",
        "2",
        "--kv-blocks",
        "8",
        "--beam-width",
        "2",
    )
    assert rc == 0 and "error" in rows[1]
    keys = set(rows[0]) | set(rows[1]) | {k for o in rows[0]["outputs"] for k in o}
    for key in keys:
        assert f"{key}:" in text or f"{key}," in text or f"{key}]" in text, key


def test_cli_without_the_engine_extra_names_it_and_exits_2(tmp_path, capsys, monkeypatch):
    # `pip install pagedkv` installs the command but not torch: `import torch` then fails
    monkeypatch.setitem(sys.modules, "torch", None)
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    assert main(["--prompts", str(f)]) == 2
    err = capsys.readouterr().err
    assert "pagedkv-engine needs torch, which is not installed" in err
    assert 'pip install "pagedkv[engine]"' in err and "Traceback" not in err


def test_cli_without_rich_fails_before_the_run(tmp_path, capsys, monkeypatch):
    # rich prints the stats table only at the end; a missing rich must not cost the whole run
    monkeypatch.setitem(sys.modules, "rich", None)
    f = tmp_path / "p.txt"
    f.write_text("w10\n")
    assert main(["--prompts", str(f), "--model", _missing_model(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert 'pagedkv-engine needs rich, which is not installed: pip install "pagedkv[engine]"' in err


def test_cli_slo_flags_reach_the_table_results_and_metrics(tiny, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10 w11 w12\nw13 w14\nw15\n")
    metrics = tmp_path / "m.json"
    common = ["--prompts", str(f), "--no-chat-template", "--max-tokens", "4", "--metrics-json", str(metrics)]
    # Targets no request can miss on any machine: every request is good.
    rc, rows = _run(tiny, tmp_path, *common, "--slo-ttft", "1000", "--slo-tpot", "500")
    assert rc == 0 and len(rows) == 3
    m = json.loads(metrics.read_text())
    assert (m["slo_ttft_s"], m["slo_tpot_s"]) == (1000.0, 500.0)
    assert (m["good_requests"], m["goodput_share"]) == (3, 1.0)
    assert m["goodput_requests_per_s"] == pytest.approx(3 / m["elapsed_s"])
    for r in rows:
        assert r["meets_slo"] is True
        # TPOT of a row: (last - first token time) / (tokens - 1), from its own ttft / latency
        assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / 3)
    table = " ".join(capsys.readouterr().out.split())
    assert "TTFT <= 1000 s, TPOT <= 500 s" in table
    assert "100.0% (3/3 requests)" in table
    # A TTFT target below any real TTFT: no request is good, in the rows, the JSON and the table.
    rc, rows = _run(tiny, tmp_path, *common, "--slo-ttft", "1e-9")
    m = json.loads(metrics.read_text())
    assert rc == 0 and [r["meets_slo"] for r in rows] == [False] * 3
    assert (m["slo_ttft_s"], m["slo_tpot_s"], m["good_requests"], m["goodput_share"]) == (1e-9, 0.1, 0, 0.0)
    assert m["goodput_requests_per_s"] == 0.0
    assert "0.0% (0/3 requests)" in " ".join(capsys.readouterr().out.split())


def test_cli_help_states_the_slo_unit_and_defaults():
    from pagedkv.engine.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--slo-ttft SECONDS" in text and "--slo-tpot SECONDS" in text
    assert "in seconds (queueing included) (default: 2.0)" in text
    assert "judged on TTFT alone) (default: 0.1)" in text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--page-size", "4096"], "--page-size needs --kv-layout virtual"),
        (["--host-min-seen", "1"], "--host-min-seen needs --host-cache-bytes"),
        (["--host-eviction", "arc"], "--host-eviction needs --host-cache-bytes"),
    ],
)
def test_cli_options_of_an_unselected_feature_are_refused(tiny, tmp_path, capsys, extra, needle):
    # Silently ignored before: a run measured the paged layout / no host tier while the
    # command line asked for a page size / an admission threshold.
    f = tmp_path / "p.txt"
    f.write_text("w5\n")
    assert main(["--prompts", str(f), "--model", str(tiny.path), *extra]) == 2
    assert needle in capsys.readouterr().err

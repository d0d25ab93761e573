"""The ``pagedkv-engine`` CLI on the tiny model folder (fast), its input readers and its errors."""

from __future__ import annotations

import json

import pytest

from pagedkv.engine import PromptFileError
from pagedkv.engine.cli import main, parse_size
from pagedkv.engine.inputs import read_prompts, read_trace, synthetic_prompt


def _run(tiny, tmp_path, *extra: str) -> tuple[int, list[dict]]:
    out = tmp_path / "results.jsonl"
    rc = main(["--model", str(tiny.path), "--block-size", "4", "--kv-blocks", "128", "--no-progress",
               "--output", str(out), *extra])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return rc, rows


def test_cli_txt_prompts_write_results(tiny, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w10 w11 w12\n\nw13 w14\nw10 w11 w12 w15 w16\n")
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--max-tokens", "5", "--no-chat-template")
    assert rc == 0
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    for r in rows:
        assert set(r) >= {"id", "prompt", "output_text", "output_token_ids", "finish_reason",
                          "cached_prompt_tokens", "preemptions"}
        assert len(r["output_token_ids"]) == 5 and r["finish_reason"] == "length"
        assert r["output_text"] == tiny.tokenizer.decode(r["output_token_ids"], skip_special_tokens=True)
    assert rows[2]["cached_prompt_tokens"] in (0, 4)  # may share a block with prompt 0
    shown = capsys.readouterr().out
    assert "output tokens/s" in shown and "preemptions" in shown and "prefix hit rate" in shown


def test_cli_jsonl_with_ids_chat_template_and_sampling(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "w20 w21", "max_tokens": 3}) + "\n"
                 + json.dumps({"id": "b", "messages": [{"role": "user", "content": "w22"}]}) + "\n")
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--max-tokens", "6", "--temperature", "0.7",
                    "--top-p", "0.9", "--top-k", "20", "--seed", "4", "--n", "2")
    assert rc == 0 and [r["id"] for r in rows] == ["a", "b"]
    assert len(rows[0]["output_token_ids"]) == 3 and len(rows[1]["output_token_ids"]) == 6
    assert len(rows[1]["outputs"]) == 2
    rc2, rows2 = _run(tiny, tmp_path, "--prompts", str(f), "--max-tokens", "6", "--temperature", "0.7",
                      "--top-p", "0.9", "--top-k", "20", "--seed", "4", "--n", "2")
    assert [r["outputs"] for r in rows2] == [r["outputs"] for r in rows]  # seeded: reproducible


def test_cli_trace_mode_and_rejection(tiny, tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nx,40,8\nx,12,5\nx,4000,10\n")
    rc, rows = _run(tiny, tmp_path, "--trace", str(f), "--trace-limit", "3", "--kv-blocks", "33",
                    "--preemption", "swap", "--beam-width", "1")
    assert rc == 0
    assert [len(r.get("output_token_ids", [])) for r in rows] == [8, 5, 0]
    assert "error" in rows[2] and "4000 tokens does not fit the model context" in rows[2]["error"]


@pytest.mark.parametrize("content,suffix,needle", [
    ("{not json\n", ".jsonl", "p.jsonl:1: not valid JSON"),
    ('{"prompt": ""}\n', ".jsonl", "p.jsonl:1: needs a non-empty string 'prompt'"),
    ('["a"]\n', ".jsonl", "expected a JSON object"),
    ('{"prompt": "x", "max_tokens": 0}\n', ".jsonl", "max_tokens=0"),
    ("\n\n", ".txt", "holds no prompt"),
    ("x\n", ".csv", "must end in .txt or .jsonl"),
])
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
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--limit", "1", "--kv-blocks", "100000000000")
    assert rc == 2 and rows == []
    err = capsys.readouterr().err
    assert "KV cache of 100000000000 blocks x " in err and "does not fit" in err
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
    rc, rows = _run(tiny, tmp_path, "--prompts", str(f), "--kv-blocks", "2", "--no-chat-template",
                    "--max-tokens", "8")
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

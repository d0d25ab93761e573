"""Per-line validation of prompts JSONL files and the file-kind wording of reader errors
(``pagedkv.engine.inputs``); no model is loaded."""

from __future__ import annotations

import json

import pytest

from pagedkv.engine import PromptFileError
from pagedkv.engine.cli import SAMPLING_OPTIONS
from pagedkv.engine.inputs import read_prompts, read_trace


def _jsonl(tmp_path, *objs) -> str:
    f = tmp_path / "p.jsonl"
    f.write_text("".join((json.dumps(o) if not isinstance(o, str) else o) + "\n" for o in objs))
    return str(f)


def test_duplicate_explicit_ids_name_the_id_and_both_lines(tmp_path):
    f = _jsonl(
        tmp_path,
        {"prompt": "What is 2 plus 2?", "id": "a"},
        "",
        {"prompt": "b", "id": "b"},
        {"prompt": "hi", "id": "a"},
    )
    with pytest.raises(PromptFileError, match=r"p\.jsonl:4: duplicate request id 'a' \(already used on line 1\)"):
        read_prompts(f)


def test_int_and_string_ids_that_print_the_same_are_duplicates(tmp_path):
    f = _jsonl(tmp_path, {"prompt": "x", "id": 7}, {"prompt": "y", "id": "7"})
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: duplicate request id '7' \(already used on line 1\)"):
        read_prompts(f)


def test_default_id_colliding_with_an_explicit_id_is_a_duplicate(tmp_path):
    # The second prompt has no id, so it gets its 0-based position "1", which line 1 claimed.
    f = _jsonl(tmp_path, {"prompt": "x", "id": "1"}, {"prompt": "y"})
    with pytest.raises(
        PromptFileError,
        match=r"p\.jsonl:2: duplicate request id '1' \(already used on line 1; "
        r"a line without \"id\" gets its 0-based position",
    ):
        read_prompts(f)


def test_valid_lines_are_returned_unchanged_and_extra_metadata_is_kept(tmp_path):
    rows = [
        {"prompt": "x", "id": 3, "cache_salt": "tenant-1", "system": "be brief", "max_tokens": 4},
        {"messages": [{"role": "user", "content": "hi"}], "id": "m", "category": "chat"},
        {"prompt": "z"},
    ]  # default id "2" collides with nothing
    assert read_prompts(_jsonl(tmp_path, *rows)) == rows


@pytest.mark.parametrize(
    "obj,needle",
    [
        ({"prompt": "hi", "cache_salt": 5}, "'cache_salt' must be a string, got int 5"),
        ({"prompt": "hi", "cache_salt": None}, "'cache_salt' must be a string, got NoneType None"),
        ({"prompt": "hi", "system": ["s"]}, "'system' must be a string, got list ['s']"),
        ({"prompt": "hi", "id": None}, "'id' must be a non-empty string or an integer, got NoneType None"),
        ({"prompt": "hi", "id": ""}, "'id' must be a non-empty string or an integer, got str ''"),
        ({"prompt": "hi", "id": True}, "'id' must be a non-empty string or an integer, got bool True"),
        ({"prompt": "hi", "id": 1.5}, "'id' must be a non-empty string or an integer, got float 1.5"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens=True must be an integer >= 1"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens=2.5 must be an integer >= 1"),
        ({"prompt": "hi", "max_tokens": "3"}, "max_tokens='3' must be an integer >= 1"),
        ({"prompt": 5}, "needs a non-empty string 'prompt' (or 'messages'), got 5"),
        (
            {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
            "has both 'prompt' and 'messages'; give one",
        ),
        ({"messages": [{"content": "hi"}]}, "'messages' must be a non-empty list of"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "'messages' must be a non-empty list of"),
        ({"messages": [{"role": "user", "content": None}]}, "'messages' must be a non-empty list of"),
        (
            {"prompt": "hi", "temperature": 0.7},
            "'temperature' cannot be set per request in a prompts file; use --temperature",
        ),
        ({"prompt": "hi", "n": 2}, "'n' cannot be set per request in a prompts file; use --n"),
        ({"prompt": "hi", "stop": ["."]}, "'stop' cannot be set per request in a prompts file; use --stop"),
        ({"prompt": "hi", "top_p": 0.9}, "use --top-p"),
        (
            {"prompt": "hi", "length_penalty": 2.0},
            "'length_penalty' cannot be set per request in a prompts file; it applies to every request",
        ),
    ],
)
def test_wrong_field_types_name_file_line_and_field(tmp_path, obj, needle):
    f = _jsonl(tmp_path, {"prompt": "fine"}, obj)
    with pytest.raises(PromptFileError) as info:
        read_prompts(f, sampling_options=SAMPLING_OPTIONS)
    msg = str(info.value)
    assert msg.startswith(f"{f}:2: "), msg
    assert needle in msg, msg


def test_missing_files_name_their_kind(tmp_path):
    with pytest.raises(PromptFileError, match=r"^trace file '.*t\.csv' does not exist$"):
        read_trace(tmp_path / "t.csv")
    with pytest.raises(PromptFileError, match=r"^prompts file '.*p\.txt' does not exist$"):
        read_prompts(tmp_path / "p.txt")
    bad = tmp_path / "t.jsonl"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(PromptFileError, match=r"^cannot read trace file '.*t\.jsonl'"):
        read_trace(bad)


def test_sampling_options_are_cli_options_and_the_reader_does_not_import_the_cli(tmp_path):
    import subprocess
    import sys

    from pagedkv.engine.cli import build_parser
    from pagedkv.engine.sampling import SamplingParams

    help_text = build_parser().format_help()
    fields = set(SamplingParams.__dataclass_fields__)
    for field, flag in SAMPLING_OPTIONS.items():
        assert field in fields and flag in help_text, (field, flag)
    f = _jsonl(tmp_path, {"prompt": "hi", "temperature": 0.5})
    code = (
        "import sys\nfrom pagedkv.engine.inputs import read_prompts\n"
        "try:\n    read_prompts(sys.argv[1])\nexcept ValueError as e:\n    print(e)\n"
        "print('pagedkv.engine.cli' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, f], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        f"{f}:1: 'temperature' cannot be set per request in a prompts file; it applies to every request",
        "False",
    ]


def test_trace_rows_keep_lengths_arrivals_and_hash_ids_as_recorded(tmp_path):
    from pagedkv.engine.inputs import read_trace_rows

    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.5000000,40,0\n"
        "2023-11-16 18:15:48.2500000,12,5\n"
        "not a time,7,3\n"
    )
    rows = read_trace_rows(azure)
    assert [(r.line, r.prompt_tokens, r.output_tokens) for r in rows] == [(2, 40, 0), (3, 12, 5), (4, 7, 3)]
    assert rows[1].arrival_s - rows[0].arrival_s == pytest.approx(1.75)
    assert rows[2].arrival_s is None and rows[0].hash_ids is None
    moon = tmp_path / "m.jsonl"
    moon.write_text(
        json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [4, 5]})
        + "\n\n"
        + json.dumps({"timestamp": 2000, "input_length": 3, "output_length": 1, "hash_ids": [6]})
        + "\n"
    )
    rows = read_trace_rows(moon, limit=1)
    assert rows == [read_trace_rows(moon)[0]] and rows[0].arrival_s == 1.5 and rows[0].hash_ids == (4, 5)
    assert [r.line for r in read_trace_rows(moon)] == [1, 3]
    # read_trace serves the same rows, scaled and at least one token each
    assert [(r.prompt_tokens, r.output_tokens) for r in read_trace(azure, scale=0.5)] == [(20, 1), (6, 2), (4, 2)]


@pytest.mark.parametrize(
    ("messages", "ok"),
    [
        ([{"role": "user", "content": "hi"}], True),
        (({"role": "system", "content": ""}, {"role": "user", "content": "x", "name": "n"}), True),
        ([], False),
        ("hi", False),
        ([{"role": "", "content": "hi"}], False),
        ([{"role": "user"}], False),
        ([{"role": "user", "content": 3}], False),
        ([["user", "hi"]], False),
    ],
)
def test_one_chat_message_rule_for_the_engine_and_the_prompts_reader(tmp_path, messages, ok):
    from pagedkv.engine.chat import valid_messages

    assert valid_messages(messages) is ok
    f = _jsonl(tmp_path, {"messages": list(messages) if isinstance(messages, tuple) else messages})
    if ok:
        assert read_prompts(f)[0]["messages"] == list(messages)
    else:
        with pytest.raises(PromptFileError, match="'messages' must be a non-empty list of"):
            read_prompts(f)


def test_short_repr_cuts_long_values_with_an_ellipsis():
    from pagedkv._repr import short_repr

    assert short_repr("abc") == "'abc'"
    assert short_repr("x" * 100, 10) == "'xxxxxx..." and len(short_repr(list(range(500)))) == 80

"""The shared JSONL reader: records with their file:line, blank lines passed over, the first bad line named."""
import re

import pytest

from llds_jax.data.jsonl import JsonlLines, iter_jsonl, parse_object


def test_records_come_with_file_and_line_blank_lines_counted(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"a": 2}\r\n{"a": 3}')
    assert list(iter_jsonl(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:4", {"a": 2}), (f"{path}:5", {"a": 3})]


@pytest.mark.parametrize("bad, reason", [
    (b'{"a": ', "invalid JSON (Expecting value at column 7)"),
    (b"\xff\xfe{}", "not UTF-8 (invalid start byte at byte 0)"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"text"', "expected a JSON object, got str"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n\n' + bad + b'\n{"a": 2}\n')
    records = iter_jsonl(path)
    assert next(records) == (f"{path}:1", {"a": 1})
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}:3: {reason}')}$") as error:
        next(records)
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_parse_object_gives_the_reason_alone():
    assert parse_object(b'{"id": "1"}\n') == {"id": "1"}
    with pytest.raises(ValueError, match=r"^invalid JSON \(Expecting value at column 1\)$"):
        parse_object(b"not json")


@pytest.mark.parametrize("content, numbers, last_line", [
    (b"", [], 0), (b"\n \n", [], 2), (b'{}\n\n{}\n\n', [1, 3], 4)])
def test_line_counts_blank_lines_and_an_empty_file(content, numbers, last_line):
    lines = JsonlLines(content.splitlines(keepends=True))
    assert [number for number, _ in lines] == numbers
    assert lines.line == last_line


def test_a_line_cut_inside_a_string_reads_unterminated_with_its_own_column(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"a": "cut\r\n')
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:1: invalid JSON \\(Unterminated string .*"
                                         " column 7\\)$"):
        list(iter_jsonl(path))

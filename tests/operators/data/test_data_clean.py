"""Cleaning rules of trainforge.data.clean, one behaviour per test (pure unit tests)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from trainforge.data.clean import clean_file
from trainforge.data.errors import SourceDecodeError

# The World Library notice as it appears between the plays of Gutenberg's 1990s complete works.
WORLD_LIBRARY = """<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC., AND IS
PROVIDED BY PROJECT GUTENBERG ETEXT OF ILLINOIS BENEDICTINE COLLEGE
WITH PERMISSION.  ELECTRONIC AND MACHINE READABLE COPIES MAY BE
DISTRIBUTED SO LONG AS SUCH COPIES (1) ARE FOR YOUR OR OTHERS
PERSONAL USE ONLY, AND (2) ARE NOT DISTRIBUTED OR USED
COMMERCIALLY.  PROHIBITED COMMERCIAL DISTRIBUTION INCLUDES BY ANY
SERVICE THAT CHARGES FOR DOWNLOAD TIME OR FOR MEMBERSHIP.>>"""


def clean(
    tmp_path: Path, content: str | bytes, *, gutenberg=True, whitespace=True, unicode_form="NFC"
):
    path = tmp_path / "doc.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return clean_file(
        path,
        strip_gutenberg_boilerplate=gutenberg,
        normalize_whitespace=whitespace,
        unicode_normalization=unicode_form,
    )


def test_modern_start_and_end_markers(tmp_path):
    text = (
        "The Project Gutenberg eBook of Hamlet\n\nThis eBook is for the use of anyone\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\nHAMLET\n\nTo be.\n\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\nSection 1. General Terms\n"
        "Project Gutenberg is a registered trademark\n"
    )
    out = clean(tmp_path, text)
    assert out.text == "HAMLET\n\nTo be."
    assert out.counts.gutenberg_header_lines == 4
    assert out.counts.gutenberg_footer_lines == 3


def test_old_small_print_header_and_end_of_footer(tmp_path):
    text = (
        "The Project Gutenberg Etext of As You Like It\n**Welcome To The World of Free Plain "
        "Vanilla Electronic Texts**\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93"
        "*END*\nAs you Like it\n\nActus Primus.\nEnd of Project Gutenberg Etext of As You Like "
        "It by Shakespeare\n"
    )
    out = clean(tmp_path, text)
    assert out.text == "As you Like it\n\nActus Primus."
    assert out.counts.gutenberg_header_lines == 3
    assert out.counts.gutenberg_footer_lines == 1


def test_world_library_notice_blocks_are_dropped_wherever_they_are(tmp_path):
    text = f"{WORLD_LIBRARY}\n\nTHE TEMPEST\n\nACT I.\n{WORLD_LIBRARY}\nBoatswain!\n"
    out = clean(tmp_path, text)
    assert out.text == "THE TEMPEST\n\nACT I.\nBoatswain!"
    assert out.counts.gutenberg_notice_lines == 16
    assert "ELECTRONIC" not in out.text


def test_other_angle_bracket_blocks_are_kept(tmp_path):
    text = "<<a quoted aside,\nstill quoted>>\nline\n<<unterminated\nrest\n"
    out = clean(tmp_path, text)
    assert out.text == "<<a quoted aside,\nstill quoted>>\nline\n<<unterminated\nrest"
    assert out.counts.gutenberg_notice_lines == 0


def test_gutenberg_rule_off_keeps_everything(tmp_path):
    text = f"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n{WORLD_LIBRARY}\nbody\n"
    out = clean(tmp_path, text, gutenberg=False)
    assert out.text.startswith("*** START OF THE PROJECT GUTENBERG")
    assert "WORLD LIBRARY" in out.text
    assert out.counts.gutenberg_header_lines == out.counts.gutenberg_notice_lines == 0


def test_whitespace_rules_and_counts(tmp_path):
    text = "\n\n  Two  households,\t both   \nalike  \n\n\n\n  In fair Verona\n\n\n"
    out = clean(tmp_path, text)
    assert out.text == " Two households, both\nalike\n\n In fair Verona"
    assert out.counts.blank_lines == 2 + 2 + 2  # leading, run of 3 kept as 1, trailing
    assert out.counts.whitespace_chars == (1 + 1 + 1 + 3) + 2 + 1


def test_whitespace_off_keeps_lines_but_normalises_line_endings(tmp_path):
    out = clean(tmp_path, b"a  b \r\n\r\n\r\n\tc\r\n", whitespace=False)
    assert out.text == "a  b \n\n\n\tc"


def test_crlf_and_bom_are_not_text(tmp_path):
    out = clean(tmp_path, b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert out.text == "line one\nline two"


@pytest.mark.parametrize(
    ("form", "expected", "changed"),
    [
        ("NFC", "caf\u00e9 \ufb01", 1),
        ("NFKC", "caf\u00e9 fi", 1),
        ("none", "cafe\u0301 \ufb01", 0),
    ],
)
def test_unicode_normalisation(tmp_path, form, expected, changed):
    out = clean(tmp_path, "cafe\u0301 \ufb01\n", unicode_form=form)
    assert out.text == expected
    assert out.counts.unicode_changed_lines == changed


def test_hashes_and_sizes(tmp_path):
    raw = b"  hello   world \n"
    out = clean(tmp_path, raw)
    assert out.file_bytes == len(raw)
    assert out.file_sha256 == hashlib.sha256(raw).hexdigest()
    assert out.text_sha256 == hashlib.sha256(b" hello world").hexdigest()


@pytest.mark.parametrize(
    ("raw", "offset"),
    [
        (b"hello\nwor\xffld\n", 9),
        (b"\xef\xbb\xbfok\n\xe2\x82\n", 6),  # truncated 3-byte sequence on line 2
        (b"caf\xe9\n", 3),  # latin-1
    ],
)
def test_not_utf8_names_file_and_byte_offset(tmp_path, raw, offset):
    with pytest.raises(SourceDecodeError) as info:
        clean(tmp_path, raw)
    assert info.value.offset == offset
    assert f"byte offset {offset}" in str(info.value)
    assert str(tmp_path / "doc.txt") in str(info.value)

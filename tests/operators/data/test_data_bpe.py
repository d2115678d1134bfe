"""Byte-level BPE: EOS id 0, lossless round trip, determinism across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from trainforge.data.bpe import train_tokenizer
from trainforge.data.settings import EOS_TOKEN

_TRAIN_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from conftest import make_text
    from trainforge.data.bpe import train_tokenizer
    texts = [make_text(i, 40) for i in range(8)]
    tok = train_tokenizer(texts, vocab_size=400, special_tokens=["<|endoftext|>"])
    sys.stdout.write(tok.to_str(pretty=True))
""")


def test_eos_is_id_zero_and_round_trip_is_lossless():
    texts = ["To be, or not to be:\n that is the question.", "caf\u00e9 \u2014 \U0001f600 \t tabs"]
    tok = train_tokenizer(texts * 5, vocab_size=300, special_tokens=[EOS_TOKEN])
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert 257 <= tok.get_vocab_size() <= 300
    for text in texts + ["unseen \u00fc\u00df \u4e2d\u6587 words"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert 0 not in ids  # EOS never comes from text
        assert max(ids) < 300
        assert tok.decode(ids) == text


def test_training_is_byte_identical_across_processes_and_thread_counts():
    """Fresh interpreters have fresh Rust hash seeds; rayon thread counts differ."""
    here = os.path.dirname(__file__)
    repo = os.path.abspath(os.path.join(here, "..", "..", ".."))
    outputs = []
    for threads in ("1", "2", "4"):
        env = dict(os.environ, RAYON_NUM_THREADS=threads, PYTHONHASHSEED=threads)
        proc = subprocess.run(
            [sys.executable, "-c", _TRAIN_SCRIPT, here, repo],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] and outputs[0] == outputs[1] == outputs[2]

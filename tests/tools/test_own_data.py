"""benchmarks/own_data.py's converter: raw SpamAssassin messages to the TSV pair task the example reads."""

from pathlib import Path

from benchmarks.own_data import _user_lines, spam_assassin_to_tsv

PLAIN = """From: a@example.org
Subject: Re:\tweekly\n build report
Content-Type: text/plain; charset=us-ascii

The build {i} passed.
All\ttests ran.
"""
HTML = """From: b@example.com
Subject: WIN $1000 now {i}
MIME-Version: 1.0
Content-Type: text/html; charset=iso-8859-1

<html><head><style>p {{color: red}}</style></head><body><p>Click&nbsp;<b>here</b> &amp; win {i}</p></body></html>
"""


def _corpus(root: Path) -> Path:
    for group, template, n in (("easy-ham-1", PLAIN, 14), ("spam-1", HTML, 6)):
        (root / "data" / group).mkdir(parents=True)
        for i in range(n):
            (root / "data" / group / f"{i:05d}.abc.txt").write_text(template.format(i=i))
    (root / "data" / "spam-1" / "bad.txt").write_bytes(b"Subject: =?bogus?Q?x?=\nContent-Type: text/plain; "
                                                        b"charset=no-such-charset\n\ncheap \xff pills\n")
    return root


def test_messages_become_a_pair_task_the_example_reads(example, tmp_path):
    out = tmp_path / "tsv"
    counts = spam_assassin_to_tsv(_corpus(tmp_path / "package"), out, dev_share=0.25, body_chars=40)
    assert counts == {"train": 16, "dev": 5, "spam": 7}
    lines = (out / "train.tsv").read_text().splitlines() + (out / "dev.tsv").read_text().splitlines()[1:]
    assert lines[0] == "subject\tbody\tlabel" and len(lines) == 22
    rows = [line.split("\t") for line in lines[1:]]
    assert all(len(row) == 3 for row in rows)  # tabs and newlines inside a field would break the table
    ham = next(row for row in rows if row[0].startswith("Re: weekly"))
    assert ham[1].startswith("The build") and "All tests ran." in ham[1] and ham[2] == "ham"
    spam = next(row for row in rows if row[0].startswith("WIN"))
    # HTML reduced to its text, entities decoded, the style sheet dropped, the body cut to body_chars
    assert spam[1].startswith("Click here & win") and "<" not in spam[1] and "color" not in spam[1]
    assert all(len(row[1]) <= 40 for row in rows) and spam[2] == "spam"

    data = example.TextClassificationData(dataset=str(out), text_column="subject", text_pair_column="body")
    assert data.label_names == ["ham", "spam"] and data.num_labels == 2
    assert len(data.train_rows) == 16 and len(data.val_rows) == 5  # dev.tsv, not a 10% cut


def test_the_report_keeps_what_a_user_reads_without_warning_locations():
    log = "\n".join([
        "Epoch 1: 100%",
        "onebit_adam: compression stage from optimizer step 81",
        "MomentumMask: 12 momentum coordinates masked in 1 parameter(s)",
        "  bert.bert.embeddings.word_embeddings.weight: 12 of 40 (30.0%)",
        "/site/lightning_onebit/callbacks.py:263: MomentumMask(auto=True) masked more than 1% of ...",
        "               optimizer: OnebitAdam",
    ])
    assert _user_lines(log) == [
        "onebit_adam: compression stage from optimizer step 81",
        "MomentumMask: 12 momentum coordinates masked in 1 parameter(s)",
        "  bert.bert.embeddings.word_embeddings.weight: 12 of 40 (30.0%)",
        "MomentumMask(auto=True) masked more than 1% of ...",
    ]

"""The default rule table on a corpus of real kernel names (public traces and engines' sources)."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from specpilot.probes.classify import Classifier, load_rules
from specpilot.probes.kernel_names import split_name
from specpilot.probes.traces.model import KernelGroup

CORPUS = Path(__file__).parent / "fixtures" / "kernel_names.tsv"


def _rows():
    with open(CORPUS, newline="") as fh:
        lines = (line for line in fh if not line.startswith("#"))
        return list(csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\"))


def test_corpus_is_large_and_covers_every_class_and_framework():
    rows = _rows()
    assert len(rows) >= 200
    classes = Counter(r["class"] for r in rows)
    for c in ("linear", "attention", "moe", "moe_routing", "norm", "communication", "gdn", "sampling", "elementwise"):
        assert classes[c] >= 4, (c, classes)
    sources = " ".join(r["source"] for r in rows)
    for repo in ("vllm-project/vllm", "sgl-project/sglang", "NVIDIA/TensorRT-LLM", "flashinfer-ai/flashinfer",
                 "Dao-AILab/flash-attention", "AMD-AGI/TraceLens", "NVIDIA/nccl", "ROCm/"):
        assert repo in sources, repo


def test_every_corpus_name_gets_its_class():
    clf = Classifier(load_rules())
    wrong = []
    for r in _rows():
        got = clf.classify(KernelGroup(step=0, name=r["name"])).cls
        if got != r["class"]:
            wrong.append(f"{r['class']:>12} <- {got:<12} {split_name(r['name'])[0][:80]}")
    assert not wrong, "\n".join(wrong)

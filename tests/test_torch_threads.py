"""torch's CPU thread count is the process's: a command run in-process (a library caller, a test)
or a scorer leaves it as it found it, while its own work runs with the threads it chose."""

from __future__ import annotations

import pytest
import torch

from specpilot.machine import torch_threads


@pytest.fixture
def threads_at_3():
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(old)


def test_torch_threads_sets_inside_and_restores_after(threads_at_3):
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3
    with torch_threads(0):   # 0: as torch has them
        assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("batch", ["1", "2"])
def test_probe_rows_in_process_leaves_the_thread_count(run_cli, threads_at_3, monkeypatch, batch):
    """The probe times with --threads 1 (what it records) and gives the process back its 3."""
    import specpilot.engine.graphs as graphs

    seen = []
    real = graphs.time_calls

    def spy(fn, reps, warmup, cuda):
        seen.append(torch.get_num_threads())
        return real(fn, reps, warmup, cuda)

    monkeypatch.setattr(graphs, "time_calls", spy)
    code, out, err = run_cli("probe", "rows", "--model", "tiny", "--context", "16", "--threads", "1",
                             "--device", "cpu", "--batch", batch, "--rows", "1,2", "--reps", "1",
                             "--warmup", "0", "--format", "json")
    assert code == 0, err
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 3


def test_builtin_scorer_scores_with_its_threads_and_gives_them_back(threads_at_3, monkeypatch):
    """The built-in tiny scorer runs its forwards with one thread (a tiny model's choice) and leaves
    the process's count alone, at load and after scoring."""
    from specpilot.auditors.round.engines import EngineScorer
    from specpilot.auditors.scorer import Scorer

    seen = []
    real = EngineScorer.score

    def spy(self, *a, **k):
        seen.append(torch.get_num_threads())
        return real(self, *a, **k)

    monkeypatch.setattr(EngineScorer, "score", spy)
    scorer = Scorer.load("tiny", device="cpu")
    assert torch.get_num_threads() == 3
    scores = scorer.score([([1, 2, 3], [4, 5])])
    assert len(scores) == 1 and len(scores[0].argmax) == 2
    assert seen == [1] and torch.get_num_threads() == 3


def test_engine_loads_with_its_threads_and_gives_them_back(threads_at_3, monkeypatch):
    """The model is built (weights made, converted, warmed up) with the engine's --threads, not
    torch's every-core default, and the process keeps its own count after."""
    import specpilot.engine.api as api

    seen = []
    real = api.build_model

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(api, "build_model", spy)
    engine = api.load_engine("model=tiny,mode=chain,drafter=model,draft_model=tiny,threads=2,ctx=64")
    assert seen == [2, 2]   # the target and the draft model
    assert engine.decoder.threads == 2
    assert torch.get_num_threads() == 3

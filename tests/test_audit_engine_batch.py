"""`audit` with an `engine:` system of batch=B: its prompts decoded B at a time on the batch decoder."""

from __future__ import annotations

import json

import pytest

from specpilot.auditors.outputs import Prompt, read_outputs
from specpilot.auditors.systems import BATCH_ROUNDS, CollectError, EngineGenerator, collect
from specpilot.errors import InputError

SPEC = "engine:model=tiny,mode=tree,drafter=ngram,nodes=8,depth=4,dtype=float32,ctx=96"


def _prompts(n: int, vocab: int) -> list[Prompt]:
    return [Prompt(f"p{i}", [(7 * i + 3 * j + 1) % vocab for j in range(5 + i % 4)]) for i in range(n)]


def test_batched_engine_collects_what_one_request_at_a_time_gives(tmp_path):
    """Three chunks (the last of one prompt) through the batch decoder give every prompt the
    output the one-request engine gives (CPU fp32), in prompt order."""
    one, many = EngineGenerator(SPEC), EngineGenerator(SPEC + ",batch=3")
    assert (one.batch, many.batch) == (1, 3)
    prompts = _prompts(2 * BATCH_ROUNDS * 3 + 1, one.engine.model.spec.vocab_size)
    chunks = []
    run = many.generate_many
    many.generate_many = lambda p, m: chunks.append(len(p)) or run(p, m)
    want = collect(one, prompts, 6)
    got = collect(many, prompts, 6, save_to=str(tmp_path / "b.jsonl"))
    assert chunks == [BATCH_ROUNDS * 3, BATCH_ROUNDS * 3, 1]
    assert [r.output_ids for r in got.rows] == [r.output_ids for r in want.rows]
    assert all(len(r.output_ids) == 6 for r in got.rows)
    assert [r.id for r in read_outputs(tmp_path / "b.jsonl").rows] == [p.id for p in prompts]


def test_a_prompt_the_engine_cannot_run_is_refused_before_any_runs(tmp_path):
    gen = EngineGenerator(SPEC + ",batch=2")
    prompts = _prompts(2 * BATCH_ROUNDS + 3, gen.engine.model.spec.vocab_size)
    prompts[2 * BATCH_ROUNDS + 1] = Prompt("long", [1] * 200)   # past the 96 cache slots
    save = tmp_path / "o.jsonl"
    with pytest.raises(InputError, match="prompt 'long': .*raise ctx= in the engine spec, or run and serve's --ctx"):
        collect(gen, prompts, 6, save_to=str(save))
    assert not save.exists()


def test_a_failing_chunk_keeps_the_chunks_before_it(tmp_path, monkeypatch):
    """A failure the up-front check cannot see (here: the check skipped) keeps what completed."""
    gen = EngineGenerator(SPEC + ",batch=2")
    monkeypatch.setattr(gen, "check", lambda *a: None)
    prompts = _prompts(2 * BATCH_ROUNDS + 3, gen.engine.model.spec.vocab_size)
    prompts[2 * BATCH_ROUNDS + 1] = Prompt("long", [1] * 200)
    save = tmp_path / "o.jsonl"
    with pytest.raises(CollectError) as ei:
        collect(gen, prompts, 6, save_to=str(save))
    assert ei.value.exit_code == 2 and ei.value.kept == 2 * BATCH_ROUNDS and "raise ctx=" in str(ei.value)
    assert [r.id for r in read_outputs(save).rows] == [p.id for p in prompts[:2 * BATCH_ROUNDS]]


def test_audit_collect_runs_a_batched_engine(run_cli, tmp_path):
    """The command a user types: the batched engine's outputs file equals the one-request one's."""
    pf = tmp_path / "prompts.jsonl"
    rows = [{"schema": "specpilot.prompts/1", "id": p.id, "prompt_ids": p.prompt_ids} for p in _prompts(5, 200)]
    pf.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = []
    for extra in ("", ",batch=4"):
        save = tmp_path / f"out{extra.replace(',', '_').replace('=', '')}.jsonl"
        code, out, err = run_cli("audit", "collect", SPEC + extra, "--prompts", pf, "--save", save,
                                 "--max-new-tokens", "5", "--format", "json")
        assert code == 0, err
        assert json.loads(out)["tokens"] == 25
        files.append([(r.id, r.output_ids) for r in read_outputs(save).rows])
    assert files[0] == files[1]


def test_a_collection_killed_outright_keeps_its_rows_so_far(tmp_path, monkeypatch):
    """A run that dies without a signal to catch (SIGKILL, the OOM killer; here an exception the
    collection does not handle) has rewritten --save with the rows so far, whole, for --resume."""
    from specpilot.auditors import systems
    from specpilot.auditors.outputs import Prompt, read_outputs

    class Dies(systems.Generator):
        def __init__(self):
            self.n = 0

        def generate(self, prompt_ids, max_new_tokens):
            self.n += 1
            if self.n == 4:
                raise SystemError("killed")
            return [7] * max_new_tokens

    monkeypatch.setattr(systems, "SAVE_EVERY_S", 0.0)
    prompts = [Prompt(f"p{i}", [1, 2, i]) for i in range(6)]
    save = tmp_path / "out.jsonl"
    with pytest.raises(SystemError):
        systems.collect(Dies(), prompts, 3, save_to=str(save), system="engine:model=tiny")
    rows = read_outputs(save).rows
    assert [r.id for r in rows] == ["p0", "p1", "p2"] and all(r.output_ids == [7, 7, 7] for r in rows)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "input"])
def test_a_run_that_stops_leaves_an_earlier_complete_outputs_file_as_it_was(tmp_path, monkeypatch, stop):
    """--save-outputs of an audit run again: the earlier run's complete file is replaced by this
    run's complete set only; stopped half way (a signal, a refused prompt), it is left as it was."""
    from specpilot.auditors import systems
    from specpilot.auditors.outputs import Prompt
    from specpilot.errors import InputError

    class Stops(systems.Generator):
        def __init__(self):
            self.n = 0

        def generate(self, prompt_ids, max_new_tokens):
            self.n += 1
            if self.n == 2:
                raise KeyboardInterrupt if stop is KeyboardInterrupt else InputError("refused")
            return [7] * max_new_tokens

    monkeypatch.setattr(systems, "SAVE_EVERY_S", 0.0)
    prompts = [Prompt(f"p{i}", [1, 2, i]) for i in range(3)]
    save = tmp_path / "out.jsonl"
    systems.collect(_Echo(), prompts, 3, save_to=str(save))
    before = save.read_bytes()
    with pytest.raises((KeyboardInterrupt, systems.CollectError)) as e:
        systems.collect(Stops(), prompts, 3, save_to=str(save))
    assert save.read_bytes() == before
    said = "\n".join(getattr(e.value, "__notes__", [])) + str(e.value)
    assert "holds an earlier run's outputs, left as they were" in said


class _Echo:
    def generate(self, prompt_ids, max_new_tokens):
        return [5] * max_new_tokens

    def check(self, prompt_ids, max_new_tokens):
        pass

    def close(self):
        pass

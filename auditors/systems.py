"""SYSTEM specs for the audit: an outputs file, an embedded-engine spec, or an HTTP server.

- ``path/to/outputs.jsonl``: read as is (``specpilot.outputs/1``).
- ``engine:model=smollm2,mode=tree,nodes=32``: the embedded engine (``specpilot.engine.api``)
  generates greedily for each prompt.
- ``http://host:port``: an SGLang-compatible server's native ``/generate`` (greedy, token ids).

Running systems need prompts. :func:`collect` runs one over the prompts and writes the outputs
file as it goes: when the run fails part-way (server died, timed out, answered garbage) the rows
already collected are kept in the file the user named and the error says how many.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specpilot.errors import EnvironmentMissing, InputError, SpecPilotError, about_prompt

from .fanout import in_threads
from .outputs import OutputRow, Outputs, Prompt, key, read_outputs, write_outputs


@dataclass
class SystemSpec:
    kind: str  # "file" | "engine" | "http"
    spec: str
    name: str

    @property
    def needs_prompts(self) -> bool:
        return self.kind != "file"


def parse_system(spec: str, name: str | None = None, files: bool = True) -> SystemSpec:
    """The system ``spec`` names: a server URL, an ``engine:`` spec (checked now, its model
    too) or, with ``files``, an outputs JSONL file (``compare`` times systems, so it passes
    False: its errors then name only what can be timed)."""
    s = spec.strip()
    if s.lower().startswith(("http://", "https://")):   # a scheme is case-insensitive (HTTP://...)
        from .http_client import parse_url

        return SystemSpec("http", parse_url(s), name or s)
    if s.startswith("engine:"):   # checked now, its model too, before any system of the command runs
        from specpilot.engine.api import resolve_model
        from specpilot.engine.spec import EngineSpec

        try:
            parsed = EngineSpec.parse(s, strict=True)
            resolve_model(parsed.model, parsed.random)
            if parsed.drafter == "model":
                from specpilot.engine.api import TINY_CONFIGS

                try:
                    resolve_model(parsed.draft_model, parsed.random or parsed.draft_model in TINY_CONFIGS)
                except InputError as e:
                    raise InputError(f"draft_model: {e}") from None
        except InputError as e:
            raise InputError(str(e) if s in str(e) else f"{s}: {e}") from None
        return SystemSpec("engine", s, name or s)
    p = Path(s).expanduser()
    if p.is_file() and files:
        return SystemSpec("file", str(p), name or p.name)
    kinds = "an engine: spec (engine:model=smollm2,mode=tree,nodes=32) or a server URL (http://127.0.0.1:30000)"
    if not files:
        what = "an outputs file cannot be timed" if p.is_file() else "neither an engine: spec nor a server URL"
        raise InputError(f"{spec}: {what}; a SYSTEM to time is {kinds}, or use --base-cmd/--candidate-cmd")
    if p.exists():
        raise InputError(f"{spec}: not a file; a SYSTEM is an outputs JSONL file, an engine: spec or http://host:port")
    raise InputError(f"{spec}: no such file; a SYSTEM is an outputs JSONL file, {kinds}")


class Generator:
    """Something that turns prompt ids into greedy output ids."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """InputError for a prompt the system cannot run, where it can tell before running any."""

    def close(self) -> None:
        pass


class HttpGenerator(Generator):
    thread_safe = True  # one HTTP request (and connection) per call

    def __init__(self, url: str, timeout: float):
        from .http_client import GenerateClient

        self.client = GenerateClient(url, timeout=timeout)
        self.client.health()

    def generate(self, prompt_ids, max_new_tokens):
        return self.client.generate(prompt_ids, max_new_tokens)


class EngineGenerator(Generator):
    """The embedded engine; with ``batch=B`` in its spec (B > 1) prompts run through its continuous
    batching decoder, up to B decoded together (:meth:`generate_many`), as ``run --batch`` does."""

    def __init__(self, spec: str):
        try:
            from specpilot.engine.api import EngineSpec, load_engine
        except ImportError as e:
            raise EnvironmentMissing(f"{spec}: the embedded engine is not available in this installation ({e})") \
                from None
        self.engine = load_engine(EngineSpec.parse(spec))
        self.batch = self.engine.spec.batch
        self._batcher = None

    def generate(self, prompt_ids, max_new_tokens):
        out = self.engine.generate(list(prompt_ids), max_new_tokens)
        return _as_ids(out)

    def check(self, prompt_ids, max_new_tokens: int) -> None:
        if self.batch > 1:
            self._batch_decoder().check(self.engine.request(list(prompt_ids), max_new_tokens))
        else:
            self.engine.decoder.check([int(t) for t in prompt_ids], max_new_tokens)

    def _batch_decoder(self):
        if self._batcher is None:   # made on first use (on CUDA it captures its graphs)
            self._batcher = self.engine.batch_decoder()
        return self._batcher

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy outputs of ``prompts``, queued at once on the batch decoder."""
        reqs = [self.engine.request(p, max_new_tokens, id=i) for i, p in enumerate(prompts)]
        return [_as_ids(r) for r in self._batch_decoder().generate_many(reqs)]


def _as_ids(out) -> list[int]:
    """Accept the shapes an engine may return: ids, a dict or object with output_ids, a tensor."""
    if isinstance(out, dict):
        out = out.get("output_ids", out.get("tokens"))
    elif hasattr(out, "output_ids"):
        out = out.output_ids
    elif hasattr(out, "tokens") and not isinstance(out, (list, tuple)):
        out = out.tokens
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, (list, tuple)) and len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = out[0]
    if not isinstance(out, (list, tuple)):
        raise InputError(f"the engine returned {type(out).__name__}, not token ids")
    return [int(t) for t in out]


def check_engine_prompts(systems, prompts: Sequence[Prompt], max_new_tokens: int) -> None:
    """Every ``engine:`` system of ``systems`` ((label, spec text) pairs) against every prompt,
    before any system runs: a prompt one of them cannot run would otherwise fail after others ran.
    The cache must hold each prompt, its new tokens and the draft rows the engine's decoder
    reserves (``EngineSpec.cache_room``: a tree's nodes, a chain's depth)."""
    from specpilot.engine.api import check_prompts
    from specpilot.engine.spec import EngineSpec

    for label, text in systems:
        if text and (text.strip() == "engine" or text.strip().startswith("engine:")):
            try:
                spec = EngineSpec.parse(text)
                check_prompts(spec, [(p.id, p.prompt_ids) for p in prompts], max_new_tokens)
            except InputError as e:
                raise InputError(f"{label}: {e}") from None


def system_identity(system: SystemSpec) -> str:
    """What a collected row records as its system: an engine spec in its canonical form (the keys
    in one order, defaults left out), a server's URL as parsed."""
    if system.kind == "engine":
        from specpilot.engine.spec import EngineSpec

        return str(EngineSpec.parse(system.spec))
    return system.spec


def make_generator(system: SystemSpec, timeout: float = 120.0) -> Generator:
    if system.kind == "http":
        return HttpGenerator(system.spec, timeout)
    if system.kind == "engine":
        return EngineGenerator(system.spec)
    raise InputError(f"{system.spec}: an outputs file is not something to run")


class CollectError(SpecPilotError):
    """A run failed part-way; the outputs collected so far are kept (exit code of the cause)."""

    def __init__(self, message: str, exit_code: int, kept: int, path: str | None):
        super().__init__(message)
        self.exit_code = exit_code
        self.kept = kept
        self.path = path


# a batched engine's prompts are queued this many batches at a time: the decoder stays full while
# a failure or a signal keeps every chunk that finished before it
BATCH_ROUNDS = 4


SAVE_EVERY_S = 10.0   # how often a collection rewrites its --save file with the rows so far


def holds_rows(path: str) -> bool:
    """Whether file ``path`` holds anything but white space."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:   # a byte order mark or a no-break space is white space here too
        return any(line.decode("utf-8", "replace").strip().strip("\ufeff") for line in f)


def collect(generator: Generator, prompts: Sequence[Prompt], max_new_tokens: int, *, save_to: str | None = None,
            name: str = "system", progress: Callable | None = None,
            on_row: Callable[[OutputRow], None] | None = None, protect: Sequence = (),
            concurrency: int = 1, save_option: str = "--save", already: Sequence[OutputRow] = (),
            system: str | None = None) -> Outputs:
    """Generate for every prompt; save the outputs file (also on failure or a signal, with the
    rows so far).

    With ``concurrency`` > 1 (servers only) that many requests are in flight at once; an engine
    with ``batch=B`` decodes B at once (:class:`EngineGenerator`); the file keeps prompt order, and
    on a failure every request that completed is kept. ``already``: rows of an earlier,
    interrupted collection; prompts they answer (same id, same prompt_ids) are not run again.
    ``system``: recorded in every row (with ``max_new_tokens``) so that a resume can check both.
    A ``save_to`` holding an earlier run's outputs (not resumed: ``already`` empty) is replaced
    only by this run's complete set: a run that stops leaves it as it was.
    """
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if concurrency < 1:
        raise InputError(f"--concurrency {concurrency}: must be at least 1")
    if concurrency > 1 and not getattr(generator, "thread_safe", False):
        concurrency = 1  # the embedded engine takes its own batching (batch=B), not threads
    batch = getattr(generator, "batch", 1)
    done: dict[int, OutputRow] = {}
    earlier = {key(r.id): r for r in already}
    for i, p in enumerate(prompts):
        r = earlier.get(key(p.id))
        if r is not None and list(r.prompt_ids) == list(p.prompt_ids):
            done[i] = r
    todo = [i for i in range(len(prompts)) if i not in done]
    try:   # a prompt the system cannot run is refused before any runs
        for i in todo:
            with about_prompt(prompts[i].id, f"{name}: "):
                generator.check(list(prompts[i].prompt_ids), max_new_tokens)
    except BaseException:
        generator.close()
        raise
    bar = progress(total=len(todo), desc=f"running {name}") if progress else None
    saved_at = [time.monotonic()]
    keep_earlier = bool(save_to) and not already and holds_rows(save_to)

    def finish(i: int, ids) -> None:
        p = prompts[i]
        ids = list(ids)
        # a generator that returned more than asked keeps its tokens and records no limit
        done[i] = OutputRow(p.id, list(p.prompt_ids), ids, max_new_tokens if len(ids) <= max_new_tokens else None,
                            system)
        if bar is not None:
            bar.update(1)
        if on_row is not None:
            on_row(done[i])
        # the rows so far, whole, every SAVE_EVERY_S: a run killed outright (SIGKILL, out of memory)
        # keeps them for --resume as a signal does
        if save_to and not keep_earlier and time.monotonic() - saved_at[0] >= SAVE_EVERY_S and len(done) < len(prompts):
            write_outputs(save_to, [done[j] for j in sorted(done)], protect=protect, option=save_option)
            saved_at[0] = time.monotonic()

    def run_one(i: int):
        with about_prompt(prompts[i].id):   # a refused prompt (a server's 400): name it
            return generator.generate(list(prompts[i].prompt_ids), max_new_tokens)

    try:
        if batch > 1:   # a batched engine, a chunk of BATCH_ROUNDS batches at a time
            step = BATCH_ROUNDS * batch
            for at in range(0, len(todo), step):
                chunk = todo[at:at + step]
                for i, ids in zip(chunk, generator.generate_many([prompts[i].prompt_ids for i in chunk],
                                                                 max_new_tokens)):
                    finish(i, ids)
        elif concurrency == 1:
            for i in todo:
                finish(i, run_one(i))
        else:
            # each row as it completes: saved every SAVE_EVERY_S, and kept when a signal stops the
            # run (which abandons the requests in flight; a failure lets them finish and keeps them)
            with contextlib.closing(in_threads(run_one, todo, concurrency)) as rows:
                for i, ids in rows:
                    finish(todo[i], ids)
    except (SpecPilotError, KeyboardInterrupt) as e:
        rows = [done[i] for i in sorted(done)]
        where = None
        if save_to and rows and not keep_earlier:
            write_outputs(save_to, rows, protect=protect, option=save_option)
            where = save_to
        if keep_earlier:
            kept = (f"; {len(rows)} of {len(prompts)} outputs were collected and not kept: {save_to} holds an "
                    "earlier run's outputs, left as they were")
        else:
            kept = (f"; kept the {len(rows)} of {len(prompts)} outputs collected so far in {where}" if where else
                    f"; {len(rows)} of {len(prompts)} outputs were collected"
                    + ("" if save_to else " (name a file with --save/--save-outputs to keep them)"))
        if isinstance(e, KeyboardInterrupt):
            e.add_note(kept[2:])
            raise
        raise CollectError(f"{name}: {e}{kept}", getattr(e, "exit_code", 2), len(rows), where) from None
    finally:
        if bar is not None:
            bar.close()
        generator.close()
    rows = [done[i] for i in sorted(done)]
    if save_to:
        write_outputs(save_to, rows, protect=protect, option=save_option)
    return Outputs(name, rows, save_to or name)


def load_system(system: SystemSpec, prompts: Sequence[Prompt] | None, max_new_tokens: int, *,
                save_to: str | None = None, timeout: float = 120.0, progress: Callable | None = None,
                protect: Sequence = (), concurrency: int = 1, save_option: str = "--save") -> Outputs:
    """Outputs of a system: read its file, or run it over the prompts."""
    if system.kind == "file":
        return read_outputs(system.spec, name=system.name)
    if not prompts:
        raise InputError(f"{system.spec}: running a system needs --prompts FILE")
    gen = make_generator(system, timeout=timeout)
    return collect(gen, prompts, max_new_tokens, save_to=save_to, name=system.name, progress=progress,
                   protect=protect, concurrency=concurrency, save_option=save_option,
                   system=system_identity(system))


def save_path_of(folder: str, role: str, index: int = 0) -> str:
    """Where :func:`default_save_path` keeps the outputs of the ``index``-th system of ``role``
    (the folder is not made)."""
    suffix = f"-{index + 1}" if index else ""
    return str(Path(folder) / f"{role}{suffix}.outputs.jsonl")


def default_save_path(folder: str, role: str, index: int = 0, option: str = "--save-outputs") -> str:
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{option} {folder}: not a folder; name a folder for the outputs") from None
    except PermissionError:
        raise InputError(f"{option} {folder}: cannot create the folder (permission denied)") from None
    except OSError as e:   # a read-only or virtual file system (/proc)
        raise InputError(f"{option} {folder}: cannot create the folder ({e.strerror or e})") from None
    return save_path_of(folder, role, index)

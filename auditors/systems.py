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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specpilot.errors import EnvironmentMissing, InputError, SpecPilotError

from .outputs import OutputRow, Outputs, Prompt, read_outputs, write_outputs


@dataclass
class SystemSpec:
    kind: str  # "file" | "engine" | "http"
    spec: str
    name: str

    @property
    def needs_prompts(self) -> bool:
        return self.kind != "file"


def parse_system(spec: str, name: str | None = None) -> SystemSpec:
    s = spec.strip()
    if s.startswith(("http://", "https://")):
        from .http_client import parse_url

        return SystemSpec("http", parse_url(s), name or s)
    if s.startswith("engine:"):
        return SystemSpec("engine", s, name or s)
    p = Path(s).expanduser()
    if p.is_file():
        return SystemSpec("file", str(p), name or p.name)
    if p.exists():
        raise InputError(f"{spec}: not a file; a SYSTEM is an outputs JSONL file, an engine: spec or http://host:port")
    raise InputError(f"{spec}: no such file; a SYSTEM is an outputs JSONL file, an engine: spec "
                     "(engine:model=smollm2,mode=tree,nodes=32) or a server URL (http://127.0.0.1:30000)")


class Generator:
    """Something that turns prompt ids into greedy output ids."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


class HttpGenerator(Generator):
    def __init__(self, url: str, timeout: float):
        from .http_client import GenerateClient

        self.client = GenerateClient(url, timeout=timeout)
        self.client.health()

    def generate(self, prompt_ids, max_new_tokens):
        return self.client.generate(prompt_ids, max_new_tokens)


class EngineGenerator(Generator):
    def __init__(self, spec: str):
        try:
            from specpilot.engine.api import EngineSpec, load_engine
        except ImportError as e:
            raise EnvironmentMissing(f"{spec}: the embedded engine is not available in this installation ({e})") \
                from None
        self.engine = load_engine(EngineSpec.parse(spec))

    def generate(self, prompt_ids, max_new_tokens):
        out = self.engine.generate(list(prompt_ids), max_new_tokens)
        return _as_ids(out)


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


def collect(generator: Generator, prompts: Sequence[Prompt], max_new_tokens: int, save_to: str | None = None,
            name: str = "system", progress: Callable | None = None,
            on_row: Callable[[OutputRow], None] | None = None, protect: Sequence = ()) -> Outputs:
    """Generate for every prompt; save the outputs file (also on failure, with the rows so far)."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    rows: list[OutputRow] = []
    it = progress(prompts, total=len(prompts), desc=f"running {name}") if progress else prompts
    try:
        for p in it:
            ids = generator.generate(list(p.prompt_ids), max_new_tokens)
            rows.append(OutputRow(p.id, list(p.prompt_ids), list(ids)))
            if on_row is not None:
                on_row(rows[-1])
    except (SpecPilotError, KeyboardInterrupt) as e:
        where = None
        if save_to and rows:
            write_outputs(save_to, rows, protect=protect)
            where = save_to
        kept = (f"; kept the {len(rows)} of {len(prompts)} outputs collected so far in {where}" if where else
                f"; {len(rows)} of {len(prompts)} outputs were collected"
                + ("" if save_to else " (name a file with --save/--save-outputs to keep them)"))
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CollectError(f"{name}: {e}{kept}", getattr(e, "exit_code", 2), len(rows), where) from None
    finally:
        generator.close()
    if save_to:
        write_outputs(save_to, rows, protect=protect)
    return Outputs(name, rows, save_to or name)


def load_system(system: SystemSpec, prompts: Sequence[Prompt] | None, max_new_tokens: int,
                save_to: str | None = None, timeout: float = 120.0, progress: Callable | None = None,
                protect: Sequence = ()) -> Outputs:
    """Outputs of a system: read its file, or run it over the prompts."""
    if system.kind == "file":
        return read_outputs(system.spec, name=system.name)
    if not prompts:
        raise InputError(f"{system.spec}: running a system needs --prompts FILE")
    gen = make_generator(system, timeout=timeout)
    return collect(gen, prompts, max_new_tokens, save_to=save_to, name=system.name, progress=progress,
                   protect=protect)


def default_save_path(folder: str, role: str, index: int = 0) -> str:
    os.makedirs(folder, exist_ok=True)
    suffix = f"-{index + 1}" if index else ""
    return str(Path(folder) / f"{role}{suffix}.outputs.jsonl")

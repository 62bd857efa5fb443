"""Resumable state: what a long verb measured so far, kept in a file it can continue from.

A verb saves its state after every unit of work (``keeper.save(doc)``, atomic), adds where it is
to the error line when a signal or an error ends the run (``keeper.note(e)`` in an ``except
BaseException`` before re-raising), and removes the file when it finishes
(``keeper.finished()``). ``compare --partial/--resume`` keeps its paired samples this way.
"""

from __future__ import annotations

import contextlib
import os

from .errors import SpecPilotError


class StateKeeper:
    """Keeps ``doc``s in ``path``; ``what(doc)`` says what a doc holds ("4 paired samples")."""

    def __init__(self, path: str, option: str, *, schema: str, resume_option: str = "--resume", what=None,
                 resuming: str | None = None):
        self.path, self.option, self.resume_option = path, option, resume_option
        self.schema = schema   # what a state file of this verb records: an existing file without it is no state
        self.what = what or (lambda doc: "the state so far")
        self.resuming = resuming   # the state file this run continues from (it may be ``path``)
        self.kept: str | None = None
        self.broken = False

    def check(self, outputs: dict[str, str | None]) -> None:
        """Before any work: the state file must be one this run may write and later remove. An
        existing file is another run's state (or not state at all) unless it is the one resumed;
        ``outputs`` (option -> path) must not name it either."""
        from pathlib import Path

        from .errors import InputError
        from .fileio import check_output_path, document_schema

        here = Path(self.path).resolve()
        for option, other in outputs.items():
            if other and Path(other).resolve() == here:
                raise InputError(f"{self.option} {self.path}: is also {option}; give them different files")
        resumed = self.resuming is not None and Path(self.resuming).resolve() == here
        if os.path.lexists(self.path) and not resumed:
            if document_schema(self.path) != self.schema:   # nothing to continue: --resume would only be refused
                raise InputError(f"{self.option} {self.path}: exists and holds no earlier run's state; remove it or "
                                 f"give another {self.option}")
            raise InputError(f"{self.option} {self.path}: holds an earlier run's state; continue that run with "
                             f"{self.resume_option} {self.path}, or remove it or give another {self.option}")
        check_output_path(self.path, self.option)

    def save(self, doc: dict) -> None:
        """Write ``doc`` atomically; a failure stops keeping state but not the verb's work."""
        if self.broken:
            return
        from .fileio import write_json_atomic
        from .output import status

        try:
            write_json_atomic(self.path, doc, option=self.option)
            self.kept = self.what(doc)
        except (SpecPilotError, OSError) as e:
            self.broken = True
            status(f"cannot keep resumable state in {self.path} ({e}); an interrupted run will start over")

    def note(self, e: BaseException) -> None:
        """Say on ``e``'s error line where the state is and how to continue."""
        if self.kept and not self.broken and hasattr(e, "add_note"):
            e.add_note(f"{self.kept} kept in {self.path}; continue with {self.resume_option} {self.path}")

    def finished(self) -> None:
        """Remove the state file, if this run wrote it (a file it never wrote is not its to remove)."""
        if self.kept is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

"""Errors that map to SpecPilot's exit codes.

0 done/pass, 1 a negative verdict, 2 bad input or usage, 3 missing environment.
Library code raises these; the CLI turns them into one ``specpilot: error: ...`` line.
"""

EXIT_OK = 0
EXIT_VERDICT = 1
EXIT_USAGE = 2
EXIT_ENV = 3


class SpecPilotError(Exception):
    """A user-facing error: one line, with what to do."""

    exit_code = EXIT_USAGE


class InputError(SpecPilotError):
    """Bad input: malformed file, unknown name, out-of-range option (exit 2)."""

    exit_code = EXIT_USAGE


class EnvironmentMissing(SpecPilotError):
    """Missing environment: no GPU, no nsys, no SGLang (exit 3)."""

    exit_code = EXIT_ENV


class NegativeVerdict(SpecPilotError):
    """A gate said no (exit 1). Raised only where there is no result to render."""

    exit_code = EXIT_VERDICT

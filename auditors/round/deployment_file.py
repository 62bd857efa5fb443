"""The deployment file of a round on SGLang (``specpilot.deployment/1``, YAML or JSON; paths relative
to it), read and checked before the round starts::

    schema: specpilot.deployment/1
    name: qwen3-8b + dflash2 on one h100
    model: qwen3-8b              # catalog name or config.json: floors, dense/hybrid
    gpu: h100                    # GPU catalog key (floors)
    dtype: bf16
    drafter: dflash2             # eagle | eagle3 | dflash | dflash2 | dspark
    batch: 1
    context: 2048
    rows: 16                     # verified rows per request per step now (e.g. the draft block)
    policy: chain                # the replay policy of today's verify (default chain)
    sglang: {version: 0.5.23, python: /opt/sglang/bin/python}   # python: apply candidates there
    experimental: false          # also try memory entries whose status is experimental
    prompts: prompts.jsonl       # token ids (text rows need the scorer, whose tokenizer reads them)
    max_new_tokens: 128
    scorer: /models/Qwen3-8B     # the audit's scorer (HF folder or .gguf)
    measurements:
      rows_probe: rows.json      # specpilot.rows/1: T_AR and T_step(N); or ar_ms / step_ms numbers
      profile: verify.sqlite     # a trace of decode/verify steps (Nsight SQLite/.nsys-rep, Kineto JSON)
      lattices: [lattice.jsonl]  # recorded by the lattice-trace bundle
      outputs: {stock: stock.outputs.jsonl, ar: ar.outputs.jsonl}
    servers:
      stock: {url: "http://127.0.0.1:30000", start: "...", ready_timeout: 900}
      candidate: {url: "http://127.0.0.1:{port}", port: 30001, start: "{launch} --port {port}"}
      candidates: {tree: {start: "..."}}     # per-candidate commands, instead of {launch}

A missing field, a typo'd one, or a file it names that is not there is refused here, before
anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpilot.errors import InputError, did_you_mean
from specpilot.fileio import is_int, is_num, load_yaml
from specpilot.limits import MAX_BATCH, MAX_CONTEXT, MAX_MS, MAX_ROWS

from .deployment import Facts

SCHEMA = "specpilot.deployment/1"


@dataclass
class SGLangDeployment:
    path: Path
    raw: dict
    facts: Facts
    model_spec: object | None
    gpu_key: str | None
    rows: int
    policy: str
    context: int
    prompts: str | None
    max_new_tokens: int
    scorer: str | None
    python: str | None
    experimental: bool
    measurements: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)

    def file(self, rel: str | None) -> Path | None:
        return _beside(self.path, rel) if rel else None


# a deployment file's fields (docs/round.md), top-level and in its maps; any other is a typo that
# would be ignored
FIELDS = ("schema", "name", "model", "model_path", "gpu", "dtype", "drafter", "batch", "context", "rows", "policy",
          "sglang", "experimental", "prompts", "max_new_tokens", "scorer", "measurements", "servers")
SGLANG_FIELDS = ("version", "python")
MEASUREMENT_FIELDS = ("rows_probe", "ar_ms", "step_ms", "lattices", "profile", "outputs")
OUTPUT_ROLES = ("stock", "ar")
SERVERS_FIELDS = ("stock", "candidate", "candidates")
SERVER_FIELDS = ("url", "start", "port", "ready_timeout", "expected_start_s")
MAX_WAIT_S = 7 * 24 * 3600.0   # a server's ready timeout or expected start: a week at most


def _known(d: dict, fields: tuple, where: str, path: Path) -> None:
    """Refuse a key of ``d`` (the map at ``where``; "" for the top level) that is not one of ``fields``."""
    for key in d:
        if key not in fields:
            raise InputError(f"{path}: unknown field {where}{key!r}{did_you_mean(key, fields)}; the fields"
                             f"{' of ' + where.rstrip('.') if where else ''}: {', '.join(fields)}")


def _check_fields(raw: dict, path: Path) -> None:
    """Every field has the type and range the round uses it with: a deployment file is read once,
    up front, and its mistakes are named there (not as a crash, nor after stages have run)."""
    from urllib.parse import urlsplit

    def bad(field: str, want: str):
        raise InputError(f"{path}: {field} must be {want}")

    def whole(x, lo: int) -> bool:
        return is_int(x) and x >= lo

    def number(x) -> bool:
        return is_num(x) and x > 0

    def url(field: str, u) -> None:
        if not isinstance(u, str):
            bad(field, "an http:// URL")
        try:
            parts = urlsplit(u.replace("{port}", "1"))
            parts.port   # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            bad(field, "an http:// URL")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            bad(field, "an http:// URL")

    _known(raw, FIELDS, "", path)
    for key, lo, hi in (("batch", 1, MAX_BATCH), ("rows", 1, MAX_ROWS), ("context", 1, MAX_CONTEXT),
                        ("max_new_tokens", 1, MAX_CONTEXT)):
        if key in raw and not (whole(raw[key], lo) and raw[key] <= hi):
            bad(key, f"a whole number in [{lo}, {hi}]")
    for key in ("model", "name", "dtype", "policy", "prompts", "scorer", "model_path", "gpu"):
        if raw.get(key) is not None and not (isinstance(raw[key], str) and raw[key].strip()):
            bad(key, "a non-empty string")
    if "experimental" in raw and not isinstance(raw["experimental"], bool):
        bad("experimental", "true or false")
    if raw.get("dtype") is not None:
        from specpilot.models import WEIGHT_DTYPES

        dtypes = (*WEIGHT_DTYPES, "fp32")
        if raw["dtype"] not in dtypes:
            bad("dtype", f"the weights' dtype, one of {', '.join(dtypes)}")
    if raw.get("policy") is not None and raw["policy"] != "ar":
        from specpilot.auditors.policies import parse_policy

        try:
            parse_policy(raw["policy"])
        except InputError as e:
            raise InputError(f"{path}: policy: {e} (or ar)") from None
    sg = raw.get("sglang")
    if sg is not None:
        if not isinstance(sg, dict):
            bad("sglang", "a map (version, python)")
        _known(sg, SGLANG_FIELDS, "sglang.", path)
        if sg.get("python") is not None and not (isinstance(sg["python"], str) and sg["python"].strip()):
            bad("sglang.python", "a path")
        v = sg.get("version")
        if v is not None and not ((isinstance(v, str) and v.strip()) or (is_num(v) and v > 0)):
            bad("sglang.version", "a version (0.5.23)")
    m = raw.get("measurements")
    if m is not None:
        if not isinstance(m, dict):
            bad("measurements", "a map (rows_probe, ar_ms, step_ms, lattices, profile, outputs)")
        _known(m, MEASUREMENT_FIELDS, "measurements.", path)
        for key in ("ar_ms", "step_ms"):
            if key in m and not (number(m[key]) and m[key] <= MAX_MS):
                bad(f"measurements.{key}", f"a number of milliseconds in (0, {MAX_MS:g}]")
        for key in ("rows_probe", "profile"):
            if m.get(key) is not None and not isinstance(m[key], str):
                bad(f"measurements.{key}", "a file")
        lats = m.get("lattices")
        if lats is not None and not (isinstance(lats, str) or (isinstance(lats, list)
                                                                 and all(isinstance(x, str) for x in lats))):
            bad("measurements.lattices", "a file or a list of files")
        outs = m.get("outputs")
        if outs is not None and not (isinstance(outs, dict) and all(isinstance(v, str) for v in outs.values())):
            bad("measurements.outputs", "a map of role to outputs file (stock, ar)")
        if outs is not None:
            _known(outs, OUTPUT_ROLES, "measurements.outputs.", path)
    srv = raw.get("servers")
    if srv is not None:
        if not isinstance(srv, dict):
            bad("servers", "a map (stock, candidate, candidates)")
        _known(srv, SERVERS_FIELDS, "servers.", path)

        def server(field: str, d, need_url: bool) -> None:
            if not isinstance(d, dict):
                bad(field, "a map (url, start, port, ready_timeout)")
            _known(d, SERVER_FIELDS, f"{field}.", path)
            if need_url or d.get("url") is not None:
                url(f"{field}.url", d.get("url"))
            if d.get("start") is not None and not (isinstance(d["start"], str) and d["start"].strip()):
                bad(f"{field}.start", "a shell command")
            if d.get("port") is not None and not (whole(d["port"], 1) and d["port"] <= 65535):
                bad(f"{field}.port", "a port number (1-65535)")
            for key in ("ready_timeout", "expected_start_s"):
                if d.get(key) is not None and not (number(d[key]) and d[key] <= MAX_WAIT_S):
                    bad(f"{field}.{key}", f"a number of seconds in (0, {MAX_WAIT_S:g}]")

        if srv.get("stock") is not None:
            server("servers.stock", srv["stock"], True)
        if srv.get("candidate") is not None:
            server("servers.candidate", srv["candidate"], False)
        cands = srv.get("candidates")
        if cands is not None:
            if not isinstance(cands, dict):
                bad("servers.candidates", "a map of candidate id to its server (start, url)")
            for cid, d in cands.items():
                server(f"servers.candidates.{cid}", d, False)


def _beside(path: Path, rel) -> Path:
    """A path a deployment file names, as the round reads it: relative paths from the file's folder."""
    p = Path(str(rel)).expanduser()
    return p if p.is_absolute() else Path(path).parent / p


def _measurement_files(raw: dict) -> list:
    """The measurement files a deployment file names (as written): rows probe, profile, lattices, outputs."""
    m = raw.get("measurements") if isinstance(raw.get("measurements"), dict) else {}
    lattices = m.get("lattices")
    files = [m.get("rows_probe"), m.get("profile")]
    files += [lattices] if isinstance(lattices, str) else list(lattices) if isinstance(lattices, list) else []
    return files + (list(m["outputs"].values()) if isinstance(m.get("outputs"), dict) else [])


def _check_files(raw: dict, path: Path) -> None:
    """The files the round will read exist (a missing one is said now, not at stage 4)."""
    if raw.get("prompts") and not _beside(path, raw["prompts"]).is_file():
        raise InputError(f"{path}: prompts: {raw['prompts']} is not a file")
    scorer = raw.get("scorer")
    if raw.get("prompts") and not scorer:   # the scorer's tokenizer is the one that reads text prompts
        from specpilot.auditors.outputs import read_prompts

        def no_tokenizer(_text):
            raise InputError(f"{path}: prompts: {raw['prompts']} holds text prompts, which need a tokenizer: give "
                             "scorer: (the audit's model; its tokenizer reads them) or prompts of token ids")

        read_prompts(_beside(path, raw["prompts"]), no_tokenizer)
    if scorer:   # as the audit will resolve it: a name it knows, or a path beside the file
        from specpilot.auditors.scorer import check_scorer_spec

        at = _beside(path, scorer)
        check_scorer_spec(str(at) if at.exists() else scorer, what=f"{path}: scorer:")
    for rel in _measurement_files(raw):
        if rel and not _beside(path, rel).is_file():
            raise InputError(f"{path}: measurements: {rel} is not a file")


def named_files(path: Path) -> list[str]:
    """The files a deployment file names (prompts, the scorer's, the measurements), resolved as the
    round reads them: what its --out must not replace. Empty where the file does not read (the round
    refuses it with its own message)."""
    from specpilot.fileio import load_yaml
    from specpilot.models import model_inputs

    try:
        raw = load_yaml(Path(path).read_text(encoding="utf-8"))
    except Exception:
        return []
    if not isinstance(raw, dict):
        return []

    rels = [raw.get("prompts")] + _measurement_files(raw)
    out = [str(_beside(path, r)) for r in rels if isinstance(r, str) and r]
    scorer = raw.get("scorer")
    if isinstance(scorer, str) and scorer:
        at = _beside(path, scorer)
        out += model_inputs(str(at) if at.exists() else scorer)
    return out


def read_deployment(path: Path) -> SGLangDeployment:
    import yaml

    from specpilot.bundles.contract import DRAFTERS

    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid YAML/JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise InputError(f"{path}: unknown schema {raw.get('schema') if isinstance(raw, dict) else raw!r}; "
                         f"expected {SCHEMA} (see docs/round.md)")
    drafter = raw.get("drafter")
    if not isinstance(drafter, str) or drafter not in DRAFTERS:
        raise InputError(f"{path}: drafter must be one of {', '.join(DRAFTERS)}")
    _check_fields(raw, path)
    if not raw.get("prompts"):
        raise InputError(f"{path}: give prompts: (a prompts file) for the paired runs and the audit")
    if not isinstance(raw.get("servers"), dict) or not isinstance(raw["servers"].get("stock"), dict):
        raise InputError(f"{path}: give servers.stock.url (and .start, or a server already answering there): "
                         "candidates are timed against stock")
    _check_files(raw, path)
    model_spec = None
    if raw.get("model"):
        from specpilot.models import load_model_spec

        try:
            model_spec = load_model_spec(str(raw["model"]) if not str(raw["model"]).endswith(".json")
                                         else str(path.parent / raw["model"]))
        except InputError as e:
            raise InputError(f"{path}: model: {e}") from None
    gpu_key = gpu_name = None
    if raw.get("gpu"):
        from specpilot.gpus import get_gpu, gpu_keys

        try:
            g = get_gpu(str(raw["gpu"]))
        except InputError:
            raise InputError(f"{path}: gpu: unknown GPU {raw['gpu']!r}; known: {', '.join(gpu_keys())}") from None
        gpu_key, gpu_name = g.key, g.name
    sg = raw.get("sglang") or {}
    batch, rows = raw.get("batch", 1), raw.get("rows", 1)
    context, max_new = raw.get("context", 2048), raw.get("max_new_tokens", 128)
    facts = Facts(kind="sglang", model=str(raw.get("model") or raw.get("name") or "target"), device="cuda",
                  gpu=gpu_name, gpu_key=gpu_key, dtype=str(raw.get("dtype", "bf16")), drafter=drafter,
                  target="hybrid" if (model_spec is not None and model_spec.is_hybrid) else "dense", batch=batch,
                  sglang=str(sg.get("version")) if sg.get("version") else None)
    return SGLangDeployment(path=path, raw=raw, facts=facts, model_spec=model_spec, gpu_key=gpu_key, rows=rows,
                            policy=str(raw.get("policy", "chain")), context=context, prompts=raw.get("prompts"),
                            max_new_tokens=max_new, scorer=raw.get("scorer"), python=sg.get("python"),
                            experimental=raw.get("experimental", False),
                            measurements=dict(raw.get("measurements") or {}), servers=dict(raw.get("servers") or {}))

